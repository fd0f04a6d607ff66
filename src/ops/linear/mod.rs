//! Linear layers: `y = x · Wᵀ (+ b)` for an nn.Linear weight W (N, K), in full precision and on
//! quantized weights (the emulated low-precision linear, and the real W8A8 / W4A4 GEMMs).
//!
//! Owns: [`Proj`], the public signatures, their checks and the dispatch. The CPU side: the
//! register-blocked kernel (`kernel.rs`, per-ISA tiles in `kernel/`), weights packed once into
//! panels (`panels.rs`), the tensor glue (`cpu.rs`), the training GEMMs (`gemm.rs` over the
//! `gemm` crate; `grad.rs`: forward and backward of a linear). The CUDA side: cuBLASLt
//! (`cuda.rs`), CUTLASS FP8 / NVFP4 or emulation (`cuda_lowp.rs`, csrc/cutlass/). May call:
//! `crate::device`, `crate::quant`, `super::quantize`, `super::elementwise` (SwiGLU, the CPU
//! twin of the fused down projection). Must not: allocate in steady state.

mod cpu;
mod cuda;
pub mod cuda_learner;
pub mod cuda_lowp;
pub mod gemm;
pub mod grad;
pub mod kernel;
pub mod panels;
#[cfg(test)]
mod lowp_tests;
#[cfg(test)]
mod tests;

pub use cuda::cast_rows;
pub(crate) use cuda::column_chunks;
pub use panels::Panels;

use super::check_rows;
use super::quantize::{ActQuant, LearnerCodes};
use crate::device::{Device, Tensor};
use crate::quant::qtensor::QTensor;
use anyhow::{bail, Result};

/// A linear's bias: exactly N values (one per output column; the CUDA arm adds several
/// projections' biases in one launch by their lengths).
fn check_bias(b: &Tensor, n: usize) -> Result<()> {
    if b.numel() != n {
        bail!("linear bias: tensor of shape {:?} for {n} output columns", b.shape());
    }
    Ok(())
}

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

/// y[..m] (m, N) = r[..m] + x[..m] · wᵀ (+ bias): [`linear`] accumulating onto the residual r
/// (m, N), the same bits as copying r into y and accumulating, without the copy on CUDA
/// (cuBLASLt reads r as its C and writes y: C ≠ D); the CPU copies r's rows into y first.
#[allow(clippy::too_many_arguments)]
pub fn linear_residual(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    r: &Tensor,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    check_rows(x, m, k, "linear input")?;
    check_rows(r, m, n, "linear residual")?;
    check_rows(y, m, n, "linear output")?;
    if let Some(b) = bias {
        check_bias(b, n)?;
    }
    match dev {
        Device::Cpu(_) => {
            y.f32s_mut()?[..m * n].copy_from_slice(&r.f32s()?[..m * n]);
            linear(dev, x, w, bias, y, m, true)
        }
        Device::Cuda(c) => cuda::linear_residual(c, x, w, bias, r, y, m),
    }
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
    linears_acc(dev, x, [Proj { w, panels, bias, y }], m, accumulate, false)
}

/// [`linear_packed`] (no bias) for an output written once, read once later, and too large to
/// stay in cache: the LM head's logits. On CPU its rows skip the caches where they can (see
/// `kernel::Job::streamed`), the same bits; CUDA runs [`linear_packed`].
pub fn linear_packed_streamed(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    panels: Option<&Panels>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    linears_acc(dev, x, [Proj { w, panels, bias: None, y }], m, false, true)
}

/// One projection of [`linears`]: y = x · wᵀ (+ bias), w (N, K), its panels when packed.
pub struct Proj<'a> {
    pub w: &'a Tensor,
    pub panels: Option<&'a Panels>,
    pub bias: Option<&'a Tensor>,
    pub y: &'a mut Tensor,
}

/// Several projections of one input (q/k/v, gate/up): y_i[..m] = x[..m] · w_iᵀ (+ b_i), each
/// with the bits of its own [`linear_packed`]. On CPU they run as one parallel region with x
/// transposed once; CUDA runs them one after another on x rounded once to the weights' dtype.
pub fn linears<const J: usize>(dev: &Device, x: &Tensor, projs: [Proj<'_>; J], m: usize) -> Result<()> {
    linears_acc(dev, x, projs, m, false, false)
}

fn linears_acc<const J: usize>(
    dev: &Device,
    x: &Tensor,
    projs: [Proj<'_>; J],
    m: usize,
    accumulate: bool,
    stream: bool,
) -> Result<()> {
    const { assert!(J >= 1 && J <= kernel::MAX_JOBS) };
    for p in &projs {
        let (n, kw) = (p.w.dim(0), p.w.dim(1));
        if let Some(pn) = p.panels {
            if pn.dims() != (n, kw) {
                bail!("linear: packed panels of {:?} for a weight of ({n}, {kw})", pn.dims());
            }
        }
        check_rows(x, m, kw, "linear input")?;
        check_rows(p.y, m, n, "linear output")?;
        if let Some(b) = p.bias {
            check_bias(b, n)?;
        }
    }
    // (Every projection's K equals x's row width: checked above.)
    let k = projs[0].w.dim(1);
    match dev {
        Device::Cpu(c) => cpu::linears(c, x, projs, m, k, accumulate, stream),
        Device::Cuda(c) => cuda::linears(c, x, projs, m, accumulate),
    }
}

/// y[..m] = quant(x[..m])·wqᵀ (+ bias): a quantized engine's linear, the input quantized with
/// `act` in the weight's format. CPU (the reference, the paper's emulated path): x is
/// fake-quantized into the scratch `xq` (reshaped to x's row width), then [`linear_q`]. CUDA:
/// the real W8A8 / W4A4 GEMM on the same codes (`xq` unused); only the FP32 summation order
/// differs, which the device check bounds.
#[allow(clippy::too_many_arguments)]
pub fn linear_act_q(
    dev: &Device,
    x: &Tensor,
    xq: &mut Tensor,
    act: &ActQuant,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    linears_act_q(dev, x, xq, act, &mut [QProj { w: wq, bias, y }], m)
}

/// One quantized projection of a shared input: its weight, bias and output.
pub struct QProj<'a> {
    pub w: &'a QTensor,
    pub bias: Option<&'a Tensor>,
    pub y: &'a mut Tensor,
}

/// [`linear_act_q`] for several projections of one input quantized alike (a layer's q, k, v,
/// or gate and up: one calibrated input, so one `act`): the input is quantized once and each
/// projection's GEMM reads the same codes — the bits of quantizing it once per projection,
/// since the quantization is a function of the input and `act` alone (stochastic rounding's
/// seed included).
pub fn linears_act_q(
    dev: &Device,
    x: &Tensor,
    xq: &mut Tensor,
    act: &ActQuant,
    projs: &mut [QProj],
    m: usize,
) -> Result<()> {
    match dev {
        Device::Cpu(_) => {
            let k = x.dim(x.shape().len() - 1);
            // The scratch is sized for the widest K; view whole rows of this K in it.
            xq.reshape_within(&[xq.capacity() / k, k])?;
            super::quantize::fake_quant_rows(dev, x, xq, m, act)?;
            for p in projs.iter_mut() {
                linear_q(dev, xq, p.w, p.bias, p.y, m)?;
            }
            Ok(())
        }
        Device::Cuda(c) => cuda_lowp::linears_act_q(c, x, act, projs, m, cuda_lowp::Path::Auto).map(|_| ()),
    }
}

/// y[..m] = quant(SwiGLU(gate[..m], up[..m]))·wqᵀ (+ bias): the down projection of a quantized
/// engine's MLP, [`linear_act_q`] of SwiGLU's output. CPU: SwiGLU into the scratch `a` (m, I),
/// then [`linear_act_q`]. CUDA: the quantizer computes SwiGLU as it reads gate and up, with
/// `ct_swiglu`'s arithmetic (the same codes, so the same bits), and `a` is not written: one
/// launch and one (m, I) f32 round trip fewer per layer.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_linear_act_q(
    dev: &Device,
    gate: &Tensor,
    up: &Tensor,
    a: &mut Tensor,
    xq: &mut Tensor,
    act: &ActQuant,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    match dev {
        Device::Cpu(_) => {
            super::elementwise::swiglu(dev, gate, up, a, m)?;
            linear_act_q(dev, a, xq, act, wq, bias, y, m)
        }
        Device::Cuda(c) => {
            cuda_lowp::swiglu_linear_act_q(c, gate, up, act, wq, bias, y, m, cuda_lowp::Path::Auto).map(|_| ())
        }
    }
}

/// y[..m] (m, N) = x[..m] · dequant(wq)ᵀ (+ bias): the emulated low-precision linear. The weight
/// is decoded exactly (FP8: e4m3·scale; NVFP4: f32(e2m1·bs)·global) block by block inside the
/// same kernel as [`linear`], so the products equal those of a real FP8/FP4 GEMM and only the
/// f32 summation order differs.
pub fn linear_q(dev: &Device, x: &Tensor, wq: &QTensor, bias: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    check_rows(x, m, k, "linear input")?;
    check_rows(y, m, n, "linear output")?;
    match dev {
        Device::Cpu(c) => cpu::linear_q(c, x, wq, bias, y, m),
        Device::Cuda(c) => cuda::linear_q(c, x, wq, bias, y, m),
    }
}

/// Whether the NVFP4 learner's forward linear of a weight (n, k) runs on its operands' codes on
/// `dev` ([`learner_w4a4`]): on every CUDA device (CUTLASS's block-scaled GEMM where it suits
/// the shape, else a BF16 GEMM of the decoded codes), for K a multiple of 16. On the CPU the
/// linear multiplies the rounded operands in f32.
pub fn learner_w4a4_here(dev: &Device, n: usize, k: usize) -> bool {
    let _ = n;
    match dev {
        Device::Cpu(_) => false,
        Device::Cuda(_) => k % 16 == 0,
    }
}

/// y[..m] (+)= x · wᵀ (+ bias) on the learner's NVFP4 codes (`quantize::learner_round_codes`):
/// the products of the unit values, FP32 accumulation, then the global scales (CUDA:
/// `cuda_learner::learner_w4a4`); Ok(false) on the CPU.
pub fn learner_w4a4(
    dev: &Device,
    x: &LearnerCodes,
    w: &LearnerCodes,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    accumulate: bool,
) -> Result<bool> {
    match dev {
        Device::Cpu(_) => Ok(false),
        Device::Cuda(c) => cuda_learner::learner_w4a4(c, x, w, bias, y, accumulate),
    }
}

/// The NVFP4 learner's straight-through data gradient on its weight's codes: dx[..m] (m, K)
/// (+)= dy[..m] (m, N) · Q(w), w's codes (N, K) (`quantize::learner_codes`); dy rounded to
/// BF16, FP32 accumulation, in the RHT's rotated domain (`cuda_learner::learner_dx`). CUDA
/// only: the CPU twin multiplies the rounded f32 copy (`linear_dx`).
pub fn learner_dx(
    dev: &Device,
    dy: &Tensor,
    w: &LearnerCodes,
    dx: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    match dev {
        Device::Cpu(_) => anyhow::bail!("learner data gradient on codes: a CUDA device's op"),
        Device::Cuda(c) => cuda_learner::learner_dx(c, dy, w, dx, m, accumulate),
    }
}

/// The NVFP4 learner's straight-through weight gradient on its input's codes: dw (N, K) f32
/// (+)= dy[..m]ᵀ · Q(x), x's codes (m, K); dy (times each token's scale, for per-token
/// scales) rounded to BF16, FP32 accumulation (`cuda_learner::learner_dw`). CUDA only: the CPU
/// twin multiplies the rounded f32 copy (`linear_dw`).
pub fn learner_dw(
    dev: &Device,
    dy: &Tensor,
    x: &LearnerCodes,
    dw: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    match dev {
        Device::Cpu(_) => anyhow::bail!("learner weight gradient on codes: a CUDA device's op"),
        Device::Cuda(c) => cuda_learner::learner_dw(c, dy, x, dw, m, accumulate),
    }
}

/// Both of [`learner_dx`] (accumulating when `acc_dx`) and [`learner_dw`] (accumulating) for
/// one learner linear, dy rounded to BF16 once for both where x's scale is per tensor or fixed
/// (`cuda_learner::learner_grads`). CUDA only.
#[allow(clippy::too_many_arguments)]
pub fn learner_grads(
    dev: &Device,
    dy: &Tensor,
    w: &LearnerCodes,
    x: &LearnerCodes,
    dx: &mut Tensor,
    acc_dx: bool,
    dw: &mut Tensor,
    m: usize,
) -> Result<()> {
    match dev {
        Device::Cpu(_) => anyhow::bail!("learner gradients on codes: a CUDA device's op"),
        Device::Cuda(c) => cuda_learner::learner_grads(c, dy, w, x, dx, acc_dx, dw, m),
    }
}

/// dx[..m] (m, K) (+)= dy[..m] (m, N) · w, w (N, K): a linear's data gradient. F32 weights: an
/// FP32 GEMM; BF16 / F16 weights: dy rounded to the weight's dtype, FP32 accumulation (CUDA;
/// the CPU twin widens the weight to f32).
pub fn linear_dx(dev: &Device, dy: &Tensor, w: &Tensor, dx: &mut Tensor, m: usize, accumulate: bool) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    check_rows(dy, m, n, "linear output gradient")?;
    check_rows(dx, m, k, "linear input gradient")?;
    match dev {
        Device::Cpu(_) => cpu::linear_dx(dy, w, dx, m, accumulate),
        Device::Cuda(c) => cuda::linear_dx(c, dy, w, dx, m, accumulate),
    }
}

/// dw (N, K) f32 (+)= dy[..m]ᵀ · x[..m], dy (m, N), x (m, K): a linear's weight gradient,
/// accumulated in FP32. `operands`: F32, or BF16 (dy and x rounded to BF16 first, as mixed-
/// precision training computes it; the CPU twin rounds them the same way).
pub fn linear_dw(
    dev: &Device,
    dy: &Tensor,
    x: &Tensor,
    dw: &mut Tensor,
    m: usize,
    accumulate: bool,
    operands: crate::device::DType,
) -> Result<()> {
    let (n, k) = (dw.dim(0), dw.dim(1));
    check_rows(dy, m, n, "linear output gradient")?;
    check_rows(x, m, k, "linear input")?;
    if dw.dtype() != crate::device::DType::F32 {
        bail!("linear weight gradient: an f32 tensor expected, found {}", dw.dtype().name());
    }
    if !matches!(operands, crate::device::DType::F32 | crate::device::DType::BF16) {
        bail!("linear weight gradient: F32 or BF16 operands, not {}", operands.name());
    }
    match dev {
        Device::Cpu(_) => cpu::linear_dw(dy, x, dw, m, accumulate, operands),
        Device::Cuda(c) => cuda::linear_dw(c, dy, x, dw, m, accumulate, operands),
    }
}

/// One projection's share of [`linear_grads`]: its output gradient dy (m, N), its weight
/// w (N, K) and its weight gradient dw (N, K) f32.
pub struct GradProj<'a> {
    pub dy: &'a Tensor,
    pub w: &'a Tensor,
    pub dw: &'a mut Tensor,
}

/// The gradients of projections of one input x[..m] (m, K) (q/k/v, gate/up, or one linear):
/// dx[..m] (+)= Σ_j dy_j · w_j (the first overwrites unless `acc_dx`) and dw_j += dy_jᵀ · x.
/// The bits of [`linear_dx`] then [`linear_dw`] (with `operands`) for each projection in turn.
/// On CUDA, x is rounded to BF16 once for every weight gradient, and each dy_j once for both
/// of its gradients where its weight is BF16 and `operands` BF16.
pub fn linear_grads<const J: usize>(
    dev: &Device,
    x: &Tensor,
    projs: [GradProj<'_>; J],
    dx: &mut Tensor,
    acc_dx: bool,
    m: usize,
    operands: crate::device::DType,
) -> Result<()> {
    const { assert!(J >= 1) };
    let k = projs[0].w.dim(1);
    check_rows(x, m, k, "linear input")?;
    check_rows(dx, m, k, "linear input gradient")?;
    if !matches!(operands, crate::device::DType::F32 | crate::device::DType::BF16) {
        bail!("linear weight gradient: F32 or BF16 operands, not {}", operands.name());
    }
    for p in &projs {
        let n = p.w.dim(0);
        if p.w.dim(1) != k || p.dw.shape() != [n, k] || p.dw.dtype() != crate::device::DType::F32 {
            bail!(
                "linear gradients: weights of {k} columns with f32 gradients of their shape expected, found a weight of {:?} and a {} gradient of {:?}",
                p.w.shape(),
                p.dw.dtype().name(),
                p.dw.shape()
            );
        }
        check_rows(p.dy, m, n, "linear output gradient")?;
    }
    match dev {
        Device::Cpu(_) => {
            for (j, p) in projs.into_iter().enumerate() {
                cpu::linear_dx(p.dy, p.w, dx, m, acc_dx || j > 0)?;
                cpu::linear_dw(p.dy, x, p.dw, m, true, operands)?;
            }
            Ok(())
        }
        Device::Cuda(c) => cuda::linear_grads(c, x, projs, dx, acc_dx, m, operands),
    }
}

/// db (N) f32 += the column sums of dy[..m] (m, N), in the order of `ops::reduction_chunk_rows`:
/// a linear's bias gradient.
pub fn bias_grad(dev: &Device, dy: &Tensor, db: &mut Tensor, m: usize) -> Result<()> {
    let n = db.numel();
    check_rows(dy, m, n, "linear output gradient")?;
    match dev {
        Device::Cpu(_) => {
            grad::bias_grad(m, n, dy.f32s()?, db.f32s_mut()?);
            Ok(())
        }
        Device::Cuda(c) => cuda::bias_grad(c, dy, db, m),
    }
}

/// On a CUDA device, out (N) += the rows of x[..m] (m, N) added in row order, whatever m (one
/// launch, no scratch): the device collective's sum over the ranks, in the host collective's
/// order (`parallel::collective`), on the communication stream.
pub fn sum_rows_in_order(dev: &crate::device::cuda::CudaDevice, x: &Tensor, out: &mut Tensor, m: usize) -> Result<()> {
    check_rows(x, m, out.numel(), "rows to sum")?;
    cuda::sum_rows_in_order(dev, x, out, m)
}
