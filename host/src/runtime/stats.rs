//! The run summary: requests, tokens, throughput, prefix-cache hit rate, preemptions, and how
//! much CPU time stayed exposed between forward passes (per decode step). Collected on the
//! engine thread from per-step timings; plain numbers for the CLI and benchmarks.

use serde::Serialize;

use super::messages::StepTiming;

/// What one `generate` run did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSummary {
    pub requests: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache (sample 0 of each request).
    pub cached_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub wall_s: f64,
    /// Forward passes.
    pub steps: u64,
    /// Forward passes in which every sequence decoded one token.
    pub decode_steps: u64,
    /// Mean sequences per decode step.
    pub mean_decode_batch: f64,
    pub preemptions: u64,
    /// Prefix-cache hit tokens / looked-up prompt tokens, for this run.
    pub prefix_hit_rate: f64,
    /// Time in forward passes.
    pub forward_s: f64,
    /// Time in the sampler stage.
    pub sample_s: f64,
    /// Mean compute-idle time between a decode step's forward pass and the previous one.
    pub exposed_ms_per_decode_step: f64,
    pub median_exposed_ms_per_decode_step: f64,
    /// Of that, waiting for the previous step's samples (the rest: plan, batch building).
    pub exposed_sample_wait_ms_per_decode_step: f64,
    /// Mean decode step (exposed time + forward pass).
    pub ms_per_decode_step: f64,
    /// Exposed time / decode step time, over all decode steps.
    pub exposed_fraction: f64,
    /// Steps that sampled at least one row under a constraint.
    pub constrained_steps: u64,
    /// Mean time per constrained step the sampler waited for constraint masks (exposed: the
    /// rest of the mask work overlapped the forward pass).
    pub mask_exposed_ms_per_step: f64,
    /// Mean constraint-worker time (consume + mask, all rows) per constrained step.
    pub mask_compute_ms_per_step: f64,
}

impl RunSummary {
    /// Generated tokens per second of wall time.
    pub fn generated_tok_per_s(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.generated_tokens as f64 / self.wall_s
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for RunSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} request(s){}, {} prompt tokens ({} from the prefix cache, hit rate {:.1}%), {} generated \
             tokens in {:.2} s ({:.1} tok/s); {} steps ({} decode, mean batch {:.1}), {} preemption(s); \
             exposed CPU time per decode step {:.2} ms (median {:.2}) of {:.2} ms = {:.1}%",
            self.requests,
            if self.failed > 0 { format!(" ({} failed)", self.failed) } else { String::new() },
            self.prompt_tokens,
            self.cached_prompt_tokens,
            self.prefix_hit_rate * 100.0,
            self.generated_tokens,
            self.wall_s,
            self.generated_tok_per_s(),
            self.steps,
            self.decode_steps,
            self.mean_decode_batch,
            self.preemptions,
            self.exposed_ms_per_decode_step,
            self.median_exposed_ms_per_decode_step,
            self.ms_per_decode_step,
            self.exposed_fraction * 100.0
        )?;
        if self.constrained_steps > 0 {
            write!(
                f,
                "; constraint masks {:.2} ms per constrained step, {:.2} ms of it exposed ({} steps)",
                self.mask_compute_ms_per_step, self.mask_exposed_ms_per_step, self.constrained_steps
            )?;
        }
        Ok(())
    }
}

/// Accumulates step timings into the summary's step fields.
#[derive(Debug, Default)]
pub struct StepStats {
    steps: u64,
    forward_s: f64,
    sample_s: f64,
    decode_gaps: Vec<f64>,
    decode_sample_waits: f64,
    decode_forward_s: f64,
    decode_seqs: u64,
    constrained_steps: u64,
    mask_wait_s: f64,
    mask_s: f64,
}

impl StepStats {
    pub fn record(&mut self, t: &StepTiming) {
        if t.num_tokens == 0 {
            return;
        }
        self.steps += 1;
        self.forward_s += t.forward_s;
        self.sample_s += t.sample_s;
        if t.constrained_rows > 0 {
            self.constrained_steps += 1;
            self.mask_wait_s += t.mask_wait_s;
            self.mask_s += t.mask_s;
        }
        if let (true, Some(gap)) = (t.decode_only, t.gap_s) {
            self.decode_gaps.push(gap);
            self.decode_sample_waits += t.wait_sample_s.min(gap);
            self.decode_forward_s += t.forward_s;
            self.decode_seqs += t.num_seqs as u64;
        }
    }

    /// Fills the step fields of `s`.
    pub fn fill(&self, s: &mut RunSummary) {
        s.steps = self.steps;
        s.forward_s = self.forward_s;
        s.sample_s = self.sample_s;
        s.constrained_steps = self.constrained_steps;
        if self.constrained_steps > 0 {
            let k = self.constrained_steps as f64;
            s.mask_exposed_ms_per_step = self.mask_wait_s / k * 1e3;
            s.mask_compute_ms_per_step = self.mask_s / k * 1e3;
        }
        let n = self.decode_gaps.len();
        s.decode_steps = n as u64;
        if n == 0 {
            return;
        }
        let total_gap: f64 = self.decode_gaps.iter().sum();
        let mut sorted = self.decode_gaps.clone();
        sorted.sort_by(f64::total_cmp);
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        s.mean_decode_batch = self.decode_seqs as f64 / n as f64;
        s.exposed_ms_per_decode_step = total_gap / n as f64 * 1e3;
        s.median_exposed_ms_per_decode_step = median * 1e3;
        s.exposed_sample_wait_ms_per_decode_step = self.decode_sample_waits / n as f64 * 1e3;
        s.ms_per_decode_step = (total_gap + self.decode_forward_s) / n as f64 * 1e3;
        s.exposed_fraction = total_gap / (total_gap + self.decode_forward_s).max(f64::MIN_POSITIVE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_decode_steps_with_a_predecessor_count_as_exposed() {
        let mut st = StepStats::default();
        let t = |gap: Option<f64>, decode_only: bool| StepTiming {
            forward_s: 0.1,
            gap_s: gap,
            wait_sample_s: 0.001,
            num_tokens: 4,
            num_seqs: 4,
            decode_only,
            ..Default::default()
        };
        st.record(&t(None, true));
        st.record(&t(Some(0.5), false));
        st.record(&t(Some(0.002), true));
        st.record(&t(Some(0.004), true));
        st.record(&StepTiming::default());
        let mut s = RunSummary::default();
        st.fill(&mut s);
        assert_eq!((s.steps, s.decode_steps), (4, 2));
        assert!((s.exposed_ms_per_decode_step - 3.0).abs() < 1e-9);
        assert!((s.ms_per_decode_step - 103.0).abs() < 1e-9);
        assert!((s.exposed_fraction - 0.006 / 0.206).abs() < 1e-9);
        assert!((s.mean_decode_batch - 4.0).abs() < 1e-9);
    }
}
