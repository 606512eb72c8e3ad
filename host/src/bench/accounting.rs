//! Throughput accounting that is easy to get wrong, in one place.
//!
//! - Decode steps/s is not tokens/s. With fixed-length drafts of `nextn` tokens, one step
//!   yields τ tokens per request: τ = 1 + nextn if every draft were accepted (the optimistic
//!   figure DeepInfer reports by default), τ = 1 + nextn × a with a measured acceptance a.
//! - Variable-length drafts (a scheduler picks how many positions to verify) already count
//!   their accepted tokens per step: applying τ again would count them twice, so it is refused.
//! - Prefill tok/s per device counts only the uncached suffix of each prompt.

use serde::{Deserialize, Serialize};

/// How a decode record's drafts are counted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct DraftSpec {
    /// Draft tokens per step (0: no speculative decoding).
    pub nextn: u32,
    /// Measured acceptance rate in [0, 1], if known.
    pub acceptance: Option<f64>,
    /// Drafts of varying length per row: the step rate already counts accepted tokens.
    pub variable_length: bool,
}

/// Why a conversion was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AccountingError {
    #[error("variable-length draft records already count accepted tokens per step; applying the acceptance factor would count them twice")]
    VariableLength,
    #[error("acceptance rate {0} is outside [0, 1]")]
    BadAcceptance(f64),
    #[error("no measured acceptance rate in this record")]
    NoAcceptance,
}

/// Tokens per request per step: 1 + nextn × a.
pub fn tau(nextn: u32, acceptance: f64) -> Result<f64, AccountingError> {
    if !(0.0..=1.0).contains(&acceptance) {
        return Err(AccountingError::BadAcceptance(acceptance));
    }
    Ok(1.0 + nextn as f64 * acceptance)
}

/// Per-user and per-device tokens/s from decode steps/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodeRates {
    pub tok_s_per_user: f64,
    pub tok_s_per_device: f64,
}

fn rates(steps_per_s: f64, requests_per_rank: usize, tau: f64) -> DecodeRates {
    let per_user = steps_per_s * tau;
    DecodeRates {
        tok_s_per_user: per_user,
        tok_s_per_device: per_user * requests_per_rank as f64,
    }
}

/// The full-acceptance figure (τ = 1 + nextn).
pub fn full_acceptance(
    steps_per_s: f64,
    requests_per_rank: usize,
    d: &DraftSpec,
) -> Result<DecodeRates, AccountingError> {
    if d.variable_length {
        return Err(AccountingError::VariableLength);
    }
    Ok(rates(steps_per_s, requests_per_rank, tau(d.nextn, 1.0)?))
}

/// The measured-acceptance figure (τ = 1 + nextn × a).
pub fn measured_acceptance(
    steps_per_s: f64,
    requests_per_rank: usize,
    d: &DraftSpec,
) -> Result<DecodeRates, AccountingError> {
    if d.variable_length {
        return Err(AccountingError::VariableLength);
    }
    let a = d.acceptance.ok_or(AccountingError::NoAcceptance)?;
    Ok(rates(steps_per_s, requests_per_rank, tau(d.nextn, a)?))
}

/// Rates of a variable-length record: its step rate is converted with the accepted tokens it
/// measured per request per step (no draft factor on top).
pub fn variable_length(
    steps_per_s: f64,
    requests_per_rank: usize,
    accepted_per_step: f64,
) -> DecodeRates {
    rates(steps_per_s, requests_per_rank, accepted_per_step)
}

/// Prefill tokens/s per device, counting only the uncached suffix of each prompt.
pub fn prefill_tok_s_per_device(
    prompt_tokens: usize,
    cached_tokens: usize,
    seconds: f64,
    devices: usize,
) -> f64 {
    prompt_tokens.saturating_sub(cached_tokens) as f64 / seconds / devices.max(1) as f64
}

/// Latency of one prefill window: the uncached tokens of the window at a per-device rate over
/// `devices` devices.
pub fn prefill_window_latency_s(
    window_tokens: usize,
    cached_tokens: usize,
    tok_s_per_device: f64,
    devices: usize,
) -> f64 {
    window_tokens.saturating_sub(cached_tokens) as f64 / (tok_s_per_device * devices.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_acceptance_factor_is_one_plus_nextn() {
        let d = DraftSpec {
            nextn: 5,
            acceptance: None,
            variable_length: false,
        };
        let r = full_acceptance(10.0, 64, &d).unwrap();
        assert_eq!(r.tok_s_per_user, 60.0);
        assert_eq!(r.tok_s_per_device, 3840.0);
    }

    #[test]
    fn measured_acceptance_conversion() {
        let d = DraftSpec {
            nextn: 5,
            acceptance: Some(0.75),
            variable_length: false,
        };
        let r = measured_acceptance(10.0, 64, &d).unwrap();
        assert!((r.tok_s_per_user - 47.5).abs() < 1e-9);
        assert!((r.tok_s_per_device - 3040.0).abs() < 1e-9);
    }

    #[test]
    fn variable_length_records_refuse_the_factor() {
        let d = DraftSpec {
            nextn: 5,
            acceptance: Some(0.75),
            variable_length: true,
        };
        assert_eq!(
            full_acceptance(10.0, 64, &d),
            Err(AccountingError::VariableLength)
        );
        assert_eq!(
            measured_acceptance(10.0, 64, &d),
            Err(AccountingError::VariableLength)
        );
        let r = variable_length(10.0, 64, 3.2);
        assert!((r.tok_s_per_user - 32.0).abs() < 1e-9);
    }

    #[test]
    fn acceptance_out_of_range_and_missing_are_errors() {
        let d = DraftSpec {
            nextn: 3,
            acceptance: Some(1.5),
            variable_length: false,
        };
        assert_eq!(
            measured_acceptance(1.0, 1, &d),
            Err(AccountingError::BadAcceptance(1.5))
        );
        let d = DraftSpec {
            nextn: 3,
            acceptance: None,
            variable_length: false,
        };
        assert_eq!(
            measured_acceptance(1.0, 1, &d),
            Err(AccountingError::NoAcceptance)
        );
    }

    #[test]
    fn no_drafts_means_steps_are_tokens() {
        let r = full_acceptance(12.0, 8, &DraftSpec::default()).unwrap();
        assert_eq!((r.tok_s_per_user, r.tok_s_per_device), (12.0, 96.0));
    }

    #[test]
    fn prefill_counts_only_the_uncached_suffix() {
        assert_eq!(prefill_tok_s_per_device(1024, 768, 0.5, 2), 256.0);
        // a 4096-token window with 1024 cached, at 3000 tok/s per device on 2 devices
        assert!((prefill_window_latency_s(4096, 1024, 3000.0, 2) - 0.512).abs() < 1e-12);
        assert_eq!(prefill_tok_s_per_device(10, 20, 1.0, 1), 0.0);
    }
}
