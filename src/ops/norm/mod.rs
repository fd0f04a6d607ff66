//! RMSNorm in its three uses: the block norms, the fused residual-add + norm, and the per-head
//! q/k norm of Qwen3. `y = x / sqrt(mean(x²) + eps) · w`, all in f32 (as transformers does); on
//! CUDA the block norms may store y in BF16 for a BF16 GEMM that reads nothing else (the
//! rounding that GEMM applied to the f32 values).
//!
//! Owns: the public signatures, their shape checks and the dispatch by device; the CPU twin
//! (`cpu.rs`), the CUDA twin (`cuda.rs`, kernel csrc/kernels/norm.cu) and the training twin
//! (`grad.rs`: forward saving 1/rms, backward). May call: `crate::device`. Must not: allocate.

mod cpu;
mod cuda;
pub mod grad;
#[cfg(test)]
mod tests;

use super::check_rows;
use crate::device::{Device, Tensor};
use anyhow::Result;

/// y[..m] (m, C) = rmsnorm(x[..m]) · w, w (C).
pub fn rmsnorm(dev: &Device, x: &Tensor, w: &Tensor, eps: f32, y: &mut Tensor, m: usize) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "rmsnorm input")?;
    check_rows(y, m, c, "rmsnorm output")?;
    match dev {
        Device::Cpu(d) => cpu::rmsnorm(d, x, w, eps, y, m),
        Device::Cuda(d) => cuda::rmsnorm(d, x, w, eps, y, m),
    }
}

/// The residual stream update fused with the next norm: x[..m] += r[..m]; y = rmsnorm(x) · w.
pub fn add_rmsnorm(
    dev: &Device,
    x: &mut Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "add_rmsnorm residual")?;
    check_rows(r, m, c, "add_rmsnorm update")?;
    check_rows(y, m, c, "add_rmsnorm output")?;
    match dev {
        Device::Cpu(d) => cpu::add_rmsnorm(d, x, r, w, eps, y, m),
        Device::Cuda(d) => cuda::add_rmsnorm(d, x, r, w, eps, y, m),
    }
}

/// Per-head RMSNorm in place: x[..m] (m, heads·D), each head's D values normalized with w (D).
pub fn head_rmsnorm(dev: &Device, x: &mut Tensor, w: &Tensor, eps: f32, m: usize, heads: usize) -> Result<()> {
    let d = w.numel();
    check_rows(x, m, heads * d, "head_rmsnorm input")?;
    match dev {
        Device::Cpu(c) => cpu::head_rmsnorm(c, x, w, eps, m, heads),
        Device::Cuda(c) => cuda::head_rmsnorm(c, x, w, eps, m, heads),
    }
}

/// Training RMSNorm: y[..m] (m, C) = x·r·w with r per row saved in rstd (m), w (C) f32 or the
/// compute weights' BF16 / F16. The
/// same op serves the per-head q/k norm (rows = tokens × heads, C = head_dim).
pub fn rmsnorm_train(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    y: &mut Tensor,
    rstd: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    check_rows(x, m, c, "rmsnorm input")?;
    check_rows(y, m, c, "rmsnorm output")?;
    if rstd.numel() < m {
        anyhow::bail!("rmsnorm saved 1/rms: {} values for {m} rows", rstd.numel());
    }
    match dev {
        Device::Cpu(_) => {
            let wv = w.to_f32_vec()?;
            grad::fwd(m, c, x.f32s()?, &wv, eps, y.f32s_mut()?, rstd.f32s_mut()?);
            Ok(())
        }
        Device::Cuda(d) => cuda::rmsnorm_train(d, x, w, eps, y, rstd, m),
    }
}

/// RMSNorm backward: dx[..m] (+)= ∂/∂x and dw (C) += ∂/∂w from dy, the input x and the saved
/// rstd (`grad::bwd`).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    dev: &Device,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dx: &mut Tensor,
    accumulate: bool,
    dw: &mut Tensor,
    m: usize,
) -> Result<()> {
    let c = w.numel();
    for (t, what) in [(dy, "rmsnorm output gradient"), (x, "rmsnorm input"), (&*dx, "rmsnorm input gradient")] {
        check_rows(t, m, c, what)?;
    }
    if rstd.numel() < m {
        anyhow::bail!("rmsnorm saved 1/rms: {} values for {m} rows", rstd.numel());
    }
    check_rows(dw, 1, c, "rmsnorm weight gradient")?;
    match dev {
        Device::Cpu(_) => {
            let (dyv, xv, wv, rv) = (dy.f32s()?, x.f32s()?, w.to_f32_vec()?, rstd.f32s()?);
            grad::bwd(m, c, dyv, xv, &wv, rv, dx.f32s_mut()?, accumulate, dw.f32s_mut()?);
            Ok(())
        }
        Device::Cuda(d) => cuda::rmsnorm_bwd(d, dy, x, w, rstd, dx, accumulate, dw, m),
    }
}
