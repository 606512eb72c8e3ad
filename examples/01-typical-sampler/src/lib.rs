//! Example 01: a third-party sampler plugin written only against `deepinfer-plugin-sdk`.
//! Locally typical sampling (Meister et al., "Locally Typical Sampling", TACL 2023): keep the
//! tokens whose surprisal is closest to the distribution's entropy until their probability
//! mass reaches `mass`, then draw among them.
//!
//! Build it with `scripts/build-plugin.sh examples/01-typical-sampler` and name it in a config:
//!
//! ```toml
//! [sampler]
//! plugin = "typical"
//! temperature = 1.0
//!
//! [plugins.typical]
//! path = "typical_sampler.wasm"
//! sha256 = "<printed by the build script>"
//! settings = { mass = 0.9 }
//! ```

use deepinfer_plugin_sdk::sampler::{Row, Sampler};
use deepinfer_plugin_sdk::{Settings, TokenId};

/// The sampler and its one setting.
#[derive(Debug)]
pub struct Typical {
    /// Probability mass of the typical set, in (0, 1].
    mass: f64,
    order: Vec<(f64, usize)>,
    probs: Vec<f64>,
}

impl Default for Typical {
    fn default() -> Self {
        Typical {
            mass: 0.95,
            order: Vec::new(),
            probs: Vec::new(),
        }
    }
}

impl Sampler for Typical {
    const DESCRIPTION: &'static str = "locally typical sampling (setting: mass, default 0.95)";

    fn configure(&mut self, settings: &Settings) -> Result<(), String> {
        settings.reject_unknown(&["mass"])?;
        let mass: f64 = settings.parse_or("mass", 0.95)?;
        if !(mass > 0.0 && mass <= 1.0) {
            return Err(format!("setting `mass` must be in (0, 1], got {mass}"));
        }
        self.mass = mass;
        Ok(())
    }

    fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String> {
        let c = row.candidates;
        let first = c.first().ok_or("no candidates")?;
        if row.params.is_greedy() {
            return Ok(first.id);
        }
        let t = row.params.temperature as f64;
        let max = c.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max) as f64;
        self.probs.clear();
        self.probs.extend(c.iter().map(|c| {
            let l = c.logit as f64;
            if l.is_nan() {
                0.0
            } else {
                ((l - max) / t).exp()
            }
        }));
        let total: f64 = self.probs.iter().sum();
        // Written so that a NaN total fails too.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(total > 0.0) {
            return Err("no candidate has a finite logit".into());
        }
        self.probs.iter_mut().for_each(|p| *p /= total);
        let entropy: f64 = self
            .probs
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -p * p.ln())
            .sum();
        self.order.clear();
        self.order.extend(
            self.probs
                .iter()
                .enumerate()
                .filter(|(_, &p)| p > 0.0)
                .map(|(i, &p)| ((-p.ln() - entropy).abs(), i)),
        );
        self.order
            .sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut kept = 0;
        let mut acc = 0.0;
        for &(_, i) in &self.order {
            acc += self.probs[i];
            kept += 1;
            if acc >= self.mass {
                break;
            }
        }
        let mut u = row.uniform() * acc;
        for &(_, i) in &self.order[..kept] {
            if u < self.probs[i] {
                return Ok(c[i].id);
            }
            u -= self.probs[i];
        }
        Ok(c[self.order[kept - 1].1].id)
    }
}

deepinfer_plugin_sdk::export_sampler!(Typical);

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_plugin_sdk::{Candidate, SamplingParams};

    #[test]
    fn drops_the_atypical_head_and_tail() {
        // One dominant token (surprisal far below the entropy) and a flat tail.
        let mut c = vec![Candidate { id: 0, logit: 0.0 }];
        c.extend((1..40).map(|i| Candidate { id: i, logit: -3.0 }));
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut s = Typical::default();
        s.configure(&Settings::new(vec![("mass".into(), "0.2".into())]))
            .unwrap();
        for step in 0..100 {
            let row = Row {
                candidates: &c,
                params: &p,
                seed: 5,
                step,
                history: &[],
                logits: &[],
                vocab_size: 40,
            };
            let id = s.sample(&row).unwrap();
            assert_ne!(id, 0, "the dominant token is not typical here");
        }
    }

    #[test]
    fn rejects_bad_settings() {
        let mut s = Typical::default();
        assert!(s
            .configure(&Settings::new(vec![("mass".into(), "1.5".into())]))
            .is_err());
        assert!(s
            .configure(&Settings::new(vec![("mas".into(), "0.5".into())]))
            .is_err());
    }
}
