//! The linears on every device of the build against f64 references.

use super::cpu::BIAS;
use super::*;
use crate::device::{CpuFloats, DType};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 0);
    (0..n).map(|_| s.normal() as f32).collect()
}

#[test]
fn fused_projections_equal_the_kernel_then_the_bias() {
    // BF16 and F32 weights and biases (the BF16 bias widened into scratch), one packed once:
    // each output of `linears` equals linear_nt alone followed by y += f32(bias), bitwise.
    let dev = Device::cpu(2).unwrap();
    let (m, k) = (11, 24);
    let x = dev.from_f32(DType::F32, &[m, k], &data(m * k, 1)).unwrap();
    let shapes = [(24, DType::BF16), (8, DType::F32), (13, DType::BF16)];
    let ws: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, dt))| dev.from_f32(dt, &[n, k], &data(n * k, 10 + i as u64)).unwrap())
        .collect();
    let bs: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, dt))| dev.from_f32(dt, &[n], &data(n, 20 + i as u64)).unwrap())
        .collect();
    let p1 = Panels::pack(CpuFloats::of(&ws[1]).unwrap(), 8, k).unwrap();
    let mut ys: Vec<Tensor> = shapes.iter().map(|&(n, _)| dev.zeros(DType::F32, &[m, n]).unwrap()).collect();
    let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
    let projs = [
        Proj { w: &ws[0], panels: None, bias: Some(&bs[0]), y: y0 },
        Proj { w: &ws[1], panels: Some(&p1), bias: Some(&bs[1]), y: y1 },
        Proj { w: &ws[2], panels: None, bias: Some(&bs[2]), y: y2 },
    ];
    linears(&dev, &x, projs, m).unwrap();
    let xs = x.to_f32_vec().unwrap();
    for (i, &(n, _)) in shapes.iter().enumerate() {
        let mut want = vec![0.0f32; m * n];
        super::kernel::linear_nt(m, n, k, &xs, CpuFloats::of(&ws[i]).unwrap(), &mut want, n, false);
        let b = bs[i].to_f32_vec().unwrap();
        for r in 0..m {
            for j in 0..n {
                want[r * n + j] += b[j];
            }
        }
        let got = ys[i].to_f32_vec().unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "projection {i}");
    }
}

#[test]
fn a_nested_call_with_the_bias_scratch_in_use_gets_its_own() {
    // As when rayon runs another caller's linear on a thread waiting inside one: the
    // thread's widened-bias scratch is borrowed; the nested call must still be right.
    let dev = Device::cpu(1).unwrap();
    let (m, k, n) = (3, 8, 5);
    let x = dev.from_f32(DType::F32, &[m, k], &data(m * k, 1)).unwrap();
    let w = dev.from_f32(DType::F32, &[n, k], &data(n * k, 2)).unwrap();
    let b = dev.from_f32(DType::BF16, &[n], &data(n, 3)).unwrap();
    let mut want = dev.zeros(DType::F32, &[m, n]).unwrap();
    linear(&dev, &x, &w, Some(&b), &mut want, m, false).unwrap();
    let mut got = dev.zeros(DType::F32, &[m, n]).unwrap();
    BIAS.with(|c| {
        let _held = c.borrow_mut();
        linear(&dev, &x, &w, Some(&b), &mut got, m, false).unwrap();
    });
    assert_eq!(got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
}

#[test]
fn a_misshapen_projection_is_an_error() {
    let dev = Device::cpu(1).unwrap();
    let x = dev.zeros(DType::F32, &[2, 4]).unwrap();
    let w = dev.zeros(DType::F32, &[3, 4]).unwrap();
    let b = dev.zeros(DType::F32, &[5]).unwrap();
    let mut y = dev.zeros(DType::F32, &[2, 3]).unwrap();
    let e = linears(&dev, &x, [Proj { w: &w, panels: None, bias: Some(&b), y: &mut y }], 2).unwrap_err();
    assert!(format!("{e:#}").contains("bias"), "{e:#}");
}
