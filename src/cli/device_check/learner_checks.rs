//! The NVFP4 learner's linears on a GPU, in the device check's `quant` group: the forward
//! (`linear::learner_w4a4`) and the straight-through backward (`linear::learner_dx`,
//! `learner_dw`) on the learner's codes, against the CPU's products of the rounded operands.
//!
//! Owns: those rows. May call: `ops::quantize`'s learner rounding, `ops::linear`. Must not:
//! time anything.

use super::checks::{Ctx, Pair, Tol, M};
use crate::device::{DType, Tensor};
use crate::ops::linear as matmul;
use crate::ops::linear::cuda_lowp as lowp;
use crate::ops::quantize;
use crate::quant::nvfp4::{Global, Nvfp4Opts};
use crate::quant::qtensor::QFormat;
use anyhow::{bail, Result};

/// The NVFP4 learner's W4A4 linear on the learner's codes, globals on the device (CUTLASS's
/// block-scaled GEMM on sm_100a / sm_103a; on Hopper a BF16 GEMM of the decoded unit values,
/// whose epilogue applies one activation scale from device memory: cuBLASLt's device pointer
/// mode) against the CPU's product of the rounded operands: written, then accumulated once
/// more (beta 0, then 1), twice the product.
pub(super) fn w4a4(
    x: &mut Ctx,
    xin: &Pair,
    w: &Pair,
    global: crate::quant::nvfp4::Global,
    opts: &Nvfp4Opts,
    label: &str,
) -> Result<()> {
    let (n, k) = (w.c.dim(0), w.c.dim(1));
    let gpu = x.gpu.clone();
    let path = match (lowp::cutlass_supports(&x.cuda, QFormat::Nvfp4, n, k), global) {
        (true, _) => "CUTLASS",
        (false, Global::Row) => "BF16 unit values",
        (false, _) => "BF16 unit values, scales in the epilogue",
    };
    let op = format!("learner W4A4 GEMM ({path}), {label} global, rht+sr");
    let (mut xr, mut wr) = (x.out(&[M, k])?, x.out(&[n, k])?);
    quantize::learner_round(&x.cpu, &xin.c, &mut xr.c, M, global, opts)?;
    quantize::learner_round(&x.cpu, &w.c, &mut wr.c, n, crate::quant::nvfp4::Global::Tensor, opts)?;
    let mut reference = Tensor::cpu_zeros(DType::F32, &[M, n]);
    matmul::linear(&x.cpu, &xr.c, &wr.c, None, &mut reference, M, false)?;
    let xc = quantize::learner_round_codes(&gpu, &xin.g, &mut xr.g, M, global, opts, true)?;
    let wc = quantize::learner_round_codes(&gpu, &w.g, &mut wr.g, n, crate::quant::nvfp4::Global::Tensor, opts, true)?;
    let (Some(xc), Some(wc)) = (xc, wc) else { bail!("{op}: no codes from a CUDA device") };
    let mut y = x.out(&[M, n])?;
    if !matmul::learner_w4a4(&gpu, &xc, &wc, None, &mut y.g, false)? {
        x.skip(&op, "f32", format!("K = {k} is not a multiple of 16"));
        return Ok(());
    }
    matmul::learner_w4a4(&gpu, &xc, &wc, None, &mut y.g, true)?;
    let twice: Vec<f32> = reference.to_f32_vec()?.iter().map(|v| 2.0 * v).collect();
    x.record(&op, "f32", &twice, &y.g.to_f32_vec()?, Tol::Close(1e-4, 1e-4));
    Ok(())
}

/// The NVFP4 learner's backward on its codes (BF16 GEMMs of the unit values in the rotated
/// domain, then the scales and the inverse RHT) against the CPU's F32 products of bf16(dy)
/// with the rounded copies. A sum over the M tokens cancels, so the tolerance is scaled to the
/// output: 1e-4·max|ref| + 1e-4·|ref|; per-token scales round g_t·dy instead of dy (one more
/// BF16 rounding of every term, 2⁻⁸ of it, 3.4e-3·max|ref| measured on the simulator):
/// 1e-2·max|ref| + 1e-2·|ref| for dw.
pub(super) fn backward(x: &mut Ctx, xin: &Pair, w: &Pair, global: Global, opts: &Nvfp4Opts, label: &str) -> Result<()> {
    let (n, k) = (w.c.dim(0), w.c.dim(1));
    let op = |what: &str| format!("learner {what} on codes (BF16), {label} global, rht+sr");
    if k % 16 != 0 {
        x.skip(&op("dx, dw"), "f32", format!("K = {k} is not a multiple of 16"));
        return Ok(());
    }
    let dy: Vec<f32> = (0..M * n).map(|_| x.rng.normal() as f32).collect();
    let dy_bf16: Vec<f32> = dy.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    let (mut xr, mut wr) = (Tensor::cpu_zeros(DType::F32, &[M, k]), Tensor::cpu_zeros(DType::F32, &[n, k]));
    quantize::learner_round(&x.cpu, &xin.c, &mut xr, M, global, opts)?;
    quantize::learner_round(&x.cpu, &w.c, &mut wr, n, Global::Tensor, opts)?;
    let dyc = x.cpu.from_f32(DType::F32, &[M, n], &dy_bf16)?;
    let (mut dx_ref, mut dw_ref) = (Tensor::cpu_zeros(DType::F32, &[M, k]), Tensor::cpu_zeros(DType::F32, &[n, k]));
    matmul::linear_dx(&x.cpu, &dyc, &wr, &mut dx_ref, M, false)?;
    matmul::linear_dw(&x.cpu, &dyc, &xr, &mut dw_ref, M, false, DType::F32)?;
    let gpu = x.gpu.clone();
    let xc = quantize::learner_codes(&gpu, &xin.g, M, global, opts)?;
    let wc = quantize::learner_codes(&gpu, &w.g, n, Global::Tensor, opts)?;
    let dyg = gpu.from_f32(DType::F32, &[M, n], &dy)?;
    let (mut dx, mut dw) = (gpu.zeros(DType::F32, &[M, k])?, gpu.zeros(DType::F32, &[n, k])?);
    matmul::learner_dx(&gpu, &dyg, &wc, &mut dx, M, false)?;
    matmul::learner_dw(&gpu, &dyg, &xc, &mut dw, M, false)?;
    let dw_rtol = if global == Global::Row { 1e-2 } else { 1e-4 };
    for (what, reference, got, rtol) in [("dx", dx_ref, dx, 1e-4), ("dw", dw_ref, dw, dw_rtol)] {
        let (reference, got) = (reference.to_f32_vec()?, got.to_f32_vec()?);
        let scale = reference.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
        x.record(&op(what), "f32", &reference, &got, Tol::Close(rtol * scale, rtol));
    }
    Ok(())
}
