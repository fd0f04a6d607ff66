//! Causal grouped-query attention over packed sequences (rows cu[b]..cu[b+1] are sequence b),
//! forward saving the log-sum-exp of every (row, head), and the backward that recomputes the
//! probabilities from it (the flash-attention backward, without the tiling):
//! P_ij = exp(q_i·k_j·s − lse_i) for j ≤ i; O_i = Σ_j P_ij v_j;
//! dV_j = Σ_i P_ij dO_i; dS_ij = P_ij (dO_i·v_j − dO_i·O_i); dQ_i = s Σ_j dS_ij k_j; dK_j = s Σ_i dS_ij q_i.
//! Query head h reads KV head h / (H / Hkv). s = 1/√D.

use super::Real;
use rayon::prelude::*;

pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// out (T, H·D), lse (T, H) from q (T, H·D), k, v (T, Hkv·D).
pub fn fwd<T: Real>(s: &Shape, cu: &[usize], q: &[T], k: &[T], v: &[T], out: &mut [T], lse: &mut [T]) {
    let (h, hkv, d) = (s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let scale = T::one() / T::from_usize(d).sqrt();
    let tasks: Vec<(usize, usize)> = (0..cu.len() - 1).flat_map(|b| (0..hkv).map(move |kh| (b, kh))).collect();
    let results: Vec<(usize, usize, Vec<T>, Vec<T>)> = tasks
        .par_iter()
        .map(|&(b, kh)| {
            let (r0, r1) = (cu[b], cu[b + 1]);
            let n = r1 - r0;
            let mut o = vec![T::zero(); n * g * d];
            let mut l = vec![T::zero(); n * g];
            let mut sc = vec![T::zero(); n];
            for i in 0..n {
                for gi in 0..g {
                    let hh = kh * g + gi;
                    let qi = &q[(r0 + i) * h * d + hh * d..(r0 + i) * h * d + (hh + 1) * d];
                    let mut mx = T::neg_infinity();
                    for j in 0..=i {
                        let kj = &k[(r0 + j) * hkv * d + kh * d..(r0 + j) * hkv * d + (kh + 1) * d];
                        sc[j] = dot(qi, kj) * scale;
                        mx = mx.max(sc[j]);
                    }
                    let mut sum = T::zero();
                    for x in sc[..=i].iter_mut() {
                        *x = (*x - mx).exp();
                        sum += *x;
                    }
                    let oi = &mut o[(i * g + gi) * d..(i * g + gi + 1) * d];
                    for j in 0..=i {
                        let p = sc[j] / sum;
                        let vj = &v[(r0 + j) * hkv * d + kh * d..(r0 + j) * hkv * d + (kh + 1) * d];
                        for (a, &bv) in oi.iter_mut().zip(vj) {
                            *a += p * bv;
                        }
                    }
                    l[i * g + gi] = mx + sum.ln();
                }
            }
            (b, kh, o, l)
        })
        .collect();
    for (b, kh, o, l) in results {
        for i in 0..cu[b + 1] - cu[b] {
            let row = cu[b] + i;
            for gi in 0..g {
                let hh = kh * g + gi;
                out[row * h * d + hh * d..row * h * d + (hh + 1) * d].copy_from_slice(&o[(i * g + gi) * d..(i * g + gi + 1) * d]);
                lse[row * h + hh] = l[i * g + gi];
            }
        }
    }
}

/// dq (T, H·D), dk, dv (T, Hkv·D) (overwritten) from dout (T, H·D) and the forward's tensors.
#[allow(clippy::too_many_arguments)]
pub fn bwd<T: Real>(s: &Shape, cu: &[usize], q: &[T], k: &[T], v: &[T], out: &[T], lse: &[T], dout: &[T], dq: &mut [T], dk: &mut [T], dv: &mut [T]) {
    let (h, hkv, d) = (s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let scale = T::one() / T::from_usize(d).sqrt();
    let tasks: Vec<(usize, usize)> = (0..cu.len() - 1).flat_map(|b| (0..hkv).map(move |kh| (b, kh))).collect();
    let results: Vec<(usize, usize, Vec<T>, Vec<T>, Vec<T>)> = tasks
        .par_iter()
        .map(|&(b, kh)| {
            let (r0, r1) = (cu[b], cu[b + 1]);
            let n = r1 - r0;
            let mut gq = vec![T::zero(); n * g * d];
            let mut gk = vec![T::zero(); n * d];
            let mut gv = vec![T::zero(); n * d];
            let krow = |j: usize| &k[(r0 + j) * hkv * d + kh * d..(r0 + j) * hkv * d + (kh + 1) * d];
            let vrow = |j: usize| &v[(r0 + j) * hkv * d + kh * d..(r0 + j) * hkv * d + (kh + 1) * d];
            for i in 0..n {
                for gi in 0..g {
                    let hh = kh * g + gi;
                    let at = (r0 + i) * h * d + hh * d;
                    let (qi, oi, doi) = (&q[at..at + d], &out[at..at + d], &dout[at..at + d]);
                    let l = lse[(r0 + i) * h + hh];
                    let di = dot(doi, oi);
                    for j in 0..=i {
                        let p = (dot(qi, krow(j)) * scale - l).exp();
                        let dp = dot(doi, vrow(j));
                        let ds = p * (dp - di) * scale;
                        let gqi = &mut gq[(i * g + gi) * d..(i * g + gi + 1) * d];
                        for (a, &kk) in gqi.iter_mut().zip(krow(j)) {
                            *a += ds * kk;
                        }
                        for (a, &qq) in gk[j * d..(j + 1) * d].iter_mut().zip(qi) {
                            *a += ds * qq;
                        }
                        for (a, &oo) in gv[j * d..(j + 1) * d].iter_mut().zip(doi) {
                            *a += p * oo;
                        }
                    }
                }
            }
            (b, kh, gq, gk, gv)
        })
        .collect();
    for (b, kh, gq, gk, gv) in results {
        for i in 0..cu[b + 1] - cu[b] {
            let row = cu[b] + i;
            for gi in 0..g {
                let hh = kh * g + gi;
                dq[row * h * d + hh * d..row * h * d + (hh + 1) * d].copy_from_slice(&gq[(i * g + gi) * d..(i * g + gi + 1) * d]);
            }
            dk[row * hkv * d + kh * d..row * hkv * d + (kh + 1) * d].copy_from_slice(&gk[i * d..(i + 1) * d]);
            dv[row * hkv * d + kh * d..row * hkv * d + (kh + 1) * d].copy_from_slice(&gv[i * d..(i + 1) * d]);
        }
    }
}
