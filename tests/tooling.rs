//! The bench, plot and eval commands end to end on the default model.

mod common;

use std::process::Command;

/// Runs the binary with `args`, then `extra`, asserting that it succeeds.
fn run_ok(args: &[&str], extra: &[&std::ffi::OsStr]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .args(extra)
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A command on the default model.
fn deepinfer(args: &[&str]) -> std::process::Output {
    let model = common::default_model_path();
    run_ok(args, &["--model".as_ref(), model.as_os_str()])
}

/// `deepinfer bench` with `repeats` measured repeats, no warm-up, 2 threads, records appended
/// to `out`, then the mode and its arguments.
fn bench(repeats: &str, out: &str, mode: &[&str]) {
    let mut args = vec![
        "bench",
        "--repeats",
        repeats,
        "--warmup",
        "0",
        "--threads",
        "2",
        "--output",
        out,
    ];
    args.extend_from_slice(mode);
    deepinfer(&args);
}

#[test]
fn bench_writes_records_and_plot_draws_them() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("bench.jsonl");
    let rec_s = rec.to_str().unwrap();
    bench("2", rec_s, &["prefill", "--lengths", "16,48"]);
    bench(
        "1",
        rec_s,
        &[
            "decode",
            "--batch",
            "1,4",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
        ],
    );
    let text = std::fs::read_to_string(&rec).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("valid JSON"))
        .collect();
    assert_eq!(recs.len(), 4);
    for r in &recs {
        assert!(r["median_s"].as_f64().unwrap() > 0.0);
        assert!(r["device"].as_str().unwrap().starts_with("cpu"));
    }
    assert!(recs[0]["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(
        recs[3]["tok_s_per_device"].as_f64().unwrap() > recs[3]["tok_s_per_user"].as_f64().unwrap()
    );
    run_ok(&["plot", rec_s, "--out-dir"], &[dir.path().as_os_str()]);
    for f in ["pareto.svg", "prefill.svg"] {
        let svg = std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
        assert!(svg.contains("<circle"), "{f} has no points");
    }
}

#[test]
fn prefill_sweeps_chunk_sizes_over_a_cached_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("prefill.jsonl");
    let rec_s = rec.to_str().unwrap();
    bench(
        "1",
        rec_s,
        &[
            "prefill",
            "--lengths",
            "48",
            "--chunk-sizes",
            "16,48",
            "--cached-prefix",
            "20",
        ],
    );
    let recs: Vec<serde_json::Value> = std::fs::read_to_string(&rec)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("valid JSON"))
        .collect();
    assert_eq!(recs.len(), 2);
    for (r, chunk) in recs.iter().zip([16, 48]) {
        assert_eq!(r["chunk_size"], chunk);
        // 20 rounds down to one whole 16-token block; the rate counts the 32 computed tokens.
        assert_eq!(r["cached_prefix_len"], 16);
        let rate = r["prefill_tok_s"].as_f64().unwrap();
        let expect = 32.0 / r["median_s"].as_f64().unwrap();
        assert!((rate - expect).abs() < 1e-6 * expect, "{rate} vs {expect}");
    }
    // The binary names the commit it was built from when built inside a git checkout.
    let in_git = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .is_ok_and(|o| o.status.success());
    if in_git {
        assert!(!recs[0]["commit"].as_str().unwrap().is_empty());
    } else {
        eprintln!("not built in a git checkout: the commit field is not checked");
    }
    // Two chunk sizes are two configurations: one plot refuses them, --compare draws both.
    let plot = |compare: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_deepinfer"));
        c.args(["plot", rec_s, "--out-dir"]).arg(dir.path());
        if compare {
            c.arg("--compare");
        }
        c.output().unwrap()
    };
    let refused = plot(false);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--compare"));
    let drawn = plot(true);
    assert!(
        drawn.status.success(),
        "{}",
        String::from_utf8_lossy(&drawn.stderr)
    );
    let svg = std::fs::read_to_string(dir.path().join("prefill.svg")).unwrap();
    assert!(svg.contains("chunk 16") && svg.contains("chunk 48"));
}

#[test]
fn eval_generates_and_scores_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let gen = dir.path().join("gen.jsonl");
    let gen_s = gen.to_str().unwrap();
    deepinfer(&[
        "eval",
        "generate",
        "--questions",
        "3",
        "-k",
        "2",
        "--max-tokens",
        "12",
        "--threads",
        "2",
        "-o",
        gen_s,
    ]);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&gen)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    let seeds: std::collections::HashSet<u64> =
        lines.iter().map(|l| l["seed"].as_u64().unwrap()).collect();
    assert_eq!(seeds.len(), 6, "each sample records its own seed");
    let out = run_ok(&["eval", "score", gen_s], &[]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["samples"], 6);
    assert_eq!(report["questions"], 3);
    let p = report["pass_at_1"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&p));
}

#[test]
fn perplexity_of_english_is_plausible() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.txt");
    std::fs::write(&f, "The cat sat on the mat. It was a sunny day, and the children were playing in the park with their friends.").unwrap();
    let out = deepinfer(&["eval", "ppl", f.to_str().unwrap(), "--threads", "2"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ppl = v["ppl"].as_f64().unwrap();
    // a 135M model on plain English: far better than uniform (49,152) and not absurdly low
    assert!(ppl > 1.5 && ppl < 200.0, "ppl {ppl}");
}

#[test]
fn chat_text_output_prints_the_answer_not_the_template() {
    let question = "What is the capital of Italy?";
    let chat = deepinfer(&[
        "generate",
        "--chat",
        "--prompt",
        question,
        "--max-tokens",
        "3",
        "--no-progress",
    ]);
    let text = String::from_utf8_lossy(&chat.stdout);
    assert!(!text.trim().is_empty(), "no answer printed");
    assert!(
        !text.contains("im_start") && !text.contains(question),
        "the templated prompt was echoed: {text:?}"
    );
    // A plain text prompt still reads on from the prompt.
    let plain = deepinfer(&[
        "generate",
        "--prompt",
        question,
        "--max-tokens",
        "1",
        "--no-progress",
    ]);
    assert!(String::from_utf8_lossy(&plain.stdout).starts_with(question));
}

#[test]
fn make_tiny_refuses_an_over_wide_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let out = out.to_str().unwrap();
    let e = common::refused(&[
        "dev",
        "make-tiny",
        "--q-lora-rank",
        "100000000",
        "--out",
        out,
    ]);
    assert!(e.contains("--q-lora-rank 100000000"), "{e}");
}

#[test]
fn eval_refuses_more_samples_than_a_run_takes() {
    for flag in ["-k", "--questions"] {
        let args = ["eval", "generate", flag, "100000000000", "-o", "/dev/null"];
        let e = common::refused(&args);
        assert!(e.contains("100000000000"), "{flag}: {e}");
    }
}
