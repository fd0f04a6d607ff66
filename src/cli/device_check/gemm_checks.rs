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
