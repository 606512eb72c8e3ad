//! Plain data types shared by every plugin kind, independent of the generated bindings.

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// A candidate token and its logit, as the host sends it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: TokenId,
    pub logit: f32,
}

/// What a plugin says about itself. The export macros fill `name` and `version` from the
/// plugin crate's `Cargo.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
}

/// The sampling part of a request's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 0.0 means no min-p cut.
    pub min_p: f32,
    /// 1.0 means none.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(TokenId, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Whether the request asks for the single most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether any history-based penalty is set.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}
