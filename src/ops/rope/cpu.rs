//! Rotary embeddings' CPU twin (the reference of csrc/kernels/rope.cu): the angle in f32, cos
//! and sin in f64, the rotation in f32 without FMA. `super` checks the shapes.

use crate::device::{CpuDevice, Tensor};
use crate::ops::rows_per_task;
use anyhow::Result;
use rayon::prelude::*;

/// cos/sin (m, D/2) for the m positions (u32) with inv_freq (D/2, f32).
pub fn rope_table(
    d: &CpuDevice,
    positions: &Tensor,
    inv_freq: &Tensor,
    cos: &mut Tensor,
    sin: &mut Tensor,
    m: usize,
) -> Result<()> {
    let half = inv_freq.numel();
    let (pos, f) = (positions.u32s()?, inv_freq.f32s()?);
    let (cs, ss) = (cos.f32s_mut()?, sin.f32s_mut()?);
    d.install(|| {
        cs[..m * half]
            .par_chunks_mut(half)
            .zip(ss[..m * half].par_chunks_mut(half))
            .zip(pos[..m].par_iter())
            .with_min_len(rows_per_task(half))
            .for_each(|((c, s), &p)| {
                for i in 0..half {
                    let a = (p as f32 * f[i]) as f64;
                    c[i] = a.cos() as f32;
                    s[i] = a.sin() as f32;
                }
            })
    });
    Ok(())
}

/// Rotates x[..m] (m, heads·D) in place.
pub fn rope(dv: &CpuDevice, x: &mut Tensor, cos: &Tensor, sin: &Tensor, m: usize, heads: usize) -> Result<()> {
    let half = cos.dim(cos.shape().len() - 1);
    let d = 2 * half;
    let (xs, cs, ss) = (x.f32s_mut()?, cos.f32s()?, sin.f32s()?);
    dv.install(|| {
        xs[..m * heads * d].par_chunks_mut(heads * d).enumerate().with_min_len(rows_per_task(heads * d)).for_each(
            |(t, row)| {
                let (c, s) = (&cs[t * half..(t + 1) * half], &ss[t * half..(t + 1) * half]);
                for h in row.chunks_exact_mut(d) {
                    let (lo, hi) = h.split_at_mut(half);
                    for i in 0..half {
                        let (a, b) = (lo[i], hi[i]);
                        lo[i] = a * c[i] - b * s[i];
                        hi[i] = b * c[i] + a * s[i];
                    }
                }
            },
        )
    });
    Ok(())
}
