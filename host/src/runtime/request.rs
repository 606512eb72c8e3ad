//! Requests in, outputs out: the plain data of the library API.

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
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
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

/// One finished request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub id: String,
    /// The prompt text after templating (absent for token prompts).
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<TokenId>,
    pub text: String,
    pub token_ids: Vec<TokenId>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub timings: Timings,
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
        }
    }
}
