//! The quantized engine's linears on a GPU, in the device check's `quant` group: the emulated
//! `linear_q` and every real W8A8 / W4A4 GEMM path (CUTLASS, cuBLASLt, the W4A4 mma kernel,
//! split over K too) against the CPU's emulation.
//!
//! Owns: those rows. May call: `ops::linear`, `ops::quantize`. Must not: time anything.

use super::checks::{Ctx, Pair, Tol, M};
use crate::device::{DType, Tensor};
use crate::ops::linear as matmul;
use crate::ops::linear::cuda_lowp as lowp;
use crate::ops::quantize::{self, ActQuant};
use crate::quant::nvfp4::Nvfp4Opts;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::Result;

/// linear_q (emulated) and the real W8A8 / W4A4 GEMM paths against the CPU emulation.
pub(super) fn qlinear(x: &mut Ctx, xin: &Pair, qc: &QTensor, qg: &QTensor, name: &str, amax: f32) -> Result<()> {
    let (n, m) = (qc.rows, M);
    let mut y = x.out(&[m, n])?;
    matmul::linear_q(&x.cpu, &xin.c, qc, None, &mut y.c, m)?;
    matmul::linear_q(&x.gpu, &xin.g, qg, None, &mut y.g, m)?;
    x.cmp("linear_q (emulated)", name, &y, Tol::Close(1e-2, 1e-2))?;
    let act = if qc.format == QFormat::Fp8 {
        ActQuant::Fp8 { scale: amax / 448.0 }
    } else {
        ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() }
    };
    let mut xq = x.out(&[m, qc.k])?;
    quantize::fake_quant_rows(&x.cpu, &xin.c, &mut xq.c, m, &act)?;
    let mut reference = Tensor::cpu_zeros(DType::F32, &[m, n]);
    matmul::linear_q(&x.cpu, &xq.c, qc, None, &mut reference, m)?;
    let want = reference.to_f32_vec()?;
    let cd = x.cuda.clone();
    let mma = (qc.format == QFormat::Nvfp4).then_some(lowp::Path::Mma);
    for path in
        [Some(lowp::Path::Cutlass), Some(lowp::Path::CublasLt), mma, Some(lowp::Path::Emulated)].into_iter().flatten()
    {
        let mut yg = x.out(&[m, n])?;
        let op = format!("{} GEMM via {path:?}", if qc.format == QFormat::Fp8 { "W8A8" } else { "W4A4" });
        match lowp::linear_act_q(&cd, &xin.g, &act, qg, None, &mut yg.g, m, path) {
            Ok(_) => {
                let got = yg.g.to_f32_vec()?;
                x.record(&op, name, &want, &got, Tol::Close(1e-3, 1e-3));
            }
            Err(e) if path != lowp::Path::Emulated => x.skip(&op, name, format!("{e:#}")),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The W4A4 mma kernel split over K (a down projection's shape at decode: too few column
/// blocks for the SMs), merged in split order, against the CPU emulation: 2 column blocks, K
/// of 33 chunks in 4 splits of 9, 9, 9 and 6 on an H200 or a B300.
pub(super) fn w4a4_split_k(x: &mut Ctx) -> Result<()> {
    let (n, k) = (64usize, 4224usize);
    let xin = x.randp(DType::F32, &[M, k], 1.0)?;
    let amax = xin.c.to_f32_vec()?.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let w = x.randp(DType::BF16, &[n, k], 0.05)?;
    let mut qc = QTensor::alloc(QFormat::Nvfp4, n, k, Nvfp4Opts::default())?;
    let mut qg = QTensor::alloc_on(&x.gpu, QFormat::Nvfp4, n, k, Nvfp4Opts::default())?;
    quantize::requantize(&x.cpu, &w.c, &mut qc, "w")?;
    quantize::requantize(&x.gpu, &w.g, &mut qg, "w")?;
    let act = ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() };
    let mut xq = x.out(&[M, k])?;
    quantize::fake_quant_rows(&x.cpu, &xin.c, &mut xq.c, M, &act)?;
    let mut reference = Tensor::cpu_zeros(DType::F32, &[M, n]);
    matmul::linear_q(&x.cpu, &xq.c, &qc, None, &mut reference, M)?;
    let splits = x.cuda.w4a4_splits(n, k);
    let mut y = x.out(&[M, n])?;
    let cd = x.cuda.clone();
    lowp::linear_act_q(&cd, &xin.g, &act, &qg, None, &mut y.g, M, lowp::Path::Mma)?;
    let op = format!("W4A4 GEMM via Mma, K split {splits} ways + merge");
    x.record(&op, "nvfp4", &reference.to_f32_vec()?, &y.g.to_f32_vec()?, Tol::Close(1e-3, 1e-3));
    Ok(())
}

/// A quantized MLP's down projection with SwiGLU computed by its quantizer (`ct_quant_fp8` /
/// `ct_quant_nvfp4` reading gate and up) against `ct_swiglu` then the linear, on the GPU: the
/// same codes, so the same bits (and the product against the CPU's emulation).
pub(super) fn swiglu_down(x: &mut Ctx) -> Result<()> {
    let (n, i) = (64usize, 512usize);
    let g = x.randp(DType::F32, &[M, i], 2.0)?;
    let u = x.randp(DType::F32, &[M, i], 1.0)?;
    let w = x.randp(DType::BF16, &[n, i], 0.05)?;
    let mut a = x.out(&[M, i])?;
    crate::ops::elementwise::swiglu(&x.cpu, &g.c, &u.c, &mut a.c, M)?;
    let amax = a.c.to_f32_vec()?.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (fmt, act) in [
        (QFormat::Fp8, ActQuant::Fp8 { scale: amax / 448.0 }),
        (
            QFormat::Nvfp4,
            ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts { rht: Some(3), stochastic: Some(4) } },
        ),
    ] {
        let (mut qc, mut qg) = (
            QTensor::alloc(fmt, n, i, Nvfp4Opts::default())?,
            QTensor::alloc_on(&x.gpu, fmt, n, i, Nvfp4Opts::default())?,
        );
        quantize::requantize(&x.cpu, &w.c, &mut qc, "w")?;
        quantize::requantize(&x.gpu, &w.g, &mut qg, "w")?;
        let (mut xq, mut y, mut fused) = (x.out(&[M, i])?, x.out(&[M, n])?, x.out(&[M, n])?);
        matmul::linear_act_q(&x.cpu, &a.c, &mut xq.c, &act, &qc, None, &mut y.c, M)?;
        crate::ops::elementwise::swiglu(&x.gpu, &g.g, &u.g, &mut a.g, M)?;
        matmul::linear_act_q(&x.gpu, &a.g, &mut xq.g, &act, &qg, None, &mut y.g, M)?;
        matmul::swiglu_linear_act_q(&x.gpu, &g.g, &u.g, &mut a.g, &mut xq.g, &act, &qg, None, &mut fused.g, M)?;
        let (apart, fused) = (y.g.to_f32_vec()?, fused.g.to_f32_vec()?);
        let name = if fmt == QFormat::Fp8 { "fp8" } else { "nvfp4 rht+sr" };
        x.record("down projection, SwiGLU in the quantizer vs apart", name, &apart, &fused, Tol::Exact);
        x.record(
            "down projection, SwiGLU in the quantizer vs CPU",
            name,
            &y.c.to_f32_vec()?,
            &fused,
            Tol::Close(1e-3, 1e-3),
        );
    }
    Ok(())
}
