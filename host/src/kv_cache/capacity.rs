//! KV capacity from a configured memory budget: an absolute size ("4GiB", "512MiB") or a
//! fraction of the memory the caller says is available ("0.9", "90%"). Resolved once at start
//! into a number of blocks; nothing here measures memory itself.

use std::str::FromStr;

use super::spec::KvCacheLayout;
use crate::error::{Error, Result};

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    Bytes(u64),
    /// A fraction in (0, 1] of the available memory.
    Fraction(f64),
}

impl KvBudget {
    /// The budget in bytes, given the memory available to the cache.
    pub fn resolve(&self, available_bytes: u64) -> Result<u64> {
        match *self {
            KvBudget::Bytes(b) => Ok(b),
            KvBudget::Fraction(f) if f > 0.0 && f <= 1.0 => Ok((available_bytes as f64 * f) as u64),
            KvBudget::Fraction(f) => Err(Error::BadConfig(format!(
                "KV budget fraction must be in (0, 1], got {f}"
            ))),
        }
    }
}

impl FromStr for KvBudget {
    type Err = Error;

    /// Accepts `4GiB`, `1.5 GiB`, `512MiB`, `64KiB`, a plain byte count with `B`, a fraction
    /// such as `0.9`, or a percentage such as `90%`.
    fn from_str(s: &str) -> Result<KvBudget> {
        let t = s.trim();
        let bad = || Error::BadConfig(format!("cannot read KV budget `{s}` (try `4GiB` or `0.9`)"));
        let number = |x: &str| {
            x.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        if let Some(p) = t.strip_suffix('%') {
            return Ok(KvBudget::Fraction(number(p).ok_or_else(bad)? / 100.0));
        }
        for (suffix, scale) in [
            ("GiB", 1u64 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
            ("B", 1),
        ] {
            if let Some(n) = t.strip_suffix(suffix) {
                return Ok(KvBudget::Bytes(
                    (number(n).ok_or_else(bad)? * scale as f64) as u64,
                ));
            }
        }
        Ok(KvBudget::Fraction(number(t).ok_or_else(bad)?))
    }
}

/// Number of blocks of `layout` that fit in `budget`, with `available_bytes` the memory a
/// fraction refers to. Fails when not even one block fits.
pub fn num_blocks_for_budget(
    layout: &KvCacheLayout,
    budget: KvBudget,
    available_bytes: u64,
) -> Result<usize> {
    layout.validate()?;
    let bytes = budget.resolve(available_bytes)?;
    let n = layout.num_blocks_for_bytes(bytes).min(u32::MAX as usize);
    if n == 0 {
        return Err(Error::BadConfig(format!(
            "KV budget of {bytes} bytes holds no block (one block takes {} bytes)",
            layout.bytes_per_block()
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::spec::AttentionShape;

    #[test]
    fn parses_sizes_fractions_and_percentages() {
        assert_eq!(
            "4GiB".parse::<KvBudget>().unwrap(),
            KvBudget::Bytes(4 << 30)
        );
        assert_eq!(
            "1.5 GiB".parse::<KvBudget>().unwrap(),
            KvBudget::Bytes(3 << 29)
        );
        assert_eq!(
            "512MiB".parse::<KvBudget>().unwrap(),
            KvBudget::Bytes(512 << 20)
        );
        assert_eq!("0.9".parse::<KvBudget>().unwrap(), KvBudget::Fraction(0.9));
        assert_eq!("50%".parse::<KvBudget>().unwrap(), KvBudget::Fraction(0.5));
        assert!("lots".parse::<KvBudget>().is_err());
        assert!("-1GiB".parse::<KvBudget>().is_err());
    }

    #[test]
    fn blocks_from_a_budget() {
        let layout = KvCacheLayout::full_attention(
            2,
            AttentionShape {
                num_kv_heads: 1,
                head_dim: 4,
                dtype_bytes: 4,
            },
            16,
        );
        // 2 layers x 1 x 4 x 2 x 4 bytes x 16 tokens = 1024 bytes per block.
        assert_eq!(
            num_blocks_for_budget(&layout, KvBudget::Bytes(10_000), 0).unwrap(),
            9
        );
        assert_eq!(
            num_blocks_for_budget(&layout, KvBudget::Fraction(0.5), 8192).unwrap(),
            4
        );
        assert!(num_blocks_for_budget(&layout, KvBudget::Bytes(1000), 0).is_err());
        assert!(num_blocks_for_budget(&layout, KvBudget::Fraction(1.5), 8192).is_err());
    }
}
