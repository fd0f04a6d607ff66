//! RoPE (HF rotate_half) on (rows, heads·D), in place: forward rotates by +angle, backward by
//! −angle (the transpose of a rotation). cos/sin: (rows, D/2).

use crate::ops::{real::Real, rows_per_task};
use rayon::prelude::*;

fn rotate<T: Real>(rows: usize, heads: usize, d: usize, x: &mut [T], cos: &[T], sin: &[T], sign: T) {
    let half = d / 2;
    x[..rows * heads * d].par_chunks_mut(heads * d).enumerate().with_min_len(rows_per_task(heads * d)).for_each(
        |(t, row)| {
            let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            for h in row.chunks_exact_mut(d) {
                let (lo, hi) = h.split_at_mut(half);
                for i in 0..half {
                    let (a, b, si) = (lo[i], hi[i], sign * s[i]);
                    lo[i] = a * c[i] - b * si;
                    hi[i] = b * c[i] + a * si;
                }
            }
        },
    );
}

pub fn fwd<T: Real>(rows: usize, heads: usize, d: usize, x: &mut [T], cos: &[T], sin: &[T]) {
    rotate(rows, heads, d, x, cos, sin, T::one())
}

pub fn bwd<T: Real>(rows: usize, heads: usize, d: usize, dx: &mut [T], cos: &[T], sin: &[T]) {
    rotate(rows, heads, d, dx, cos, sin, -T::one())
}

/// cos/sin (rows, D/2) of angle = position · inv_freq, the angle rounded to f32 first (as
/// transformers computes it), then cos/sin in f64.
pub fn table<T: Real>(positions: &[u32], inv_freq: &[f32], cos: &mut [T], sin: &mut [T]) {
    let half = inv_freq.len();
    for (t, &p) in positions.iter().enumerate() {
        for i in 0..half {
            let a = (p as f32 * inv_freq[i]) as f64;
            cos[t * half + i] = T::from_f64(a.cos());
            sin[t * half + i] = T::from_f64(a.sin());
        }
    }
}
