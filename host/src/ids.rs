//! Identifier newtypes shared across the engine. Token ids stay plain `u32` (they travel in
//! large arrays to tokenizers, kernels and plugins); everything else gets its own type.

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// One generation request, unique within an engine.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct RequestId(pub u64);

/// A physical KV-cache block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// A routed expert of a mixture-of-experts layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertId(pub u32);

/// A rank in a parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank(pub u32);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}
