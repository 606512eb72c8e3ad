//! Engine settings, resolved once at start: scheduler limits, the KV-cache budget and how it
//! turns into a block count for a model, async scheduling, seed and progress display.

use crate::error::{Error, Result};
use crate::kv_cache::{
    num_blocks_for_budget, AttentionShape, KvBudget, KvCacheLayout, DEFAULT_BLOCK_SIZE,
};
use crate::model::hparams::ModelConfig;
use crate::scheduler::SchedulerConfig;

/// The default KV budget on the CPU: 1 GiB. The CPU backend's pages are zero-allocated, so
/// the part no sequence has touched yet costs no resident memory.
pub const DEFAULT_KV_BUDGET: KvBudget = KvBudget::Bytes(1 << 30);

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences running at once (the decode batch).
    pub max_num_seqs: usize,
    /// Most tokens one step runs: decodes plus prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Memory for the paged KV cache: bytes, or a fraction of available memory.
    pub kv_budget: KvBudget,
    /// Reuse the KV of full prompt blocks that earlier requests computed.
    pub enable_prefix_caching: bool,
    /// Plan step N+1 while step N runs (decodes get placeholder tokens). Off: every step
    /// waits for the previous one's results before it is planned.
    pub async_scheduling: bool,
    /// Let a step whose samplers need only top candidates bring back only those (selected on
    /// the device); off: every step brings back full logits rows. Results are the same.
    pub select_candidates: bool,
    /// Seed for requests that give none.
    pub seed: u64,
    /// Show a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            kv_budget: DEFAULT_KV_BUDGET,
            enable_prefix_caching: true,
            async_scheduling: true,
            select_candidates: true,
            seed: 0,
            progress: false,
        }
    }
}

/// Sizes derived from the options and the model, fixed for the engine's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedSizes {
    pub num_blocks: usize,
    pub bytes_per_block: usize,
    pub scheduler: SchedulerConfig,
}

impl EngineOptions {
    /// The KV layout of `cfg` as the CPU backend stores it (f32 K and V per layer).
    pub fn kv_layout(&self, cfg: &ModelConfig) -> KvCacheLayout {
        let shape = AttentionShape {
            num_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            dtype_bytes: std::mem::size_of::<f32>(),
        };
        KvCacheLayout::full_attention(cfg.n_layers, shape, self.block_size)
    }

    /// Block count and scheduler limits for `cfg`. The budget is capped at what
    /// `max_num_seqs` full-context sequences could use twice over (the second half keeps
    /// finished prompts for prefix hits), so a tiny model does not reserve a huge table.
    pub fn resolve(&self, cfg: &ModelConfig) -> Result<ResolvedSizes> {
        self.resolve_layout(cfg, &self.kv_layout(cfg))
    }

    /// [`EngineOptions::resolve`] for a model whose cache has its own `layout` (latent MLA,
    /// mixed layer groups).
    pub fn resolve_layout(
        &self,
        cfg: &ModelConfig,
        layout: &KvCacheLayout,
    ) -> Result<ResolvedSizes> {
        if self.block_size == 0 || self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err(Error::BadConfig(format!(
                "engine needs block_size, max_num_seqs and max_num_batched_tokens >= 1, got \
                 {} / {} / {}",
                self.block_size, self.max_num_seqs, self.max_num_batched_tokens
            )));
        }
        layout.validate()?;
        let available = match self.kv_budget {
            KvBudget::Bytes(_) => 0,
            KvBudget::Fraction(_) => available_memory()?,
        };
        let budget_blocks = num_blocks_for_budget(layout, self.kv_budget, available)?;
        let per_seq = cfg.context_len.div_ceil(self.block_size);
        let cap = per_seq.saturating_mul(self.max_num_seqs).saturating_mul(2);
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: cfg.context_len,
            chunked_prefill: true,
        };
        scheduler.validate()?;
        Ok(ResolvedSizes {
            num_blocks: budget_blocks.min(cap.max(1)),
            bytes_per_block: layout.bytes_per_block(),
            scheduler,
        })
    }
}

/// Memory the operating system says is available (`MemAvailable` in `/proc/meminfo`), what
/// a fractional KV budget refers to on the CPU.
pub fn available_memory() -> Result<u64> {
    let text =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| Error::io("/proc/meminfo", e))?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| {
            Error::BadConfig(
                "cannot read MemAvailable from /proc/meminfo; give the KV budget in bytes \
                 (e.g. 2GiB)"
                    .into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::hparams::{AttentionKind, LayerSpec, RopeSpec, RopeStyle};

    fn cfg() -> ModelConfig {
        let rope = RopeSpec {
            theta: 1e4,
            dims: 64,
            style: RopeStyle::Half,
            scale: 1.0,
        };
        ModelConfig {
            arch: "llama".into(),
            n_layers: 30,
            hidden: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            context_len: 8192,
            rms_eps: 1e-5,
            tie_embeddings: true,
            layers: vec![
                LayerSpec {
                    attention: AttentionKind::Full,
                    rope
                };
                30
            ],
        }
    }

    #[test]
    fn budget_turns_into_blocks_once() {
        let opts = EngineOptions::default();
        let r = opts.resolve(&cfg()).unwrap();
        // 30 layers x 3 heads x 64 x 2 (K, V) x 4 bytes x 16 tokens.
        assert_eq!(r.bytes_per_block, 737_280);
        assert_eq!(r.num_blocks, (1usize << 30) / 737_280);
        assert_eq!(r.scheduler.max_model_len, 8192);
        let small = EngineOptions {
            kv_budget: KvBudget::Bytes(10 * 737_280),
            ..opts.clone()
        };
        assert_eq!(small.resolve(&cfg()).unwrap().num_blocks, 10);
        let none = EngineOptions {
            kv_budget: KvBudget::Bytes(1000),
            ..opts
        };
        assert!(none.resolve(&cfg()).is_err());
    }

    #[test]
    fn huge_budgets_are_capped_for_small_models() {
        let mut c = cfg();
        c.context_len = 64;
        let opts = EngineOptions {
            max_num_seqs: 4,
            ..Default::default()
        };
        // 4 blocks per sequence x 4 sequences x 2.
        assert_eq!(opts.resolve(&c).unwrap().num_blocks, 32);
    }

    #[test]
    fn fractions_read_available_memory() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(available_memory().unwrap() > 0);
            let opts = EngineOptions {
                kv_budget: KvBudget::Fraction(0.01),
                ..Default::default()
            };
            assert!(opts.resolve(&cfg()).unwrap().num_blocks >= 1);
        }
    }
}
