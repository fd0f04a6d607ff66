//! SwiGLU, the embedding lookup and the residual stream, forward and backward.
//! a = silu(g)·u, silu(g) = g·σ(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g))).

use crate::ops::{real::Real, rows_per_task};
use rayon::prelude::*;

#[inline]
fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// a (n) = silu(g) · u.
pub fn swiglu_fwd<T: Real>(g: &[T], u: &[T], a: &mut [T]) {
    a.par_iter_mut().zip(g.par_iter().zip(u)).with_min_len(4096).for_each(|(o, (&g, &u))| {
        *o = g * sigmoid(g) * u;
    });
}

/// dg, du (n) from da (n).
pub fn swiglu_bwd<T: Real>(da: &[T], g: &[T], u: &[T], dg: &mut [T], du: &mut [T]) {
    dg.par_iter_mut().zip(du.par_iter_mut()).enumerate().with_min_len(4096).for_each(|(i, (dgi, dui))| {
        let s = sigmoid(g[i]);
        let silu = g[i] * s;
        *dui = da[i] * silu;
        *dgi = da[i] * u[i] * s * (T::one() + g[i] * (T::one() - s));
    });
}

/// x (rows, C) = table[ids].
pub fn embed_fwd<T: Real>(c: usize, ids: &[u32], table: &[T], x: &mut [T]) {
    x[..ids.len() * c].par_chunks_mut(c).zip(ids.par_iter()).with_min_len(rows_per_task(c)).for_each(|(r, &i)| {
        r.copy_from_slice(&table[i as usize * c..(i as usize + 1) * c]);
    });
}

/// dtable[ids[t]] += dx[t], rows in order (deterministic). Lookups of `skip` (the padding
/// index, as nn.Embedding(padding_idx) does) contribute nothing.
pub fn embed_bwd<T: Real>(c: usize, ids: &[u32], dx: &[T], dtable: &mut [T], skip: Option<u32>) {
    for (t, &i) in ids.iter().enumerate() {
        if Some(i) == skip {
            continue;
        }
        let dst = &mut dtable[i as usize * c..(i as usize + 1) * c];
        for (a, b) in dst.iter_mut().zip(&dx[t * c..(t + 1) * c]) {
            *a += *b;
        }
    }
}

/// y = a + b, elementwise.
pub fn add<T: Real>(a: &[T], b: &[T], y: &mut [T]) {
    y.par_iter_mut().zip(a.par_iter().zip(b)).with_min_len(4096).for_each(|(o, (&x, &z))| *o = x + z);
}

/// y += a, elementwise.
pub fn add_into<T: Real>(y: &mut [T], a: &[T]) {
    y.par_iter_mut().zip(a.par_iter()).with_min_len(4096).for_each(|(o, &x)| *o += x);
}
