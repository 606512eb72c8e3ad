//! The third-party example `examples/02-regex-constraint` (regex-automata DFA, written only
//! against the SDK), loaded from its component file with a sha256 pin like any third-party
//! plugin, and checked against the builtin `grammar` plugin (llguidance): both must give the
//! same mask at every step of several regexes over the same vocabulary.

use std::path::PathBuf;
use std::sync::Arc;

use deepinfer::config::PluginConfig;
use deepinfer::plugins::{
    sha256_hex, CacheDir, ConstraintVocab, PluginEngine, PluginSource, WasmConstraint,
};

const EOS: u32 = 0;

fn tokens() -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    t.extend((32u8..127).map(|b| vec![b]));
    for w in [
        "12", "123", "2024", "-0", "ab", "abc", "ba", "a1", "(", ")", " (", "555", "-55", "é",
        "éé", "the", " the", ".com", "@",
    ] {
        t.push(w.as_bytes().to_vec());
    }
    t.push(vec![0xC3]);
    t
}

fn load(name: &str, table: Option<&PluginConfig>) -> Arc<WasmConstraint> {
    let tokens = tokens();
    let vocab = ConstraintVocab::from_tokens(&tokens, &[EOS], &[], tokens.len() + 3);
    let engine = PluginEngine::new(&CacheDir::Disabled).expect("engine");
    let source = PluginSource::resolve(name, table).expect("plugin source");
    WasmConstraint::load(engine, &source, &vocab).expect("plugin loads")
}

fn example() -> Arc<WasmConstraint> {
    let path = PathBuf::from(env!("DEEPINFER_TEST_PLUGIN_DIR")).join("regex-dfa.wasm");
    let sha = sha256_hex(&std::fs::read(&path).expect("host/build.rs built the example"));
    let table = PluginConfig {
        path: Some(path),
        sha256: Some(sha),
        ..Default::default()
    };
    load("regex-dfa", Some(&table))
}

#[test]
fn example_agrees_with_llguidance_step_by_step() {
    let ours = example();
    assert_eq!(ours.manifest().kinds, vec!["regex".to_string()]);
    let reference = load("grammar", None);
    let cases: &[(&str, &str)] = &[
        (r"[0-9]{2,4}", "2024"),
        (r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "(555) 123-4567"),
        (r"(yes|no), the (ab|abc)+\.", "no, the ababc."),
        (r"[a-z]{1,5}@[a-z]{1,5}\.com", "ab@abc.com"),
        (r"é+a?", "ééa"),
        (r"-?[0-9]+", "-0123"),
    ];
    let words: Vec<Vec<u8>> = tokens();
    for &(re, text) in cases {
        let a = ours.matcher("regex", re).expect("example compiles");
        let b = reference.matcher("regex", re).expect("grammar compiles");
        let mut rest = text.as_bytes();
        let mut steps = 0;
        loop {
            let (mut ma, mut mb) = (Vec::new(), Vec::new());
            a.mask(&mut ma).unwrap();
            b.mask(&mut mb).unwrap();
            assert_eq!(ma, mb, "{re:?} after {steps} tokens of {text:?}");
            if rest.is_empty() {
                break;
            }
            // Take the longest allowed token that continues the text.
            let t = (1..words.len())
                .filter(|&t| ma[t / 32] >> (t % 32) & 1 == 1 && rest.starts_with(&words[t]))
                .max_by_key(|&t| words[t].len())
                .unwrap_or_else(|| panic!("{re:?}: no allowed token continues {rest:?}"));
            a.consume(&[t as u32]).unwrap();
            b.consume(&[t as u32]).unwrap();
            rest = &rest[words[t].len()..];
            steps += 1;
        }
        assert!(a.is_accepting().unwrap(), "{re:?} accepts {text:?}");
        a.consume(&[EOS]).unwrap();
        a.rollback(1).unwrap();
        assert!(a.is_accepting().unwrap());
    }
}

#[test]
fn example_refuses_bad_patterns_with_the_place() {
    let ours = example();
    let e = ours
        .matcher("regex", "(ab")
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("regex") && e.contains("unclosed"), "{e}");
    let e = ours
        .matcher("json-schema", "{}")
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("not supported"), "{e}");
}
