//! Causal grouped-query attention over packed sequences (rows cu[b]..cu[b+1] are sequence b),
//! forward saving the log-sum-exp of every (row, head), and the backward that recomputes the
//! probabilities from it (the flash-attention backward):
//! P_ij = exp(s·q_i·k_j − lse_i) for j ≤ i; O_i = Σ_j P_ij v_j;
//! dV = Pᵀ dO; dS_ij = P_ij (dO_i·v_j − dO_i·O_i); dQ = s·dS K; dK = s·dSᵀ Q.
//! Query head h reads KV head h / (H / Hkv); s = 1/√D.
//!
//! Work is one task per (sequence, KV head): the G query heads sharing that KV head are stacked
//! row-major as (token, head) so that a block of QB query tokens is one contiguous matrix, and
//! every product is a GEMM (QB·G × keys) over the causal prefix of the block.

use crate::ops::linear::grad::serial;
use crate::ops::real::Real;
use rayon::prelude::*;

pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Query tokens per block (bounds the score matrix to QB·G × sequence length).
const QB: usize = 128;

/// Copies the G heads of KV head `kh` of rows r0..r0+n from x (rows, heads·D) into (n·G, D).
fn gather<T: Real>(x: &[T], heads: usize, d: usize, r0: usize, n: usize, h0: usize, g: usize, out: &mut [T]) {
    for i in 0..n {
        let src = &x[(r0 + i) * heads * d + h0 * d..(r0 + i) * heads * d + (h0 + g) * d];
        out[i * g * d..(i + 1) * g * d].copy_from_slice(src);
    }
}

fn scatter<T: Real>(y: &mut [T], heads: usize, d: usize, r0: usize, n: usize, h0: usize, g: usize, src: &[T]) {
    for i in 0..n {
        y[(r0 + i) * heads * d + h0 * d..(r0 + i) * heads * d + (h0 + g) * d]
            .copy_from_slice(&src[i * g * d..(i + 1) * g * d]);
    }
}

/// Tasks (sequence, KV head).
fn tasks(cu: &[usize], hkv: usize) -> Vec<(usize, usize)> {
    (0..cu.len() - 1).flat_map(|b| (0..hkv).map(move |kh| (b, kh))).collect()
}

/// out (T, H·D), lse (T, H) from q (T, H·D), k, v (T, Hkv·D).
pub fn fwd<T: Real>(s: &Shape, cu: &[usize], q: &[T], k: &[T], v: &[T], out: &mut [T], lse: &mut [T]) {
    let (h, hkv, d) = (s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let scale = T::one() / T::from_usize(d).sqrt();
    let results: Vec<(usize, usize, Vec<T>, Vec<T>)> = tasks(cu, hkv)
        .par_iter()
        .map(|&(b, kh)| {
            let (r0, n) = (cu[b], cu[b + 1] - cu[b]);
            let mut qg = vec![T::zero(); n * g * d];
            let (mut kk, mut vv) = (vec![T::zero(); n * d], vec![T::zero(); n * d]);
            gather(q, h, d, r0, n, kh * g, g, &mut qg);
            gather(k, hkv, d, r0, n, kh, 1, &mut kk);
            gather(v, hkv, d, r0, n, kh, 1, &mut vv);
            let mut o = vec![T::zero(); n * g * d];
            let mut l = vec![T::zero(); n * g];
            let mut sc = vec![T::zero(); QB.min(n) * g * n];
            let mut i0 = 0;
            while i0 < n {
                let i1 = (i0 + QB).min(n);
                let (rows, keys) = ((i1 - i0) * g, i1);
                let sb = &mut sc[..rows * keys];
                serial::nt(rows, keys, d, &qg[i0 * g * d..i1 * g * d], &kk[..keys * d], sb, false);
                for (r, row) in sb.chunks_exact_mut(keys).enumerate() {
                    let i = i0 + r / g;
                    let mut mx = T::neg_infinity();
                    for x in row[..=i].iter_mut() {
                        *x *= scale;
                        mx = mx.max(*x);
                    }
                    let mut sum = T::zero();
                    for x in row[..=i].iter_mut() {
                        *x = (*x - mx).exp();
                        sum += *x;
                    }
                    let inv = T::one() / sum;
                    for x in row[..=i].iter_mut() {
                        *x *= inv;
                    }
                    row[i + 1..].fill(T::zero());
                    l[i0 * g + r] = mx + sum.ln();
                }
                serial::nn(rows, keys, d, sb, &vv[..keys * d], &mut o[i0 * g * d..i1 * g * d], false);
                i0 = i1;
            }
            (b, kh, o, l)
        })
        .collect();
    for (b, kh, o, l) in results {
        let (r0, n) = (cu[b], cu[b + 1] - cu[b]);
        scatter(out, h, d, r0, n, kh * g, g, &o);
        for i in 0..n {
            lse[(r0 + i) * h + kh * g..(r0 + i) * h + (kh + 1) * g].copy_from_slice(&l[i * g..(i + 1) * g]);
        }
    }
}

/// dq (T, H·D), dk, dv (T, Hkv·D) (overwritten) from dout (T, H·D) and the forward's tensors.
#[allow(clippy::too_many_arguments)]
pub fn bwd<T: Real>(
    s: &Shape,
    cu: &[usize],
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    lse: &[T],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let (h, hkv, d) = (s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let scale = T::one() / T::from_usize(d).sqrt();
    type Grads<T> = (usize, usize, Vec<T>, Vec<T>, Vec<T>);
    let results: Vec<Grads<T>> = tasks(cu, hkv)
        .par_iter()
        .map(|&(b, kh)| {
            let (r0, n) = (cu[b], cu[b + 1] - cu[b]);
            let mut qg = vec![T::zero(); n * g * d];
            let mut og = vec![T::zero(); n * g * d];
            let mut dog = vec![T::zero(); n * g * d];
            let (mut kk, mut vv) = (vec![T::zero(); n * d], vec![T::zero(); n * d]);
            gather(q, h, d, r0, n, kh * g, g, &mut qg);
            gather(out, h, d, r0, n, kh * g, g, &mut og);
            gather(dout, h, d, r0, n, kh * g, g, &mut dog);
            gather(k, hkv, d, r0, n, kh, 1, &mut kk);
            gather(v, hkv, d, r0, n, kh, 1, &mut vv);
            let mut l = vec![T::zero(); n * g];
            for i in 0..n {
                l[i * g..(i + 1) * g].copy_from_slice(&lse[(r0 + i) * h + kh * g..(r0 + i) * h + (kh + 1) * g]);
            }
            let (mut gq, mut gk, mut gv) = (vec![T::zero(); n * g * d], vec![T::zero(); n * d], vec![T::zero(); n * d]);
            let cap = QB.min(n) * g * n;
            let (mut p, mut dp) = (vec![T::zero(); cap], vec![T::zero(); cap]);
            let mut i0 = 0;
            while i0 < n {
                let i1 = (i0 + QB).min(n);
                let (rows, keys) = ((i1 - i0) * g, i1);
                let (qb, ob, dob) =
                    (&qg[i0 * g * d..i1 * g * d], &og[i0 * g * d..i1 * g * d], &dog[i0 * g * d..i1 * g * d]);
                let (pb, dpb) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                serial::nt(rows, keys, d, qb, &kk[..keys * d], pb, false);
                for (r, row) in pb.chunks_exact_mut(keys).enumerate() {
                    let i = i0 + r / g;
                    let li = l[i0 * g + r];
                    for x in row[..=i].iter_mut() {
                        *x = (*x * scale - li).exp();
                    }
                    row[i + 1..].fill(T::zero());
                }
                // dV += Pᵀ dO
                serial::tn(rows, keys, d, pb, dob, &mut gv[..keys * d], true);
                // dP = dO Vᵀ; dS = P (dP − rowsum(dO ∘ O)) · s
                serial::nt(rows, keys, d, dob, &vv[..keys * d], dpb, false);
                for r in 0..rows {
                    let di: T = dob[r * d..(r + 1) * d].iter().zip(&ob[r * d..(r + 1) * d]).map(|(&a, &b)| a * b).sum();
                    for (ds, &pp) in dpb[r * keys..(r + 1) * keys].iter_mut().zip(&pb[r * keys..(r + 1) * keys]) {
                        *ds = pp * (*ds - di) * scale;
                    }
                }
                // dQ = dS K; dK += dSᵀ Q
                serial::nn(rows, keys, d, dpb, &kk[..keys * d], &mut gq[i0 * g * d..i1 * g * d], false);
                serial::tn(rows, keys, d, dpb, qb, &mut gk[..keys * d], true);
                i0 = i1;
            }
            (b, kh, gq, gk, gv)
        })
        .collect();
    for (b, kh, gq, gk, gv) in results {
        let (r0, n) = (cu[b], cu[b + 1] - cu[b]);
        scatter(dq, h, d, r0, n, kh * g, g, &gq);
        scatter(dk, hkv, d, r0, n, kh, 1, &gk);
        scatter(dv, hkv, d, r0, n, kh, 1, &gv);
    }
}
