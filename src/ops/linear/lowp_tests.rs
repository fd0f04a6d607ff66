//! The real low-precision GEMM paths (`cuda_lowp`: CUTLASS, cuBLASLt, emulated) on the
//! simulated GPU of each architecture profile, against an f64 reference built on the host
//! from the CPU quantizers' codes: which path exists where (no NVFP4 CUTLASS kernel on sm_90),
//! what `Auto` picks, and that each path computes y = quant(x) · wqᵀ.
//!
//! Tolerance |gpu − ref| ≤ 1e-4 + 1e-4·|ref|: the operands are the same exact unit values on
//! both sides; the reference multiplies the dequantized f32 values (each rounded once) in f64,
//! the simulated libraries the unit values with alpha = product of the tensor scales.

use super::cuda_lowp::{self as lowp, Path};
use crate::device::cuda::CudaDevice;
use crate::device::{CpuFloats, CpuStorage, DType, Device, Storage, Tensor};
use crate::formats::fp8::e4m3_table;
use crate::formats::nvfp4;
use crate::ops::quantize::{self, ActQuant};
use crate::quant::nvfp4::Nvfp4Opts;
use crate::quant::qtensor::{QFormat, QTensor};

fn data(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 0);
    (0..n).map(|_| s.normal() as f32 * std).collect()
}

/// The weight's values as the CPU quantizer left them (f32, exact decode).
fn dequantized(q: &QTensor) -> Vec<f32> {
    let bytes = |t: &Tensor| match t.storage() {
        Storage::Cpu(CpuStorage::U8(v)) => v.clone(),
        _ => panic!("expected host bytes"),
    };
    let codes = bytes(&q.codes);
    match q.format {
        QFormat::Fp8 => codes.iter().map(|&c| e4m3_table()[c as usize] * q.scale).collect(),
        QFormat::Nvfp4 => {
            let sc = bytes(&q.block_scales);
            let mut out = vec![0.0f32; q.rows * q.k];
            nvfp4::dequantize_into(&codes, &sc, q.scale, 0, &mut out);
            out
        }
    }
}

/// y = quant(x) · wqᵀ on every path of `arch`'s simulated GPU (ordinal `ordinal`).
fn paths_on(arch: &str, ordinal: usize, k: usize) {
    let cd = CudaDevice::sim_arch(ordinal, Some(arch)).unwrap();
    let gpu = Device::Cuda(cd.clone());
    let cpu = Device::cpu(1).unwrap();
    let (m, n) = (37, 132);
    let xs = data(m * k, 1, 1.0);
    let ws = data(n * k, 2, 0.05);
    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let xg = gpu.from_f32(DType::F32, &[m, k], &xs).unwrap();
    let wg = gpu.from_f32(DType::BF16, &[n, k], &ws).unwrap();
    let wb: Vec<f32> = wg.to_f32_vec().unwrap();
    let sm100 = arch == "sm_100a";
    for format in [QFormat::Fp8, QFormat::Nvfp4] {
        let act = match format {
            QFormat::Fp8 => ActQuant::Fp8 { scale: amax / 448.0 },
            QFormat::Nvfp4 => ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() },
        };
        let mut qc = QTensor::alloc(format, n, k, Nvfp4Opts::default()).unwrap();
        qc.requantize_cpu(CpuFloats::F32(&wb), "w").unwrap();
        let mut qg = QTensor::alloc_on(&gpu, format, n, k, Nvfp4Opts::default()).unwrap();
        quantize::requantize(&gpu, &wg, &mut qg, "w").unwrap();
        // The reference: the CPU's fake-quantized activations times the CPU's weight values.
        let xc = cpu.from_f32(DType::F32, &[m, k], &xs).unwrap();
        let mut xq = Tensor::cpu_zeros(DType::F32, &[m, k]);
        quantize::fake_quant_rows(&cpu, &xc, &mut xq, m, &act).unwrap();
        let (xq, wq) = (xq.to_f32_vec().unwrap(), dequantized(&qc));
        let want: Vec<f64> =
            (0..m * n).map(|ij| (0..k).map(|t| xq[ij / n * k + t] as f64 * wq[ij % n * k + t] as f64).sum()).collect();
        let cutlass = k % if format == QFormat::Fp8 { 16 } else { 32 } == 0 && (format == QFormat::Fp8 || sm100);
        for path in [Path::Cutlass, Path::CublasLt, Path::Emulated, Path::Auto] {
            let mut y = gpu.from_f32(DType::F32, &[m, n], &vec![f32::NAN; m * n]).unwrap();
            let what = format!("{arch} {format:?} K={k} via {path:?}");
            let r = lowp::linear_act_q(&cd, &xg, &act, &qg, None, &mut y, m, path);
            if path == Path::Cutlass && !cutlass {
                let e = format!("{:#}", r.expect_err(&what));
                assert!(e.contains("no CUTLASS"), "{what}: {e}");
                continue;
            }
            if path == Path::CublasLt && format == QFormat::Nvfp4 && k % 32 != 0 {
                // cuBLASLt refuses it too (16 bytes of FP4 per row step).
                let e = format!("{:#}", r.expect_err(&what));
                assert!(e.contains("K divisible by 32"), "{what}: {e}");
                continue;
            }
            let taken = r.unwrap_or_else(|e| panic!("{what}: {e:#}"));
            let expect = match path {
                Path::Auto if cutlass => Path::Cutlass,
                Path::Auto => Path::Emulated,
                p => p,
            };
            assert_eq!(taken, expect, "{what}");
            let got = y.to_f32_vec().unwrap();
            for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
                assert!((g as f64 - r).abs() <= 1e-4 + 1e-4 * r.abs(), "{what}: y[{i}] = {g}, reference {r}");
            }
        }
    }
}

#[test]
fn lowp_gemm_paths_on_sim_sm90a() {
    // FP8 through the sm_90a CUTLASS reference; NVFP4 has no CUTLASS kernel on Hopper.
    paths_on("sm_90a", 6, 256);
}

#[test]
fn lowp_gemm_paths_on_sim_sm100a() {
    // FP8 and NVFP4 through the sm_100a CUTLASS references (NVFP4 with swizzled scales);
    // K = 272 (17 blocks of 16) breaks NVFP4's K % 32 rule: Auto takes the emulated path.
    paths_on("sm_100a", 7, 256);
    paths_on("sm_100a", 7, 272);
}
