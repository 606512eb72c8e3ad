//! The `greedy` sampler plugin: the candidate with the highest logit after logit bias. It asks
//! the host for one candidate (plus any biased tokens), so it moves almost no data; it ignores
//! temperature, the cuts and the penalties.

use deepinfer_plugin_sdk::sampler::{Row, Sampler};
use deepinfer_plugin_sdk::TokenId;

#[derive(Debug, Default)]
pub struct Greedy;

impl Sampler for Greedy {
    const DESCRIPTION: &'static str = "argmax of the logits plus logit bias";
    const TOP_K: u32 = 1;

    fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String> {
        let bias = |id: TokenId| {
            row.params
                .logit_bias
                .iter()
                .filter(|(t, _)| *t == id)
                .map(|(_, b)| b)
                .sum::<f32>()
        };
        let mut best: Option<(TokenId, f32)> = None;
        for c in row.candidates {
            let l = c.logit + bias(c.id);
            let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
            best = match best {
                Some((id, bl)) if bl > l || (bl == l && id < c.id) => Some((id, bl)),
                _ => Some((c.id, l)),
            };
        }
        best.map(|(id, _)| id)
            .ok_or_else(|| "no candidates".to_string())
    }
}

deepinfer_plugin_sdk::export_sampler!(Greedy);

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_plugin_sdk::{Candidate, SamplingParams};

    fn row<'a>(c: &'a [Candidate], p: &'a SamplingParams) -> Row<'a> {
        Row {
            candidates: c,
            params: p,
            seed: 0,
            step: 0,
            history: &[],
            logits: &[],
            vocab_size: 10,
        }
    }

    #[test]
    fn picks_highest_and_honours_bias() {
        let c = [
            Candidate { id: 3, logit: 2.0 },
            Candidate { id: 7, logit: -1.0 },
        ];
        let mut p = SamplingParams::default();
        assert_eq!(Greedy.sample(&row(&c, &p)), Ok(3));
        p.logit_bias = vec![(7, 5.0)];
        assert_eq!(Greedy.sample(&row(&c, &p)), Ok(7));
        assert!(Greedy.sample(&row(&[], &p)).is_err());
    }
}
