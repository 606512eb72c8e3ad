//! One JSONL record per benchmark point: the whole configuration, the machine, the commit and
//! the raw timings, plus the derived metrics.

use serde::{Deserialize, Serialize};

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
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Summary { median, min: v[0], max: v[n - 1], n })
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
    pub commit: String,
    /// Seconds per measured repeat (prefill: the whole prompt; decode: one step).
    pub raw_s: Vec<f64>,
    pub median_s: f64,
    /// Prompt tokens per second (prefill), counting only tokens actually computed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_tok_s: Option<f64>,
    /// Decode steps per second (a step advances every sequence of the batch by one token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_steps_s: Option<f64>,
    /// Tokens per second seen by one user (= steps/s without drafts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tok_s_per_user: Option<f64>,
    /// Tokens per second over the whole batch on this device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tok_s_per_device: Option<f64>,
}

impl BenchRecord {
    /// Fills the derived metrics from `raw_s`.
    pub fn derive(&mut self) {
        let Some(s) = Summary::of(&self.raw_s) else { return };
        self.median_s = s.median;
        match self.mode.as_str() {
            "prefill" => self.prefill_tok_s = Some((self.prompt_len * self.batch) as f64 / s.median),
            _ => {
                let steps = 1.0 / s.median;
                self.decode_steps_s = Some(steps);
                self.tok_s_per_user = Some(steps);
                self.tok_s_per_device = Some(steps * self.batch as f64);
            }
        }
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
            commit: String::new(),
            raw_s: vec![0.1, 0.2, 0.1],
            median_s: 0.0,
            prefill_tok_s: None,
            decode_steps_s: None,
            tok_s_per_user: None,
            tok_s_per_device: None,
        };
        r.derive();
        assert!((r.decode_steps_s.unwrap() - 10.0).abs() < 1e-9);
        assert!((r.tok_s_per_device.unwrap() - 80.0).abs() < 1e-9);
    }
}
