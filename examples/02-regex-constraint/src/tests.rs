//! The plugin natively: its masks against a brute-force check of every token.

use super::*;

const EOS: TokenId = 0;

/// `<eos>`, every printable ASCII byte, and some multi-byte words.
fn vocab() -> (Vocabulary, Vec<Vec<u8>>) {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    tokens.extend((32u8..127).map(|b| vec![b]));
    for w in [
        "12",
        "123",
        "ab",
        "abc",
        "-",
        "--",
        "2024",
        "-0",
        "a1",
        "é",
        "\u{e9}\u{e9}",
    ] {
        tokens.push(w.as_bytes().to_vec());
    }
    tokens.push(vec![0xC3]); // half of "é"
    (
        Vocabulary::from_tokens(&tokens, &[EOS], tokens.len() as u32 + 5),
        tokens,
    )
}

fn bit(mask: &[u32], t: usize) -> bool {
    mask[t / 32] >> (t % 32) & 1 == 1
}

/// The mask after `consumed` under `re`, and the matcher.
fn mask_of(p: &mut RegexPlugin, re: &str, consumed: &[TokenId]) -> (Vec<u32>, RegexMatcher) {
    let g = p.compile("regex", re).expect("compiles");
    let mut m = p.matcher(&g);
    m.consume(consumed).expect("consumed tokens are allowed");
    let mut out = Vec::new();
    m.mask(&mut out).unwrap();
    (out, m)
}

#[test]
fn digits_mask_is_exact() {
    let (v, tokens) = vocab();
    let mut p = RegexPlugin::with_vocabulary(v.clone()).unwrap();
    let (mask, mut m) = mask_of(&mut p, "[0-9]{2,4}", &[]);
    assert_eq!(mask.len(), v.mask_words());
    for (t, b) in tokens.iter().enumerate() {
        let want = t != 0 && b.iter().all(u8::is_ascii_digit) && b.len() <= 4;
        assert_eq!(
            bit(&mask, t),
            want,
            "token {t} {:?}",
            String::from_utf8_lossy(b)
        );
    }
    assert!(!bit(&mask, EOS as usize), "not complete yet");
    let t12 = tokens.iter().position(|b| b == b"12").unwrap() as TokenId;
    m.consume(&[t12]).unwrap();
    assert!(m.is_accepting() && !m.is_finished());
    let mut mask = Vec::new();
    m.mask(&mut mask).unwrap();
    assert!(bit(&mask, EOS as usize));
    let t2024 = tokens.iter().position(|b| b == b"2024").unwrap();
    assert!(!bit(&mask, t2024), "12 + 2024 is too long");
    let t123 = tokens.iter().position(|b| b == b"123").unwrap() as TokenId;
    assert_eq!(m.validate(&[t12, t123]), 1);
    assert!(m.consume(&[t123]).is_err());
    m.consume(&[t12]).unwrap();
    assert!(m.is_finished(), "four digits: only EOS may follow");
    m.rollback(2).unwrap();
    assert!(!m.is_accepting());
    assert!(m.rollback(5).is_err());
}

#[test]
fn alternation_keeps_every_match_and_utf8_halves() {
    let (v, tokens) = vocab();
    let mut p = RegexPlugin::with_vocabulary(v).unwrap();
    let id = |s: &[u8]| tokens.iter().position(|b| b == s).unwrap() as TokenId;
    // Leftmost-first semantics would stop after "a"; all-match semantics keeps "abc" open.
    let (mask, mut m) = mask_of(&mut p, "a|abc", &[id(b"a")]);
    assert!(bit(&mask, EOS as usize) && bit(&mask, id(b"b") as usize));
    m.consume(&[id(b"b")]).unwrap();
    assert!(!m.is_accepting());
    let (mask, _) = mask_of(&mut p, "é+", &[]);
    for t in ["é", "éé"].map(|s| id(s.as_bytes())) {
        assert!(bit(&mask, t as usize));
    }
    assert!(
        bit(&mask, id(&[0xC3]) as usize),
        "a token holding half of é"
    );
    assert!(!bit(&mask, id(b"a") as usize));
    // Padding past the tokenizer's tokens is never allowed.
    assert!(!(tokens.len()..tokens.len() + 5).any(|t| bit(&mask, t)));
}

#[test]
fn bad_patterns_name_the_place() {
    let (v, _) = vocab();
    let mut p = RegexPlugin::with_vocabulary(v).unwrap();
    let e = p.compile("regex", "[0-9").err().unwrap();
    assert!(e.starts_with("regex:") && e.contains("unclosed"), "{e}");
    let e = p.compile("json-schema", "{}").err().unwrap();
    assert!(e.contains("unknown constraint kind"), "{e}");
}
