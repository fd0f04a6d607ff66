//! The CPU twins of the row-wise ops (the reference of csrc/kernels/elementwise.cu): one rayon
//! task per block of rows. `super` checks the shapes.

use crate::device::{CpuDevice, CpuFloats, Tensor};
use crate::ops::{isa::Isa, rows_per_task, vecmath};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// out[..m] (m, C) = table[ids[i]]; an id outside the vocabulary is an error.
pub fn embedding(d: &CpuDevice, table: &Tensor, ids: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    let (v, c) = (table.dim(0), table.dim(1));
    let (tf, is, os) = (CpuFloats::of(table)?, ids.u32s()?, out.f32s_mut()?);
    if let Some(bad) = is[..m].iter().find(|&&i| i as usize >= v) {
        bail!("token id {bad} is out of the vocabulary (size {v})");
    }
    d.install(|| {
        os[..m * c].par_chunks_mut(c).zip(is[..m].par_iter()).with_min_len(rows_per_task(c)).for_each(|(o, &i)| {
            tf.read_into(i as usize * c, o);
        })
    });
    Ok(())
}

/// out[..m] (m, I) = silu(gate) ⊙ up.
pub fn swiglu(d: &CpuDevice, gate: &Tensor, up: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    let i = gate.dim(gate.shape().len() - 1);
    let (g, u, o, isa) = (gate.f32s()?, up.f32s()?, out.f32s_mut()?, Isa::detect());
    d.install(|| {
        o[..m * i]
            .par_chunks_mut(i)
            .zip(g[..m * i].par_chunks(i).zip(u[..m * i].par_chunks(i)))
            .with_min_len(rows_per_task(i))
            .for_each(|(o, (g, u))| vecmath::silu_mul_with(isa, g, u, o))
    });
    Ok(())
}

/// dst[..r] (r, C) = src[idx[i]]; an index outside src is an error.
pub fn gather_rows(d: &CpuDevice, src: &Tensor, idx: &Tensor, dst: &mut Tensor, r: usize) -> Result<()> {
    let c = src.dim(src.shape().len() - 1);
    let (s, is, o) = (src.f32s()?, idx.u32s()?, dst.f32s_mut()?);
    let n = s.len() / c;
    if let Some(bad) = is[..r].iter().find(|&&i| i as usize >= n) {
        bail!("gather_rows: row {bad} out of range ({n} rows)");
    }
    d.install(|| {
        o[..r * c].par_chunks_mut(c).zip(is[..r].par_iter()).for_each(|(o, &i)| {
            o.copy_from_slice(&s[i as usize * c..(i as usize + 1) * c]);
        })
    });
    Ok(())
}

/// max |x| over the first m rows, propagating NaN.
pub fn amax_rows(d: &CpuDevice, x: &Tensor, m: usize) -> Result<f32> {
    let c = x.dim(x.shape().len() - 1);
    let xs = &x.f32s()?[..m * c];
    Ok(d.install(|| {
        xs.par_chunks(4096)
            .map(|ch| ch.iter().fold(0.0f32, |a, v| if v.is_nan() || a.is_nan() { f32::NAN } else { a.max(v.abs()) }))
            .reduce(|| 0.0f32, |a, b| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) })
    }))
}
