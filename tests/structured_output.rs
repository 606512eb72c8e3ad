//! Structured output on the default model (SmolLM2-135M-Instruct), sampled through the Wasm
//! `standard` sampler plugin with masks from the builtin `grammar` constraint plugin. One
//! engine run holds every request: 32 JSON Schemas (each output must parse and validate with
//! the independent `jsonschema` crate), regexes (each output must fully match, checked with the
//! `regex` crate), Lark grammars (checked by equivalent regexes and by a hand-written parser),
//! choices, a request cut off mid-structure (finish_reason must be `length`), a request with a
//! broken schema (it alone fails, with the place named) and an `n = 2` request. A second test
//! checks masks against the 49,152-token vocabulary token by token.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use deepinfer::config::Config;
use deepinfer::model::chat::Message;
use deepinfer::runtime::{
    Constraint, EngineOptions, FinishReason, Llm, PromptInput, Request, RequestOutput,
};
use deepinfer::sampling::SamplingParams;
use serde_json::Value;

fn llm() -> &'static Llm {
    static LLM: OnceLock<Llm> = OnceLock::new();
    LLM.get_or_init(|| {
        let sampler = deepinfer::plugins::build_sampler(&Config::default())
            .expect("the standard sampler plugin loads");
        Llm::new(common::default_model(), sampler, EngineOptions::default())
            .expect("the engine starts")
    })
}

fn chat(text: &str) -> PromptInput {
    PromptInput::Chat(vec![Message {
        role: "user".into(),
        content: text.into(),
    }])
}

fn request(id: String, prompt: &str, c: Constraint, max_tokens: usize) -> Request {
    let mut r = Request::new(
        id,
        chat(prompt),
        SamplingParams {
            max_tokens,
            ..Default::default()
        },
    );
    r.constraint = Some(c);
    r
}

/// (what to ask for, schema): objects, nested arrays, enums, bounded numbers, string
/// patterns, `$ref`/`$defs`, `anyOf`/`oneOf`, `additionalProperties: false`, formats.
const SCHEMAS: &[(&str, &str)] = &[
    (
        "a person",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}"#,
    ),
    (
        "a city",
        r#"{"type":"object","properties":{"city":{"type":"string","maxLength":20},"country":{"type":"string","maxLength":20},"population":{"type":"integer","minimum":1,"maximum":40000000}},"required":["city","country","population"],"additionalProperties":false}"#,
    ),
    (
        "a boolean answer",
        r#"{"type":"object","properties":{"answer":{"type":"boolean"}},"required":["answer"],"additionalProperties":false}"#,
    ),
    (
        "a colour",
        r#"{"type":"object","properties":{"colour":{"enum":["red","green","blue"]}},"required":["colour"],"additionalProperties":false}"#,
    ),
    (
        "three small numbers",
        r#"{"type":"array","items":{"type":"integer","minimum":0,"maximum":9},"minItems":3,"maxItems":3}"#,
    ),
    (
        "a matrix",
        r#"{"type":"array","items":{"type":"array","items":{"type":"integer","minimum":-9,"maximum":9},"minItems":2,"maxItems":2},"minItems":2,"maxItems":2}"#,
    ),
    (
        "a shopping list",
        r#"{"type":"object","properties":{"items":{"type":"array","items":{"type":"string","maxLength":12},"minItems":1,"maxItems":4}},"required":["items"],"additionalProperties":false}"#,
    ),
    (
        "a temperature",
        r#"{"type":"object","properties":{"celsius":{"type":"number","minimum":-50,"maximum":60}},"required":["celsius"],"additionalProperties":false}"#,
    ),
    (
        "a percentage",
        r#"{"type":"object","properties":{"percent":{"type":"integer","minimum":0,"maximum":100}},"required":["percent"],"additionalProperties":false}"#,
    ),
    (
        "a zip code",
        r#"{"type":"object","properties":{"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["zip"],"additionalProperties":false}"#,
    ),
    (
        "a product code",
        r#"{"type":"object","properties":{"code":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{3}$"}},"required":["code"],"additionalProperties":false}"#,
    ),
    (
        "a date",
        r#"{"type":"object","properties":{"date":{"type":"string","format":"date"}},"required":["date"],"additionalProperties":false}"#,
    ),
    (
        "an address via $ref",
        r##"{"type":"object","properties":{"home":{"$ref":"#/$defs/addr"},"work":{"$ref":"#/$defs/addr"}},"required":["home","work"],"additionalProperties":false,"$defs":{"addr":{"type":"object","properties":{"street":{"type":"string","maxLength":20},"number":{"type":"integer","minimum":1,"maximum":999}},"required":["street","number"],"additionalProperties":false}}}"##,
    ),
    (
        "a shape (anyOf)",
        r#"{"anyOf":[{"type":"object","properties":{"circle":{"type":"integer","minimum":1,"maximum":99}},"required":["circle"],"additionalProperties":false},{"type":"object","properties":{"square":{"type":"integer","minimum":1,"maximum":99}},"required":["square"],"additionalProperties":false}]}"#,
    ),
    (
        "a pet (oneOf)",
        r#"{"oneOf":[{"type":"object","properties":{"kind":{"const":"cat"},"lives":{"type":"integer","minimum":1,"maximum":9}},"required":["kind","lives"],"additionalProperties":false},{"type":"object","properties":{"kind":{"const":"dog"},"breed":{"type":"string","maxLength":15}},"required":["kind","breed"],"additionalProperties":false}]}"#,
    ),
    (
        "a number or a word (anyOf)",
        r#"{"anyOf":[{"type":"integer","minimum":0,"maximum":1000},{"type":"string","maxLength":10}]}"#,
    ),
    (
        "a book",
        r#"{"type":"object","properties":{"title":{"type":"string","maxLength":30},"year":{"type":"integer","minimum":1400,"maximum":2030},"genres":{"type":"array","items":{"enum":["fiction","history","science","poetry"]},"minItems":1,"maxItems":2}},"required":["title","year","genres"],"additionalProperties":false}"#,
    ),
    (
        "a point",
        r#"{"type":"object","properties":{"x":{"type":"integer","minimum":-100,"maximum":100},"y":{"type":"integer","minimum":-100,"maximum":100}},"required":["x","y"],"additionalProperties":false}"#,
    ),
    (
        "a list of points",
        r##"{"type":"array","items":{"$ref":"#/$defs/p"},"minItems":1,"maxItems":3,"$defs":{"p":{"type":"object","properties":{"x":{"type":"integer","minimum":0,"maximum":9},"y":{"type":"integer","minimum":0,"maximum":9}},"required":["x","y"],"additionalProperties":false}}}"##,
    ),
    (
        "a weekday",
        r#"{"enum":["Monday","Tuesday","Wednesday","Thursday","Friday","Saturday","Sunday"]}"#,
    ),
    (
        "a status",
        r#"{"type":"object","properties":{"status":{"enum":["ok","error","pending"]},"code":{"type":"integer","minimum":100,"maximum":599}},"required":["status","code"],"additionalProperties":false}"#,
    ),
    (
        "an email",
        r#"{"type":"object","properties":{"email":{"type":"string","pattern":"^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},"required":["email"],"additionalProperties":false}"#,
    ),
    (
        "a tree",
        r##"{"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"value":{"type":"integer","minimum":0,"maximum":99},"children":{"type":"array","items":{"type":"object","properties":{"value":{"type":"integer","minimum":0,"maximum":99}},"required":["value"],"additionalProperties":false},"maxItems":2}},"required":["value","children"],"additionalProperties":false}}}"##,
    ),
    (
        "an RGB colour",
        r#"{"type":"array","prefixItems":[{"type":"integer","minimum":0,"maximum":255},{"type":"integer","minimum":0,"maximum":255},{"type":"integer","minimum":0,"maximum":255}],"items":false,"minItems":3}"#,
    ),
    (
        "a user with an optional nickname",
        r#"{"type":"object","properties":{"id":{"type":"integer","minimum":1,"maximum":9999},"nickname":{"type":"string","maxLength":10}},"required":["id"],"additionalProperties":false}"#,
    ),
    (
        "a score",
        r#"{"type":"object","properties":{"score":{"type":"number","minimum":0,"maximum":10}},"required":["score"],"additionalProperties":false}"#,
    ),
    (
        "a null or a count",
        r#"{"type":"object","properties":{"count":{"type":["integer","null"],"minimum":0,"maximum":50}},"required":["count"],"additionalProperties":false}"#,
    ),
    (
        "a team",
        r#"{"type":"object","properties":{"team":{"type":"string","maxLength":15},"members":{"type":"array","items":{"type":"object","properties":{"name":{"type":"string","maxLength":10},"role":{"enum":["lead","dev","qa"]}},"required":["name","role"],"additionalProperties":false},"minItems":1,"maxItems":2}},"required":["team","members"],"additionalProperties":false}"#,
    ),
    (
        "a yes/no const",
        r#"{"type":"object","properties":{"version":{"const":2},"ok":{"type":"boolean"}},"required":["version","ok"],"additionalProperties":false}"#,
    ),
    (
        "a time",
        r#"{"type":"object","properties":{"time":{"type":"string","pattern":"^([01][0-9]|2[0-3]):[0-5][0-9]$"}},"required":["time"],"additionalProperties":false}"#,
    ),
    (
        "words (string length bounds)",
        r#"{"type":"array","items":{"type":"string","minLength":2,"maxLength":6,"pattern":"^[a-z]+$"},"minItems":2,"maxItems":3}"#,
    ),
    (
        "an inventory (allOf)",
        r#"{"allOf":[{"type":"object","properties":{"sku":{"type":"string","pattern":"^[0-9]{4}$"},"qty":{"type":"integer","minimum":0,"maximum":500}},"required":["sku","qty"],"additionalProperties":false},{"required":["qty"]}]}"#,
    ),
];

/// Regexes the whole output must match.
const REGEXES: &[(&str, &str)] = &[
    ("a US phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("today's date", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    (
        "whether water is wet, with a reason",
        r"(yes|no), because [a-z ]{1,40}\.",
    ),
    (
        "a famous person's name",
        r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}",
    ),
    ("a colour as hex", r"#[0-9a-f]{6}"),
    ("an IPv4 address", r"[0-9]{1,3}(\.[0-9]{1,3}){3}"),
];

/// Choices (the output must be one of them).
const CHOICES: &[(&str, &[&str])] = &[
    ("What colour is the sky?", &["red", "green", "blue"]),
    ("Is fire cold?", &["yes", "no"]),
    (
        "What is the capital of France?",
        &["Paris", "London", "Berlin", "Rome"],
    ),
];

/// A comma list of at most four lowercase words (checked by an equivalent regex).
const LIST_GRAMMAR: &str = "start: item (\",\" item)~0..3\nitem: /[a-z]{1,12}/\n";
const LIST_REGEX: &str = r"^[a-z]{1,12}(,[a-z]{1,12}){0,3}$";
/// `key=value` lines (checked by an equivalent regex).
const PAIRS_GRAMMAR: &str =
    "start: pair (\"\\n\" pair)~0..2\npair: KEY \"=\" VALUE\nKEY: /[a-z_]{1,10}/\nVALUE: /[0-9]{1,4}/\n";
const PAIRS_REGEX: &str = r"^[a-z_]{1,10}=[0-9]{1,4}(\n[a-z_]{1,10}=[0-9]{1,4}){0,2}$";
/// Arithmetic (checked by `parse_arith`).
const ARITH_GRAMMAR: &str = "start: expr\nexpr: term ((\"+\" | \"-\") term)~0..3\nterm: factor ((\"*\" | \"/\") factor)~0..2\nfactor: NUMBER | \"(\" expr \")\"\nNUMBER: /[0-9]{1,3}/\n";

/// A recursive-descent parser of `ARITH_GRAMMAR`'s language; whether `s` is a sentence.
fn parse_arith(s: &str) -> bool {
    fn expr(b: &[u8], i: &mut usize) -> bool {
        if !term(b, i) {
            return false;
        }
        let mut n = 0;
        while n < 3 && matches!(b.get(*i), Some(b'+' | b'-')) {
            *i += 1;
            n += 1;
            if !term(b, i) {
                return false;
            }
        }
        true
    }
    fn term(b: &[u8], i: &mut usize) -> bool {
        if !factor(b, i) {
            return false;
        }
        let mut n = 0;
        while n < 2 && matches!(b.get(*i), Some(b'*' | b'/')) {
            *i += 1;
            n += 1;
            if !factor(b, i) {
                return false;
            }
        }
        true
    }
    fn factor(b: &[u8], i: &mut usize) -> bool {
        if b.get(*i) == Some(&b'(') {
            *i += 1;
            return expr(b, i) && b.get(*i) == Some(&b')') && {
                *i += 1;
                true
            };
        }
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() && *i - start < 3 {
            *i += 1;
        }
        *i > start && !b.get(*i).is_some_and(u8::is_ascii_digit)
    }
    let b = s.as_bytes();
    let mut i = 0;
    expr(b, &mut i) && i == b.len()
}

#[test]
fn arith_checker_is_a_real_parser() {
    assert!(parse_arith("1+2*(3-4)"));
    assert!(parse_arith("(((7)))"));
    assert!(!parse_arith("1+"));
    assert!(!parse_arith("1234"));
    assert!(!parse_arith("(1"));
    assert!(!parse_arith("1+2+3+4+5"));
}

fn by_id<'a>(outs: &'a [RequestOutput], id: &str) -> &'a RequestOutput {
    outs.iter()
        .find(|o| o.id == id)
        .expect("an output per request")
}

#[test]
fn constrained_outputs_parse_validate_and_match() {
    let llm = llm();
    let mut reqs = Vec::new();
    for (i, (what, schema)) in SCHEMAS.iter().enumerate() {
        let prompt = format!("Reply with JSON only: {what}.");
        let mut r = request(
            format!("schema-{i}"),
            &prompt,
            Constraint::json_schema(*schema),
            160,
        );
        if i % 4 == 3 {
            // Some sampled, not greedy: the mask must hold for any draw.
            r.params.temperature = 0.8;
            r.params.seed = Some(i as u64);
        }
        reqs.push(r);
    }
    for (i, (what, re)) in REGEXES.iter().enumerate() {
        let prompt = format!("Give {what}.");
        reqs.push(request(
            format!("regex-{i}"),
            &prompt,
            Constraint::regex(*re),
            48,
        ));
    }
    for (i, (q, options)) in CHOICES.iter().enumerate() {
        reqs.push(request(
            format!("choice-{i}"),
            q,
            Constraint::choice(options),
            8,
        ));
    }
    let grammars = [
        ("list", LIST_GRAMMAR, "List some fruits, comma separated."),
        ("pairs", PAIRS_GRAMMAR, "Write settings as key=value lines."),
        ("arith", ARITH_GRAMMAR, "Write an arithmetic expression."),
    ];
    for (name, g, prompt) in grammars {
        reqs.push(request(
            format!("lark-{name}"),
            prompt,
            Constraint::lark(g),
            48,
        ));
    }
    // Cut off mid-structure: must end with `length`, not a false stop.
    reqs.push(request(
        "cut-off".into(),
        "Describe a person as JSON.",
        Constraint::json_schema(SCHEMAS[0].1),
        4,
    ));
    // A broken schema fails this request alone, naming the place.
    reqs.push(request(
        "broken".into(),
        "Anything.",
        Constraint::json_schema("{\"type\": \"object\",\n \"properties\": }"),
        8,
    ));
    let mut two = request(
        "two-samples".into(),
        "Reply with JSON only: a point.",
        Constraint::json_schema(SCHEMAS[17].1),
        40,
    );
    two.n = 2;
    two.params.temperature = 1.0;
    two.params.seed = Some(7);
    reqs.push(two);

    let outs = llm.generate(&reqs, &mut |_| {});
    let summary = llm.last_summary().expect("a summary");
    println!("{summary}");
    assert!(summary.constrained_steps > 0);

    let mut failures = Vec::new();
    for (i, (_, schema)) in SCHEMAS.iter().enumerate() {
        let o = by_id(&outs, &format!("schema-{i}"));
        let schema_v: Value = serde_json::from_str(schema).expect("test schema is JSON");
        let validator = jsonschema::draft202012::options()
            .should_validate_formats(true)
            .build(&schema_v)
            .expect("the validator takes the test schema");
        let verdict = match (o.finish_reason, serde_json::from_str::<Value>(&o.text)) {
            (FinishReason::Stop, Ok(v)) => match validator.validate(&v) {
                Ok(()) => None,
                Err(e) => Some(format!("does not validate: {e}")),
            },
            (FinishReason::Stop, Err(e)) => Some(format!("not JSON: {e}")),
            (reason, _) => Some(format!("finished with {reason:?} ({:?})", o.error)),
        };
        println!("schema-{i}: {}", o.text);
        if let Some(v) = verdict {
            failures.push(format!("schema-{i} {:?}: {v}", o.text));
        }
    }
    for (i, (_, re)) in REGEXES.iter().enumerate() {
        let o = by_id(&outs, &format!("regex-{i}"));
        let full = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
        println!("regex-{i}: {:?}", o.text);
        if o.finish_reason != FinishReason::Stop || !full.is_match(&o.text) {
            failures.push(format!("regex-{i} {:?} ({:?})", o.text, o.finish_reason));
        }
    }
    for (i, (_, options)) in CHOICES.iter().enumerate() {
        let o = by_id(&outs, &format!("choice-{i}"));
        println!("choice-{i}: {:?}", o.text);
        if !options.contains(&o.text.as_str()) {
            failures.push(format!("choice-{i} {:?} ({:?})", o.text, o.finish_reason));
        }
    }
    let list = regex::Regex::new(LIST_REGEX).unwrap();
    let pairs = regex::Regex::new(PAIRS_REGEX).unwrap();
    type Check<'a> = Box<dyn Fn(&str) -> bool + 'a>;
    let checks: [(&str, Check<'_>); 3] = [
        ("list", Box::new(|t| list.is_match(t))),
        ("pairs", Box::new(|t| pairs.is_match(t))),
        ("arith", Box::new(parse_arith)),
    ];
    for (name, ok) in checks {
        let o = by_id(&outs, &format!("lark-{name}"));
        println!("lark-{name}: {:?}", o.text);
        if o.finish_reason != FinishReason::Stop || !ok(&o.text) {
            failures.push(format!("lark-{name} {:?} ({:?})", o.text, o.finish_reason));
        }
    }
    let cut = by_id(&outs, "cut-off");
    assert_eq!(cut.finish_reason, FinishReason::Length, "{cut:?}");
    assert_eq!(cut.token_ids.len(), 4);
    assert!(serde_json::from_str::<Value>(&cut.text).is_err(), "{cut:?}");
    let broken = by_id(&outs, "broken");
    assert_eq!(broken.finish_reason, FinishReason::Error);
    let msg = broken.error.as_deref().unwrap_or("");
    assert!(msg.contains("line 2"), "the error names the place: {msg}");
    let two = by_id(&outs, "two-samples");
    assert_eq!(two.samples.len(), 1);
    println!(
        "two-samples: {:?} ({:?}, {:?}) / {:?} ({:?}, {:?})",
        two.text,
        two.finish_reason,
        two.token_ids,
        two.samples[0].text,
        two.samples[0].finish_reason,
        two.samples[0].token_ids,
    );
    println!("two-samples error: {:?}", two.samples[0].error);
    assert!(two.error.is_none(), "{two:?}");
    for text in [&two.text, &two.samples[0].text] {
        let v: Value = serde_json::from_str(text).expect("each sample is JSON");
        assert!(v["x"].is_i64() && v["y"].is_i64(), "{text}");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn masks_are_exact_on_the_49k_vocabulary() {
    let llm = llm();
    let vocab = llm.constraint_vocab();
    assert_eq!(vocab.vocab_size, 49_152);
    let plugin = llm.constraint_plugin().expect("grammar plugin");
    let bytes = |t: usize| {
        let start = if t == 0 {
            0
        } else {
            vocab.token_ends[t - 1] as usize
        };
        &vocab.token_bytes[start..vocab.token_ends[t] as usize]
    };
    let special: HashSet<u32> = vocab
        .special_tokens
        .iter()
        .chain(&vocab.eos_tokens)
        .copied()
        .collect();
    let bit = |m: &[u32], t: usize| m[t / 32] >> (t % 32) & 1 == 1;
    let n = vocab.token_ends.len();

    // Digits: exactly the tokens made only of ASCII digits.
    let m = plugin.matcher("regex", "[0-9]+").unwrap();
    let mut mask = Vec::new();
    m.mask(&mut mask).unwrap();
    let mut wrong = Vec::new();
    for t in 0..n {
        let b = bytes(t);
        let want =
            !special.contains(&(t as u32)) && !b.is_empty() && b.iter().all(u8::is_ascii_digit);
        if bit(&mask, t) != want {
            wrong.push(t);
        }
    }
    assert!(wrong.is_empty(), "tokens masked wrongly: {wrong:?}");
    let digit = (0..n).find(|&t| bytes(t) == b"7").unwrap();
    m.consume(&[digit as u32]).unwrap();
    mask.clear();
    m.mask(&mut mask).unwrap();
    assert!(
        bit(&mask, vocab.eos_tokens[0] as usize),
        "EOS once complete"
    );

    // "é" is C3 A9: the byte-level token holding only C3 must be allowed, and every allowed
    // token must continue C3 A9 C3 A9 ...
    let m = plugin.matcher("regex", "é+").unwrap();
    mask.clear();
    m.mask(&mut mask).unwrap();
    let mut allowed_half = false;
    for t in 0..n {
        let b = bytes(t);
        let want = !special.contains(&(t as u32))
            && !b.is_empty()
            && b.iter().enumerate().all(|(i, &x)| x == [0xC3, 0xA9][i % 2]);
        assert_eq!(bit(&mask, t), want, "token {t} {b:?}");
        allowed_half |= want && b == [0xC3];
    }
    assert!(allowed_half, "the half-character token C3 is allowed");
}

#[test]
fn invalid_specs_are_refused_naming_the_place() {
    let llm = llm();
    let cases = [
        (
            Constraint::json_schema("{\"type\": \"object\",\n  \"properties\": [}"),
            "line 2",
        ),
        (
            Constraint::json_schema(r#"{"type":"object","not":{"type":"null"}}"#),
            "not",
        ),
        (Constraint::regex("[0-9]{3"), "^"),
        (Constraint::lark("start: \"a\" (\n"), "1("),
        (Constraint::new("gbnf", "root ::= \"a\""), "not supported"),
    ];
    for (c, place) in cases {
        let e = llm.check_constraint(&c).expect_err("refused").to_string();
        println!("{} -> {e}", c.kind);
        assert!(e.contains(place), "{e:?} should name {place:?}");
    }
    let plugin: Arc<_> = llm.constraint_plugin().unwrap();
    assert!(plugin.manifest().kinds.iter().any(|k| k == "lark"));
}
