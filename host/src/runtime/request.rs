//! Requests in, outputs out: the plain data of the library API (no engine state here).

use serde::{Deserialize, Serialize};

use crate::ids::TokenId;
use crate::model::chat::Message;
use crate::sampling::SamplingParams;

/// What to generate from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// Raw text, tokenized as is.
    Text(String),
    /// Chat messages, rendered with the model's chat template plus the generation prompt.
    Chat(Vec<Message>),
    /// Token ids, used as is.
    Tokens(Vec<TokenId>),
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Caller's id, echoed in the output.
    pub id: String,
    pub prompt: PromptInput,
    pub params: SamplingParams,
    /// Independent samples of the prompt (`n`, at least 1); they share the prompt's KV.
    pub n: u32,
    /// More token ids that end generation (the model's EOS always does, unless
    /// `params.ignore_eos`).
    pub stop_token_ids: Vec<TokenId>,
    /// Structured output: every sample must match this constraint.
    pub constraint: Option<Constraint>,
}

/// A structured-output constraint: the output must match `spec` compiled as `kind` by the
/// engine's constraint plugin (the builtin `grammar` compiles `json-schema`, `regex`, `lark`
/// and `choice`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraint {
    pub kind: String,
    pub spec: String,
}

impl Constraint {
    pub fn new(kind: impl Into<String>, spec: impl Into<String>) -> Constraint {
        Constraint {
            kind: kind.into(),
            spec: spec.into(),
        }
    }
    /// A JSON Schema (as JSON text).
    pub fn json_schema(schema: impl Into<String>) -> Constraint {
        Constraint::new("json-schema", schema)
    }
    /// A regular expression the whole output must match.
    pub fn regex(re: impl Into<String>) -> Constraint {
        Constraint::new("regex", re)
    }
    /// A Lark-style EBNF grammar (start rule `start`).
    pub fn lark(grammar: impl Into<String>) -> Constraint {
        Constraint::new("lark", grammar)
    }
    /// Exactly one of these strings.
    pub fn choice<S: AsRef<str>>(options: &[S]) -> Constraint {
        let list: Vec<&str> = options.iter().map(AsRef::as_ref).collect();
        Constraint::new("choice", serde_json::to_string(&list).unwrap_or_default())
    }
}

impl Request {
    /// One sample, no extra stop ids.
    pub fn new(id: impl Into<String>, prompt: PromptInput, params: SamplingParams) -> Request {
        Request {
            id: id.into(),
            prompt,
            params,
            n: 1,
            stop_token_ids: Vec::new(),
            constraint: None,
        }
    }

    /// A text prompt.
    pub fn text(id: impl Into<String>, text: impl Into<String>, params: SamplingParams) -> Request {
        Request::new(id, PromptInput::Text(text.into()), params)
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// End-of-sequence token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The request failed; see the output's `error`.
    Error,
}

/// Timings of one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Seconds from the start of the run to the first generated token.
    pub time_to_first_token_s: f64,
    /// Generated tokens after the first, per second of decoding.
    pub decode_tok_per_s: f64,
    /// Seconds from the start of the run to the last token.
    pub total_s: f64,
}

/// One further sample of an `n > 1` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleOutput {
    /// The sample's index (1 ..= n - 1; sample 0 is the output's own fields).
    pub sample: u32,
    pub text: String,
    pub token_ids: Vec<TokenId>,
    pub finish_reason: FinishReason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One finished request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub id: String,
    /// The prompt text after templating (absent for token prompts).
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<TokenId>,
    /// Sample 0's text, with a matched stop string cut off.
    pub text: String,
    /// Sample 0's generated tokens (a final end-of-sequence token is left out).
    pub token_ids: Vec<TokenId>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub timings: Timings,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    #[serde(default)]
    pub cached_prompt_tokens: usize,
    /// Times the request lost its KV to preemption and recomputed it.
    #[serde(default)]
    pub preemptions: u32,
    /// Samples 1 .. n - 1 of an `n > 1` request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<SampleOutput>,
}

impl RequestOutput {
    pub(crate) fn failed(id: String, prompt: Option<String>, error: String) -> RequestOutput {
        RequestOutput {
            id,
            prompt,
            prompt_token_ids: Vec::new(),
            text: String::new(),
            token_ids: Vec::new(),
            finish_reason: FinishReason::Error,
            error: Some(error),
            timings: Timings::default(),
            cached_prompt_tokens: 0,
            preemptions: 0,
            samples: Vec::new(),
        }
    }

    /// Generated tokens over every sample.
    pub fn num_generated_tokens(&self) -> usize {
        self.token_ids.len()
            + self
                .samples
                .iter()
                .map(|s| s.token_ids.len())
                .sum::<usize>()
    }
}

/// What a streaming run reports, in the order it happens.
#[derive(Debug, Clone, Copy)]
pub enum StreamEvent<'a> {
    /// New tokens of one sample of a request, with the text they complete (it may be empty
    /// while a multi-byte character is still incomplete).
    Tokens {
        /// The request's index in the slice given to the run.
        index: usize,
        id: &'a str,
        sample: u32,
        token_ids: &'a [TokenId],
        text: &'a str,
    },
    /// A request finished (all its samples).
    Finished {
        index: usize,
        output: &'a RequestOutput,
    },
}
