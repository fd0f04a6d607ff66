//! The optimizer step on every device against torch's formulas in f64, and the CUDA twin
//! against the CPU's bit for bit (master, moments, clipped gradient, compute weights and their
//! amax), across chunk boundaries. Tolerance against the f64 formula: |a − ref| ≤ 1e-6 +
//! 1e-5·|ref| (f32 element arithmetic over three steps).

use super::*;
use crate::device::bf16_rne;

/// Three tensors, the middle one crossing a chunk boundary.
fn layout() -> Layout {
    Layout::new(vec![(0, 5), (5, CHUNK + 7), (CHUNK + 12, 3)]).unwrap()
}

fn data(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 7);
    (0..n).map(|_| s.normal() as f32 * std).collect()
}

/// torch.optim.AdamW in f64 on one value over `grads` (each already clipped).
fn adamw_ref(p0: f64, grads: &[f64], lr: f64, wd: f64, b: [f64; 2], eps: f64) -> f64 {
    let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
    for (t, &g) in grads.iter().enumerate() {
        let t = t as i32 + 1;
        p *= 1.0 - lr * wd;
        m = b[0] * m + (1.0 - b[0]) * g;
        v = b[1] * v + (1.0 - b[1]) * g * g;
        p -= lr / (1.0 - b[0].powi(t)) * m / (v.sqrt() / (1.0 - b[1].powi(t)).sqrt() + eps);
    }
    p
}

struct Run {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<f32>,
    compute: Vec<f32>,
    amax: Vec<f32>,
}

/// Three AdamW steps (the second clipped by 0.5) or three SGD steps on `dev`, compute weights
/// of `cdt`.
fn run(dev: &Device, adam: bool, cdt: DType) -> Run {
    let l = layout();
    let n = l.len();
    let mut master = dev.from_f32(DType::F32, &[n], &data(n, 1, 1.0)).unwrap();
    let mut m = dev.from_f32(DType::F32, &[n], &vec![0.0; n]).unwrap();
    let mut v = dev.from_f32(DType::F32, &[n], &vec![0.0; n]).unwrap();
    // The compute weights are one tensor per parameter, of its own shape.
    let shapes = [vec![5], vec![CHUNK + 7], vec![3, 1]];
    let mut compute: Vec<Tensor> =
        shapes.iter().map(|s| dev.from_f32(cdt, s, &vec![f32::NAN; s.iter().product()]).unwrap()).collect();
    let mut amax = dev.upload(Tensor::from_u32_host(&[3], vec![u32::MAX; 3]).unwrap()).unwrap();
    let mut grad = dev.from_f32(DType::F32, &[n], &vec![0.0; n]).unwrap();
    for t in 1..=3u64 {
        grad.write_f32(&data(n, 10 + t, 0.3)).unwrap();
        let clip = if t == 2 { 0.5 } else { 1.0 };
        let rule = if adam { Rule::adamw(1e-2, 0.1, [0.9, 0.999], 1e-8, t) } else { Rule::sgd(0.5, 0.01) };
        let mut st = State { master: &mut master, m: adam.then_some(&mut m), v: adam.then_some(&mut v), layout: &l };
        let mut ws: Vec<&mut Tensor> = compute.iter_mut().collect();
        let out = Compute { weights: &mut ws, amax: Some(&mut amax) };
        step(dev, &mut st, &mut grad, clip, &rule, Some(out)).unwrap();
    }
    Run {
        master: master.to_f32_vec().unwrap(),
        m: m.to_f32_vec().unwrap(),
        v: v.to_f32_vec().unwrap(),
        grad: grad.to_f32_vec().unwrap(),
        compute: compute.iter().flat_map(|t| t.to_f32_vec().unwrap()).collect(),
        amax: amax.to_u32_vec().unwrap().into_iter().map(f32::from_bits).collect(),
    }
}

fn adamw_follows_torch(dev: &Device) {
    let r = run(dev, true, DType::BF16);
    let l = layout();
    let p0 = data(l.len(), 1, 1.0);
    let gs: Vec<Vec<f32>> = (1..=3).map(|t| data(l.len(), 10 + t, 0.3)).collect();
    for i in (0..l.len()).step_by(97).chain([4, 5, CHUNK + 4, CHUNK + 5, l.len() - 1]) {
        let g: Vec<f64> = (0..3).map(|t| gs[t][i] as f64 * if t == 1 { 0.5 } else { 1.0 }).collect();
        let want = adamw_ref(p0[i] as f64, &g, 1e-2, 0.1, [0.9, 0.999], 1e-8);
        let got = r.master[i] as f64;
        assert!((got - want).abs() <= 1e-6 + 1e-5 * want.abs(), "{}: p[{i}] = {got}, torch {want}", dev.name());
        // The compute weights are the rounded master; the amax is of the rounded values.
        assert_eq!(r.compute[i], bf16_rne(r.master[i]).to_f32(), "{}: compute[{i}]", dev.name());
    }
    for (t, &(off, len)) in l.tensors().iter().enumerate() {
        let want = r.master[off..off + len].iter().map(|&x| bf16_rne(x).to_f32().abs()).fold(0.0f32, f32::max);
        assert_eq!(r.amax[t], want, "{}: amax of tensor {t}", dev.name());
    }
}

test_device!(adamw_follows_torch, adamw_follows_torch_cpu, adamw_follows_torch_sim, adamw_follows_torch_cuda);

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_simulated_cuda_step_equals_the_cpu_step_bit_for_bit() {
    let (cpu, sim) = (Device::cpu(1).unwrap(), Device::parse("cuda-sim:0").unwrap());
    for (adam, cdt) in [(true, DType::BF16), (true, DType::F32), (false, DType::F16), (false, DType::BF16)] {
        let (a, b) = (run(&cpu, adam, cdt), run(&sim, adam, cdt));
        let what = format!("{} with {} compute weights", if adam { "AdamW" } else { "SGD" }, cdt.name());
        assert_eq!(bits(&a.master), bits(&b.master), "{what}: master");
        assert_eq!(bits(&a.grad), bits(&b.grad), "{what}: clipped gradient");
        assert_eq!(bits(&a.compute), bits(&b.compute), "{what}: compute weights");
        assert_eq!(bits(&a.amax), bits(&b.amax), "{what}: amax");
        if adam {
            assert_eq!(bits(&a.m), bits(&b.m), "{what}: first moment");
            assert_eq!(bits(&a.v), bits(&b.v), "{what}: second moment");
        }
    }
}

#[test]
fn the_squared_norm_agrees_across_devices() {
    let (cpu, sim) = (Device::cpu(1).unwrap(), Device::parse("cuda-sim:0").unwrap());
    for n in [1usize, 1000, 3 * CHUNK + 17] {
        let g = data(n, 5, 2.0);
        let want: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
        for dev in [&cpu, &sim] {
            let t = dev.from_f32(DType::F32, &[n], &g).unwrap();
            let got = sum_sq(dev, &t).unwrap();
            assert!((got - want).abs() <= 1e-12 * want, "{} n={n}: {got} vs {want}", dev.name());
        }
    }
}

#[test]
fn bad_layouts_and_state_are_refused() {
    let e = format!("{:#}", Layout::new(vec![(0, 4), (5, 2)]).unwrap_err());
    assert!(e.contains("tensor 1 starts at 5, expected 4"), "{e}");
    let dev = Device::cpu(1).unwrap();
    let l = Layout::new(vec![(0, 4)]).unwrap();
    let mut master = dev.from_f32(DType::F32, &[4], &[0.0; 4]).unwrap();
    let mut grad = dev.from_f32(DType::F32, &[3], &[0.0; 3]).unwrap();
    let rule = Rule::adamw(1e-3, 0.0, [0.9, 0.999], 1e-8, 1);
    let mut st = State { master: &mut master, m: None, v: None, layout: &l };
    let e = format!("{:#}", step(&dev, &mut st, &mut grad, 1.0, &rule, None).unwrap_err());
    assert!(e.contains("gradient: 3 values for a layout of 4"), "{e}");
    let mut grad = dev.from_f32(DType::F32, &[4], &[0.0; 4]).unwrap();
    let e = format!("{:#}", step(&dev, &mut st, &mut grad, 1.0, &rule, None).unwrap_err());
    assert!(e.contains("AdamW needs both moments"), "{e}");
}
