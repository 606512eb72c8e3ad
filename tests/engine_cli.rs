//! `deepinfer generate` as a user runs it, on a generated tiny model: a 1,000-prompt
//! `--prompts-file` completes with exactly one line per prompt; a run killed midway keeps
//! its finished lines and a second run appends the rest without duplicates (and with the
//! same results); `--config` values apply unless a flag overrides them, and unknown config
//! keys are named with their file.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use deepinfer::model::gguf_writer;
use deepinfer::model::tiny::TinyLlama;

const BIN: &str = env!("CARGO_BIN_EXE_deepinfer");
const N: usize = 1000;

fn tiny_model(dir: &Path) -> PathBuf {
    let shape = TinyLlama {
        hidden: 128,
        ffn: 256,
        context: 128,
        ..Default::default()
    };
    let (meta, tensors) = shape.build();
    let p = dir.join("tiny.gguf");
    gguf_writer::write(&p, &meta, &tensors).expect("write the tiny model");
    p
}

fn prompts_file(dir: &Path) -> PathBuf {
    let p = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..N)
        .map(|i| serde_json::json!({"id": format!("q{i}"), "prompt": format!("hello {i} or {}", i * 31 % 97)}).to_string())
        .collect();
    std::fs::write(&p, lines.join("\n") + "\n").expect("write prompts");
    p
}

fn generate(model: &Path, prompts: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["generate", "--threads", "1", "--ignore-eos", "--model"])
        .arg(model)
        .arg("--prompts-file")
        .arg(prompts)
        .arg("--output")
        .arg(out)
        .args(extra);
    c
}

/// Every line of an output file: id -> generated token ids; panics on a duplicate id.
fn read_results(path: &Path) -> HashMap<String, Vec<u64>> {
    let text = std::fs::read_to_string(path).expect("read output");
    let mut seen = HashMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("every line is JSON");
        let id = v["id"].as_str().expect("id").to_string();
        assert!(v["error"].is_null(), "{line}");
        let toks = v["token_ids"]
            .as_array()
            .expect("token_ids")
            .iter()
            .map(|t| t.as_u64().expect("id"))
            .collect();
        assert!(
            seen.insert(id.clone(), toks).is_none(),
            "{id} written twice"
        );
    }
    seen
}

fn all_ids() -> HashSet<String> {
    (0..N).map(|i| format!("q{i}")).collect()
}

#[test]
fn a_thousand_prompts_give_one_line_each() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prompts) = (tiny_model(dir.path()), prompts_file(dir.path()));
    let out = dir.path().join("out.jsonl");
    let o = generate(&model, &prompts, &out, &["--max-tokens", "2"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("1000 request(s)"), "no summary: {stderr}");
    let results = read_results(&out);
    assert_eq!(results.keys().cloned().collect::<HashSet<_>>(), all_ids());
    assert!(results.values().all(|t| t.len() == 2));
    // Running again finds nothing left to do and leaves the file alone.
    let o = generate(&model, &prompts, &out, &["--max-tokens", "2"])
        .output()
        .expect("runs");
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing left"));
    assert_eq!(read_results(&out).len(), N);
}

#[test]
fn a_killed_run_resumes_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let (model, prompts) = (tiny_model(dir.path()), prompts_file(dir.path()));
    // Two sequences at a time and 24 tokens each: slow enough to be killed midway.
    let args = [
        "--max-tokens",
        "24",
        "--max-num-seqs",
        "2",
        "--native-sampler",
    ];
    let clean = dir.path().join("clean.jsonl");
    let o = generate(&model, &prompts, &clean, &args)
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = read_results(&clean);

    let out = dir.path().join("out.jsonl");
    let mut child = generate(&model, &prompts, &out, &args)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawns");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&out).map_or(0, |t| t.lines().count()) < 20 {
        assert!(Instant::now() < deadline, "no output lines appeared");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().expect("kill");
    let _ = child.wait();
    let kept = std::fs::read_to_string(&out).unwrap().lines().count();
    assert!(
        (20..N).contains(&kept),
        "the run was not interrupted midway ({kept} lines)"
    );

    let o = generate(&model, &prompts, &out, &args)
        .output()
        .expect("resumes");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("already holds"), "{stderr}");
    let got = read_results(&out);
    assert_eq!(got.keys().cloned().collect::<HashSet<_>>(), all_ids());
    assert_eq!(
        got, want,
        "resumed results differ from an uninterrupted run"
    );
}

#[test]
fn config_values_apply_unless_a_flag_overrides_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[sampler]\nplugin = \"greedy\"\nmax_tokens = 3\nignore_eos = true\n",
    )
    .unwrap();
    let lengths = |extra: &[&str]| -> Vec<usize> {
        let o = Command::new(BIN)
            .args([
                "generate",
                "--threads",
                "1",
                "--output",
                "jsonl",
                "-p",
                "hello",
                "-p",
                "world",
                "--config",
            ])
            .arg(&cfg)
            .arg("--model")
            .arg(&model)
            .args(extra)
            .output()
            .expect("runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).expect("json")["token_ids"]
                    .as_array()
                    .expect("ids")
                    .len()
            })
            .collect()
    };
    assert_eq!(lengths(&[]), vec![3, 3]);
    assert_eq!(lengths(&["--max-tokens", "5"]), vec![5, 5]);

    std::fs::write(&cfg, "[sampler]\nmax_tokens = 3\ntemprature = 0.5\n").unwrap();
    let o = Command::new(BIN)
        .args(["generate", "-p", "x", "--config"])
        .arg(&cfg)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("temprature") && stderr.contains("run.toml"),
        "{stderr}"
    );
}
