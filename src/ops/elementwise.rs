//! Row-wise data movement and activations: embedding lookup, SwiGLU, row gather.

use super::{check_rows, rows_per_task, softmax_cpu};
use crate::device::{cuda, CpuFloats, Device, Tensor};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// out[..m] (m, C) = table[ids[i]] for table (V, C), ids (m) u32. Ids are validated by callers
/// (token ids out of vocabulary are rejected at input parsing); an out-of-range id here is an error.
pub fn embedding(dev: &Device, table: &Tensor, ids: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    let (v, c) = (table.dim(0), table.dim(1));
    check_rows(out, m, c, "embedding output")?;
    match dev {
        Device::Cpu(d) => {
            let (tf, is, os) = (CpuFloats::of(table)?, ids.u32s()?, out.f32s_mut()?);
            if let Some(bad) = is[..m].iter().find(|&&i| i as usize >= v) {
                bail!("token id {bad} is out of the vocabulary (size {v})");
            }
            d.install(|| {
                os[..m * c].par_chunks_mut(c).zip(is[..m].par_iter()).with_min_len(rows_per_task(c)).for_each(
                    |(o, &i)| {
                        tf.read_into(i as usize * c, o);
                    },
                )
            });
            Ok(())
        }
        Device::Cuda(d) => cuda::ops::embedding(d, table, ids, out, m),
    }
}

/// out[..m] (m, I) = silu(gate) ⊙ up, silu(g) = g / (1 + exp(−g)) with the crate's own exp
/// (`softmax_cpu::silu`: the same bits on every ISA and C library).
pub fn swiglu(dev: &Device, gate: &Tensor, up: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    let i = gate.dim(gate.shape().len() - 1);
    check_rows(up, m, i, "swiglu up")?;
    check_rows(out, m, i, "swiglu output")?;
    match dev {
        Device::Cpu(d) => {
            let (g, u, o, isa) = (gate.f32s()?, up.f32s()?, out.f32s_mut()?, super::isa::Isa::detect());
            d.install(|| {
                o[..m * i]
                    .par_chunks_mut(i)
                    .zip(g[..m * i].par_chunks(i).zip(u[..m * i].par_chunks(i)))
                    .with_min_len(rows_per_task(i))
                    .for_each(|(o, (g, u))| softmax_cpu::silu_mul_with(isa, g, u, o))
            });
            Ok(())
        }
        Device::Cuda(d) => cuda::ops::swiglu(d, gate, up, out, m),
    }
}


/// dst[..r] (r, C) = src[idx[i]] for idx (r) u32 rows of src (n, C).
pub fn gather_rows(dev: &Device, src: &Tensor, idx: &Tensor, dst: &mut Tensor, r: usize) -> Result<()> {
    let c = src.dim(src.shape().len() - 1);
    check_rows(dst, r, c, "gather_rows output")?;
    match dev {
        Device::Cpu(d) => {
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
        Device::Cuda(d) => cuda::ops::gather_rows(d, src, idx, dst, r),
    }
}

/// max |x| over the first m rows of x (rows, C), propagating NaN.
pub fn amax_rows(dev: &Device, x: &Tensor, m: usize) -> Result<f32> {
    let c = x.dim(x.shape().len() - 1);
    check_rows(x, m, c, "amax input")?;
    match dev {
        Device::Cpu(d) => {
            let xs = &x.f32s()?[..m * c];
            Ok(d.install(|| {
                xs.par_chunks(4096)
                    .map(|ch| ch.iter().fold(0.0f32, |a, v| if v.is_nan() || a.is_nan() { f32::NAN } else { a.max(v.abs()) }))
                    .reduce(|| 0.0f32, |a, b| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) })
            }))
        }
        Device::Cuda(d) => cuda::ops::amax_rows(d, x, m),
    }
}
