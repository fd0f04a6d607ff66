//! Attention over a paged KV cache (vLLM layout), for prefill and decode alike: every query row
//! of the flat batch belongs to a sequence whose keys/values live in fixed-size cache blocks
//! listed in its block table; row i of a sequence with q_len new tokens and ctx_len cached
//! tokens sits at position ctx_len − q_len + i and attends causally to positions 0..=that.
//! Softmax(q·kᵀ/√D) in f32; grouped-query attention maps query head h to KV head h / (H/Hkv).

use super::check_rows;
use super::isa::Isa;
use crate::device::{cuda, CpuStorage, Device, Tensor};
use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::cell::RefCell;

/// Per-step batch metadata. Tensors are allocated at capacity; `num_seqs`/`num_tokens` say
/// how much is live.
#[derive(Debug)]
pub struct AttnMeta {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub block_size: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    pub q_start: Tensor,      // (S+1) u32: rows of sequence s are q_start[s]..q_start[s+1]
    pub ctx_len: Tensor,      // (S) u32: cached tokens of s after this step's write
    pub block_tables: Tensor, // (S, max_blocks) u32
    pub slot_mapping: Tensor, // (T) u32: cache slot (block·block_size + offset) of each row
}

/// Writes the new keys/values k, v (m, Hkv·D) into the caches (num_blocks, Hkv, block_size, D)
/// at `meta.slot_mapping`. FP8 (u8) caches store e4m3_satfinite(x / scale); float caches ignore
/// the scales.
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    dev: &Device,
    k: &Tensor,
    v: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    k_scale: f32,
    v_scale: f32,
    meta: &AttnMeta,
) -> Result<()> {
    let (nb, hkv, bs, d) = cache_dims(k_cache)?;
    let m = meta.num_tokens;
    check_rows(k, m, hkv * d, "kv_write keys")?;
    check_rows(v, m, hkv * d, "kv_write values")?;
    match dev {
        Device::Cpu(_) => {
            let slots = meta.slot_mapping.u32s()?;
            let (ks, vs) = (k.f32s()?, v.f32s()?);
            for (src, cache, scale) in [(ks, k_cache, k_scale), (vs, v_cache, v_scale)] {
                let st = cache.cpu_mut()?;
                for t in 0..m {
                    let slot = slots[t] as usize;
                    let (blk, off) = (slot / bs, slot % bs);
                    if blk >= nb {
                        bail!("kv_write: slot {slot} outside the cache ({nb} blocks of {bs})");
                    }
                    for h in 0..hkv {
                        let dst = ((blk * hkv + h) * bs + off) * d;
                        let s = &src[t * hkv * d + h * d..t * hkv * d + (h + 1) * d];
                        store(st, dst, s, scale)?;
                    }
                }
            }
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::kv_write(c, k, v, k_cache, v_cache, k_scale, v_scale, meta),
    }
}

fn store(st: &mut CpuStorage, at: usize, src: &[f32], scale: f32) -> Result<()> {
    match st {
        CpuStorage::F32(c) => c[at..at + src.len()].copy_from_slice(src),
        CpuStorage::BF16(c) => {
            for (o, x) in c[at..at + src.len()].iter_mut().zip(src) {
                *o = bf16::from_f32(*x);
            }
        }
        CpuStorage::F16(c) => {
            for (o, x) in c[at..at + src.len()].iter_mut().zip(src) {
                *o = f16::from_f32(*x);
            }
        }
        CpuStorage::U8(c) => {
            for (o, x) in c[at..at + src.len()].iter_mut().zip(src) {
                *o = crate::quant::fp8::E4M3.encode(*x / scale);
            }
        }
        _ => bail!("KV cache storage must be f32, bf16, f16 or FP8 (u8)"),
    }
    Ok(())
}

/// (num_blocks, Hkv, block_size, D) of a cache tensor.
pub fn cache_dims(c: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match c.shape() {
        [a, b, c2, d] => Ok((*a, *b, *c2, *d)),
        s => bail!("KV cache tensor must be (blocks, kv_heads, block_size, head_dim), got {s:?}"),
    }
}

/// Keys per online-softmax update. Fixed (not the cache block size), so a row's result does
/// not depend on how the cache is paged.
pub const KCHUNK: usize = 16;

thread_local! {
    /// Per-thread attention scratch of a fixed size (groups × block_size + 2 groups + D).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Grows this thread's attention scratch to at least `n` values.
pub fn reserve(n: usize) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n {
            s.resize(n, 0.0);
        }
    });
}

/// out[..T] (T, H·D) = attention of q (T, H·D) over the paged caches (FP8 caches decoded as
/// e4m3(code) · scale).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dev: &Device,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k_scale: f32,
    v_scale: f32,
    meta: &AttnMeta,
    out: &mut Tensor,
    heads: usize,
) -> Result<()> {
    let (_nb, hkv, bs, d) = cache_dims(k_cache)?;
    if bs != meta.block_size {
        bail!("paged_attention: cache block size {bs} != metadata block size {}", meta.block_size);
    }
    if heads % hkv != 0 {
        bail!("paged_attention: {heads} query heads not a multiple of {hkv} KV heads");
    }
    let t_rows = meta.num_tokens;
    check_rows(q, t_rows, heads * d, "attention queries")?;
    check_rows(out, t_rows, heads * d, "attention output")?;
    match dev {
        Device::Cpu(dv) => {
            let qs = q.f32s()?;
            let qst = &meta.q_start.u32s()?[..meta.num_seqs + 1];
            let ctx = &meta.ctx_len.u32s()?[..meta.num_seqs];
            let bt = meta.block_tables.u32s()?;
            let (kc, vc) = (Kv::of(k_cache, k_scale)?, Kv::of(v_cache, v_scale)?);
            let os = out.f32s_mut()?;
            let job = Rows { qs, qst, ctx, bt, kc, vc, hkv, bs, d, groups: heads / hkv, heads, maxb: meta.max_blocks };
            let isa = Isa::detect();
            dv.install(|| {
                os[..t_rows * heads * d].par_chunks_mut(job.groups * d).enumerate().for_each(|(item, o)| {
                    SCRATCH.with(|sc| job.run(isa, item, o, &mut sc.borrow_mut()));
                })
            });
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::paged_attention(c, q, k_cache, v_cache, k_scale, v_scale, meta, out, heads),
    }
}

/// The read-only inputs of one CPU attention call; [`Rows::run`] computes one work item: one
/// query row × one KV head (its `groups` query heads).
struct Rows<'a> {
    qs: &'a [f32],  // (T, H·D)
    qst: &'a [u32], // (S+1)
    ctx: &'a [u32], // (S)
    bt: &'a [u32],  // (S, maxb)
    kc: Kv<'a>,
    vc: Kv<'a>,
    hkv: usize,
    bs: usize,
    d: usize,
    groups: usize,
    heads: usize,
    maxb: usize,
}

impl Rows<'_> {
    /// o (groups·D) ← attention of work item `item` (row item / Hkv, KV head item % Hkv), on the
    /// widest vector unit the CPU has. Every instruction set computes the same bits: the body
    /// is written without reassociation (Rust never fuses a·b + c), so wider vectors only run
    /// the same lanes side by side.
    fn run(&self, isa: Isa, item: usize, o: &mut [f32], sc: &mut Vec<f32>) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect()` returned Avx512 / Avx2 only after detecting those features.
            Isa::Avx512 => unsafe { self.run512(item, o, sc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { self.run256(item, o, sc) },
            _ => self.item(item, o, sc, dot),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn run512(&self, item: usize, o: &mut [f32], sc: &mut Vec<f32>) {
        // SAFETY: this function runs only where AVX-512F was detected.
        self.item(item, o, sc, |a, b| unsafe { x86::dot512(a, b) })
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run256(&self, item: usize, o: &mut [f32], sc: &mut Vec<f32>) {
        // SAFETY: this function runs only where AVX2 was detected.
        self.item(item, o, sc, |a, b| unsafe { x86::dot256(a, b) })
    }

    /// The work item, in portable Rust (inlined into each instruction-set wrapper), with that
    /// instruction set's [`dot`].
    #[inline(always)]
    fn item(&self, item: usize, o: &mut [f32], sc: &mut Vec<f32>, dot: impl Fn(&[f32], &[f32]) -> f32) {
        let Rows { qs, qst, ctx, bt, kc, vc, hkv, bs, d, groups, heads, maxb } = *self;
        let scale = 1.0 / (d as f32).sqrt();
        let (t, kvh) = (item / hkv, item % hkv);
        // Sequence of row t: last s with q_start[s] <= t.
        let s = qst.partition_point(|&x| x as usize <= t) - 1;
        let q_len = (qst[s + 1] - qst[s]) as usize;
        let pos = ctx[s] as usize - q_len + (t - qst[s] as usize);
        let n = pos + 1;
        let table = &bt[s * maxb..(s + 1) * maxb];
        let slot = |j: usize| ((table[j / bs] as usize * hkv + kvh) * bs + j % bs) * d;
        let qrow = &qs[t * heads * d + kvh * groups * d..t * heads * d + (kvh + 1) * groups * d];
        // Layout: scores (groups × KCHUNK) | running max (groups) | sum (groups) | one K/V row (d).
        let need = groups * KCHUNK + 2 * groups + d;
        if sc.len() < need {
            sc.resize(need, 0.0);
        }
        let (scores, rest) = sc.split_at_mut(groups * KCHUNK);
        let (mx, rest) = rest.split_at_mut(groups);
        let (sum, rest) = rest.split_at_mut(groups);
        let kr = &mut rest[..d];
        mx.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        o.fill(0.0);
        // Online softmax over the keys, KCHUNK at a time (flash-style): rescale the running sum
        // and output when the running max grows.
        let mut j0 = 0;
        while j0 < n {
            let jn = KCHUNK.min(n - j0);
            for j in 0..jn {
                let kr = kc.row(slot(j0 + j), kr);
                for g in 0..groups {
                    scores[g * KCHUNK + j] = dot(&qrow[g * d..(g + 1) * d], kr) * scale;
                }
            }
            for g in 0..groups {
                let blk_max = scores[g * KCHUNK..g * KCHUNK + jn].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let m_new = mx[g].max(blk_max);
                let corr = (mx[g] - m_new).exp();
                if corr != 1.0 {
                    sum[g] *= corr;
                    for a in o[g * d..(g + 1) * d].iter_mut() {
                        *a *= corr;
                    }
                }
                mx[g] = m_new;
                for x in scores[g * KCHUNK..g * KCHUNK + jn].iter_mut() {
                    *x = (*x - m_new).exp();
                    sum[g] += *x;
                }
            }
            for j in 0..jn {
                let vr = vc.row(slot(j0 + j), kr);
                for g in 0..groups {
                    let p = scores[g * KCHUNK + j];
                    for (a, b) in o[g * d..(g + 1) * d].iter_mut().zip(vr.iter()) {
                        *a += p * b;
                    }
                }
            }
            j0 += jn;
        }
        for g in 0..groups {
            let inv = 1.0 / sum[g];
            for a in o[g * d..(g + 1) * d].iter_mut() {
                *a *= inv;
            }
        }
    }
}

/// Σ a[i]·b[i] (each product rounded, then added) in one fixed order: 16 lane sums over
/// i ≡ l (mod 16), halved pairwise (l + 8, then + 4, + 2, + 1), then the tail past the last 16.
/// Written so that it vectorizes without reassociation, so every CPU gives the same bits;
/// `x86::dot512` / `dot256` are the same order in intrinsics (the compiler vectorizes this
/// loop only 2–4 wide).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    let mut l = [0.0f32; 16];
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            l[i] += x[i] * y[i];
        }
    }
    let mut w = 8;
    while w > 0 {
        for i in 0..w {
            l[i] += l[i + w];
        }
        w /= 2;
    }
    ta.iter().zip(tb).fold(l[0], |s, (x, y)| s + x * y)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::dot`] with the 16 lane sums in one zmm register.
    ///
    /// # Safety
    /// The CPU has AVX-512F; a and b have the same length.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn dot512(a: &[f32], b: &[f32]) -> f32 {
        let (n, pa, pb) = (a.len().min(b.len()), a.as_ptr(), b.as_ptr());
        let full = n / 16 * 16;
        let mut l = _mm512_setzero_ps();
        for i in (0..full).step_by(16) {
            l = _mm512_add_ps(l, _mm512_mul_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i))));
        }
        // Lanes l + 8 (the high half onto the low), then halve the 8 as dot256 does.
        let h8 = _mm256_add_ps(
            _mm512_castps512_ps256(l),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(l))),
        );
        finish(h8, a, b, full, n)
    }

    /// [`super::dot`] with lanes 0..8 and 8..16 in two ymm registers.
    ///
    /// # Safety
    /// The CPU has AVX2; a and b have the same length.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot256(a: &[f32], b: &[f32]) -> f32 {
        let (n, pa, pb) = (a.len().min(b.len()), a.as_ptr(), b.as_ptr());
        let full = n / 16 * 16;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..full).step_by(16) {
            lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8))));
        }
        finish(_mm256_add_ps(lo, hi), a, b, full, n)
    }

    /// h8 (lanes l + l + 8, l < 8) → + 4, + 2, + 1, then the tail a[full..n]·b[full..n] in order.
    #[inline(always)]
    unsafe fn finish(h8: __m256, a: &[f32], b: &[f32], full: usize, n: usize) -> f32 {
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2));
        a[full..n].iter().zip(&b[full..n]).fold(_mm_cvtss_f32(h1), |s, (x, y)| s + x * y)
    }
}

/// A read-only view of a CPU cache tensor.
#[derive(Clone, Copy)]
enum Kv<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    Fp8(&'a [u8], f32, &'static [f32; 256]),
}

impl<'a> Kv<'a> {
    fn of(t: &'a Tensor, scale: f32) -> Result<Kv<'a>> {
        Ok(match t.cpu()? {
            CpuStorage::F32(v) => Kv::F32(v),
            CpuStorage::BF16(v) => Kv::BF16(v),
            CpuStorage::F16(v) => Kv::F16(v),
            CpuStorage::U8(v) => Kv::Fp8(v, scale, crate::quant::fp8::e4m3_table()),
            _ => bail!("KV cache storage must be f32, bf16, f16 or FP8 (u8)"),
        })
    }
    /// The cache row of `out.len()` values at `at` as f32: the cache itself when it is f32,
    /// else decoded into `out`.
    #[inline(always)]
    fn row<'s>(&'s self, at: usize, out: &'s mut [f32]) -> &'s [f32] {
        let n = out.len();
        match self {
            Kv::F32(v) => return &v[at..at + n],
            Kv::BF16(v) => {
                // The BF16 bits are the f32's high half: a shift that vectorizes (`to_f32` also
                // quiets NaNs, one branch per value; NaN stays NaN here too).
                for (o, x) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = f32::from_bits((x.to_bits() as u32) << 16);
                }
            }
            Kv::F16(v) => {
                for (o, x) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = x.to_f32();
                }
            }
            Kv::Fp8(v, scale, t) => {
                for (o, x) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = t[*x as usize] * *scale;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::dot;

    #[test]
    fn dot_is_the_documented_order_and_near_f64() {
        let mut s = crate::rand::Stream::new(11, 0);
        for n in [0usize, 1, 15, 16, 17, 31, 64, 100, 128, 257] {
            let a: Vec<f32> = (0..n).map(|_| s.normal() as f32).collect();
            let b: Vec<f32> = (0..n).map(|_| s.normal() as f32).collect();
            let got = dot(&a, &b);
            // The intrinsic versions give the same bits.
            #[cfg(target_arch = "x86_64")]
            for isa in crate::ops::isa::Isa::available() {
                // SAFETY: `available` lists only detected instruction sets.
                let v = match isa {
                    crate::ops::isa::Isa::Avx512 => unsafe { super::x86::dot512(&a, &b) },
                    crate::ops::isa::Isa::Avx2 => unsafe { super::x86::dot256(&a, &b) },
                    crate::ops::isa::Isa::Portable => dot(&a, &b),
                };
                assert_eq!(v.to_bits(), got.to_bits(), "{isa:?}, n = {n}");
            }
            // The order, spelled out: lane sums, then lanes l and l + 8, + 4, + 2, + 1, then the tail.
            let full = n / 16 * 16;
            let mut lane = [0.0f32; 16];
            for i in 0..full {
                lane[i % 16] += a[i] * b[i];
            }
            let h8: Vec<f32> = (0..8).map(|l| lane[l] + lane[l + 8]).collect();
            let h4: Vec<f32> = (0..4).map(|l| h8[l] + h8[l + 4]).collect();
            let h2: Vec<f32> = (0..2).map(|l| h4[l] + h4[l + 2]).collect();
            let mut want = h2[0] + h2[1];
            for i in full..n {
                want += a[i] * b[i];
            }
            assert_eq!(got.to_bits(), want.to_bits(), "n = {n}");
            // |dot − Σ a·b (f64)| ≤ 1e-6 + 1e-5·Σ|a·b|.
            let r: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
            assert!((got as f64 - r).abs() <= 1e-6 + 1e-5 * mag, "n = {n}: {got} vs {r}");
        }
    }
}
