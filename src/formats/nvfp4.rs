//! NVFP4 (seed 004 Eq. 4; NVIDIA's format as Transformer Engine and ModelOpt implement it):
//! E2M1 values, one E4M3 scale per 16 consecutive values along K, one FP32 scale per tensor.
//! The arithmetic, every intermediate in f32 and in this order (the CUDA kernels reproduce it):
//!   global  = amax / 2688            (= amax / (6·448); 1 when amax = 0)
//!   bs      = e4m3_satfinite(bamax / f32(6·global)), a zero scale replaced by 1
//!   q       = e2m1_rne(clamp(x / f32(bs·global), −6, 6))
//!   value   = f32(q·bs)·global
//! Packing: byte = code[2i] | code[2i+1] << 4 (the even element in the low nibble).
//! Options, as in the NVFP4 training recipe: a 16×16 random Hadamard transform (H/4 times a fixed
//! random ±1 diagonal) applied to each block before quantization, and stochastic rounding.

use super::fp8::{encode_e2m1_fast, encode_e4m3_fast, E2M1_VALUES};
use rayon::prelude::*;

pub const BLOCK: usize = 16;

/// Optional transforms of the recipe.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Nvfp4Opts {
    /// Random Hadamard transform with signs drawn from this seed.
    pub rht: Option<u64>,
    /// Stochastic rounding with uniforms keyed by (this seed, element index).
    pub stochastic: Option<u64>,
}

/// The global (per-tensor) scale of a tensor with max magnitude `amax`.
pub fn global_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / 2688.0
    } else {
        1.0
    }
}

/// The ±1 signs of the RHT diagonal for `seed`.
pub fn rht_signs(seed: u64) -> [f32; BLOCK] {
    let mut s = crate::rand::Stream::new(seed, 0x5248_5400);
    let mut out = [1.0f32; BLOCK];
    for v in out.iter_mut() {
        if s.next_u32() & 1 == 1 {
            *v = -1.0;
        }
    }
    out
}

/// In place: x ← (H/4)·diag(signs)·x for one block (H the 16×16 Sylvester Hadamard matrix;
/// orthonormal, its own inverse up to the sign diagonal).
#[inline]
pub fn rht_block(x: &mut [f32], signs: &[f32; BLOCK]) {
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
    let mut h = 1;
    while h < BLOCK {
        for i in (0..BLOCK).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    for v in x.iter_mut() {
        *v *= 0.25;
    }
}

/// The inverse of [`rht_block`].
pub fn rht_block_inverse(x: &mut [f32], signs: &[f32; BLOCK]) {
    // H/4 is symmetric and orthonormal: apply it again, then undo the signs.
    let ones = [1.0f32; BLOCK];
    rht_block(x, &ones);
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
}

/// E2M1 code of v (|v| ≤ 6) by stochastic rounding between its two neighbours.
#[inline]
fn sr_e2m1(v: f32, u: f64) -> u8 {
    let a = v.abs().min(6.0);
    let mags = &E2M1_VALUES[..8];
    let mut lo = 0;
    while lo + 1 < 8 && mags[lo + 1] <= a {
        lo += 1;
    }
    let code = if lo == 7 || a == mags[lo] {
        lo
    } else {
        let p = (a - mags[lo]) / (mags[lo + 1] - mags[lo]);
        if u < p as f64 {
            lo + 1
        } else {
            lo
        }
    };
    (if v.is_sign_negative() { 8 } else { 0 } | code) as u8
}

/// Quantizes a piece of a row (a multiple of 16 values) into `packed` (len/2) and `scales`
/// (len/16). `first` is the flat index of x[0] in its tensor: it keys stochastic rounding.
#[inline(always)]
pub fn quantize_row(
    x: &[f32],
    global: f32,
    opts: &Nvfp4Opts,
    signs: Option<&[f32; BLOCK]>,
    first: u64,
    packed: &mut [u8],
    scales: &mut [u8],
) {
    let denom6 = 6.0 * global;
    let e4m3 = super::fp8::e4m3_table();
    let mut blk = [0.0f32; BLOCK];
    let mut codes = [0u8; BLOCK];
    for (b, chunk) in x.chunks_exact(BLOCK).enumerate() {
        blk.copy_from_slice(chunk);
        if let Some(s) = signs {
            rht_block(&mut blk, s);
        }
        // The block's max magnitude: the largest |x| bit pattern, an integer reduction that
        // vectorizes (values are finite: the tensor's amax was checked).
        let bamax = f32::from_bits(blk.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0));
        let mut bs = encode_e4m3_fast(bamax / denom6);
        if bs == 0 {
            bs = 0x38; // a zero scale becomes 1.0
        }
        scales[b] = bs;
        let denom = e4m3[bs as usize] * global;
        match opts.stochastic {
            None => {
                for (c, v) in codes.iter_mut().zip(&blk) {
                    *c = encode_e2m1_fast(v / denom);
                }
            }
            Some(seed) => {
                for (j, (c, v)) in codes.iter_mut().zip(&blk).enumerate() {
                    let idx = first + (b * BLOCK + j) as u64;
                    let r = crate::rand::philox4x32_10(
                        [idx as u32, (idx >> 32) as u32, 0x5352, 0],
                        crate::rand::seed_key(seed),
                    );
                    *c = sr_e2m1((v / denom).clamp(-6.0, 6.0), crate::rand::uniform_f64(r[0], r[1]));
                }
            }
        }
        for i in 0..BLOCK / 2 {
            packed[b * BLOCK / 2 + i] = codes[2 * i] | (codes[2 * i + 1] << 4);
        }
    }
}

/// Quantizes x (rows, K) with the given global scale into preallocated `packed` (rows, K/2) and
/// `scales` (rows, K/16), rows in parallel.
pub fn quantize(x: &[f32], k: usize, global: f32, opts: &Nvfp4Opts, packed: &mut [u8], scales: &mut [u8]) {
    let signs = opts.rht.map(rht_signs);
    packed
        .par_chunks_mut(k / 2)
        .zip(scales.par_chunks_mut(k / BLOCK))
        .zip(x.par_chunks(k))
        .enumerate()
        .for_each(|(r, ((p, s), xr))| quantize_row(xr, global, opts, signs.as_ref(), (r * k) as u64, p, s));
}

/// Values [start, start + out.len()) of a quantized tensor (flat, row-major; start and length
/// multiples of 16), decoded exactly: f32(q·bs)·global.
#[inline]
pub fn dequantize_into(packed: &[u8], scales: &[u8], global: f32, start: usize, out: &mut [f32]) {
    let e4m3 = super::fp8::e4m3_table();
    for (bi, blk) in out.chunks_exact_mut(BLOCK).enumerate() {
        let b = start / BLOCK + bi;
        let bs = e4m3[scales[b] as usize];
        for (i, o) in blk.iter_mut().enumerate() {
            let byte = packed[(b * BLOCK + i) / 2];
            let code = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
            *o = (E2M1_VALUES[code as usize] * bs) * global;
        }
    }
}

/// Fake-quantizes rows of activations in place (quantize, then dequantize), with a fixed global
/// scale (from calibration) and dynamic block scales, as the emulated W4A4 engine consumes them.
pub fn fake_quantize_rows(x: &mut [f32], k: usize, global: f32, opts: &Nvfp4Opts) {
    let signs = opts.rht.map(rht_signs);
    x.par_chunks_mut(k).enumerate().for_each(|(r, row)| {
        let mut p = [0u8; BLOCK / 2];
        let mut s = [0u8; 1];
        for (b, blk) in row.chunks_exact_mut(BLOCK).enumerate() {
            quantize_row(blk, global, opts, signs.as_ref(), (r * k + b * BLOCK) as u64, &mut p, &mut s);
            dequantize_into(&p, &s, global, 0, blk);
        }
    });
}

/// Where the learner's rounding takes its global scale: the tensor's amax (of the rotated
/// values), each row's, or a fixed (calibrated) one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Global {
    Tensor,
    Row,
    Fixed(f32),
}

/// The learner's NVFP4 rounding (seed 004 §5.1, App. B.1), in place on rows (n, k) (k a
/// multiple of 16): every block rotated by the RHT (when `opts.rht`), rounded onto the NVFP4 grid
/// under `global` (stochastic keys: the flat element index, as in the engine), decoded, and
/// rotated back — the learner's operands live in the unrotated domain. Returns the tensor amax
/// (of the rotated values; 0 unless `global` is Tensor) for the caller's NaN check. The CUDA
/// twin: ct_amax + ct_quant_nvfp4 with row_k and unrotate.
pub fn learner_round(x: &mut [f32], k: usize, global: Global, opts: &Nvfp4Opts) -> f32 {
    let signs = opts.rht.map(rht_signs);
    if let Some(s) = &signs {
        x.par_chunks_mut(BLOCK).for_each(|b| rht_block(b, s));
    }
    let amax = |v: &[f32]| v.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let tensor = match global {
        Global::Tensor => x.par_chunks(k.max(1)).map(amax).reduce(|| 0.0, f32::max),
        _ => 0.0,
    };
    x.par_chunks_mut(k).enumerate().for_each(|(r, row)| {
        let g = match global {
            Global::Tensor => global_scale(tensor),
            Global::Row => global_scale(amax(row)),
            Global::Fixed(g) => g,
        };
        let mut p = [0u8; BLOCK / 2];
        let mut s = [0u8; 1];
        for (b, blk) in row.chunks_exact_mut(BLOCK).enumerate() {
            quantize_row(blk, g, opts, None, (r * k + b * BLOCK) as u64, &mut p, &mut s);
            dequantize_into(&p, &s, g, 0, blk);
            if let Some(sg) = &signs {
                rht_block_inverse(blk, sg);
            }
        }
    });
    tensor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rht_is_orthonormal_and_invertible() {
        let signs = rht_signs(5);
        let mut x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.7).sin()).collect();
        let orig = x.clone();
        let n0: f32 = x.iter().map(|v| v * v).sum();
        rht_block(&mut x, &signs);
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5 * n0);
        rht_block_inverse(&mut x, &signs);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-6);
        }
        // Dot products are preserved: the rotated GEMM equals the plain one.
        let (mut a, mut b): (Vec<f32>, Vec<f32>) =
            ((0..16).map(|i| i as f32).collect(), (0..16).map(|i| 1.0 / (1.0 + i as f32)).collect());
        let d0: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        rht_block(&mut a, &signs);
        rht_block(&mut b, &signs);
        let d1: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((d0 - d1).abs() < 1e-5 * d0.abs());
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let opts = Nvfp4Opts { rht: None, stochastic: Some(11) };
        // One block scaled so that x / denom = 2.4 exactly-ish: neighbours 2 and 3, p(3) = 0.4.
        let mut x = vec![0.0f32; 16];
        x[0] = 6.0;
        let n = 4000;
        let mut mean = 0.0f64;
        for r in 0..n {
            let mut xr = x.clone();
            xr[1] = 2.4;
            let (mut p, mut s) = ([0u8; 8], [0u8; 1]);
            quantize_row(&xr, 1.0 / 448.0 * 6.0 / 6.0, &opts, None, r * 16, &mut p, &mut s);
            let mut out = [0.0f32; 16];
            dequantize_into(&p, &s, 1.0 / 448.0 * 6.0 / 6.0, 0, &mut out);
            mean += out[1] as f64 / n as f64;
        }
        assert!((mean - 2.4).abs() < 0.03, "E[q] = {mean}");
    }
}
