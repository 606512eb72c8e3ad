//! Tests of the host side of the constraint world against the builtin `grammar` plugin, over a
//! small vocabulary (the printable bytes plus an end-of-sequence token and padding).

use std::sync::{Arc, OnceLock};

use super::*;
use crate::plugins::cache::CacheDir;

const EOS: TokenId = 0;

fn tok(text: &str) -> Vec<TokenId> {
    text.bytes().map(|b| (b - 31) as TokenId).collect()
}

fn allowed(mask: &[u32], t: TokenId) -> bool {
    mask[t as usize / 32] >> (t % 32) & 1 == 1
}

fn plugin() -> Arc<WasmConstraint> {
    static P: OnceLock<Arc<WasmConstraint>> = OnceLock::new();
    P.get_or_init(|| {
        let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
        tokens.extend((32u8..127).map(|b| vec![b]));
        let vocab = ConstraintVocab::from_tokens(&tokens, &[EOS], &[], 130);
        let engine = PluginEngine::new(&CacheDir::Disabled).expect("engine");
        let source = PluginSource::resolve("grammar", None).expect("builtin grammar plugin");
        WasmConstraint::load(engine, &source, &vocab).expect("load")
    })
    .clone()
}

#[test]
fn manifest_lists_the_kinds() {
    let p = plugin();
    for k in ["json-schema", "regex", "lark", "choice"] {
        assert!(p.manifest().kinds.iter().any(|x| x == k), "{k}");
    }
    assert_eq!(p.mask_words(), 5);
}

#[test]
fn regex_matcher_masks_consumes_rolls_back() {
    let p = plugin();
    let m = p.matcher("regex", "[0-9]{2}x").unwrap();
    let mut mask = Vec::new();
    m.mask(&mut mask).unwrap();
    assert_eq!(mask.len(), 5);
    assert!(allowed(&mask, tok("7")[0]) && !allowed(&mask, tok("x")[0]));
    assert!(!allowed(&mask, EOS));
    assert_eq!(m.validate(&tok("12y")).unwrap(), 2);
    let e = m.consume(&tok("1a")).unwrap_err();
    assert!(e.to_string().contains("not allowed"), "{e}");
    m.consume(&tok("2x")).unwrap();
    assert!(m.is_accepting().unwrap());
    mask.clear();
    m.mask(&mut mask).unwrap();
    assert!(allowed(&mask, EOS), "EOS once complete");
    m.rollback(1).unwrap();
    assert!(!m.is_accepting().unwrap());
}

#[test]
fn bad_specs_are_bad_requests_naming_the_place() {
    let p = plugin();
    let e = p.matcher("json-schema", "{\"type\":").err().unwrap();
    assert!(matches!(e, Error::BadRequest(_)), "{e}");
    assert!(e.to_string().contains("line 1"), "{e}");
    let e = p.matcher("regex", "(ab").err().unwrap();
    assert!(matches!(e, Error::BadRequest(_)), "{e}");
    let e = p.matcher("gbnf", "root ::= \"a\"").err().unwrap();
    assert!(e.to_string().contains("not supported"), "{e}");
}

#[test]
fn json_matcher_accepts_a_valid_document() {
    let p = plugin();
    let schema = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0}},"required":["n"],"additionalProperties":false}"#;
    let m = p.matcher("json-schema", schema).unwrap();
    m.consume(&tok(r#"{"n":42}"#)).unwrap();
    assert!(m.is_accepting().unwrap());
    let bad = p.matcher("json-schema", schema).unwrap();
    assert!(bad.validate(&tok(r#"{"n":-1}"#)).unwrap() < 8);
}
