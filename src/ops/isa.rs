//! Which vector instruction set the CPU kernels run on (`linear::kernel`, `vecmath`): one
//! definition of the detection, so the kernels agree on what "AVX2" means (AVX2 with FMA) and
//! their tests cover the same set.
//!
//! Owns no state (std caches the CPUID answer). May call: std::arch. Must not touch anything else.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isa {
    /// AVX-512F, on a CPU that also has AVX2 + FMA.
    Avx512,
    /// AVX2 + FMA.
    Avx2,
    /// Scalar Rust (`f32::mul_add` for fused operations).
    Portable,
}

impl Isa {
    /// The widest instruction set this CPU runs.
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every instruction set this CPU runs, portable first (tests compare them bit for bit).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        match Isa::detect() {
            Isa::Avx512 => vec![Isa::Portable, Isa::Avx2, Isa::Avx512],
            Isa::Avx2 => vec![Isa::Portable, Isa::Avx2],
            Isa::Portable => vec![Isa::Portable],
        }
    }
}
