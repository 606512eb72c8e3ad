//! Constraint plugin figures through Wasm: init time, grammar compile time, and mask time per
//! token (p50 / p99) while generating a JSON document token by token, on a 49,152-token and a
//! synthetic 131,072-token vocabulary. Run: `cargo bench -p deepinfer --bench constraint_mask`.

use std::time::Instant;

use deepinfer::plugins::{CacheDir, ConstraintVocab, PluginEngine, PluginSource, WasmConstraint};

const SCHEMA: &str = r##"{"type":"object","properties":{
  "name":{"type":"string","maxLength":20},
  "age":{"type":"integer","minimum":0,"maximum":150},
  "tags":{"type":"array","items":{"enum":["a","b","c"]},"maxItems":4},
  "home":{"$ref":"#/$defs/addr"}},
  "required":["name","age","tags","home"],"additionalProperties":false,
  "$defs":{"addr":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},
  "required":["city","zip"],"additionalProperties":false}}}"##;
const DOC: &str =
    r#"{"name":"Ada Lovelace","age":36,"tags":["a","c"],"home":{"city":"London","zip":"12345"}}"#;

/// Printable bytes, then pseudo-random ASCII words of 2-8 bytes up to `size` tokens.
fn vocab(size: usize) -> (Vec<Vec<u8>>, u32) {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    tokens.extend((0..=255u8).map(|b| vec![b]));
    let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789\":,{}[] _ABCDEFGHIJ";
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut seen = std::collections::HashSet::new();
    while tokens.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 7) as usize;
        let w: Vec<u8> = (0..len)
            .map(|i| alphabet[((x >> (8 + 5 * i)) % alphabet.len() as u64) as usize])
            .collect();
        if seen.insert(w.clone()) {
            tokens.push(w);
        }
    }
    (tokens, 0)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run(size: usize) {
    let (tokens, eos) = vocab(size);
    let cv = ConstraintVocab::from_tokens(&tokens, &[eos], &[], size);
    let engine = PluginEngine::new(&CacheDir::Disabled).expect("engine");
    let mut source = PluginSource::resolve("grammar", None).expect("grammar plugin");
    source.limits.memory_mib = 512;
    let t = Instant::now();
    let plugin = WasmConstraint::load(engine, &source, &cv).expect("load");
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let m = plugin.matcher("json-schema", SCHEMA).expect("compile");
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    // Feed the document greedily by the longest allowed token, timing each mask.
    let mut times = Vec::new();
    let mut rest = DOC.as_bytes();
    let mut mask = Vec::new();
    while !rest.is_empty() {
        mask.clear();
        let t = Instant::now();
        m.mask(&mut mask).expect("mask");
        times.push(t.elapsed().as_secs_f64() * 1e6);
        let best = (1..tokens.len())
            .filter(|&i| mask[i / 32] >> (i % 32) & 1 == 1 && rest.starts_with(&tokens[i]))
            .max_by_key(|&i| tokens[i].len())
            .expect("some allowed token continues the document");
        m.consume(&[best as u32]).expect("consume");
        rest = &rest[tokens[best].len()..];
    }
    assert!(m.is_accepting().unwrap());
    let n = times.len();
    println!(
        "vocab {size}: load+init {load_ms:.0} ms, compile {compile_ms:.2} ms, mask over {n} steps: p50 {:.1} us, p99 {:.1} us",
        pct(&mut times, 0.5),
        pct(&mut times, 0.99)
    );
}

fn main() {
    run(49_152);
    run(131_072);
}
