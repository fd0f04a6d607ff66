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

/// y = quant(x) · wqᵀ on every path of `arch`'s simulated GPU (ordinal `ordinal`), for an
/// (m, n, k) problem. The device is the test's own: it reads the launch ledger, which a test
/// running beside it on a shared ordinal would add to (or take).
fn paths_on(arch: &str, ordinal: usize, m: usize, n: usize, k: usize) {
    let cd = CudaDevice::sim_unshared_arch(ordinal, arch);
    let gpu = Device::Cuda(cd.clone());
    let cpu = Device::cpu(1).unwrap();
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
        // The W4A4 mma kernel takes NVFP4 decode shapes (and, without CUTLASS, Auto's).
        let mma = format == QFormat::Nvfp4 && m <= 64 && n % 32 == 0 && k % 128 == 0;
        for path in [Path::Cutlass, Path::CublasLt, Path::Mma, Path::Emulated, Path::Auto] {
            let mut y = gpu.from_f32(DType::F32, &[m, n], &vec![f32::NAN; m * n]).unwrap();
            let what = format!("{arch} {format:?} K={k} via {path:?}");
            cd.take_ledger();
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
            if path == Path::Mma && !mma {
                let e = format!("{:#}", r.expect_err(&what));
                assert!(e.contains("no W4A4 mma kernel"), "{what}: {e}");
                continue;
            }
            let taken = r.unwrap_or_else(|e| panic!("{what}: {e:#}"));
            let expect = match path {
                Path::Auto if cutlass => Path::Cutlass,
                Path::Auto if mma => Path::Mma,
                Path::Auto => Path::Emulated,
                p => p,
            };
            assert_eq!(taken, expect, "{what}");
            // What ran: the mma kernel alone reads the codes; the emulated path decodes them.
            let ledger = cd.take_ledger();
            let ran = |name: &str| ledger.entries().any(|(key, _)| key.2 == name);
            assert_eq!(ran("ct_gemm_w4a4"), expect == Path::Mma, "{what}");
            if expect == Path::Mma {
                assert!(!ran("ct_dequant") && !ran("gemm bf16 nt"), "{what}");
                // Split over K where the column blocks alone leave SMs idle, then merged.
                assert_eq!(ran("ct_gemm_w4a4_merge"), cd.w4a4_splits(n, k) > 1, "{what}");
            }
            let got = y.to_f32_vec().unwrap();
            for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
                assert!((g as f64 - r).abs() <= 1e-4 + 1e-4 * r.abs(), "{what}: y[{i}] = {g}, reference {r}");
            }
        }
    }
}

#[test]
fn lowp_gemm_paths_on_sim_sm90a() {
    // FP8 through the sm_90a CUTLASS reference; NVFP4 has no CUTLASS kernel on Hopper: it
    // takes the mma kernel where the shape fits (m = 1, a decode step of one sequence; 9: one
    // partial m-tile; 37: three, the last partial; 64: four whole ones; K = 384: three
    // 128-value chunks for the 8 warps, most of them idle) and the emulated path where it does
    // not (n = 132, m = 65).
    paths_on("sm_90a", 112, 37, 132, 256);
    paths_on("sm_90a", 112, 1, 32, 128);
    paths_on("sm_90a", 112, 9, 64, 256);
    paths_on("sm_90a", 112, 37, 96, 256);
    paths_on("sm_90a", 112, 64, 32, 384);
    paths_on("sm_90a", 112, 65, 32, 128);
    // Split-K: 33 chunks of K over 2 column blocks, in 4 splits of 9, 9, 9 and 6 chunks.
    assert_eq!(CudaDevice::sim_unshared_arch(112, "sm_90a").w4a4_splits(64, 4224), 4);
    paths_on("sm_90a", 112, 37, 64, 4224);
    paths_on("sm_90a", 112, 1, 64, 4224);
}

/// How many splits of K the W4A4 kernel takes on an H200 (132 SMs, 8 warps a block): none
/// where the column blocks fill the SMs (a 4B gate/up projection: 304 blocks), enough for one
/// wave where they do not (its down projection: 80 blocks, 2 splits), never fewer than one
/// 128-value chunk per warp a split, at most 16.
#[test]
fn the_w4a4_kernel_splits_k_only_where_its_columns_leave_sms_idle() {
    let d = CudaDevice::sim_dry(126, Some("sm_90a")).unwrap();
    assert_eq!(d.w4a4_splits(9728, 2560), 1);
    assert_eq!(d.w4a4_splits(2560, 9728), 2);
    assert_eq!(d.w4a4_splits(4224, 2560), 1, "132 blocks: one whole wave");
    assert_eq!(d.w4a4_splits(64, 256), 1, "2 chunks: not one per warp in two splits");
    assert_eq!(d.w4a4_splits(64, 2048), 2, "16 chunks: 2 splits of one per warp");
    assert_eq!(d.w4a4_splits(32, 1 << 16), 16, "at most 16");
}

#[test]
fn lowp_gemm_paths_on_sim_sm100a() {
    // FP8 and NVFP4 through the sm_100a CUTLASS references (NVFP4 with swizzled scales);
    // K = 272 (17 blocks of 16) breaks NVFP4's K % 32 rule: Auto takes the emulated path.
    paths_on("sm_100a", 113, 37, 132, 256);
    paths_on("sm_100a", 113, 37, 132, 272);
}

/// The NVFP4 learner's W4A4 linear (`learner_w4a4`: CUTLASS block-scaled GEMM on the learner's
/// codes, globals applied on the device) against f64 over the host's `learner_round` copies,
/// for every activation global (per tensor, per row, fixed) with and without RHT + stochastic
/// rounding, with a bias, accumulating into y: on sm_100a through the CUTLASS block-scaled
/// GEMM, on sm_90a (no NVFP4 tensor cores) through a BF16 GEMM of the decoded unit values
/// whose epilogue applies the global scales (device pointer mode: no pass over y) unless they
/// are per row. Tolerance |gpu − ref| ≤ 1e-5 + 1e-4·|ref|: the same grid values on both sides,
/// only the f32 summation order (and, under the RHT, the f32 rotation back of the copies)
/// differ.
#[test]
fn the_learners_w4a4_linear_multiplies_its_rounded_operands() {
    use crate::formats::nvfp4::Global;
    let (m, n, k) = (37, 52, 64);
    let xs = data(m * k, 11, 1.0);
    let ws = data(n * k, 12, 0.05);
    let bs = data(n, 13, 0.1);
    let y0 = data(m * n, 14, 0.3);
    for (arch, ordinal) in [("sm_100a", 115), ("sm_90a", 116)] {
        let cd = CudaDevice::sim_unshared_arch(ordinal, arch);
        let dev = Device::Cuda(cd.clone());
        for opts in [Nvfp4Opts::default(), Nvfp4Opts { rht: Some(5), stochastic: Some(17) }] {
            for global in [Global::Tensor, Global::Row, Global::Fixed(0.004)] {
                let what = format!("{arch} {global:?} {opts:?}");
                let x = dev.from_f32(DType::F32, &[m, k], &xs).unwrap();
                let w = dev.from_f32(DType::F32, &[n, k], &ws).unwrap();
                let bias = dev.from_f32(DType::F32, &[n], &bs).unwrap();
                let (mut xr, mut wr) =
                    (dev.zeros(DType::F32, &[m, k]).unwrap(), dev.zeros(DType::F32, &[n, k]).unwrap());
                let xc = quantize::learner_round_codes(&dev, &x, &mut xr, m, global, &opts, true).unwrap();
                let wc = quantize::learner_round_codes(&dev, &w, &mut wr, n, Global::Tensor, &opts, true).unwrap();
                let (xc, wc) = (xc.expect("codes on CUDA"), wc.expect("codes on CUDA"));
                let mut y = dev.from_f32(DType::F32, &[m, n], &y0).unwrap();
                cd.take_ledger();
                let taken = super::learner_w4a4(&dev, &xc, &wc, Some(&bias), &mut y, true).unwrap();
                assert!(taken, "{what}: the W4A4 path taken");
                // The scale-out: a pass over the product (read, y read and written), or on
                // sm_90a with one activation scale the GEMM's (alpha, beta) alone.
                let l = cd.take_ledger();
                let rows = crate::device::cuda::ledger::rows(&l);
                let scale_out: Vec<(u64, f64)> =
                    rows.iter().filter(|r| r.op == "ct_nvfp4_scale_out").map(|r| (r.launches, r.bytes)).collect();
                let epilogue = arch == "sm_90a" && global != Global::Row;
                let pass = (m * n * 12) as f64;
                assert_eq!(scale_out, vec![(1, if epilogue { 16.0 } else { pass })], "{what}");
                let (mut hx, mut hw) = (xs.clone(), ws.clone());
                crate::formats::nvfp4::learner_round(&mut hx, k, global, &opts);
                crate::formats::nvfp4::learner_round(&mut hw, k, Global::Tensor, &opts);
                assert_eq!(xr.to_f32_vec().unwrap(), hx, "{what}: the rounded activations");
                let got = y.to_f32_vec().unwrap();
                // Written over NaN instead (beta 0: y is not read).
                let mut fresh = dev.from_f32(DType::F32, &[m, n], &vec![f32::NAN; m * n]).unwrap();
                assert!(super::learner_w4a4(&dev, &xc, &wc, Some(&bias), &mut fresh, false).unwrap());
                let fresh = fresh.to_f32_vec().unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|t| hx[i * k + t] as f64 * hw[j * k + t] as f64).sum();
                        let want = y0[i * n + j] as f64 + bs[j] as f64 + dot;
                        let g = got[i * n + j] as f64;
                        assert!((g - want).abs() <= 1e-5 + 1e-4 * want.abs(), "{what}: y[{i},{j}] {g} vs {want}");
                        let (g, want) = (fresh[i * n + j] as f64, bs[j] as f64 + dot);
                        assert!((g - want).abs() <= 1e-5 + 1e-4 * want.abs(), "{what}: fresh y[{i},{j}] {g} vs {want}");
                    }
                }
            }
        }
    }
}

/// An engine's NVFP4 weight keeps what its GEMM reads in the form the GEMM reads it, written
/// once per requantize instead of at every GEMM: on Hopper (the GEMM emulated) its BF16 unit
/// values, on sm_100a (CUTLASS's block-scaled kernel) its block scales in the tiled layout.
/// The GEMM through the kept form equals the one that prepares it per call, bit for bit, after
/// the first requantize and after a second one from other weights (a form left stale would
/// repeat the first result); and a call then launches one preparation (the activations')
/// instead of two. FP8 has its CUTLASS kernel on both and keeps nothing. m = 65 rows: a
/// prefill's shape (on Hopper, decode shapes take the mma kernel, which reads the codes).
#[test]
fn a_kept_gemm_operand_follows_each_requantize_sim() {
    use lowp::Kept::{Decoded, Swizzled};
    let (m, n, k) = (65, 64, 128);
    let cpu = Device::cpu(1).unwrap();
    assert!(!lowp::emulated_here(&cpu, QFormat::Nvfp4, n, k));
    for (i, (arch, prep)) in [("sm_90a", "ct_dequant"), ("sm_100a", "ct_swizzle_sf")].into_iter().enumerate() {
        let cd = CudaDevice::sim_unshared_arch(79 - i, arch);
        let gpu = Device::Cuda(cd.clone());
        assert_eq!(lowp::emulated_here(&gpu, QFormat::Nvfp4, n, k), arch == "sm_90a");
        assert!(!lowp::emulated_here(&gpu, QFormat::Fp8, n, k));
        // What an engine keeps: on Hopper nothing for shapes whose decode steps read the codes
        // (the mma kernel), the decoded copy for the others (N % 32 != 0, K % 128 != 0).
        let kept_on = |n, k| lowp::Kept::on(&gpu, QFormat::Nvfp4, n, k);
        if arch == "sm_90a" {
            assert_eq!((kept_on(n, k), kept_on(132, k), kept_on(n, 144)), (None, Some(Decoded), Some(Decoded)));
        } else {
            assert_eq!((kept_on(n, k), kept_on(132, k)), (Some(Swizzled), Some(Swizzled)));
        }
        let xg = gpu.from_f32(DType::F32, &[m, k], &data(m * k, 3, 1.0)).unwrap();
        let act = ActQuant::Nvfp4 { global: 4.0 / 2688.0, opts: Nvfp4Opts::default() };
        let mut kept = QTensor::alloc_on(&gpu, QFormat::Nvfp4, n, k, Nvfp4Opts::default()).unwrap();
        let plain_bytes = kept.size_bytes();
        if arch == "sm_90a" {
            kept.keep_decoded(&gpu).unwrap();
            assert_eq!(kept.size_bytes(), plain_bytes + 2 * n * k);
        } else {
            kept.keep_swizzled(&gpu, lowp::swizzled_sf_bytes(n, k)).unwrap();
            assert_eq!(kept.size_bytes(), plain_bytes + 128 * (k / 16));
        }
        let mut plain = QTensor::alloc_on(&gpu, QFormat::Nvfp4, n, k, Nvfp4Opts::default()).unwrap();
        let run = |q: &QTensor| -> (Vec<u32>, u64) {
            let mut y = gpu.zeros(DType::F32, &[m, n]).unwrap();
            cd.take_ledger();
            lowp::linear_act_q(&cd, &xg, &act, q, None, &mut y, m, Path::Auto).unwrap();
            let l = cd.take_ledger();
            let preps = crate::device::cuda::ledger::rows(&l).iter().filter(|r| r.op == prep).map(|r| r.launches).sum();
            (y.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect(), preps)
        };
        let mut first = Vec::new();
        for seed in [11, 12] {
            let w = gpu.from_f32(DType::BF16, &[n, k], &data(n * k, seed, 0.05)).unwrap();
            quantize::requantize(&gpu, &w, &mut kept, "w").unwrap();
            quantize::requantize(&gpu, &w, &mut plain, "w").unwrap();
            let ((a, pa), (b, pb)) = (run(&kept), run(&plain));
            assert_eq!(a, b, "{arch} weights {seed}: the kept form against a preparation per call");
            assert_eq!((pa, pb), (1, 2), "{arch}: {prep} launches per GEMM");
            assert_ne!(a, first, "{arch} weights {seed}: the result follows the new weights");
            first = a;
            // The guard's check of an engine's view reads the kept form too: true as
            // written, false once it is cleared while the codes stay.
            let host = w.to_f32_vec().unwrap();
            let rows: Vec<usize> = (0..n).step_by(9).collect();
            assert!(kept.matches_fresh(CpuFloats::F32(&host), "w", &rows).unwrap(), "{arch}");
            if seed == 12 {
                for t in [&mut kept.decoded, &mut kept.swizzled].into_iter().flatten() {
                    t.fill_zero().unwrap();
                }
                assert!(!kept.matches_fresh(CpuFloats::F32(&host), "w", &rows).unwrap(), "{arch}: a cleared kept form");
            }
        }
    }
}

/// The NVFP4 learner's straight-through backward on its operands' codes (`learner_dx`,
/// `learner_dw`: BF16 GEMMs in the RHT's rotated domain, then the scales and the inverse RHT)
/// against f64 over the host's `learner_round` copies (rotated back): dx = dy·Q(w) and
/// dw = dyᵀ·Q(x), both accumulating, for every activation global (per tensor, per token,
/// fixed), with and without RHT + stochastic rounding, on both profiles. The device rounds dy
/// to BF16 (as every BF16 linear's gradient GEMM); the reference multiplies bf16(dy) exactly,
/// so only the f32 summation and rotation orders differ: |gpu − ref| ≤ 1e-5 + 1e-4·S with
/// S = Σ|terms| (a sum over tokens cancels, so |ref| alone would not bound the rounding).
/// Per-token scales are folded into dy before its rounding (g_t·dy rounded, not dy): one
/// more BF16 rounding of every term, 2⁻⁸·S besides. `learner_grads` computes both from one
/// rounding of dy (two with per-token scales), bit for bit the same.
#[test]
fn the_learners_backward_multiplies_its_codes_sim() {
    use crate::formats::nvfp4::Global;
    let (m, n, k) = (37, 48, 64);
    let (dys, xs, ws) = (data(m * n, 21, 1.0), data(m * k, 22, 1.0), data(n * k, 23, 0.05));
    let (dx0, dw0) = (data(m * k, 24, 0.3), data(n * k, 25, 0.3));
    let bf = |v: f32| half::bf16::from_f32(v).to_f64();
    // Devices of their own (ordinals 66, 67): the ledger counts this test's casts only.
    for (arch, ordinal) in [("sm_100a", 67), ("sm_90a", 66)] {
        let cd = CudaDevice::sim_unshared_arch(ordinal, arch);
        let dev = Device::Cuda(cd.clone());
        for opts in [Nvfp4Opts::default(), Nvfp4Opts { rht: Some(5), stochastic: Some(17) }] {
            for global in [Global::Tensor, Global::Row, Global::Fixed(0.004)] {
                let what = format!("{arch} {global:?} {opts:?}");
                let up = |v: &[f32], shape: &[usize]| dev.from_f32(DType::F32, shape, v).unwrap();
                let (x, w, dy) = (up(&xs, &[m, k]), up(&ws, &[n, k]), up(&dys, &[m, n]));
                let xc = quantize::learner_codes(&dev, &x, m, global, &opts).unwrap();
                let wc = quantize::learner_codes(&dev, &w, n, Global::Tensor, &opts).unwrap();
                let (mut dx, mut dw) = (up(&dx0, &[m, k]), up(&dw0, &[n, k]));
                super::learner_dx(&dev, &dy, &wc, &mut dx, m, true).unwrap();
                super::learner_dw(&dev, &dy, &xc, &mut dw, m, true).unwrap();
                // Both from one rounding of dy (two for per-token scales): the same bits.
                let (mut dx2, mut dw2) = (up(&dx0, &[m, k]), up(&dw0, &[n, k]));
                cd.take_ledger();
                super::learner_grads(&dev, &dy, &wc, &xc, &mut dx2, true, &mut dw2, m).unwrap();
                let casts = crate::device::cuda::ledger::rows(&cd.take_ledger())
                    .into_iter()
                    .filter(|r| r.op == "ct_cast")
                    .map(|r| r.launches)
                    .sum::<u64>();
                assert_eq!(casts, if global == Global::Row { 2 } else { 1 }, "{what}: dy's BF16 roundings");
                assert_eq!(dx2.to_f32_vec().unwrap(), dx.to_f32_vec().unwrap(), "{what}: learner_grads' dx");
                assert_eq!(dw2.to_f32_vec().unwrap(), dw.to_f32_vec().unwrap(), "{what}: learner_grads' dw");
                let (mut hx, mut hw) = (xs.clone(), ws.clone());
                crate::formats::nvfp4::learner_round(&mut hx, k, global, &opts);
                crate::formats::nvfp4::learner_round(&mut hw, k, Global::Tensor, &opts);
                let close = |got: f32, base: f32, terms: &mut dyn Iterator<Item = f64>, rtol: f64, at: String| {
                    let (mut sum, mut s) = (0.0, 0.0);
                    for t in terms {
                        sum += t;
                        s += t.abs();
                    }
                    let want = base as f64 + sum;
                    let tol = 1e-5 + rtol * s;
                    assert!((got as f64 - want).abs() <= tol, "{what}: {at} {got} vs {want} (tolerance {tol:e})");
                };
                let dx = dx.to_f32_vec().unwrap();
                for i in 0..m {
                    for t in 0..k {
                        let mut terms = (0..n).map(|j| bf(dys[i * n + j]) * hw[j * k + t] as f64);
                        close(dx[i * k + t], dx0[i * k + t], &mut terms, 1e-4, format!("dx[{i},{t}]"));
                    }
                }
                let rtol = if global == Global::Row { 1e-4 + 2f64.powi(-8) } else { 1e-4 };
                let dw = dw.to_f32_vec().unwrap();
                for j in 0..n {
                    for t in 0..k {
                        let mut terms = (0..m).map(|i| bf(dys[i * n + j]) * hx[i * k + t] as f64);
                        close(dw[j * k + t], dw0[j * k + t], &mut terms, rtol, format!("dw[{j},{t}]"));
                    }
                }
            }
        }
    }
}

/// The projections of one input quantize it once (`linears_act_q`): on the simulated sm_90a
/// (FP8 through CUTLASS, NVFP4 through the mma kernel, with and without RHT + stochastic
/// rounding) and on the CPU, each output has the bits of its own `linear_act_q` (a bias on
/// one of them), and the GPU's ledger holds one activation quantization for the group against
/// one per projection.
#[test]
fn the_projections_of_one_input_quantize_it_once_sim() {
    use crate::ops::linear::{self as matmul, QProj};
    let (m, k, ns) = (5usize, 256usize, [64usize, 96]);
    let xs = data(m * k, 21, 1.0);
    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let cd = CudaDevice::sim_unshared_arch(125, "sm_90a");
    let gpu = Device::Cuda(cd.clone());
    let cpu = Device::cpu(1).unwrap();
    let bias = data(ns[1], 23, 0.1);
    for (format, act) in [
        (QFormat::Fp8, ActQuant::Fp8 { scale: amax / 448.0 }),
        (QFormat::Nvfp4, ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() }),
        (
            QFormat::Nvfp4,
            ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts { rht: Some(3), stochastic: Some(9) } },
        ),
    ] {
        for dev in [&cpu, &gpu] {
            let what = format!("{act:?} on {}", dev.name());
            let x = dev.from_f32(DType::F32, &[m, k], &xs).unwrap();
            let mut xq = dev.zeros(DType::F32, &[m, k]).unwrap();
            let b = dev.from_f32(DType::F32, &[ns[1]], &bias).unwrap();
            let mut ws = Vec::new();
            for (j, &n) in ns.iter().enumerate() {
                let w = dev.from_f32(DType::BF16, &[n, k], &data(n * k, 30 + j as u64, 0.05)).unwrap();
                let mut q = QTensor::alloc_on(dev, format, n, k, Nvfp4Opts::default()).unwrap();
                quantize::requantize(dev, &w, &mut q, "w").unwrap();
                ws.push(q);
            }
            let mut each = Vec::new();
            cd.take_ledger();
            for (j, q) in ws.iter().enumerate() {
                let mut y = dev.from_f32(DType::F32, &[m, ns[j]], &vec![f32::NAN; m * ns[j]]).unwrap();
                let bj = (j == 1).then_some(&b);
                matmul::linear_act_q(dev, &x, &mut xq, &act, q, bj, &mut y, m).unwrap();
                each.push(y.to_f32_vec().unwrap());
            }
            let quants = |l: &crate::device::cuda::ledger::Ledger| {
                l.entries().filter(|(key, _)| key.2.starts_with("ct_quant")).map(|(_, e)| e.launches).sum::<u64>()
            };
            let apart = quants(&cd.take_ledger());
            let (mut y0, mut y1) = (
                dev.from_f32(DType::F32, &[m, ns[0]], &vec![f32::NAN; m * ns[0]]).unwrap(),
                dev.from_f32(DType::F32, &[m, ns[1]], &vec![f32::NAN; m * ns[1]]).unwrap(),
            );
            let mut group =
                [QProj { w: &ws[0], bias: None, y: &mut y0 }, QProj { w: &ws[1], bias: Some(&b), y: &mut y1 }];
            matmul::linears_act_q(dev, &x, &mut xq, &act, &mut group, m).unwrap();
            let together = quants(&cd.take_ledger());
            assert_eq!(y0.to_f32_vec().unwrap(), each[0], "{what}: the first projection");
            assert_eq!(y1.to_f32_vec().unwrap(), each[1], "{what}: the second, with its bias");
            assert!(each[1].iter().all(|v| v.is_finite()), "{what}");
            if matches!(dev, Device::Cuda(_)) {
                assert_eq!((apart, together), (2, 1), "{what}: activation quantizations");
            }
        }
    }
}

/// A quantized MLP's down projection quantizes SwiGLU(gate, up) as its quantizer reads them
/// (`swiglu_linear_act_q`): on the simulated sm_90a (FP8 through CUTLASS, NVFP4 through the
/// mma kernel, with and without RHT + stochastic rounding) the bits of `ct_swiglu` then
/// `linear_act_q`, with one launch (no `ct_swiglu`) and SwiGLU's output never written; on the
/// CPU (its twin: SwiGLU, then the linear) the same values within the GPU GEMM's summation
/// order, |gpu − cpu| ≤ 1e-4 + 1e-4·|cpu|.
#[test]
fn a_down_projection_quantizes_swiglu_as_it_reads_gate_and_up_sim() {
    use crate::ops::elementwise;
    use crate::ops::linear as matmul;
    let (m, i, n) = (6usize, 384usize, 64usize);
    let gs = data(m * i, 41, 2.0);
    let us = data(m * i, 42, 1.0);
    let ws = data(n * i, 43, 0.05);
    let bias = data(n, 44, 0.1);
    // The calibrated input amax: SwiGLU's largest |value| on these rows (from the CPU's output).
    let cpu = Device::cpu(1).unwrap();
    let cd = CudaDevice::sim_unshared_arch(127, "sm_90a");
    let gpu = Device::Cuda(cd.clone());
    let mut probe = Tensor::cpu_zeros(DType::F32, &[m, i]);
    let (gc, uc) = (cpu.from_f32(DType::F32, &[m, i], &gs).unwrap(), cpu.from_f32(DType::F32, &[m, i], &us).unwrap());
    elementwise::swiglu(&cpu, &gc, &uc, &mut probe, m).unwrap();
    let amax = probe.to_f32_vec().unwrap().iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for (format, act) in [
        (QFormat::Fp8, ActQuant::Fp8 { scale: amax / 448.0 }),
        (QFormat::Nvfp4, ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() }),
        (
            QFormat::Nvfp4,
            ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts { rht: Some(7), stochastic: Some(8) } },
        ),
    ] {
        let what = format!("{act:?}");
        let mut outs = Vec::new();
        for dev in [&cpu, &gpu] {
            let g = dev.from_f32(DType::F32, &[m, i], &gs).unwrap();
            let u = dev.from_f32(DType::F32, &[m, i], &us).unwrap();
            let b = dev.from_f32(DType::F32, &[n], &bias).unwrap();
            let w = dev.from_f32(DType::BF16, &[n, i], &ws).unwrap();
            let mut q = QTensor::alloc_on(dev, format, n, i, Nvfp4Opts::default()).unwrap();
            quantize::requantize(dev, &w, &mut q, "w").unwrap();
            let mut xq = dev.zeros(DType::F32, &[m, i]).unwrap();
            let nan = |r: usize, c: usize| dev.from_f32(DType::F32, &[r, c], &vec![f32::NAN; r * c]).unwrap();
            // Apart: SwiGLU written, then the linear on it.
            let (mut a, mut y) = (nan(m, i), nan(m, n));
            elementwise::swiglu(dev, &g, &u, &mut a, m).unwrap();
            matmul::linear_act_q(dev, &a, &mut xq, &act, &q, Some(&b), &mut y, m).unwrap();
            // Fused.
            let (mut a2, mut y2) = (nan(m, i), nan(m, n));
            cd.take_ledger();
            matmul::swiglu_linear_act_q(dev, &g, &u, &mut a2, &mut xq, &act, &q, Some(&b), &mut y2, m).unwrap();
            let l = cd.take_ledger();
            let (y, y2) = (y.to_f32_vec().unwrap(), y2.to_f32_vec().unwrap());
            assert!(y.iter().all(|v| v.is_finite()), "{what}");
            assert_eq!(y2, y, "{what} on {}: fused against apart", dev.name());
            if let Device::Cuda(_) = dev {
                let launched = |op: &str| l.entries().filter(|(k, _)| k.2 == op).map(|(_, e)| e.launches).sum::<u64>();
                let quant = if format == QFormat::Fp8 { "ct_quant_fp8" } else { "ct_quant_nvfp4" };
                assert_eq!((launched("ct_swiglu"), launched(quant)), (0, 1), "{what}: launches");
                assert!(a2.to_f32_vec().unwrap().iter().all(|v| v.is_nan()), "{what}: SwiGLU's output not written");
            }
            outs.push(y2);
        }
        for (j, (&g, &c)) in outs[1].iter().zip(&outs[0]).enumerate() {
            assert!((g - c).abs() <= 1e-4 + 1e-4 * c.abs(), "{what}: y[{j}] gpu {g} cpu {c}");
        }
    }
}
