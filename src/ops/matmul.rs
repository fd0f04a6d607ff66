//! Linear layers: `y = x · Wᵀ (+ b)` for an nn.Linear weight W (N, K).

use super::linear_panels::Panels;
use super::{check_rows, linear_cpu};
use crate::device::{cuda, CpuFloats, Device, Tensor};
use anyhow::{bail, Result};

/// y[..m] (m, N) = x[..m] (m, K) · wᵀ, w (N, K), plus `bias` (N) when given; `accumulate` adds to y.
pub fn linear(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    linear_packed(dev, x, w, None, bias, y, m, accumulate)
}

/// [`linear`], reading W from `panels` (the same weight packed once, see
/// `ModelWeights::pack_panels`) where given: the same bits on CPU; CUDA ignores them.
#[allow(clippy::too_many_arguments)]
pub fn linear_packed(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    panels: Option<&Panels>,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    if let Some(p) = panels {
        if p.dims() != (n, k) {
            bail!("linear: packed panels of {:?} for a weight of ({n}, {k})", p.dims());
        }
    }
    check_rows(x, m, k, "linear input")?;
    check_rows(y, m, n, "linear output")?;
    if let Some(b) = bias {
        check_rows(b, 1, n, "linear bias")?;
    }
    match dev {
        Device::Cpu(c) => {
            let (xs, wf) = (x.f32s()?, CpuFloats::of(w)?);
            let bf = bias.map(CpuFloats::of).transpose()?;
            let ys = y.f32s_mut()?;
            c.install(|| {
                match panels {
                    Some(p) => linear_cpu::linear_nt_panels(m, xs, p, ys, n, accumulate),
                    None => linear_cpu::linear_nt(m, n, k, xs, wf, ys, n, accumulate),
                }
                if let Some(b) = bf {
                    for row in ys[..m * n].chunks_exact_mut(n) {
                        for (j, v) in row.iter_mut().enumerate() {
                            *v += b.get(j);
                        }
                    }
                }
            });
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::linear(c, x, w, bias, y, m, accumulate),
    }
}

/// y[..m] = quant(x[..m])·wqᵀ (+ bias): a quantized engine's linear, the input quantized with
/// `act` in the weight's format. CPU (the reference, the paper's emulated path): x is
/// fake-quantized into the scratch `xq` (reshaped to x's row width), then [`linear_q`]. CUDA:
/// the real W8A8 / W4A4 GEMM on the same codes (`xq` unused); only the FP32 summation order
/// differs, which the device check bounds.
#[allow(clippy::too_many_arguments)]
pub fn linear_act_q(dev: &Device, x: &Tensor, xq: &mut Tensor, act: &crate::ops::quantize::ActQuant, wq: &crate::quant::QTensor, bias: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    match dev {
        Device::Cpu(_) => {
            let k = x.dim(x.shape().len() - 1);
            xq.reshape(&[xq.numel() / k, k])?;
            crate::ops::quantize::fake_quant_rows(dev, x, xq, m, act)?;
            linear_q(dev, xq, wq, bias, y, m)
        }
        Device::Cuda(c) => cuda::ops::linear_act_q(c, x, act, wq, bias, y, m),
    }
}

/// y[..m] (m, N) = x[..m] · dequant(wq)ᵀ (+ bias): the emulated low-precision linear. The weight
/// is decoded exactly (FP8: e4m3·scale; NVFP4: f32(e2m1·bs)·global) block by block inside the
/// same kernel as [`linear`], so the products equal those of a real FP8/FP4 GEMM and only the
/// f32 summation order differs.
pub fn linear_q(dev: &Device, x: &Tensor, wq: &crate::quant::QTensor, bias: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    check_rows(x, m, k, "linear input")?;
    check_rows(y, m, n, "linear output")?;
    match dev {
        Device::Cpu(c) => {
            let xs = x.f32s()?;
            let bf = bias.map(CpuFloats::of).transpose()?;
            let wv = wq.view()?;
            let ys = y.f32s_mut()?;
            c.install(|| {
                linear_cpu::linear_nt(m, n, k, xs, wv, ys, n, false);
                if let Some(b) = bf {
                    for row in ys[..m * n].chunks_exact_mut(n) {
                        for (j, v) in row.iter_mut().enumerate() {
                            *v += b.get(j);
                        }
                    }
                }
            });
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::linear_q(c, x, wq, bias, y, m),
    }
}
