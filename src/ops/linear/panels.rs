//! Linear weights packed once, for engines whose weights do not change (`generate`, `score`):
//! the (K, 16) panels that `kernel` otherwise transposes out of the row-major weight on
//! every call, stored in the weight's own dtype (F32, BF16 or F16; same bytes as the weight).
//! A call then reads one sequential stream instead of 16 strided rows and does no transposes;
//! the arithmetic is unchanged (the same FMA chain per output), so results are bit-identical
//! to the row-major path (tested in `kernel`).
//!
//! Owns: [`Panels`]. May call: `CpuFloats` decoding. Must not touch: devices, tensors, rayon.

use super::kernel::G;
use crate::device::CpuFloats;
use half::{bf16, f16};

/// A weight W (n, k) as ⌈n / 16⌉ panels of (k, 16): panel q holds W[q·16 + c][p] at p·16 + c;
/// the columns past n of the last panel are zero.
pub struct Panels {
    n: usize,
    k: usize,
    data: Data,
}

enum Data {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Panels {
    /// The panels of `w` (n, k), or None for a dtype that is not packed (FP8 and NVFP4 codes:
    /// their scales are blocked along k in row-major order).
    pub fn pack(w: CpuFloats, n: usize, k: usize) -> Option<Panels> {
        fn permute<T: Copy + Default>(v: &[T], n: usize, k: usize) -> Vec<T> {
            // Reserved (an untouched mapping at these sizes), advised, then filled.
            let len = n.div_ceil(G) * G * k;
            let mut d = Vec::with_capacity(len);
            crate::util::advise_huge_pages(d.as_ptr(), len * std::mem::size_of::<T>());
            d.resize(len, T::default());
            if k == 0 {
                return d;
            }
            for (q, panel) in d.chunks_exact_mut(G * k).enumerate() {
                for c in 0..G.min(n - q * G) {
                    let row = &v[(q * G + c) * k..(q * G + c + 1) * k];
                    for (p, x) in row.iter().enumerate() {
                        panel[p * G + c] = *x;
                    }
                }
            }
            d
        }
        assert!(w.len() >= n * k, "Panels::pack: weight shorter than {n} x {k}");
        let data = match w {
            CpuFloats::F32(v) => Data::F32(permute(v, n, k)),
            CpuFloats::BF16(v) => Data::BF16(permute(v, n, k)),
            CpuFloats::F16(v) => Data::F16(permute(v, n, k)),
            CpuFloats::Fp8 { .. } | CpuFloats::Nvfp4 { .. } => return None,
        };
        Some(Panels { n, k, data })
    }

    /// (n, k) of the weight.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    pub fn size_bytes(&self) -> usize {
        match &self.data {
            Data::F32(v) => 4 * v.len(),
            Data::BF16(v) => 2 * v.len(),
            Data::F16(v) => 2 * v.len(),
        }
    }

    /// Panel q as f32 (k, 16): the stored panel itself when it is f32, else widened into
    /// `scratch` (grown once).
    pub(super) fn panel<'a>(&'a self, q: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let (len, at) = (G * self.k, q * G * self.k);
        let view = match &self.data {
            Data::F32(v) => return &v[at..at + len],
            Data::BF16(v) => CpuFloats::BF16(&v[at..at + len]),
            Data::F16(v) => CpuFloats::F16(&v[at..at + len]),
        };
        if scratch.len() < len {
            scratch.resize(len, 0.0);
        }
        view.read_into(0, &mut scratch[..len]);
        &scratch[..len]
    }

    /// The stored bytes of panel q (empty past the last): what to prefetch while panel q − 1
    /// computes.
    pub(super) fn bytes(&self, q: usize) -> &[u8] {
        let (len, at) = (G * self.k, q * G * self.k);
        match &self.data {
            Data::F32(v) => CpuFloats::F32(v).bytes(at, len),
            Data::BF16(v) => CpuFloats::BF16(v).bytes(at, len),
            Data::F16(v) => CpuFloats::F16(v).bytes(at, len),
        }
    }
}
