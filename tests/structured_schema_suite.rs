//! The JSON-Schema-Test-Suite (draft 2020-12, copied under `tests/data/json-schema-test-suite/`)
//! run against the builtin `grammar` constraint plugin through the host's matcher: each group's
//! schema is compiled; each `valid` instance, force-fed as tokens of a byte-level vocabulary
//! (compact JSON), must be consumed to an accepting state; each `invalid` one must be refused
//! somewhere (a token refused, or not accepting at its end; a schema refused as unsatisfiable
//! rejects everything). Groups that fail (a schema refused
//! as unsupported, or a case answered wrongly) are listed in `baseline-unsupported.txt`; the
//! list may only shrink: a failure not listed fails the test, and so does a listed group that
//! now passes. `DEEPINFER_UPDATE_BASELINE=1` rewrites the list. The pass count is printed.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use deepinfer::json::sorted_keys;
use deepinfer::plugins::{CacheDir, ConstraintVocab, PluginEngine, PluginSource, WasmConstraint};
use serde_json::Value;

const EOS: u32 = 256;

fn suite_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/json-schema-test-suite")
}

fn plugin() -> Arc<WasmConstraint> {
    let tokens: Vec<Vec<u8>> = (0..=255u8)
        .map(|b| vec![b])
        .chain([b"<eos>".to_vec()])
        .collect();
    let vocab = ConstraintVocab::from_tokens(&tokens, &[EOS], &[], tokens.len());
    let engine = PluginEngine::new(&CacheDir::Disabled).expect("plugin engine");
    let source = PluginSource::resolve("grammar", None).expect("builtin grammar plugin");
    WasmConstraint::load(engine, &source, &vocab).expect("grammar plugin loads")
}

/// Whether `data` is accepted by a fresh matcher of `schema`.
fn accepts(p: &Arc<WasmConstraint>, schema: &str, data: &Value) -> Result<bool, String> {
    let m = match p.matcher("json-schema", schema) {
        Ok(m) => m,
        // A schema no instance satisfies rejects every instance, which is the right answer.
        Err(e) if e.to_string().contains("Unsatisfiable schema") => return Ok(false),
        Err(e) => return Err(e.to_string()),
    };
    let text = serde_json::to_string(&sorted_keys(data)).map_err(|e| e.to_string())?;
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let ok = m.validate(&tokens).map_err(|e| e.to_string())? as usize;
    if ok < tokens.len() {
        return Ok(false);
    }
    m.consume(&tokens).map_err(|e| e.to_string())?;
    m.is_accepting().map_err(|e| e.to_string())
}

#[test]
fn json_schema_test_suite_draft2020_12() {
    let p = plugin();
    let dir = suite_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("suite folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let (mut groups, mut cases, mut passed_cases) = (0usize, 0usize, 0usize);
    let mut failing = BTreeSet::new();
    // DEEPINFER_SUITE_VERBOSE=1 prints why each failing group fails.
    let verbose = std::env::var_os("DEEPINFER_SUITE_VERBOSE").is_some();
    for file in &files {
        let name = file.file_stem().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(file).expect("suite file");
        let doc: Value = serde_json::from_str(&text).expect("suite file is JSON");
        for group in doc.as_array().expect("a suite file is an array") {
            groups += 1;
            let desc = group["description"].as_str().unwrap_or("?");
            let schema = sorted_keys(&group["schema"]).to_string();
            let mut why = None;
            for case in group["tests"].as_array().into_iter().flatten() {
                cases += 1;
                let want = case["valid"].as_bool().unwrap_or(false);
                match accepts(&p, &schema, &case["data"]) {
                    Ok(got) if got == want => passed_cases += 1,
                    Ok(got) => {
                        why.get_or_insert_with(|| {
                            let verdict = if got { "accepted" } else { "rejected" };
                            format!("{verdict} {}", case["data"])
                        });
                    }
                    Err(e) => {
                        why.get_or_insert(e);
                    }
                }
            }
            if let Some(why) = why {
                let group = format!("{name}: {desc}");
                if verbose {
                    println!("{group}\n    {why}");
                }
                failing.insert(group);
            }
        }
    }
    let baseline_path = dir.join("baseline-unsupported.txt");
    if std::env::var_os("DEEPINFER_UPDATE_BASELINE").is_some() {
        let mut out = String::from(
            "# Groups of the draft 2020-12 suite the grammar plugin does not pass (unsupported\n\
             # keywords or approximations). This list may only shrink.\n",
        );
        for f in &failing {
            out.push_str(f);
            out.push('\n');
        }
        std::fs::write(&baseline_path, out).expect("write baseline");
    }
    let baseline: BTreeSet<String> = std::fs::read_to_string(&baseline_path)
        .expect("baseline file")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    println!(
        "JSON-Schema-Test-Suite 2020-12: {} of {groups} groups pass, {passed_cases} of {cases} cases",
        groups - failing.len()
    );
    let new: Vec<_> = failing.difference(&baseline).collect();
    let fixed: Vec<_> = baseline.difference(&failing).collect();
    assert!(
        new.is_empty(),
        "groups failing that the baseline does not list: {new:#?}"
    );
    assert!(
        fixed.is_empty(),
        "groups passing now: remove them from the baseline: {fixed:#?}"
    );
    assert!(groups - failing.len() > 0);
}
