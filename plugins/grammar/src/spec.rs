//! Turning user specs into llguidance grammars: JSON Schema text with the plugin's option
//! defaults, and a choice list as an escaped regex alternation. Errors name the place.

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

/// The plugin's settings that shape compiled grammars.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Ignore unsupported JSON Schema keywords instead of refusing the schema.
    pub lenient: bool,
    /// Allow whitespace between JSON tokens (off: compact output).
    pub flexible_whitespace: bool,
}

/// Parses a JSON Schema and adds the plugin's compile options unless the schema carries its own
/// `x-guidance` object. `oneOf` is compiled as `anyOf` (exact when the branches are disjoint).
pub fn json_schema_grammar(spec: &str, options: &Options) -> Result<TopLevelGrammar, String> {
    let mut schema: Value = serde_json::from_str(spec).map_err(|e| {
        format!(
            "json-schema: not JSON at line {}, column {}: {e}",
            e.line(),
            e.column()
        )
    })?;
    match &mut schema {
        Value::Object(map) => {
            if !map.contains_key("x-guidance") {
                map.insert(
                    "x-guidance".into(),
                    serde_json::json!({
                        "whitespace_flexible": options.flexible_whitespace,
                        "coerce_one_of": true,
                        "lenient": options.lenient,
                    }),
                );
            }
        }
        Value::Bool(_) => {}
        other => {
            return Err(format!(
                "json-schema: the root must be an object or a boolean, not {}",
                kind_name(other)
            ))
        }
    }
    Ok(TopLevelGrammar::from_json_schema(schema))
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A regex matching exactly one of the choices. The spec is a JSON array of strings, or else
/// comma-separated text.
pub fn choice_regex(spec: &str) -> Result<String, String> {
    let choices: Vec<String> = if spec.trim_start().starts_with('[') {
        serde_json::from_str(spec).map_err(|e| {
            format!(
                "choice: not a JSON array of strings at column {}: {e}",
                e.column()
            )
        })?
    } else {
        spec.split(',').map(str::to_string).collect()
    };
    if let Some(i) = choices.iter().position(|c| c.is_empty()) {
        return Err(format!("choice: choice {} is empty", i + 1));
    }
    if choices.is_empty() {
        return Err("choice: no choices".into());
    }
    let alts: Vec<String> = choices.iter().map(|c| escape(c)).collect();
    Ok(format!("({})", alts.join("|")))
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}
