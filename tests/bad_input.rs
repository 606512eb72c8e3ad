//! Bad input gets a clear error, never a panic: broken model files, unknown architectures,
//! over-long and empty prompts. The engine keeps serving the other requests.

mod common;

use std::ffi::OsStr;
use std::path::Path;

use deepinfer::model::gguf::MetaValue;
use deepinfer::model::gguf_writer::{self, TensorOut};
use deepinfer::model::tiny::TinyLlama;
use deepinfer::runtime::{FinishReason, PromptInput};
use deepinfer::Error;

fn write_tiny(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<TensorOut>),
) -> std::path::PathBuf {
    let (mut meta, mut tensors) = TinyLlama::default().build();
    edit(&mut meta, &mut tensors);
    let p = dir.join(name);
    gguf_writer::write(&p, &meta, &tensors).expect("write gguf");
    p
}

fn load_err(p: &Path) -> Error {
    match common::load_cpu(p) {
        Ok(_) => panic!("{} loaded but should not", p.display()),
        Err(e) => e,
    }
}

#[test]
fn tiny_model_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "ok.gguf", |_, _| {});
    let llm = common::engine(common::load_cpu(&p).expect("tiny model loads"));
    let out = llm.generate(
        &[common::greedy(
            "a",
            PromptInput::Text("hello world".into()),
            5,
        )],
        &mut |_| {},
    );
    assert_eq!(out[0].token_ids.len(), 5, "{:?}", out[0]);
    assert_eq!(out[0].finish_reason, FinishReason::Length);
}

#[test]
fn not_gguf_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, b"this is plainly a text file").unwrap();
    let e = load_err(&p);
    assert!(matches!(e, Error::NotGguf { .. }), "{e}");
    assert!(e.to_string().contains("not a GGUF file"), "{e}");
}

#[test]
fn truncated_gguf_is_refused_at_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "full.gguf", |_, _| {});
    let bytes = std::fs::read(&p).unwrap();
    let cut_path = dir.path().join("cut.gguf");
    for cut in [3usize, 8, 30, 200, 5000, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&cut_path, &bytes[..cut]).unwrap();
        let e = load_err(&cut_path);
        assert!(
            matches!(e, Error::BadGguf { .. } | Error::NotGguf { .. }),
            "cut {cut}: {e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("truncated") || msg.contains("GGUF"),
            "cut {cut}: {msg}"
        );
    }
}

#[test]
fn unknown_tensor_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "t.gguf", |_, t| t[2].type_id = 99);
    let e = load_err(&p);
    assert!(
        matches!(e, Error::UnknownTensorType { type_id: 99, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("blk.0.attn_norm.weight"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "m.gguf", |_, t| {
        t.retain(|x| x.name != "blk.1.ffn_up.weight")
    });
    let e = load_err(&p);
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "blk.1.ffn_up.weight"),
        "{e}"
    );
}

#[test]
fn shape_contradicting_metadata_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "s.gguf", |_, t| {
        let q = t
            .iter_mut()
            .find(|x| x.name == "blk.0.attn_q.weight")
            .unwrap();
        *q = TensorOut::f32("blk.0.attn_q.weight", &[32, 64], &vec![0.0; 32 * 64]);
    });
    let e = load_err(&p);
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    assert!(e.to_string().contains("blk.0.attn_q.weight"), "{e}");
}

#[test]
fn layer_count_past_the_ceiling_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for n in [u32::MAX, 1 << 31, 1025] {
        let p = write_tiny(dir.path(), "b.gguf", |m, _| {
            let v = m
                .iter_mut()
                .find(|(k, _)| k == "llama.block_count")
                .unwrap();
            v.1 = MetaValue::U32(n);
        });
        let e = load_err(&p).to_string();
        assert!(
            e.contains("llama.block_count") && e.contains("1024"),
            "{n}: {e}"
        );
    }
    // Within the ceiling but past the file's blocks: the first missing tensor is named.
    let p = write_tiny(dir.path(), "c.gguf", |m, _| {
        let v = m
            .iter_mut()
            .find(|(k, _)| k == "llama.block_count")
            .unwrap();
        v.1 = MetaValue::U32(40);
    });
    let e = load_err(&p);
    assert!(
        matches!(&e, Error::MissingTensor(n) if n.starts_with("blk.")),
        "{e}"
    );
}

/// Every integer and float of the tiny model's metadata set to each extreme: the load either
/// succeeds or gives an error; it never panics or aborts (a layer count of 2^32 - 1 once sized
/// a table before any tensor was looked at).
#[test]
fn every_metadata_number_at_its_extremes_is_an_error_or_loads() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, _) = TinyLlama::default().build();
    let mut tried = 0;
    for (i, (key, v)) in meta.iter().enumerate() {
        let extremes: Vec<MetaValue> = match v {
            MetaValue::U32(_) => [0, 1, 1 << 31, u32::MAX].map(MetaValue::U32).to_vec(),
            MetaValue::U64(_) => [0, 1, 1 << 63, u64::MAX].map(MetaValue::U64).to_vec(),
            MetaValue::I32(_) => [i32::MIN, -1, 0, i32::MAX].map(MetaValue::I32).to_vec(),
            MetaValue::F32(_) => [0.0, -1.0, f32::NAN, f32::INFINITY, 1e30]
                .map(MetaValue::F32)
                .to_vec(),
            _ => continue,
        };
        for x in extremes {
            let p = write_tiny(dir.path(), "x.gguf", |m, _| m[i].1 = x.clone());
            if let Err(e) = common::load_cpu(&p) {
                assert!(!e.to_string().is_empty(), "{key} = {x:?}");
            }
            tried += 1;
        }
    }
    assert!(tried >= 20, "only {tried} values tried");
}

#[test]
fn unknown_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "a.gguf", |m, _| {
        m[0].1 = MetaValue::Str("frobnicator".into())
    });
    let e = load_err(&p);
    assert!(matches!(e, Error::UnknownArchitecture(..)), "{e}");
    assert!(e.to_string().contains("frobnicator"), "{e}");
}

#[test]
fn over_long_and_empty_prompts_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "ok.gguf", |_, _| {});
    let llm = common::engine(common::load_cpu(&p).unwrap());
    let long = "x".repeat(200); // 200 byte tokens > context 64
    let reqs = vec![
        common::greedy("long", PromptInput::Text(long), 4),
        common::greedy("empty", PromptInput::Text(String::new()), 4),
        common::greedy("fine", PromptInput::Text("hello".into()), 4),
        common::greedy("bad-id", PromptInput::Tokens(vec![1, 100_000]), 4),
    ];
    let out = llm.generate(&reqs, &mut |_| {});
    assert_eq!(out[0].finish_reason, FinishReason::Error);
    assert!(
        out[0].error.as_deref().unwrap().contains("context window"),
        "{:?}",
        out[0].error
    );
    assert!(
        out[1].error.as_deref().unwrap().contains("empty"),
        "{:?}",
        out[1].error
    );
    assert_eq!(out[2].error, None);
    assert_eq!(out[2].token_ids.len(), 4);
    assert!(
        out[3]
            .error
            .as_deref()
            .unwrap()
            .contains("outside the vocabulary"),
        "{:?}",
        out[3].error
    );
}

#[test]
fn cli_reports_a_corrupt_model_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00\xff").unwrap();
    let stderr = common::refused(&[
        "generate".as_ref(),
        "--prompt".as_ref(),
        "hi".as_ref(),
        "--model".as_ref(),
        p.as_os_str(),
    ]);
    assert!(stderr.contains("truncated"), "{stderr}");
}

#[test]
fn cli_refuses_a_thread_count_past_the_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny(dir.path(), "t.gguf", |_, _| {});
    let mut args: Vec<&OsStr> = ["generate", "--prompt", "hi", "--max-tokens", "2"]
        .map(OsStr::new)
        .to_vec();
    args.extend([
        OsStr::new("--threads"),
        "100000".as_ref(),
        "--model".as_ref(),
        p.as_os_str(),
    ]);
    let stderr = common::refused(&args);
    assert!(
        stderr.contains("100000 CPU threads") && stderr.contains("1024"),
        "{stderr}"
    );
}

#[test]
fn cli_rejects_unknown_prompt_file_keys() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), "ok.gguf", |_, _| {});
    let f = dir.path().join("p.jsonl");
    std::fs::write(&f, "{\"prompt\": \"hi\", \"temprature\": 0.5}\n").unwrap();
    let stderr = common::refused(&[
        "generate".as_ref(),
        "--prompts-file".as_ref(),
        f.as_os_str(),
        "--model".as_ref(),
        model.as_os_str(),
    ]);
    assert!(
        stderr.contains("p.jsonl:1") && stderr.contains("temprature"),
        "{stderr}"
    );
}

/// A device or pipe named where a file is read whole or line by line (`/dev/zero` never ends
/// and has no newline) is refused at a ceiling, not read until the memory runs out.
#[cfg(unix)]
#[test]
fn endless_files_named_by_flags_are_refused_at_a_ceiling() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["generate", "--prompt", "hi", "--config", "/dev/zero"],
            "longer than 64 MiB",
        ),
        (
            &["generate", "--prompt", "hi", "--json-schema", "/dev/zero"],
            "longer than 64 MiB",
        ),
        (
            &["generate", "--prompt", "hi", "--grammar", "/dev/zero"],
            "longer than 64 MiB",
        ),
        (
            &["eval", "score", "/dev/zero"],
            "line is longer than 256 MiB",
        ),
        (
            &[
                "eval",
                "generate",
                "--tasks",
                "/dev/zero",
                "-o",
                "/dev/null",
            ],
            "line is longer than 256 MiB",
        ),
        (
            &["plot", "/dev/zero", "-o", "/dev/null"],
            "line is longer than 256 MiB",
        ),
    ];
    for (args, want) in cases {
        let stderr = common::refused(args);
        assert!(
            stderr.contains("/dev/zero") && stderr.contains(want),
            "{args:?}: {stderr}"
        );
    }
}

/// `--threads 0` is refused by name on every command that takes it, not run as one thread.
#[test]
fn zero_threads_are_refused_by_every_command() {
    for args in [
        &["generate", "--prompt", "hi", "--threads", "0"][..],
        &["eval", "ppl", "text.txt", "--threads", "0"],
        &["bench", "decode", "--threads", "0"],
    ] {
        let stderr = common::refused(args);
        assert!(
            stderr.contains("--threads") && stderr.contains("at least 1"),
            "{args:?}: {stderr}"
        );
    }
}

/// Bench sizes of 0 (a batch, a prompt length, steps, repeats) and a perplexity window too
/// short to score a token are refused by flag, not run as empty measurements or into a panic.
#[test]
fn zero_bench_sizes_are_refused_by_flag() {
    for (args, flag) in [
        (&["bench", "decode", "--batch", "1,0"][..], "--batch"),
        (&["bench", "decode", "--prompt-len", "0"], "--prompt-len"),
        (&["bench", "decode", "--new-tokens", "0"], "--new-tokens"),
        (&["bench", "decode", "--repeats", "0"], "--repeats"),
        (&["bench", "prefill", "--lengths", "0"], "--lengths"),
        (&["bench", "prefill", "--chunk-sizes", "0"], "--chunk-sizes"),
        (&["eval", "ppl", "text.txt", "--window", "1"], "--window"),
    ] {
        let stderr = common::refused(args);
        assert!(
            stderr.contains(flag) && stderr.contains("must be at least"),
            "{args:?}: {stderr}"
        );
    }
}
