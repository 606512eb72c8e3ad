//! The instruction-set levels the kernels are written for, detected at run time.

/// A kernel family. Only levels for which [`Isa::is_available`] holds may run kernels: the SIMD
/// kernels execute instructions the CPU must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (integer dots with `vpmaddubsw`).
    Avx2,
    /// AVX2 plus AVX-VNNI (256-bit `vpdpbusd`).
    AvxVnni,
    /// AVX-512 F/BW/VL + AVX-512 VNNI (512-bit `vpdpbusd`).
    Avx512Vnni,
}

impl Isa {
    /// Every level, slowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

    /// The fastest level this CPU supports.
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    }

    /// Every level this CPU supports, slowest first (always starts with `Scalar`).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// Whether this CPU can run kernels of this level (cheap: the feature bits are cached).
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.is_available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_level_is_available_and_scalar_always_is() {
        assert!(Isa::Scalar.is_available());
        assert!(Isa::detect().is_available());
        assert_eq!(Isa::available()[0], Isa::Scalar);
        assert_eq!(Isa::available().last(), Some(&Isa::detect()));
    }
}
