//! Row-wise data movement and activations: embedding lookup, SwiGLU, row gather, max |x|.
//!
//! Owns: the public signatures, their checks and the dispatch; the CPU twin (`cpu.rs`), the
//! CUDA twin (`cuda.rs`, kernels csrc/kernels/elementwise.cu and quantize.cu's ct_amax), the
//! training twin (`grad.rs`: SwiGLU, embedding, adds). May call: `crate::device`. Must not:
//! allocate.

mod cpu;
mod cuda;
pub mod grad;
#[cfg(test)]
mod tests;

pub use cuda::fill_normal;

use super::check_rows;
use crate::device::{Device, Tensor};
use anyhow::Result;

/// out[..m] (m, C) = table[ids[i]] for table (V, C), ids (m) u32. Ids are validated by callers
/// (token ids out of vocabulary are rejected at input parsing); an out-of-range id here is an error.
pub fn embedding(dev: &Device, table: &Tensor, ids: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    check_rows(out, m, table.dim(1), "embedding output")?;
    match dev {
        Device::Cpu(d) => cpu::embedding(d, table, ids, out, m),
        Device::Cuda(d) => cuda::embedding(d, table, ids, out, m),
    }
}

/// out[..m] (m, I) = silu(gate) ⊙ up, silu(g) = g / (1 + exp(−g)) with the crate's own exp
/// (`vecmath::silu`: the same bits on every ISA and C library).
pub fn swiglu(dev: &Device, gate: &Tensor, up: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    let i = gate.dim(gate.shape().len() - 1);
    check_rows(up, m, i, "swiglu up")?;
    check_rows(out, m, i, "swiglu output")?;
    match dev {
        Device::Cpu(d) => cpu::swiglu(d, gate, up, out, m),
        Device::Cuda(d) => cuda::swiglu(d, gate, up, out, m),
    }
}

/// dst[..r] (r, C) = src[idx[i]] for idx (r) u32 rows of src (n, C).
pub fn gather_rows(dev: &Device, src: &Tensor, idx: &Tensor, dst: &mut Tensor, r: usize) -> Result<()> {
    let c = src.dim(src.shape().len() - 1);
    check_rows(dst, r, c, "gather_rows output")?;
    match dev {
        Device::Cpu(d) => cpu::gather_rows(d, src, idx, dst, r),
        Device::Cuda(d) => cuda::gather_rows(d, src, idx, dst, r),
    }
}

/// max |x| over the first m rows of x (rows, C), propagating NaN.
pub fn amax_rows(dev: &Device, x: &Tensor, m: usize) -> Result<f32> {
    let c = x.dim(x.shape().len() - 1);
    check_rows(x, m, c, "amax input")?;
    match dev {
        Device::Cpu(d) => cpu::amax_rows(d, x, m),
        Device::Cuda(d) => cuda::amax_rows(d, x, m),
    }
}

/// SwiGLU backward over whole tensors: dg, du from da, the gate g and the up projection u.
/// dg and du are f32, or on CUDA both BF16: the values rounded as the BF16 GEMMs of the gate
/// and up projections' gradients round them (nothing else may read them then).
pub fn swiglu_bwd(dev: &Device, da: &Tensor, g: &Tensor, u: &Tensor, dg: &mut Tensor, du: &mut Tensor) -> Result<()> {
    let n = da.numel();
    if [g.numel(), u.numel(), dg.numel(), du.numel()].iter().any(|&x| x != n) {
        anyhow::bail!("swiglu backward: tensors of {n} values expected");
    }
    if dg.dtype() != du.dtype() {
        anyhow::bail!("swiglu backward: gradients of dtypes {} and {}", dg.dtype().name(), du.dtype().name());
    }
    match dev {
        Device::Cpu(_) => {
            grad::swiglu_bwd(da.f32s()?, g.f32s()?, u.f32s()?, dg.f32s_mut()?, du.f32s_mut()?);
            Ok(())
        }
        Device::Cuda(d) => cuda::swiglu_bwd(d, da, g, u, dg, du),
    }
}

/// Embedding backward: dtable[ids[t]] += dx[t] (t < tokens, in order: deterministic with
/// repeated ids), lookups of `skip` (a padding index) contributing nothing. dtable (V, C) f32.
pub fn embed_bwd(
    dev: &Device,
    ids: &Tensor,
    dx: &Tensor,
    dtable: &mut Tensor,
    tokens: usize,
    skip: Option<u32>,
) -> Result<()> {
    let c = dtable.dim(1);
    check_rows(dx, tokens, c, "embedding output gradient")?;
    match dev {
        Device::Cpu(_) => {
            let (idv, v) = (&ids.u32s()?[..tokens], dtable.dim(0));
            if let Some(&bad) = idv.iter().find(|&&i| i as usize >= v && Some(i) != skip) {
                anyhow::bail!("embedding backward: token id {bad} outside the vocabulary of {v}");
            }
            grad::embed_bwd(c, idv, dx.f32s()?, dtable.f32s_mut()?, skip);
            Ok(())
        }
        Device::Cuda(d) => cuda::embed_bwd(d, ids, dx, dtable, tokens, skip),
    }
}
