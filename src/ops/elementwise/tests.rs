//! The row-wise ops on every device of the build against plain references: embedding and
//! gather bit for bit (they copy), SwiGLU against f64, max |x| exactly (it selects).

use super::*;
use crate::device::DType;

fn rowwise_ops_match_references(dev: &Device) {
    let mut s = crate::rand::Stream::new(11, 1);
    let (v, c, m) = (9usize, 6usize, 4usize);
    let table: Vec<f32> = (0..v * c).map(|_| s.normal() as f32).collect();
    let ids: Vec<u32> = vec![3, 0, 8, 3];
    let tt = dev.from_f32(DType::F32, &[v, c], &table).unwrap();
    let it = dev.upload(Tensor::from_u32_host(&[m], ids.clone()).unwrap()).unwrap();
    let mut out = dev.zeros(DType::F32, &[m, c]).unwrap();
    embedding(dev, &tt, &it, &mut out, m).unwrap();
    let want: Vec<f32> = ids.iter().flat_map(|&i| table[i as usize * c..(i as usize + 1) * c].to_vec()).collect();
    assert_eq!(out.to_f32_vec().unwrap(), want, "embedding");
    gather_rows(dev, &tt, &it, &mut out, m).unwrap();
    assert_eq!(out.to_f32_vec().unwrap(), want, "gather_rows");

    let (g, u): (Vec<f32>, Vec<f32>) = (0..m * c).map(|_| ((4.0 * s.normal()) as f32, s.normal() as f32)).unzip();
    let (gt, ut) = (dev.from_f32(DType::F32, &[m, c], &g).unwrap(), dev.from_f32(DType::F32, &[m, c], &u).unwrap());
    swiglu(dev, &gt, &ut, &mut out, m).unwrap();
    for (i, &y) in out.to_f32_vec().unwrap().iter().enumerate() {
        let (g, u) = (g[i] as f64, u[i] as f64);
        let want = g / (1.0 + (-g).exp()) * u;
        // |Δ| ≤ 1e-6 + 1e-6·|ref|: f32 exp within 2 ulp, three f32 roundings.
        assert!((y as f64 - want).abs() <= 1e-6 + 1e-6 * want.abs(), "swiglu[{i}]: {y} vs {want}");
    }

    let mut x = g.clone();
    x[5] = -9.5;
    let xt = dev.from_f32(DType::F32, &[m, c], &x).unwrap();
    assert_eq!(amax_rows(dev, &xt, m).unwrap(), 9.5, "amax");
    x[7] = f32::NAN;
    let xt = dev.from_f32(DType::F32, &[m, c], &x).unwrap();
    assert!(amax_rows(dev, &xt, m).unwrap().is_nan(), "amax propagates NaN");

    // An id outside the vocabulary is an error (CPU: before any write; CUDA: at the next sync).
    // A simulated GPU's error word is the device's: on a shared ordinal a test running beside
    // this one would read it at its own next sync, so the error is provoked on a device of its
    // own.
    let own;
    let d = if dev.name().starts_with("cuda-sim") {
        own = Device::Cuda(crate::device::cuda::CudaDevice::sim_unshared_arch(114, "sm_90a"));
        &own
    } else {
        dev
    };
    let tt = d.from_f32(DType::F32, &[v, c], &table).unwrap();
    let mut out = d.zeros(DType::F32, &[m, c]).unwrap();
    let bad = d.upload(Tensor::from_u32_host(&[1], vec![v as u32]).unwrap()).unwrap();
    let r = embedding(d, &tt, &bad, &mut out, 1).and_then(|_| d.synchronize());
    assert!(r.is_err(), "out-of-vocabulary id accepted");
}

test_device!(
    rowwise_ops_match_references,
    rowwise_ops_match_references_cpu,
    rowwise_ops_match_references_sim,
    rowwise_ops_match_references_cuda
);
