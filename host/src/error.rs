//! The crate's one error type. Every failure a user or a file can cause is a variant here,
//! with enough structure to say what went wrong and where.

use std::path::PathBuf;

/// Errors from loading, tokenizing and running models.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} is not a GGUF file: {reason}")]
    NotGguf { path: PathBuf, reason: String },

    #[error("GGUF file {path} is malformed: {reason}")]
    BadGguf { path: PathBuf, reason: String },

    #[error("tensor `{tensor}` has unknown or unsupported type {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },

    #[error("model is missing tensor `{0}`")]
    MissingTensor(String),

    #[error("tensor `{tensor}` has shape {actual:?}, but the model metadata implies {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },

    #[error("unsupported model architecture `{0}` (supported: {1})")]
    UnknownArchitecture(String, String),

    #[error("model metadata key `{key}`: {reason}")]
    BadMetadata { key: String, reason: String },

    #[error("invalid model config: {0}")]
    BadConfig(String),

    #[error("device: {0}")]
    BadDevice(String),

    #[error("config file {path}: {message}")]
    Config { path: PathBuf, message: String },

    #[error("plugin `{plugin}`: {reason}")]
    Plugin { plugin: String, reason: String },

    #[error("plugin `{plugin}`: {path} has sha256 {actual}, but the config pins {expected}")]
    PluginHashMismatch {
        plugin: String,
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("plugin `{plugin}` was built for the plugin ABI deepinfer:plugin@{found}, which this host does not support (it loads {supported}); rebuild it against a supported deepinfer-plugin-sdk")]
    PluginAbi {
        plugin: String,
        found: String,
        supported: String,
    },

    #[error("plugin `{plugin}` imports `{import}`, which the host does not provide (plugins may import only deepinfer:plugin/host and deepinfer:plugin/types; build them for wasm32-unknown-unknown, not WASI)")]
    PluginImport { plugin: String, import: String },

    #[error("safetensors error in {path}: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    #[error("tokenizer error: {0}")]
    Tokenizer(String),

    #[error("chat template error: {0}")]
    ChatTemplate(String),

    #[error("prompt is empty (it tokenizes to no tokens)")]
    EmptyPrompt,

    #[error("prompt has {prompt_tokens} tokens; with max_tokens = {max_tokens} it needs {needed}, but the context window is {context} tokens")]
    PromptTooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        needed: usize,
        context: usize,
    },

    #[error("invalid request: {0}")]
    BadRequest(String),

    #[error("model fetch failed: {0}")]
    Fetch(String),

    #[error("a request needs {needed_blocks} KV blocks to reach its full length, but the cache has only {num_blocks}")]
    KvCacheTooSmall {
        needed_blocks: usize,
        num_blocks: usize,
    },

    #[error("scheduler: {0}")]
    Scheduler(String),

    #[error("CUDA: {0}")]
    Cuda(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
