//! The `--prompts-file` format of `deepinfer generate`: one JSON request a line, with an id,
//! exactly one of `prompt` / `messages` / `prompt_token_ids`, and optional per-request
//! sampling fields that override the run's defaults, and at most one structured-output
//! constraint (`json_schema`, `regex`, `grammar`, `choice`). Parsing only; nothing runs here.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::files::BoundedLines;
use crate::ids::TokenId;
use crate::model::chat::Message;
use crate::runtime::{Constraint, PromptInput, Request};
use crate::sampling::SamplingParams;

/// One line of a `--prompts-file`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    id: Option<serde_json::Value>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    prompt_token_ids: Option<Vec<TokenId>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
    ignore_eos: Option<bool>,
    stop_token_ids: Option<Vec<TokenId>>,
    n: Option<u32>,
    /// A JSON Schema: an object, or its text.
    json_schema: Option<serde_json::Value>,
    /// A regular expression the whole output must match.
    regex: Option<String>,
    /// A Lark-style EBNF grammar (start rule `start`).
    grammar: Option<String>,
    /// One of these strings: an array, or comma-separated text.
    choice: Option<serde_json::Value>,
}

impl PromptLine {
    /// The line's constraint, if it gives one (two are an error).
    fn constraint(&mut self) -> Result<Option<Constraint>, String> {
        let mut found = Vec::new();
        if let Some(v) = self.json_schema.take() {
            let text = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            found.push(Constraint::json_schema(text));
        }
        if let Some(r) = self.regex.take() {
            found.push(Constraint::regex(r));
        }
        if let Some(g) = self.grammar.take() {
            found.push(Constraint::lark(g));
        }
        if let Some(v) = self.choice.take() {
            found.push(match v {
                serde_json::Value::String(s) => Constraint::new("choice", s),
                v @ serde_json::Value::Array(_) => Constraint::new("choice", v.to_string()),
                _ => {
                    return Err(
                        "`choice` must be an array of strings or comma-separated text".into(),
                    )
                }
            });
        }
        if found.len() > 1 {
            return Err("give at most one of `json_schema`, `regex`, `grammar` or `choice`".into());
        }
        Ok(found.pop())
    }
}

/// Run-wide defaults a line starts from.
pub struct LineDefaults<'a> {
    pub params: &'a SamplingParams,
    pub n: u32,
    /// Wrap a plain `prompt` as a user turn of the chat template.
    pub chat: bool,
}

/// An id as the output writes it: strings as they are, other JSON values in JSON form.
pub fn id_string(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads every request of `path`; lines without an id get `first_id + their position`
/// among the requests. Blank lines are skipped; errors name the file and line.
pub fn read_prompts_file(
    path: &Path,
    d: &LineDefaults<'_>,
    first_id: usize,
) -> anyhow::Result<Vec<Request>> {
    let mut lines =
        BoundedLines::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for n in 0.. {
        let Some(line) = lines
            .next_line()
            .with_context(|| format!("reading {}:{}", path.display(), n + 1))?
        else {
            break;
        };
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), n + 1);
        let mut l: PromptLine = serde_json::from_str(&line)
            .with_context(|| format!("{}: not a valid request line", at()))?;
        let constraint = l
            .constraint()
            .map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
        let prompt = match (l.prompt, l.messages, l.prompt_token_ids) {
            (Some(p), None, None) if d.chat => PromptInput::Chat(vec![Message {
                role: "user".into(),
                content: p,
            }]),
            (Some(p), None, None) => PromptInput::Text(p),
            (None, Some(m), None) => PromptInput::Chat(m),
            (None, None, Some(t)) => PromptInput::Tokens(t),
            _ => bail!(
                "{}: give exactly one of `prompt`, `messages` or `prompt_token_ids`",
                at()
            ),
        };
        let mut p = d.params.clone();
        macro_rules! take {
            ($($f:ident),*) => { $( if let Some(v) = l.$f { p.$f = v; } )* };
        }
        take!(
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            stop,
            ignore_eos
        );
        if let Some(s) = l.seed {
            p.seed = Some(s);
        }
        p.validate().map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
        let id =
            l.id.as_ref()
                .map_or_else(|| (first_id + out.len()).to_string(), id_string);
        let mut req = Request::new(id, prompt, p);
        req.n = l.n.unwrap_or(d.n);
        req.stop_token_ids = l.stop_token_ids.unwrap_or_default();
        req.constraint = constraint;
        if req.n == 0 {
            bail!("{}: n must be at least 1", at());
        }
        out.push(req);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_override_defaults_and_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(
            &path,
            "{\"id\": 7, \"prompt\": \"a\", \"max_tokens\": 3, \"n\": 2}\n\n{\"prompt_token_ids\": [1, 2], \"temperature\": 0.5}\n",
        )
        .unwrap();
        let params = SamplingParams::default();
        let d = LineDefaults {
            params: &params,
            n: 1,
            chat: false,
        };
        let reqs = read_prompts_file(&path, &d, 10).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(
            (reqs[0].id.as_str(), reqs[0].params.max_tokens, reqs[0].n),
            ("7", 3, 2)
        );
        assert_eq!(
            (reqs[1].id.as_str(), reqs[1].params.temperature, reqs[1].n),
            ("11", 0.5, 1)
        );
        assert_eq!(reqs[1].prompt, PromptInput::Tokens(vec![1, 2]));
        std::fs::write(
            &path,
            "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"colour\": 1}\n",
        )
        .unwrap();
        let e = format!("{:#}", read_prompts_file(&path, &d, 0).unwrap_err());
        assert!(e.contains("p.jsonl:2") && e.contains("colour"), "{e}");
        std::fs::write(&path, "{\"prompt\": \"a\", \"top_p\": 3.0}\n").unwrap();
        let e = format!("{:#}", read_prompts_file(&path, &d, 0).unwrap_err());
        assert!(e.contains("top_p"), "{e}");
    }

    #[test]
    fn lines_carry_one_constraint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.jsonl");
        std::fs::write(
            &path,
            concat!(
                "{\"prompt\": \"a\", \"json_schema\": {\"type\": \"integer\"}}\n",
                "{\"prompt\": \"b\", \"regex\": \"[0-9]+\"}\n",
                "{\"prompt\": \"c\", \"choice\": [\"x\", \"y\"]}\n",
                "{\"prompt\": \"d\", \"grammar\": \"start: \\\"a\\\"\"}\n",
                "{\"prompt\": \"e\"}\n",
            ),
        )
        .unwrap();
        let params = SamplingParams::default();
        let d = LineDefaults {
            params: &params,
            n: 1,
            chat: false,
        };
        let reqs = read_prompts_file(&path, &d, 0).unwrap();
        let c: Vec<_> = reqs.iter().map(|r| r.constraint.clone()).collect();
        assert_eq!(c[0], Some(Constraint::json_schema(r#"{"type":"integer"}"#)));
        assert_eq!(c[1], Some(Constraint::regex("[0-9]+")));
        assert_eq!(c[2], Some(Constraint::choice(&["x", "y"])));
        assert_eq!(c[3], Some(Constraint::lark("start: \"a\"")));
        assert_eq!(c[4], None);
        std::fs::write(
            &path,
            "{\"prompt\": \"a\", \"regex\": \"a\", \"choice\": \"a,b\"}\n",
        )
        .unwrap();
        let e = format!("{:#}", read_prompts_file(&path, &d, 0).unwrap_err());
        assert!(e.contains("c.jsonl:1") && e.contains("at most one"), "{e}");
    }
}
