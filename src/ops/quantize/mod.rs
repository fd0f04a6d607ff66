//! Quantization on a device: activation rows quantized with a fixed (calibrated) scale and
//! dequantized back, as the real kernels would consume them (the emulated low-precision
//! engines), and the in-place re-quantization of weights at each resync (one amax pass, one
//! encode pass; on CUDA after a device update, the encode pass alone, reading the amax the
//! optimizer reduced while it wrote the weights). FP8: per-tensor E4M3 with scale amax/448. NVFP4: dynamic E4M3 block scales per
//! 16 values under a global scale (amax/2688), optionally rotated by the RHT. The arithmetic is
//! `crate::quant`'s; this room runs it over tensors.
//!
//! Owns: [`ActQuant`], the public signatures, their checks and the dispatch; the CPU twin
//! (`cpu.rs`), the CUDA twin (`cuda.rs`, kernels csrc/kernels/quantize.cu). May call:
//! `crate::device`, `crate::quant`. Must not: allocate on the CPU.

mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

pub use cuda::swizzled_sf_bytes;
pub use cuda::LearnerCodes;
pub(crate) use cuda::{amax, dequant, quant_rows_fixed, swizzle_sf_into};

use super::check_rows;
use crate::device::{Device, Tensor};
use crate::quant::nvfp4::{self, Nvfp4Opts};
use crate::quant::qtensor::QTensor;
use anyhow::Result;

/// How a linear's input rows are quantized: not at all, FP8 with a per-tensor scale, or NVFP4
/// with a global scale (block scales are computed per 16 values).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActQuant {
    None,
    Fp8 { scale: f32 },
    Nvfp4 { global: f32, opts: Nvfp4Opts },
}

/// y[..m] = dequant(quant(x[..m])) for rows of K = last dim.
pub fn fake_quant_rows(dev: &Device, x: &Tensor, y: &mut Tensor, m: usize, q: &ActQuant) -> Result<()> {
    let k = x.dim(x.shape().len() - 1);
    check_rows(y, m, k, "fake_quant output")?;
    match dev {
        Device::Cpu(d) => cpu::fake_quant_rows(d, x, y, m, q),
        Device::Cuda(d) => cuda::fake_quant_rows(d, x, y, m, q),
    }
}

/// The NVFP4 learner's operand (seed 004 §5.1): out (m, k) F32 = the first m rows of x (any
/// float dtype) rounded by [`nvfp4::learner_round`] — rotated by the RHT, onto the NVFP4 grid
/// under `global`, decoded and rotated back. On CUDA: an amax kernel (per tensor or per row;
/// none for a fixed global) and the encode kernel writing the decoded values; the host
/// checks nothing there (the optimizer never writes a non-finite weight: it skips such a step),
/// where the CPU refuses a non-finite tensor amax.
pub fn learner_round(
    dev: &Device,
    x: &Tensor,
    out: &mut Tensor,
    m: usize,
    global: nvfp4::Global,
    opts: &Nvfp4Opts,
) -> Result<()> {
    learner_round_codes(dev, x, out, m, global, opts, false).map(|_| ())
}

/// [`learner_round`], and with `codes` on CUDA, written by the same launch, the NVFP4 codes
/// that the real W4A4 GEMM reads (`linear::learner_w4a4`); None on the CPU.
pub fn learner_round_codes(
    dev: &Device,
    x: &Tensor,
    out: &mut Tensor,
    m: usize,
    global: nvfp4::Global,
    opts: &Nvfp4Opts,
    codes: bool,
) -> Result<Option<LearnerCodes>> {
    let k = check_learner(x, m, global)?;
    check_rows(out, m, k, "learner NVFP4 output")?;
    match dev {
        Device::Cpu(d) => cpu::learner_round(d, x, out, m, k, global, opts).map(|_| None),
        Device::Cuda(d) => cuda::learner_round(d, x, Some(out), m, k, global, opts, codes),
    }
}

/// Only the codes of [`learner_round_codes`] (CUDA), no rounded f32 copy: for a learner whose
/// GEMMs, forward and backward, all read codes (`linear::learner_dx`, `linear::learner_dw`).
pub fn learner_codes(
    dev: &Device,
    x: &Tensor,
    m: usize,
    global: nvfp4::Global,
    opts: &Nvfp4Opts,
) -> Result<LearnerCodes> {
    let k = check_learner(x, m, global)?;
    let codes = match dev {
        Device::Cpu(_) => anyhow::bail!("learner NVFP4 codes: the CPU learner multiplies the rounded values"),
        Device::Cuda(d) => cuda::learner_round(d, x, None, m, k, global, opts, true)?,
    };
    codes.ok_or_else(|| anyhow::anyhow!("learner NVFP4 codes: an empty operand ({m} rows)"))
}

/// The learner operand's K, checked: a multiple of the block, m rows present, a usable global.
fn check_learner(x: &Tensor, m: usize, global: nvfp4::Global) -> Result<usize> {
    let k = x.dim(x.shape().len() - 1);
    if k == 0 || k % nvfp4::BLOCK != 0 {
        anyhow::bail!("learner NVFP4: the reduction dimension {k} is not a multiple of {}", nvfp4::BLOCK);
    }
    if x.numel() < m * k {
        anyhow::bail!("learner NVFP4: {m} rows of {k} from a tensor of {} values", x.numel());
    }
    if let nvfp4::Global::Fixed(g) = global {
        if !(g > 0.0 && g.is_finite()) {
            anyhow::bail!("learner NVFP4: a fixed global scale must be positive and finite, got {g}");
        }
    }
    Ok(k)
}

/// Re-quantizes `q` from the weight tensor `src` (same device) in place; fails, naming `name`,
/// if `src` holds a non-finite value.
pub fn requantize(dev: &Device, src: &Tensor, q: &mut QTensor, name: &str) -> Result<()> {
    requantize_all(dev, &mut [(src, q, name)])
}

/// Re-quantizes every (source, buffer, name) in place, in order. On CUDA the kernels of all
/// tensors are queued first and the scales come back in one read (one wait per resync).
pub fn requantize_all(dev: &Device, items: &mut [(&Tensor, &mut QTensor, &str)]) -> Result<()> {
    match dev {
        Device::Cpu(d) => cpu::requantize_all(d, items),
        Device::Cuda(d) => cuda::requantize_all(d, items, None),
    }
}

/// As [`requantize_all`], with amaxes already reduced on the device — the optimizer's, written
/// while it wrote the weights (`ops::optim::Compute::amax`): `amax` holds f32 bit patterns (U32),
/// `slots[i]` item i's (None: reduce it here). Such an item's weights are read once, by its
/// quantize kernel. Items under the RHT reduce their own (theirs is of the rotated blocks).
/// A CUDA path: the CPU trainer keeps no device amax, and its requantize reduces its own.
pub fn requantize_all_known(
    dev: &Device,
    items: &mut [(&Tensor, &mut QTensor, &str)],
    amax: &Tensor,
    slots: &[Option<usize>],
) -> Result<()> {
    match dev {
        Device::Cpu(_) => anyhow::bail!("requantize with known amaxes: a CUDA path (the CPU reduces its own)"),
        Device::Cuda(d) => cuda::requantize_all(d, items, Some((amax, slots))),
    }
}
