//! Native tests of the plugin over a small vocabulary: every printable byte, a few merged
//! tokens, and an end-of-sequence token.

use super::*;

const EOS: TokenId = 0;

fn vocab() -> Vocabulary {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    tokens.extend((32u8..127).map(|b| vec![b]));
    for w in [&b"\"name\""[..], b"true", b"false", b"ab", b"{\"", b"\":"] {
        tokens.push(w.to_vec());
    }
    Vocabulary::from_tokens(&tokens, &[EOS], 200)
}

fn tok(text: &str) -> Vec<TokenId> {
    // Single-byte tokens: byte b is token b - 31.
    text.bytes().map(|b| (b - 31) as TokenId).collect()
}

fn allowed(mask: &[u32], t: TokenId) -> bool {
    mask[t as usize / 32] >> (t % 32) & 1 == 1
}

fn matcher(kind: &str, spec: &str) -> GrammarMatcher {
    let mut p = GrammarPlugin::with_vocabulary(vocab()).unwrap();
    let g = p.compile(kind, spec).unwrap();
    p.matcher(&g)
}

fn mask(m: &mut GrammarMatcher) -> Vec<u32> {
    let mut out = Vec::new();
    m.mask(&mut out).unwrap();
    out
}

#[test]
fn regex_masks_consumes_and_stops() {
    let mut m = matcher("regex", "a[bc]+");
    let first = mask(&mut m);
    assert_eq!(first.len(), 200usize.div_ceil(32));
    assert!(allowed(&first, tok("a")[0]));
    assert!(!allowed(&first, tok("b")[0]));
    assert!(!allowed(&first, EOS));
    assert!(
        !allowed(&first, 150),
        "padding past the tokenizer is never allowed"
    );
    m.consume(&tok("ab")).unwrap();
    assert!(m.is_accepting());
    let after = mask(&mut m);
    assert!(allowed(&after, EOS) && allowed(&after, tok("c")[0]));
    assert!(m.consume(&tok("x")).is_err());
    // The refused token left the matcher usable, before it.
    m.consume(&tok("c")).unwrap();
    m.consume(&[EOS]).unwrap();
    assert!(m.is_finished());
}

#[test]
fn validate_counts_the_allowed_prefix_and_rollback_undoes() {
    let mut m = matcher("regex", "abc");
    assert_eq!(m.validate(&tok("abx")), 2);
    assert_eq!(m.validate(&tok("abc")), 3);
    m.consume(&tok("ab")).unwrap();
    m.rollback(1).unwrap();
    assert!(allowed(&mask(&mut m), tok("b")[0]));
    assert!(!m.is_accepting());
}

#[test]
fn json_schema_accepts_valid_and_refuses_invalid() {
    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"ok":{"type":"boolean"}},
        "required":["name","ok"],"additionalProperties":false}"#;
    let mut m = matcher("json-schema", schema);
    let text = r#"{"name":"x","ok":true}"#;
    assert_eq!(m.validate(&tok(text)), text.len() as u32);
    m.consume(&tok(text)).unwrap();
    assert!(m.is_accepting());
    let mut bad = matcher("json-schema", schema);
    let wrong = r#"{"name":1}"#;
    assert!(bad.validate(&tok(wrong)) < wrong.len() as u32);
}

#[test]
fn lark_and_choice() {
    let mut m = matcher(
        "lark",
        "start: \"(\" NUM (\",\" NUM)* \")\"\nNUM: /[0-9]+/\n",
    );
    m.consume(&tok("(1,23)")).unwrap();
    assert!(m.is_accepting());
    let mut c = matcher("choice", "red,green,a.b");
    assert_eq!(c.validate(&tok("a.b")), 3);
    assert_eq!(c.validate(&tok("axb")), 1);
    c.consume(&tok("green")).unwrap();
    assert!(c.is_accepting());
}

#[test]
fn forced_tokens_follow_a_fixed_prefix() {
    let mut m = matcher("regex", "hello[0-9]");
    let f = m.forced();
    assert!(!f.is_empty());
    let text: Vec<u8> = f.iter().flat_map(|&t| vocab().token(t).to_vec()).collect();
    assert!(b"hello".starts_with(&text), "{text:?}");
}

#[test]
fn bad_specs_are_refused_with_the_place() {
    let mut p = GrammarPlugin::with_vocabulary(vocab()).unwrap();
    let e = p.compile("json-schema", "{\"type\": \n 1,").err().unwrap();
    assert!(e.contains("line 2"), "{e}");
    let e = p.compile("regex", "a(b").err().unwrap();
    assert!(e.starts_with("regex:"), "{e}");
    let e = p.compile("lark", "start: foo\n").err().unwrap();
    assert!(e.contains("foo"), "{e}");
    let e = p
        .compile(
            "json-schema",
            r#"{"type":"string","format":"no-such-format-x"}"#,
        )
        .err();
    assert!(e.is_some(), "an unknown format is refused in strict mode");
    assert!(p.compile("choice", "a,,b").is_err());
}

#[test]
fn lenient_setting_ignores_unknown_keywords() {
    let mut p = GrammarPlugin::default();
    p.configure(&Settings::new(vec![("lenient".into(), "true".into())]))
        .unwrap();
    p.init(vocab()).unwrap();
    assert!(p
        .compile(
            "json-schema",
            r#"{"type":"string","format":"no-such-format-x"}"#
        )
        .is_ok());
}
