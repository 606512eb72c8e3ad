//! Mixture-of-experts feed-forward (Dai et al., 2024, "DeepSeekMoE"; DeepSeek-AI, 2024,
//! "DeepSeek-V3 Technical Report"): a router picks `top_k` routed experts per token, their
//! SwiGLU outputs are summed with the router weights, and shared experts run on every token.
//!
//! Owns the routing math (sigmoid / softmax / sqrt-softplus scores, the correction bias,
//! group-limited top-k, hash routing by token id), the per-step expert-load counters and the
//! grouped expert computation (tokens gathered per expert, one product per expert). It must not
//! know about attention or checkpoints: the architecture hands it prepared weights.

use std::sync::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ids::{ExpertId, TokenId};

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreFunc {
    /// `sigmoid(l)` (DeepSeek-V3).
    Sigmoid,
    /// `softmax(l)` over the experts (DeepSeek-V2, Mixtral).
    Softmax,
    /// `sqrt(softplus(l))` (DeepSeek-V4).
    SqrtSoftplus,
}

impl ScoreFunc {
    /// Parses a config's `scoring_func`.
    pub fn parse(s: &str) -> Result<ScoreFunc> {
        match s {
            "sigmoid" => Ok(ScoreFunc::Sigmoid),
            "softmax" => Ok(ScoreFunc::Softmax),
            "sqrtsoftplus" | "sqrt_softplus" => Ok(ScoreFunc::SqrtSoftplus),
            other => Err(Error::BadConfig(format!(
                "scoring_func `{other}` is not supported (sigmoid, softmax, sqrtsoftplus)"
            ))),
        }
    }

    /// Scores of one token's logits.
    pub fn apply(self, logits: &[f32], out: &mut [f32]) {
        match self {
            ScoreFunc::Sigmoid => {
                for (o, &l) in out.iter_mut().zip(logits) {
                    *o = 1.0 / (1.0 + (-l).exp());
                }
            }
            ScoreFunc::Softmax => {
                let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0.0;
                for (o, &l) in out.iter_mut().zip(logits) {
                    *o = (l - m).exp();
                    sum += *o;
                }
                for o in out.iter_mut() {
                    *o /= sum;
                }
            }
            ScoreFunc::SqrtSoftplus => {
                for (o, &l) in out.iter_mut().zip(logits) {
                    // softplus(l) = max(l, 0) + ln(1 + e^-|l|), stable for large |l|
                    let sp = l.max(0.0) + (-l.abs()).exp().ln_1p();
                    *o = sp.sqrt();
                }
            }
        }
    }
}

/// Router settings, resolved and validated once.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    pub score: ScoreFunc,
    /// Expert groups (1: no group limit).
    pub n_group: usize,
    /// Groups a token may pick its experts from.
    pub topk_group: usize,
    /// Divide the chosen weights by their sum.
    pub norm_topk_prob: bool,
    /// Multiplies the final weights.
    pub scaling: f32,
}

impl RouterConfig {
    /// Rejects settings the routing cannot satisfy, naming the offending key.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::BadConfig(m));
        if self.n_experts == 0 {
            return bad("n_routed_experts must be positive".into());
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return bad(format!(
                "num_experts_per_tok = {} must be between 1 and n_routed_experts = {}",
                self.top_k, self.n_experts
            ));
        }
        if self.n_group == 0 || !self.n_experts.is_multiple_of(self.n_group) {
            return bad(format!(
                "n_group = {} must be positive and divide n_routed_experts = {}",
                self.n_group, self.n_experts
            ));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return bad(format!(
                "topk_group = {} must be between 1 and n_group = {}",
                self.topk_group, self.n_group
            ));
        }
        let per_group = self.n_experts / self.n_group;
        if self.topk_group * per_group < self.top_k {
            return bad(format!(
                "topk_group = {} groups of {per_group} experts cannot hold num_experts_per_tok = {}",
                self.topk_group, self.top_k
            ));
        }
        if self.n_group > 1 && self.score != ScoreFunc::Softmax && per_group < 2 {
            return bad(format!(
                "group scores sum each group's top 2 experts, but n_group = {} leaves {per_group} per group",
                self.n_group
            ));
        }
        if !self.scaling.is_finite() || self.scaling <= 0.0 {
            return bad(format!(
                "routed_scaling_factor = {} must be positive",
                self.scaling
            ));
        }
        Ok(())
    }
}

/// The experts each token goes to, with their weights: `[n_tokens, top_k]` each.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<ExpertId>,
    pub weights: Vec<f32>,
}

/// Indices of the `k` largest values (ties: the lower index), largest first.
fn top_k_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Routes `n = logits.len() / n_experts` tokens. `bias` (DeepSeek-V3's
/// `e_score_correction_bias`) shifts the scores used for the choice but not the weights.
///
/// Group-limited choice: each group is scored by the sum of its two best (biased) scores, or by
/// its best score under softmax (DeepSeek-V2's rule); experts outside the `topk_group` best
/// groups are excluded (as DeepSeek's reference code masks them with -inf).
pub fn route(cfg: &RouterConfig, logits: &[f32], bias: Option<&[f32]>) -> Routing {
    let e = cfg.n_experts;
    let n = logits.len() / e;
    let per_group = e / cfg.n_group;
    let mut experts = Vec::with_capacity(n * cfg.top_k);
    let mut weights = Vec::with_capacity(n * cfg.top_k);
    let mut scores = vec![0.0f32; e];
    let mut choice = vec![0.0f32; e];
    for t in 0..n {
        cfg.score.apply(&logits[t * e..(t + 1) * e], &mut scores);
        for (i, c) in choice.iter_mut().enumerate() {
            *c = scores[i] + bias.map_or(0.0, |b| b[i]);
        }
        if cfg.n_group > 1 && cfg.topk_group < cfg.n_group {
            let group_score: Vec<f32> = choice
                .chunks_exact(per_group)
                .map(|g| match cfg.score {
                    ScoreFunc::Softmax => g.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
                    _ => top_k_indices(g, 2).iter().map(|&i| g[i]).sum(),
                })
                .collect();
            let keep = top_k_indices(&group_score, cfg.topk_group);
            for g in 0..cfg.n_group {
                if !keep.contains(&g) {
                    choice[g * per_group..(g + 1) * per_group].fill(f32::NEG_INFINITY);
                }
            }
        }
        let chosen = top_k_indices(&choice, cfg.top_k);
        push_weights(cfg, &scores, &chosen, &mut experts, &mut weights);
    }
    Routing {
        top_k: cfg.top_k,
        experts,
        weights,
    }
}

fn push_weights(
    cfg: &RouterConfig,
    scores: &[f32],
    chosen: &[usize],
    experts: &mut Vec<ExpertId>,
    weights: &mut Vec<f32>,
) {
    let sum: f32 = chosen.iter().map(|&i| scores[i]).sum();
    for &i in chosen {
        let mut w = scores[i];
        if cfg.norm_topk_prob {
            w /= sum + 1e-20;
        }
        experts.push(ExpertId(i as u32));
        weights.push(w * cfg.scaling);
    }
}

/// Hash routing (DeepSeek-V4's first layers): a fixed table gives each token id its
/// `top_k` experts; the router scores still weight them.
#[derive(Debug, Clone, PartialEq)]
pub struct HashTable {
    /// `[vocab, top_k]` expert ids.
    pub table: Vec<ExpertId>,
    pub top_k: usize,
}

impl HashTable {
    /// Checks the table against the router's shape.
    pub fn validate(&self, cfg: &RouterConfig) -> Result<()> {
        if self.top_k != cfg.top_k || !self.table.len().is_multiple_of(self.top_k.max(1)) {
            return Err(Error::BadConfig(format!(
                "hash routing table has {} entries for top_k = {}, router top_k = {}",
                self.table.len(),
                self.top_k,
                cfg.top_k
            )));
        }
        if let Some(bad) = self.table.iter().find(|x| x.0 as usize >= cfg.n_experts) {
            return Err(Error::BadConfig(format!(
                "hash routing table names expert {} of {}",
                bad.0, cfg.n_experts
            )));
        }
        Ok(())
    }
}

/// Routes each token to the experts its id hashes to, weighted by their scores.
pub fn route_hash(
    cfg: &RouterConfig,
    table: &HashTable,
    logits: &[f32],
    tokens: &[TokenId],
) -> Result<Routing> {
    let e = cfg.n_experts;
    let mut experts = Vec::with_capacity(tokens.len() * cfg.top_k);
    let mut weights = Vec::with_capacity(tokens.len() * cfg.top_k);
    let mut scores = vec![0.0f32; e];
    for (t, &tok) in tokens.iter().enumerate() {
        let row = table
            .table
            .get(tok as usize * table.top_k..(tok as usize + 1) * table.top_k)
            .ok_or_else(|| {
                Error::BadRequest(format!("token {tok} is outside the hash routing table"))
            })?;
        cfg.score.apply(&logits[t * e..(t + 1) * e], &mut scores);
        let chosen: Vec<usize> = row.iter().map(|x| x.0 as usize).collect();
        push_weights(cfg, &scores, &chosen, &mut experts, &mut weights);
    }
    Ok(Routing {
        top_k: cfg.top_k,
        experts,
        weights,
    })
}

/// Tokens routed to each expert: in the last step and since the layer was built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpertLoad {
    pub last_step: Vec<u64>,
    pub total: Vec<u64>,
    pub steps: u64,
}

/// A SwiGLU feed-forward: `down(silu(gate x) * up x)`.
pub struct Mlp<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
    /// Width of the hidden product.
    pub inter: usize,
}

impl<W> Mlp<W> {
    /// `out = mlp(x)` for `n` rows of `d`.
    pub fn forward<B: Backend<Weight = W>>(
        &self,
        be: &B,
        x: &B::Buf,
        n: usize,
        out: &mut B::Buf,
    ) -> Result<()> {
        let g = self.gated(be, x, n)?;
        be.matmul(&self.down, &g, n, out)
    }

    /// `mlp(x)` for `n` rows into a new buffer of `n * d` (`d` the output width), made just
    /// before the product that writes it.
    pub fn apply<B: Backend<Weight = W>>(
        &self,
        be: &B,
        x: &B::Buf,
        n: usize,
        d: usize,
    ) -> Result<B::Buf> {
        let g = self.gated(be, x, n)?;
        let mut out = be.zeros(n * d)?;
        be.matmul(&self.down, &g, n, &mut out)?;
        Ok(out)
    }

    /// `silu(gate x) * up x`, each product's output made just before it (the two products
    /// stay back to back, so a backend may run them in one launch).
    fn gated<B: Backend<Weight = W>>(&self, be: &B, x: &B::Buf, n: usize) -> Result<B::Buf> {
        let mut g = be.zeros(n * self.inter)?;
        be.matmul(&self.gate, x, n, &mut g)?;
        let mut u = be.zeros(n * self.inter)?;
        be.matmul(&self.up, x, n, &mut u)?;
        be.silu_mul(&mut g, &u)?;
        Ok(g)
    }
}

/// How a layer picks experts.
pub enum Router<W> {
    /// Learned gate `[n_experts, hidden]`, optional correction bias.
    Learned { gate: W, bias: Option<Vec<f32>> },
    /// Learned gate for the weights, fixed table for the choice.
    Hashed { gate: W, table: HashTable },
}

/// A mixture-of-experts layer on backend weights `W`.
pub struct MoeLayer<W> {
    pub cfg: RouterConfig,
    pub router: Router<W>,
    pub experts: Vec<Mlp<W>>,
    pub shared: Option<Mlp<W>>,
    load: Mutex<ExpertLoad>,
    /// Backend-private state made on first use (the CUDA backend keeps its expert pointer
    /// tables and device-side load counters here).
    pub device: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
}

impl<W> MoeLayer<W> {
    pub fn new(
        cfg: RouterConfig,
        router: Router<W>,
        experts: Vec<Mlp<W>>,
        shared: Option<Mlp<W>>,
    ) -> Result<MoeLayer<W>> {
        cfg.validate()?;
        if experts.len() != cfg.n_experts {
            return Err(Error::BadConfig(format!(
                "{} experts loaded for n_routed_experts = {}",
                experts.len(),
                cfg.n_experts
            )));
        }
        match &router {
            Router::Learned { bias: Some(b), .. } if b.len() != cfg.n_experts => {
                return Err(Error::BadConfig(format!(
                    "e_score_correction_bias has {} entries for {} experts",
                    b.len(),
                    cfg.n_experts
                )))
            }
            Router::Hashed { table, .. } => table.validate(&cfg)?,
            _ => {}
        }
        let load = ExpertLoad {
            last_step: vec![0; cfg.n_experts],
            total: vec![0; cfg.n_experts],
            steps: 0,
        };
        Ok(MoeLayer {
            cfg,
            router,
            experts,
            shared,
            load: Mutex::new(load),
            device: std::sync::OnceLock::new(),
        })
    }

    /// Expert-load counters (a copy).
    pub fn load(&self) -> ExpertLoad {
        self.load.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Counts one step whose per-expert tokens a backend keeps itself (see
    /// [`Backend::expert_load`]); returns the steps so far.
    pub fn count_device_step(&self) -> u64 {
        match self.load.lock() {
            Ok(mut l) => {
                l.steps += 1;
                l.steps
            }
            Err(_) => 0,
        }
    }

    /// Routes `n` tokens of `x` (`[n, d]`).
    pub fn route<B: Backend<Weight = W>>(
        &self,
        be: &B,
        x: &B::Buf,
        tokens: &[TokenId],
        n: usize,
    ) -> Result<Routing> {
        let e = self.cfg.n_experts;
        let mut logits = be.zeros(n * e)?;
        let gate = match &self.router {
            Router::Learned { gate, .. } | Router::Hashed { gate, .. } => gate,
        };
        be.matmul(gate, x, n, &mut logits)?;
        let logits = be.to_host(&logits)?;
        match &self.router {
            Router::Learned { bias, .. } => Ok(route(&self.cfg, &logits[..n * e], bias.as_deref())),
            Router::Hashed { table, .. } => route_hash(&self.cfg, table, &logits[..n * e], tokens),
        }
    }

    /// `out = sum_k w_k expert_k(x) + shared(x)` for `n` rows of width `d`. Tokens are grouped
    /// by expert: each expert runs one product over all of its tokens.
    pub fn forward<B: Backend<Weight = W>>(
        &self,
        be: &B,
        x: &B::Buf,
        tokens: &[TokenId],
        n: usize,
        d: usize,
        out: &mut B::Buf,
    ) -> Result<()> {
        let routing = self.route(be, x, tokens, n)?;
        let e = self.cfg.n_experts;
        let mut rows: Vec<Vec<usize>> = vec![Vec::new(); e];
        let mut scales: Vec<Vec<f32>> = vec![Vec::new(); e];
        for (i, (&ex, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            rows[ex.0 as usize].push(i / routing.top_k);
            scales[ex.0 as usize].push(w);
        }
        if let Ok(mut l) = self.load.lock() {
            for (j, r) in rows.iter().enumerate() {
                l.last_step[j] = r.len() as u64;
                l.total[j] += r.len() as u64;
            }
            l.steps += 1;
        }
        *out = be.zeros(n * d)?;
        for (j, expert) in self.experts.iter().enumerate() {
            let m = rows[j].len();
            if m == 0 {
                continue;
            }
            let mut xe = be.zeros(m * d)?;
            be.gather_rows(x, d, &rows[j], &mut xe)?;
            let mut ye = be.zeros(m * d)?;
            expert.forward(be, &xe, m, &mut ye)?;
            be.scatter_add_rows(out, &ye, d, &rows[j], &scales[j])?;
        }
        if let Some(shared) = &self.shared {
            let mut s = be.zeros(n * d)?;
            shared.forward(be, x, n, &mut s)?;
            be.add_assign(out, &s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
