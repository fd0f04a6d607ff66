//! The device-level fused LM-head loss on every device against the f64 twin (`grad.rs` at
//! T = f64 on the same values): statistics, the surrogate loss and both gradients, plain and
//! centered, with chunks that split the scored rows unevenly and a vocabulary wider than a
//! block's 1024 threads. Tolerances |a − ref| ≤ atol + rtol·|ref|: F32 head 1e-5 / 1e-4 (f32
//! logits and sums against f64); BF16 head (CUDA rounds h and dz to BF16 for its GEMMs, the CPU
//! widens the head to f32): the relative norm error of each output ≤ 1e-2.

use super::grad::{self, Center, Scratch};
use super::*;

const C: usize = 40;
const V: usize = 1500;
const N_H: usize = 23;

fn data(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 3);
    (0..n).map(|_| s.normal() as f32 * std).collect()
}

struct Inputs {
    h: Vec<f32>,
    wh: Vec<f32>,
    rows: Vec<u32>,
    targets: Vec<u32>,
    coef: Vec<f32>,
    ids: Vec<u32>,
    probs: Vec<f32>,
}

const K: usize = 3;

fn inputs() -> Inputs {
    let rows: Vec<u32> = vec![3, 0, 22, 7, 8, 9, 15, 1, 2, 19, 11, 12, 5];
    let n = rows.len();
    let targets = (0..n as u32).map(|i| (i * 397 + 11) % V as u32).collect();
    let coef = data(n, 4, 1.0);
    let ids = (0..(n * K) as u32).map(|i| (i * 131 + 7) % V as u32).collect();
    let probs = (0..n * K).map(|i| [0.5, 0.3, 0.2][i % K]).collect();
    Inputs { h: data(N_H * C, 1, 1.0), wh: data(V * C, 2, 0.3), rows, targets, coef, ids, probs }
}

/// (logp, entropy, loss, dh, dwh) of the f64 twin, on `wh` as the device stores it.
fn reference(x: &Inputs, wh: &[f32], center: bool) -> (Vec<f64>, Vec<f64>, f64, Vec<f64>, Vec<f64>) {
    let f = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (h, w, coef) = (f(&x.h), f(wh), f(&x.coef));
    let n = x.rows.len();
    let mut s = Scratch::<f64>::new(4, C, V);
    let (mut lp, mut en) = (vec![0.0; n], vec![0.0; n]);
    grad::stats(C, V, &x.rows, &x.targets, &h, &w, 0.7, &mut s, &mut lp, &mut en);
    let (mut dh, mut dwh) = (vec![0.0; N_H * C], vec![0.0; V * C]);
    let ct = Center { k: K, ids: &x.ids, probs: &x.probs };
    let loss = grad::grad_centered(
        C,
        V,
        &x.rows,
        &x.targets,
        &coef,
        center.then_some(&ct),
        &h,
        &w,
        0.7,
        &mut s,
        &mut dh,
        &mut dwh,
    );
    (lp, en, loss, dh, dwh)
}

fn close(dev: &Device, what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - r).abs() <= atol + rtol * r.abs(), "{} {what}[{i}]: {g} vs {r}", dev.name());
    }
}

fn rel_norm(got: &[f32], want: &[f64]) -> f64 {
    let d: f64 = got.iter().zip(want).map(|(&g, &r)| (g as f64 - r).powi(2)).sum();
    let w: f64 = want.iter().map(|r| r * r).sum();
    (d / w).sqrt()
}

fn fused_loss(dev: &Device) {
    let x = inputs();
    let n = x.rows.len();
    let up = |v: Vec<u32>| dev.upload(Tensor::from_u32_host(&[v.len()], v).unwrap()).unwrap();
    let (rows, targets, ids) = (up(x.rows.clone()), up(x.targets.clone()), up(x.ids.clone()));
    let h = dev.from_f32(DType::F32, &[N_H, C], &x.h).unwrap();
    let coef = dev.from_f32(DType::F32, &[n], &x.coef).unwrap();
    let probs = dev.from_f32(DType::F32, &[n * K], &x.probs).unwrap();
    let r = Rows { rows: &rows, targets: &targets };
    for wdt in [DType::F32, DType::BF16] {
        let wh = dev.from_f32(wdt, &[V, C], &x.wh).unwrap();
        let whv = wh.to_f32_vec().unwrap();
        for center in [false, true] {
            let (lp_r, en_r, loss_r, dh_r, dwh_r) = reference(&x, &whv, center);
            let what = format!("{} head, centered {center}", wdt.name());
            let mut lp = dev.from_f32(DType::F32, &[n], &vec![f32::NAN; n]).unwrap();
            let mut en = dev.from_f32(DType::F32, &[n], &vec![f32::NAN; n]).unwrap();
            stats(dev, &h, &wh, &r, 0.7, 5, &mut lp, &mut en).unwrap();
            // The gradients accumulate into what the buffers hold.
            let (dh0, dwh0) = (data(N_H * C, 8, 0.1), data(V * C, 9, 0.1));
            let mut dh = dev.from_f32(DType::F32, &[N_H, C], &dh0).unwrap();
            let mut dwh = dev.from_f32(DType::F32, &[V, C], &dwh0).unwrap();
            let dh_r: Vec<f64> = dh_r.iter().zip(&dh0).map(|(a, &b)| a + b as f64).collect();
            let dwh_r: Vec<f64> = dwh_r.iter().zip(&dwh0).map(|(a, &b)| a + b as f64).collect();
            let ct = DevCenter { k: K, ids: &ids, probs: &probs };
            let loss = loss_grad(dev, &h, &wh, &r, &coef, center.then_some(&ct), 0.7, 5, &mut dh, &mut dwh).unwrap();
            let (lp, en, dh, dwh) = (
                lp.to_f32_vec().unwrap(),
                en.to_f32_vec().unwrap(),
                dh.to_f32_vec().unwrap(),
                dwh.to_f32_vec().unwrap(),
            );
            if wdt == DType::F32 || dev.is_cpu() {
                close(dev, &format!("{what}: logp"), &lp, &lp_r, 1e-5, 1e-4);
                close(dev, &format!("{what}: entropy"), &en, &en_r, 1e-5, 1e-4);
                close(dev, &format!("{what}: dh"), &dh, &dh_r, 1e-5, 1e-4);
                close(dev, &format!("{what}: dWh"), &dwh, &dwh_r, 1e-5, 1e-4);
                assert!((loss - loss_r).abs() <= 1e-5 + 1e-4 * loss_r.abs(), "{what}: loss {loss} vs {loss_r}");
            } else {
                for (name, got, want) in
                    [("logp", &lp, &lp_r), ("entropy", &en, &en_r), ("dh", &dh, &dh_r), ("dWh", &dwh, &dwh_r)]
                {
                    let e = rel_norm(got, want);
                    assert!(e <= 1e-2, "{} {what}: {name} relative norm error {e:e}", dev.name());
                }
                assert!((loss - loss_r).abs() <= 1e-2 * loss_r.abs().max(1.0), "{what}: loss {loss} vs {loss_r}");
            }
            // Rows that are not scored keep what they held.
            for row in [4usize, 6, 10] {
                assert_eq!(dh[row * C..(row + 1) * C], dh0[row * C..(row + 1) * C], "{what}: dh of unscored row {row}");
            }
        }
    }
}

test_device!(fused_loss, fused_loss_cpu, fused_loss_sim, fused_loss_cuda);

#[test]
fn bad_indices_are_errors_not_panics() {
    let dev = Device::cpu(1).unwrap();
    let x = inputs();
    let h = dev.from_f32(DType::F32, &[N_H, C], &x.h).unwrap();
    let wh = dev.from_f32(DType::F32, &[V, C], &x.wh).unwrap();
    let rows = Tensor::from_u32_host(&[2], vec![0, N_H as u32]).unwrap();
    let targets = Tensor::from_u32_host(&[2], vec![0, 1]).unwrap();
    let (mut lp, mut en) = (Tensor::cpu_zeros(DType::F32, &[2]), Tensor::cpu_zeros(DType::F32, &[2]));
    let r = Rows { rows: &rows, targets: &targets };
    let e = format!("{:#}", stats(&dev, &h, &wh, &r, 1.0, 4, &mut lp, &mut en).unwrap_err());
    assert!(e.contains("row index 23 outside the 23 hidden rows"), "{e}");
}

/// ct_lm_dz storing dz in BF16 itself (a BF16 head's loss pass without centering) writes the
/// bits `ct_cast` writes from the f32 dz it stores otherwise (`dz_two_ways`): 3 rows of 1,500
/// logits (wider than the block), coefficients of both signs, each row's target moved by −k.
#[test]
fn the_loss_kernels_bf16_logit_gradient_is_its_f32_one_rounded_sim() {
    let cd = crate::device::cuda::CudaDevice::sim_unshared_arch(124, "sm_90a");
    let z = data(3 * V, 11, 2.0);
    let (f32s, bf16s) = super::dz_two_ways(&cd, &z, &[7.5, 8.0, 6.9], &[0.8, -1.3, 0.05], &[5, 1499, 1024], 1.0 / 0.7)
        .expect("both launches");
    assert!(f32s.iter().all(|x| x.is_finite()) && f32s[5] < 0.0 && f32s[V + 1499] > 0.0, "finite; targets moved by -k");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&f32s), bits(&bf16s));
}
