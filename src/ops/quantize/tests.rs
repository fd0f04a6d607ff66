//! Quantization on every device of the build against `crate::quant`'s scalar encoders (which
//! tests/quant_formats.rs checks bit for bit against ml_dtypes): the tensor ops must give the
//! same bits row by row, whatever the device.

use super::*;
use crate::device::{CpuStorage, DType, Storage};
use crate::quant::fp8::{e4m3_table, E4M3};
use crate::quant::nvfp4::{self, Nvfp4Opts};
use crate::quant::qtensor::QFormat;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 2);
    (0..n).map(|i| (s.normal() * if i % 17 == 0 { 8.0 } else { 1.0 }) as f32).collect()
}

fn bytes(t: &Tensor) -> Vec<u8> {
    match t.storage() {
        Storage::Cpu(CpuStorage::U8(v)) => v.clone(),
        Storage::Cpu(_) => panic!("expected u8 codes"),
        Storage::Cuda(c) => {
            let mut b = vec![0u8; t.numel()];
            c.read_raw(&mut b).expect("device bytes");
            b
        }
    }
}

/// Fake quantization of activation rows: FP8 e4m3(x/s)·s element by element; NVFP4 each 16-value
/// block quantized by `nvfp4::quantize` and decoded by `nvfp4::dequantize_into`, bit for bit.
fn fake_quant_equals_the_scalar_encoders(dev: &Device) {
    let (m, k) = (3usize, 64usize);
    let x = data(m * k, 1);
    let xt = dev.from_f32(DType::F32, &[m, k], &x).unwrap();
    let mut y = dev.zeros(DType::F32, &[m, k]).unwrap();
    fake_quant_rows(dev, &xt, &mut y, m, &ActQuant::Fp8 { scale: 0.02 }).unwrap();
    let want: Vec<u32> = x.iter().map(|&v| (e4m3_table()[E4M3.encode(v / 0.02) as usize] * 0.02).to_bits()).collect();
    assert_eq!(y.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "fp8");
    let global = nvfp4::global_scale(6.0);
    fake_quant_rows(dev, &xt, &mut y, m, &ActQuant::Nvfp4 { global, opts: Nvfp4Opts::default() }).unwrap();
    let (mut p, mut s) = (vec![0u8; m * k / 2], vec![0u8; m * k / 16]);
    nvfp4::quantize(&x, k, global, &Nvfp4Opts::default(), &mut p, &mut s);
    let mut want = vec![0.0f32; m * k];
    nvfp4::dequantize_into(&p, &s, global, 0, &mut want);
    assert_eq!(
        y.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "nvfp4"
    );
}

/// In-place re-quantization of a weight: FP8 codes e4m3(w / (amax/448)); NVFP4 codes and block
/// scales of `nvfp4::quantize` under the global scale amax/2688; the scales as stated; and a
/// weight holding NaN is an error naming it.
fn requantize_equals_the_scalar_encoders(dev: &Device) {
    let (n, k) = (8usize, 32usize);
    let w = data(n * k, 2);
    let amax = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let wt = dev.from_f32(DType::F32, &[n, k], &w).unwrap();
    let mut q8 = QTensor::alloc_on(dev, QFormat::Fp8, n, k, Nvfp4Opts::default()).unwrap();
    let mut q4 = QTensor::alloc_on(dev, QFormat::Nvfp4, n, k, Nvfp4Opts::default()).unwrap();
    requantize_all(dev, &mut [(&wt, &mut q8, "w8"), (&wt, &mut q4, "w4")]).unwrap();
    assert_eq!(q8.scale, amax / E4M3.max());
    let want: Vec<u8> = w.iter().map(|&v| E4M3.encode(v / q8.scale)).collect();
    assert_eq!(bytes(&q8.codes), want, "fp8 codes");
    assert_eq!(q4.scale, nvfp4::global_scale(amax));
    let (mut p, mut s) = (vec![0u8; n * k / 2], vec![0u8; n * k / 16]);
    nvfp4::quantize(&w, k, q4.scale, &Nvfp4Opts::default(), &mut p, &mut s);
    assert_eq!(bytes(&q4.codes), p, "nvfp4 codes");
    assert_eq!(bytes(&q4.block_scales), s, "nvfp4 block scales");
    let mut bad = w.clone();
    bad[9] = f32::NAN;
    let bt = dev.from_f32(DType::F32, &[n, k], &bad).unwrap();
    let e = format!("{:#}", requantize(dev, &bt, &mut q8, "layer.w").unwrap_err());
    assert!(e.contains("layer.w") && e.contains("NaN"), "{e}");
}

test_device!(
    fake_quant_equals_the_scalar_encoders,
    fake_quant_equals_the_scalar_encoders_cpu,
    fake_quant_equals_the_scalar_encoders_sim,
    fake_quant_equals_the_scalar_encoders_cuda
);
test_device!(
    requantize_equals_the_scalar_encoders,
    requantize_equals_the_scalar_encoders_cpu,
    requantize_equals_the_scalar_encoders_sim,
    requantize_equals_the_scalar_encoders_cuda
);

/// The fused amax: the optimizer step writes BF16 weights and reduces each tensor's amax while
/// it does (`ops::optim`), and the requantize that reads those amaxes (no amax kernel) gives
/// the codes, block scales and scales of today's two-kernel path bit for bit — FP8, NVFP4, and
/// NVFP4 under the RHT (which reduces its own: its amax is of the rotated blocks). An amax
/// twice the true one is what the encode then uses (scale 2·amax/448): the slot is read, not
/// recomputed.
#[test]
fn the_optimizers_amax_feeds_the_requantize_bit_for_bit() {
    use crate::ops::optim::{self, Compute, Layout, Rule, State};
    let dev = Device::parse("cuda-sim:0").unwrap();
    let (n, k) = (16usize, 64usize);
    let layout = Layout::new(vec![(0, n * k), (n * k, n * k)]).unwrap();
    let mut master = dev.from_f32(DType::F32, &[2 * n * k], &data(2 * n * k, 3)).unwrap();
    let mut grad = dev.from_f32(DType::F32, &[2 * n * k], &data(2 * n * k, 4)).unwrap();
    let mut w = [dev.zeros(DType::BF16, &[n, k]).unwrap(), dev.zeros(DType::BF16, &[n, k]).unwrap()];
    let mut amax = dev.upload(Tensor::from_u32_host(&[2], vec![0; 2]).unwrap()).unwrap();
    let mut st = State { master: &mut master, m: None, v: None, layout: &layout };
    let mut ws: Vec<&mut Tensor> = w.iter_mut().collect();
    let out = Compute { weights: &mut ws, amax: Some(&mut amax) };
    optim::step(&dev, &mut st, &mut grad, 1.0, &Rule::sgd(0.1, 0.0), Some(out)).unwrap();
    let rht = Nvfp4Opts { rht: Some(7), stochastic: None };
    let alloc = || {
        [
            QTensor::alloc_on(&dev, QFormat::Fp8, n, k, Nvfp4Opts::default()).unwrap(),
            QTensor::alloc_on(&dev, QFormat::Nvfp4, n, k, Nvfp4Opts::default()).unwrap(),
            QTensor::alloc_on(&dev, QFormat::Nvfp4, n, k, rht).unwrap(),
        ]
    };
    let ([mut a8, mut a4, mut ar], [mut b8, mut b4, mut br]) = (alloc(), alloc());
    requantize_all(&dev, &mut [(&w[0], &mut a8, "w0"), (&w[1], &mut a4, "w1"), (&w[1], &mut ar, "w1 rht")]).unwrap();
    let mut items = [(&w[0], &mut b8, "w0"), (&w[1], &mut b4, "w1"), (&w[1], &mut br, "w1 rht")];
    requantize_all_known(&dev, &mut items, &amax, &[Some(0), Some(1), Some(1)]).unwrap();
    for (what, a, b) in [("fp8", &a8, &b8), ("nvfp4", &a4, &b4), ("nvfp4 rht", &ar, &br)] {
        assert_eq!(a.scale.to_bits(), b.scale.to_bits(), "{what}: scale");
        assert_eq!(bytes(&a.codes), bytes(&b.codes), "{what}: codes");
        if a.format == QFormat::Nvfp4 {
            assert_eq!(bytes(&a.block_scales), bytes(&b.block_scales), "{what}: block scales");
        }
    }
    // The optimizer's amax is the max |w| of the BF16 values it wrote.
    let w0 = w[0].to_f32_vec().unwrap();
    let true_amax = w0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert_eq!(amax.to_u32_vec().unwrap()[0], true_amax.to_bits());
    let doubled = dev.upload(Tensor::from_u32_host(&[1], vec![(2.0 * true_amax).to_bits()]).unwrap()).unwrap();
    requantize_all_known(&dev, &mut [(&w[0], &mut b8, "w0")], &doubled, &[Some(0)]).unwrap();
    assert_eq!(b8.scale, 2.0 * true_amax / E4M3.max());
    let want: Vec<u8> = w0.iter().map(|&v| E4M3.encode(v / b8.scale)).collect();
    assert_eq!(bytes(&b8.codes), want, "fp8 codes under the given amax");
    let e =
        format!("{:#}", requantize_all_known(&dev, &mut [(&w[0], &mut b8, "w0")], &doubled, &[Some(3)]).unwrap_err());
    assert!(e.contains("slot 3 of 1"), "{e}");
}

/// The learner's NVFP4 operand on every device equals `nvfp4::learner_round` on the host bit
/// for bit — per-tensor, per-row and fixed global scales, with and without the RHT and
/// stochastic rounding, from F32 and BF16 inputs, over the first m of more rows.
fn learner_round_equals_the_reference(dev: &Device) {
    use crate::quant::nvfp4::Global;
    let (rows, m, k) = (7usize, 5usize, 48usize);
    let x = data(rows * k, 11);
    for dt in [DType::F32, DType::BF16] {
        let xt = dev.from_f32(dt, &[rows, k], &x).unwrap();
        let xs = xt.to_f32_vec().unwrap();
        for opts in [
            Nvfp4Opts::default(),
            Nvfp4Opts { rht: Some(3), stochastic: None },
            Nvfp4Opts { rht: Some(3), stochastic: Some(5) },
        ] {
            for global in [Global::Tensor, Global::Row, Global::Fixed(0.004)] {
                let mut out = dev.from_f32(DType::F32, &[rows, k], &vec![f32::NAN; rows * k]).unwrap();
                learner_round(dev, &xt, &mut out, m, global, &opts).unwrap();
                let mut want = xs[..m * k].to_vec();
                nvfp4::learner_round(&mut want, k, global, &opts);
                let got = out.to_f32_vec().unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got[..m * k]), bits(&want), "{} {dt:?} {opts:?} {global:?}", dev.name());
                assert!(got[m * k..].iter().all(|v| v.is_nan()), "rows past m untouched");
            }
        }
    }
    let xt = dev.from_f32(DType::F32, &[2, 40], &vec![1.0; 80]).unwrap();
    let mut out = dev.zeros(DType::F32, &[2, 40]).unwrap();
    let e = format!("{:#}", learner_round(dev, &xt, &mut out, 2, Global::Row, &Nvfp4Opts::default()).unwrap_err());
    assert!(e.contains("40 is not a multiple of 16"), "{e}");
}

test_device!(
    learner_round_equals_the_reference,
    learner_round_equals_the_reference_cpu,
    learner_round_equals_the_reference_sim,
    learner_round_equals_the_reference_cuda
);
