//! Paged attention's CPU twin (the reference of csrc/kernels/attention.cu and
//! attention_prefill.cu): one work item per (query row, KV head), an online softmax over
//! KCHUNK keys at a time in f32, keys and values decoded from the cache's dtype. `super` checks
//! the shapes.

use super::{cache_dims, AttnMeta};
use crate::device::{CpuDevice, CpuStorage, Tensor};
use crate::ops::isa::Isa;
use crate::ops::vecmath::{exp_f32, exp_sub_with};
use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::cell::RefCell;

/// Writes k, v (m, Hkv·D) into the caches at `meta.slot_mapping` (FP8: e4m3(x / scale)).
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
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

/// Keys per online-softmax update. Fixed (not the cache block size), so a row's result does
/// not depend on how the cache is paged.
pub const KCHUNK: usize = 16;

thread_local! {
    /// Per-thread attention scratch of a fixed size (groups × block_size + 2 groups + D).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Values of a thread's attention scratch for `groups` query heads per KV head of `d`:
/// scores (groups × KCHUNK) | running max (groups) | sum (groups) | the chunk's K rows, then V
/// rows (KCHUNK × d each; used for caches that are not f32 only).
pub fn scratch_len(groups: usize, d: usize) -> usize {
    groups * KCHUNK + 2 * groups + 2 * KCHUNK * d
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

/// out[..T] (T, H·D) = attention of q over the paged caches, items in parallel.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dv: &CpuDevice,
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
    let t_rows = meta.num_tokens;
    let qs = q.f32s()?;
    let qst = &meta.q_start.u32s()?[..meta.num_seqs + 1];
    let ctx = &meta.ctx_len.u32s()?[..meta.num_seqs];
    let bt = meta.block_tables.u32s()?;
    let (kc, vc) = (Kv::of(k_cache, k_scale)?, Kv::of(v_cache, v_scale)?);
    let os = out.f32s_mut()?;
    let job = Rows { qs, qst, ctx, bt, kc, vc, hkv, bs, d, groups: heads / hkv, heads, maxb: meta.max_blocks };
    let isa = Isa::detect();
    dv.install(|| {
        let items = t_rows * hkv;
        os[..t_rows * heads * d].par_chunks_mut(job.groups * d).enumerate().for_each(|(item, o)| {
            // A thread usually takes the next item next: its first keys and values
            // (in other cache blocks, which no hardware stream finds) are asked for now.
            if item + 1 < items {
                job.prefetch_first(item + 1);
            }
            SCRATCH.with(|sc| job.run(isa, item, o, &mut sc.borrow_mut()));
        })
    });
    Ok(())
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
    /// Prefetches the first KCHUNK key and value rows of work item `item` (a hint).
    fn prefetch_first(&self, item: usize) {
        let (t, kvh) = (item / self.hkv, item % self.hkv);
        let s = self.qst.partition_point(|&x| x as usize <= t) - 1;
        let q_len = (self.qst[s + 1] - self.qst[s]) as usize;
        let n = self.ctx[s] as usize - q_len + (t - self.qst[s] as usize) + 1;
        let table = &self.bt[s * self.maxb..(s + 1) * self.maxb];
        let mut at = [0usize; KCHUNK];
        let at = &mut at[..n.min(KCHUNK)];
        self.offsets(table, kvh, 0, at);
        self.kc.prefetch_rows(at, self.d);
        self.vc.prefetch_rows(at, self.d);
    }

    /// out[i] ← the cache offset of key j0 + i of KV head `kvh` in a sequence with block table
    /// `table`: block table[j / bs], row j % bs, walked with one division per call.
    #[inline(always)]
    fn offsets(&self, table: &[u32], kvh: usize, j0: usize, out: &mut [usize]) {
        let (hkv, bs, d) = (self.hkv, self.bs, self.d);
        let (mut b, mut r) = (j0 / bs, j0 % bs);
        for o in out {
            *o = ((table[b] as usize * hkv + kvh) * bs + r) * d;
            r += 1;
            if r == bs {
                (b, r) = (b + 1, 0);
            }
        }
    }

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
            _ => self.item(Isa::Portable, item, o, sc, dots, pv),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn run512(&self, item: usize, o: &mut [f32], sc: &mut Vec<f32>) {
        // SAFETY: this function runs only where AVX-512F was detected.
        self.item(
            Isa::Avx512,
            item,
            o,
            sc,
            |q, k, at, n, out| unsafe { x86::dots512(q, k, at, n, out) },
            |o, p, at, v| unsafe { x86::pv512(o, p, at, v) },
        )
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run256(&self, item: usize, o: &mut [f32], sc: &mut Vec<f32>) {
        // SAFETY: this function runs only where AVX2 was detected.
        let dots = |q: &[f32], k: &[f32], at: &[usize; KCHUNK], n: usize, out: &mut [f32]| {
            for (o, &a) in out.iter_mut().zip(&at[..n]) {
                // SAFETY: as above.
                *o = unsafe { x86::dot256(q, &k[a..a + q.len()]) };
            }
        };
        self.item(Isa::Avx2, item, o, sc, dots, |o, p, at, v| unsafe { x86::pv256(o, p, at, v) })
    }

    /// The work item, in portable Rust (inlined into each instruction-set wrapper), with that
    /// instruction set's [`dots`] and [`pv`].
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    fn item(
        &self,
        isa: Isa,
        item: usize,
        o: &mut [f32],
        sc: &mut Vec<f32>,
        dots: impl Fn(&[f32], &[f32], &[usize; KCHUNK], usize, &mut [f32]),
        pv: impl Fn(&mut [f32], &[f32], &[usize; KCHUNK], &[f32]),
    ) {
        let Rows { qs, qst, ctx, bt, kc, vc, hkv, bs: _, d, groups, heads, maxb } = *self;
        let scale = 1.0 / (d as f32).sqrt();
        let (t, kvh) = (item / hkv, item % hkv);
        // Sequence of row t: last s with q_start[s] <= t.
        let s = qst.partition_point(|&x| x as usize <= t) - 1;
        let q_len = (qst[s + 1] - qst[s]) as usize;
        let pos = ctx[s] as usize - q_len + (t - qst[s] as usize);
        let n = pos + 1;
        let table = &bt[s * maxb..(s + 1) * maxb];
        let slots_from = |j0: usize, out: &mut [usize]| self.offsets(table, kvh, j0, out);
        let qrow = &qs[t * heads * d + kvh * groups * d..t * heads * d + (kvh + 1) * groups * d];
        let need = scratch_len(groups, d);
        if sc.len() < need {
            sc.resize(need, 0.0);
        }
        let (scores, rest) = sc.split_at_mut(groups * KCHUNK);
        let (mx, rest) = rest.split_at_mut(groups);
        let (sum, rest) = rest.split_at_mut(groups);
        let (ks, vs) = rest.split_at_mut(KCHUNK * d);
        mx.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        o.fill(0.0);
        // Online softmax over the keys, KCHUNK at a time (flash-style): rescale the running sum
        // and output when the running max grows.
        let mut j0 = 0;
        let mut next = [0usize; KCHUNK];
        slots_from(0, &mut next[..KCHUNK.min(n)]);
        while j0 < n {
            let jn = KCHUNK.min(n - j0);
            let slots = next;
            // The next chunk's rows live in other cache blocks (no hardware stream finds them):
            // ask for them now, while this chunk computes.
            let nn = KCHUNK.min(n.saturating_sub(j0 + KCHUNK));
            slots_from(j0 + KCHUNK, &mut next[..nn]);
            kc.prefetch_rows(&next[..nn], d);
            vc.prefetch_rows(&next[..nn], d);
            let (kbase, koff) = kc.rows(slots, jn, d, ks);
            for g in 0..groups {
                let sg = &mut scores[g * KCHUNK..g * KCHUNK + jn];
                dots(&qrow[g * d..(g + 1) * d], kbase, &koff, jn, sg);
                for x in sg.iter_mut() {
                    *x *= scale;
                }
            }
            for g in 0..groups {
                let blk_max = scores[g * KCHUNK..g * KCHUNK + jn].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let m_new = mx[g].max(blk_max);
                let corr = exp_f32(mx[g] - m_new);
                if corr != 1.0 {
                    sum[g] *= corr;
                    for a in o[g * d..(g + 1) * d].iter_mut() {
                        *a *= corr;
                    }
                }
                mx[g] = m_new;
                let sg = &mut scores[g * KCHUNK..g * KCHUNK + jn];
                exp_sub_with(isa, sg, m_new);
                // (In a local: through the slice, every addition was also a store.)
                sum[g] = sg.iter().fold(sum[g], |a, x| a + x);
            }
            // o[g] += p[g][j] · v_j for j in order, 16 dimensions at a time held in a register
            // across the chunk's keys (the same additions, in the same order, as key by key).
            let (vbase, voff) = vc.rows(slots, jn, d, vs);
            for g in 0..groups {
                pv(&mut o[g * d..(g + 1) * d], &scores[g * KCHUNK..g * KCHUNK + jn], &voff, vbase);
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

/// out[j] = [`dot`](q, k_j) for j < n, k_j = kbase[koff[j]..][..q.len()]. `x86::dots512` is the
/// same for 16 keys at once.
fn dots(q: &[f32], kbase: &[f32], koff: &[usize; KCHUNK], n: usize, out: &mut [f32]) {
    for (o, &a) in out.iter_mut().zip(&koff[..n]) {
        *o = dot(q, &kbase[a..a + q.len()]);
    }
}

/// o += p[j] · v_j for the chunk's keys j < p.len() in order, v_j = vbase[voff[j]..][..o.len()]:
/// per element the additions of key-by-key accumulation, in its order. `x86::pv512` / `pv256`
/// are the same with the sums held in registers across the keys.
pub(super) fn pv(o: &mut [f32], p: &[f32], voff: &[usize; KCHUNK], vbase: &[f32]) {
    let d = o.len();
    for (&pj, &at) in p.iter().zip(voff) {
        for (a, v) in o.iter_mut().zip(&vbase[at..at + d]) {
            *a += pj * v;
        }
    }
}

/// Σ a[i]·b[i] (each product rounded, then added) in one fixed order: 16 lane sums over
/// i ≡ l (mod 16), halved pairwise (l + 8, then + 4, + 2, + 1), then the tail past the last 16.
/// Written so that it vectorizes without reassociation, so every CPU gives the same bits;
/// `x86::dot256` (and `dots512`, 16 keys at once) are the same order in intrinsics (the compiler vectorizes this
/// loop only 2–4 wide).
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub(super) mod x86 {
    use std::arch::x86_64::*;

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

    /// [`super::dots`] for up to 16 keys at once: each key's 16 lane sums in its own register
    /// (16 independent chains instead of one), then the halving tree of [`super::dot`] run on
    /// all 16 together: lanes l + 8, + 4, + 2, + 1 are the same additions, brought side by side
    /// by shuffles; then each key's tail past the last 16, in order.
    ///
    /// # Safety
    /// The CPU has AVX-512F; every k_j holds q.len() values; out holds n ≤ 16.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn dots512(q: &[f32], kbase: &[f32], koff: &[usize; super::KCHUNK], n: usize, out: &mut [f32]) {
        const _: () = assert!(super::KCHUNK == 16);
        let (d, n) = (q.len(), n.min(16).min(out.len()));
        for &at in &koff[..n] {
            assert!(at + d <= kbase.len(), "dots512: key row out of range");
        }
        let full = d / 16 * 16;
        let (qp, kp) = (q.as_ptr(), kbase.as_ptr());
        let mut l = [_mm512_setzero_ps(); 16];
        for c in (0..full).step_by(16) {
            let qc = _mm512_loadu_ps(qp.add(c));
            for (j, lj) in l.iter_mut().enumerate().take(n) {
                *lj = _mm512_add_ps(*lj, _mm512_mul_ps(qc, _mm512_loadu_ps(kp.add(koff[j] + c))));
            }
        }
        // (Loops, not array::from_fn: a closure does not inherit this function's target
        // features, and its intrinsics would stay out-of-line calls.)
        // Lanes i + 8: keys 2a and 2a + 1 side by side (their 256-bit halves).
        let mut s1 = [_mm512_setzero_ps(); 8];
        for (a, s) in s1.iter_mut().enumerate() {
            let (x, y) = (l[2 * a], l[2 * a + 1]);
            *s = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
        }
        // + 4: keys 4b..4b + 4, one per 128-bit lane.
        let mut s2 = [_mm512_setzero_ps(); 4];
        for (b, s) in s2.iter_mut().enumerate() {
            let (x, y) = (s1[2 * b], s1[2 * b + 1]);
            *s = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y));
        }
        // + 2: in 128-bit lane k, keys 8c + k and 8c + 4 + k, two values each.
        let mut s3 = [_mm512_setzero_ps(); 2];
        for (c, s) in s3.iter_mut().enumerate() {
            let (x, y) = (s2[2 * c], s2[2 * c + 1]);
            *s = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xEE>(x, y));
        }
        // + 1: position 4k + e holds key 4e + k.
        let s4 = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(s3[0], s3[1]), _mm512_shuffle_ps::<0xDD>(s3[0], s3[1]));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let mut r = [0.0f32; 16];
        _mm512_storeu_ps(r.as_mut_ptr(), _mm512_permutexvar_ps(idx, s4));
        for (j, o) in out.iter_mut().enumerate().take(n) {
            let k = &kbase[koff[j]..koff[j] + d];
            *o = q[full..].iter().zip(&k[full..]).fold(r[j], |s, (x, y)| s + x * y);
        }
    }

    /// [`super::pv`]: 64 (then 16) dimensions of o in 4 (1) zmm registers across the keys.
    ///
    /// # Safety
    /// The CPU has AVX-512F; every v_j holds o.len() values.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn pv512(o: &mut [f32], p: &[f32], voff: &[usize; super::KCHUNK], vbase: &[f32]) {
        let (d, n) = (o.len(), p.len().min(super::KCHUNK));
        for &at in &voff[..n] {
            assert!(at + d <= vbase.len(), "pv512: value row out of range");
        }
        let (op, vp) = (o.as_mut_ptr(), vbase.as_ptr());
        let mut b = 0;
        while b + 64 <= d {
            let mut acc = [_mm512_setzero_ps(); 4];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(op.add(b + 16 * i));
            }
            for j in 0..n {
                let pj = _mm512_set1_ps(p[j]);
                let v = vp.add(voff[j] + b);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(pj, _mm512_loadu_ps(v.add(16 * i))));
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(b + 16 * i), *a);
            }
            b += 64;
        }
        while b + 16 <= d {
            let mut a = _mm512_loadu_ps(op.add(b));
            for j in 0..n {
                a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vp.add(voff[j] + b))));
            }
            _mm512_storeu_ps(op.add(b), a);
            b += 16;
        }
        for (i, a) in o.iter_mut().enumerate().skip(b) {
            for j in 0..n {
                *a += p[j] * vbase[voff[j] + i];
            }
        }
    }

    /// [`super::pv`] with 8 ymm registers (64 dimensions), then 1 (8), then scalars.
    ///
    /// # Safety
    /// The CPU has AVX2; every v_j holds o.len() values.
    #[target_feature(enable = "avx2")]
    pub unsafe fn pv256(o: &mut [f32], p: &[f32], voff: &[usize; super::KCHUNK], vbase: &[f32]) {
        let (d, n) = (o.len(), p.len().min(super::KCHUNK));
        for &at in &voff[..n] {
            assert!(at + d <= vbase.len(), "pv256: value row out of range");
        }
        let (op, vp) = (o.as_mut_ptr(), vbase.as_ptr());
        let mut b = 0;
        while b + 64 <= d {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(op.add(b + 8 * i));
            }
            for j in 0..n {
                let pj = _mm256_set1_ps(p[j]);
                let v = vp.add(voff[j] + b);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(pj, _mm256_loadu_ps(v.add(8 * i))));
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(op.add(b + 8 * i), *a);
            }
            b += 64;
        }
        while b + 8 <= d {
            let mut a = _mm256_loadu_ps(op.add(b));
            for j in 0..n {
                a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vp.add(voff[j] + b))));
            }
            _mm256_storeu_ps(op.add(b), a);
            b += 8;
        }
        for (i, a) in o.iter_mut().enumerate().skip(b) {
            for j in 0..n {
                *a += p[j] * vbase[voff[j] + i];
            }
        }
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
    /// A hint to bring the rows of `d` values at offsets `at` into L2 (never faults; no-op off
    /// x86).
    #[inline(always)]
    fn prefetch_rows(&self, at: &[usize], d: usize) {
        let (bytes, size): (&[u8], usize) = match self {
            Kv::F32(v) => (bytemuck::cast_slice(v), 4),
            Kv::BF16(v) => (bytemuck::cast_slice(v), 2),
            Kv::F16(v) => (bytemuck::cast_slice(v), 2),
            Kv::Fp8(v, ..) => (v, 1),
        };
        #[cfg(target_arch = "x86_64")]
        for &a in at {
            let (start, end) = ((a * size).min(bytes.len()), ((a + d) * size).min(bytes.len()));
            for line in (start..end).step_by(64) {
                // SAFETY: a prefetch is a hint that cannot fault; the address is inside `bytes`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        bytes.as_ptr().add(line) as *const i8
                    )
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (bytes, at, d);
    }

    /// The `n` rows (of `d` values) at offsets `at` as f32: (values, each row's offset in them)
    /// — the cache itself when it is f32, else decoded into `out` (n × d).
    #[inline(always)]
    fn rows<'s>(&'s self, at: [usize; KCHUNK], n: usize, d: usize, out: &'s mut [f32]) -> (&'s [f32], [usize; KCHUNK]) {
        if let Kv::F32(v) = self {
            return (v, at);
        }
        for (j, &a) in at.iter().enumerate().take(n) {
            self.row(a, &mut out[j * d..(j + 1) * d]);
        }
        (out, std::array::from_fn(|j| j * d))
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
