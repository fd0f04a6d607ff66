//! Rotary embeddings (HF `rotate_half` convention): per token, per head, with half = D/2,
//! `x'[i] = x[i]·cos_i − x[i+half]·sin_i`, `x'[i+half] = x[i+half]·cos_i + x[i]·sin_i`,
//! angle_i = position · inv_freq[i] computed in f32 (as transformers does).
//!
//! Owns: the public signatures, their checks and the dispatch; the CPU twin (`cpu.rs`), the
//! CUDA twin (`cuda.rs`, kernel csrc/kernels/rope.cu), the training twin (`grad.rs`). May call:
//! `crate::device`. Must not: allocate.

mod cpu;
mod cuda;
pub mod grad;
#[cfg(test)]
mod tests;

use super::check_rows;
use crate::device::{Device, Tensor};
use anyhow::Result;

/// Fills cos/sin (m, D/2) for the m positions (u32) with inv_freq (D/2, f32).
pub fn rope_table(
    dev: &Device,
    positions: &Tensor,
    inv_freq: &Tensor,
    cos: &mut Tensor,
    sin: &mut Tensor,
    m: usize,
) -> Result<()> {
    let half = inv_freq.numel();
    check_rows(cos, m, half, "rope cos")?;
    check_rows(sin, m, half, "rope sin")?;
    match dev {
        Device::Cpu(d) => cpu::rope_table(d, positions, inv_freq, cos, sin, m),
        Device::Cuda(d) => cuda::rope_table(d, positions, inv_freq, cos, sin, m),
    }
}

/// Rotates x[..m] (m, heads·D) in place with the tables of [`rope_table`].
pub fn rope(dev: &Device, x: &mut Tensor, cos: &Tensor, sin: &Tensor, m: usize, heads: usize) -> Result<()> {
    let half = cos.dim(cos.shape().len() - 1);
    check_rows(x, m, heads * 2 * half, "rope input")?;
    match dev {
        Device::Cpu(d) => cpu::rope(d, x, cos, sin, m, heads),
        Device::Cuda(d) => cuda::rope(d, x, cos, sin, m, heads),
    }
}

/// RoPE backward in place: dx[..m] rotated by −angle (the transpose of the forward rotation).
pub fn rope_bwd(dev: &Device, dx: &mut Tensor, cos: &Tensor, sin: &Tensor, m: usize, heads: usize) -> Result<()> {
    let half = cos.dim(cos.shape().len() - 1);
    check_rows(dx, m, heads * 2 * half, "rope gradient")?;
    match dev {
        Device::Cpu(_) => {
            grad::bwd(m, heads, 2 * half, dx.f32s_mut()?, cos.f32s()?, sin.f32s()?);
            Ok(())
        }
        Device::Cuda(d) => cuda::rope_bwd(d, dx, cos, sin, m, heads),
    }
}
