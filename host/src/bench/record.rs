//! One JSONL record per benchmark point: the whole configuration, the machine, the commit and
//! the raw timings, plus the derived metrics.

use serde::{Deserialize, Serialize};

use super::accounting::{self, DraftSpec};

/// Median and spread of a set of timings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Summary {
    /// `None` for an empty set.
    pub fn of(values: &[f64]) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Summary {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }
}

/// A measured point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRecord {
    /// `prefill` or `decode`.
    pub mode: String,
    /// `deepinfer` or `peer`.
    pub engine: String,
    pub model: String,
    pub device: String,
    pub threads: usize,
    pub batch: usize,
    pub prompt_len: usize,
    pub new_tokens: usize,
    pub warmup: usize,
    /// Prompt tokens served from the prefix cache (not computed) per request.
    #[serde(default)]
    pub cached_prefix_len: usize,
    /// Chunked prefill: tokens per forward pass (`None`: the whole prompt in one pass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<usize>,
    /// Speculative-decoding drafts, if any.
    #[serde(default)]
    pub drafts: DraftSpec,
    pub commit: String,
    /// Seconds since the Unix epoch when the point was measured (the latest record of a
    /// repeated point wins).
    #[serde(default)]
    pub timestamp: u64,
    /// Seconds per measured repeat (prefill: the whole prompt; decode: one step).
    pub raw_s: Vec<f64>,
    pub median_s: f64,
    /// Prompt tokens per second (prefill), counting only tokens actually computed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_tok_s: Option<f64>,
    /// Decode steps per second (a step advances every sequence of the batch by one token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_steps_s: Option<f64>,
    /// Tokens per second seen by one user: steps/s x (1 + nextn x measured acceptance).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tok_s_per_user: Option<f64>,
    /// The same if every draft token were accepted (τ = 1 + nextn), for comparison with
    /// figures reported that way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tok_s_per_user_full_acceptance: Option<f64>,
    /// Tokens per second over the whole batch on this device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tok_s_per_device: Option<f64>,
}

impl BenchRecord {
    /// Fills the derived metrics from `raw_s`. Prefill counts only the uncached suffix;
    /// decode converts steps to tokens with the draft accounting (measured acceptance where
    /// known; variable-length drafts get no factor).
    pub fn derive(&mut self) {
        let Some(s) = Summary::of(&self.raw_s) else {
            return;
        };
        self.median_s = s.median;
        match self.mode.as_str() {
            "prefill" => {
                let per_seq = accounting::prefill_tok_s_per_device(
                    self.prompt_len,
                    self.cached_prefix_len,
                    s.median,
                    1,
                );
                self.prefill_tok_s = Some(per_seq * self.batch as f64);
            }
            _ => {
                let steps = 1.0 / s.median;
                self.decode_steps_s = Some(steps);
                let d = &self.drafts;
                let full = if d.nextn == 0 || d.variable_length {
                    Some(accounting::variable_length(steps, self.batch, 1.0))
                } else {
                    accounting::full_acceptance(steps, self.batch, d).ok()
                };
                let measured = match d.acceptance {
                    Some(_) => accounting::measured_acceptance(steps, self.batch, d).ok(),
                    None => full.filter(|_| d.nextn == 0),
                };
                self.tok_s_per_user_full_acceptance = full.map(|r| r.tok_s_per_user);
                self.tok_s_per_user = measured.map(|r| r.tok_s_per_user);
                self.tok_s_per_device = measured.map(|r| r.tok_s_per_device);
            }
        }
    }

    /// Everything that identifies the configuration, apart from the swept point (batch,
    /// prompt length) and the results: records with different keys do not belong on one curve.
    pub fn config_key(&self) -> String {
        format!(
            "{} | {} | {} | {} | threads {} | new {} | nextn {}{}{}{}",
            self.mode,
            self.engine,
            self.model,
            self.device,
            self.threads,
            self.new_tokens,
            self.drafts.nextn,
            if self.drafts.variable_length {
                " (variable)"
            } else {
                ""
            },
            match self.cached_prefix_len {
                0 => String::new(),
                n => format!(" | cached prefix {n}"),
            },
            self.chunk_size
                .map_or(String::new(), |c| format!(" | chunk {c}")),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_sets() {
        assert_eq!(Summary::of(&[3.0, 1.0, 2.0]).unwrap().median, 2.0);
        assert_eq!(Summary::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn decode_metrics_scale_with_batch() {
        let mut r = BenchRecord {
            mode: "decode".into(),
            engine: "deepinfer".into(),
            model: "m".into(),
            device: "cpu".into(),
            threads: 2,
            batch: 8,
            prompt_len: 16,
            new_tokens: 4,
            warmup: 1,
            cached_prefix_len: 0,
            chunk_size: None,
            drafts: DraftSpec::default(),
            commit: String::new(),
            timestamp: 0,
            raw_s: vec![0.1, 0.2, 0.1],
            median_s: 0.0,
            prefill_tok_s: None,
            decode_steps_s: None,
            tok_s_per_user: None,
            tok_s_per_user_full_acceptance: None,
            tok_s_per_device: None,
        };
        r.derive();
        assert!((r.decode_steps_s.unwrap() - 10.0).abs() < 1e-9);
        assert!((r.tok_s_per_device.unwrap() - 80.0).abs() < 1e-9);
        // with drafts: 5 per step at measured acceptance 0.75 -> τ = 4.75
        r.drafts = DraftSpec {
            nextn: 5,
            acceptance: Some(0.75),
            variable_length: false,
        };
        r.derive();
        assert!((r.tok_s_per_user.unwrap() - 47.5).abs() < 1e-9);
        assert!((r.tok_s_per_user_full_acceptance.unwrap() - 60.0).abs() < 1e-9);
        assert!((r.tok_s_per_device.unwrap() - 380.0).abs() < 1e-9);
    }

    #[test]
    fn chunked_and_cached_prefix_points_are_their_own_configurations() {
        let base: BenchRecord = serde_json::from_str(
            r#"{"mode":"prefill","engine":"deepinfer","model":"m","device":"cpu","threads":2,"batch":1,
                "prompt_len":512,"new_tokens":0,"warmup":1,"commit":"","raw_s":[0.5],"median_s":0}"#,
        )
        .unwrap();
        let mut chunked = base.clone();
        chunked.chunk_size = Some(128);
        let mut cached = base.clone();
        cached.cached_prefix_len = 256;
        let keys = [base.config_key(), chunked.config_key(), cached.config_key()];
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_ne!(keys[1], keys[2]);
        // The chunk size survives a JSONL round trip; an unchunked record has no such field.
        let line = serde_json::to_string(&chunked).unwrap();
        let back: BenchRecord = serde_json::from_str(&line).unwrap();
        assert_eq!(back.chunk_size, Some(128));
        assert!(!serde_json::to_string(&base).unwrap().contains("chunk_size"));
    }

    #[test]
    fn prefill_rate_counts_the_uncached_suffix() {
        let mut r: BenchRecord = serde_json::from_str(
            r#"{"mode":"prefill","engine":"deepinfer","model":"m","device":"cpu","threads":2,"batch":1,
                "prompt_len":1024,"new_tokens":0,"warmup":1,"cached_prefix_len":1000,"commit":"",
                "raw_s":[0.5],"median_s":0}"#,
        )
        .unwrap();
        r.derive();
        assert_eq!(r.prefill_tok_s, Some(48.0));
    }
}
