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

/// The backward GEMMs on every device against f64: dx = dy·W (F32 and BF16 weights, plain and
/// accumulating) and dW = dyᵀ·x (F32 and BF16 operands, FP32 accumulation). Tolerance
/// |a − ref| ≤ 1e-5 + 1e-5·|ref| against f64 sums of the operands each device multiplies: with
/// a BF16 weight, CUDA rounds dy to BF16 first, the CPU does not.
fn backward_gemms(dev: &Device) {
    let (m, n, k) = (37, 48, 40);
    let (dys, xs, ws, start) = (data(m * n, 31), data(m * k, 32), data(n * k, 33), data(m * k, 34));
    let close = |got: &[f32], want: &[f64], tol: f64, what: &str| {
        for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - r).abs() <= tol + tol * r.abs(), "{} {what}[{i}]: {g} vs {r}", dev.name());
        }
    };
    let dy = dev.from_f32(DType::F32, &[m, n], &dys).unwrap();
    let x = dev.from_f32(DType::F32, &[m, k], &xs).unwrap();
    for wdt in [DType::F32, DType::BF16] {
        let w = dev.from_f32(wdt, &[n, k], &ws).unwrap();
        let wv = w.to_f32_vec().unwrap();
        let round_dy = wdt == DType::BF16 && !dev.is_cpu();
        let dyv: Vec<f64> =
            dys.iter().map(|&v| if round_dy { crate::device::bf16_rne(v).to_f32() as f64 } else { v as f64 }).collect();
        for acc in [false, true] {
            let mut dx = dev.from_f32(DType::F32, &[m, k], &start).unwrap();
            linear_dx(dev, &dy, &w, &mut dx, m, acc).unwrap();
            let want: Vec<f64> = (0..m * k)
                .map(|ij| {
                    let (i, j) = (ij / k, ij % k);
                    let s: f64 = (0..n).map(|t| dyv[i * n + t] * wv[t * k + j] as f64).sum();
                    s + if acc { start[ij] as f64 } else { 0.0 }
                })
                .collect();
            close(&dx.to_f32_vec().unwrap(), &want, 1e-5, &format!("dx ({} weight, acc {acc})", wdt.name()));
        }
    }
    let wstart = data(n * k, 35);
    for operands in [DType::F32, DType::BF16] {
        let r = |v: f32| if operands == DType::BF16 { crate::device::bf16_rne(v).to_f32() as f64 } else { v as f64 };
        for acc in [false, true] {
            let mut dw = dev.from_f32(DType::F32, &[n, k], &wstart).unwrap();
            linear_dw(dev, &dy, &x, &mut dw, m, acc, operands).unwrap();
            let want: Vec<f64> = (0..n * k)
                .map(|ij| {
                    let (i, j) = (ij / k, ij % k);
                    let s: f64 = (0..m).map(|t| r(dys[t * n + i]) * r(xs[t * k + j])).sum();
                    s + if acc { wstart[ij] as f64 } else { 0.0 }
                })
                .collect();
            close(&dw.to_f32_vec().unwrap(), &want, 1e-5, &format!("dW ({} operands, acc {acc})", operands.name()));
        }
    }
}

test_device!(backward_gemms, backward_gemms_cpu, backward_gemms_sim, backward_gemms_cuda);

/// `linears` and `linear_grads` (projections of one input) against `linear`, `linear_dx` and
/// `linear_dw` called one projection at a time: bit for bit, on the CPU and on the simulated
/// GPU, for every weight dtype and weight-gradient operand, with and without accumulation,
/// the forward with biases. On the simulated GPU (a device of its own, ordinal 60, so the
/// ledger counts this test's launches only) the input is rounded once for all projections
/// and each dy once for both of its GEMMs where they take the same dtype: the counted
/// `ct_cast` launches; and the three biases are added in one `ct_add_bias` launch.
#[test]
fn projections_of_one_input_round_it_once_sim() {
    use crate::device::cuda::{ledger, CudaDevice};
    let cd = CudaDevice::sim_unshared_arch(60, "sm_90a");
    let casts = || -> u64 {
        ledger::rows(&cd.take_ledger()).into_iter().filter(|r| r.op == "ct_cast").map(|r| r.launches).sum()
    };
    let (m, k, ns) = (19, 24, [16, 8, 8]);
    for dev in [Device::cpu(1).unwrap(), Device::Cuda(cd.clone())] {
        let up = |v: &[f32], shape: &[usize], dt| dev.from_f32(dt, shape, v).unwrap();
        let x = up(&data(m * k, 41), &[m, k], DType::F32);
        let dys: Vec<Tensor> =
            ns.iter().enumerate().map(|(j, &n)| up(&data(m * n, 42 + j as u64), &[m, n], DType::F32)).collect();
        let dx0 = data(m * k, 45);
        let dw0: Vec<Vec<f32>> = ns.iter().enumerate().map(|(j, &n)| data(n * k, 46 + j as u64)).collect();
        let bits = |t: &Tensor| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for wdt in [DType::BF16, DType::F16, DType::F32] {
            let ws: Vec<Tensor> =
                ns.iter().enumerate().map(|(j, &n)| up(&data(n * k, 50 + j as u64), &[n, k], wdt)).collect();
            let bs: Vec<Tensor> = ns.iter().enumerate().map(|(j, &n)| up(&data(n, 60 + j as u64), &[n], wdt)).collect();
            let what = format!("{} {} weights", dev.name(), wdt.name());
            // The forward: `linears` against one `linear` each, without and with biases.
            for biased in [false, true] {
                let bias = |j: usize| biased.then_some(&bs[j]);
                let mut ys: Vec<Tensor> = ns.iter().map(|&n| dev.zeros(DType::F32, &[m, n]).unwrap()).collect();
                let mut want = Vec::new();
                for (j, (w, y)) in ws.iter().zip(ys.iter_mut()).enumerate() {
                    linear(&dev, &x, w, bias(j), y, m, false).unwrap();
                    want.push(bits(y));
                }
                let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
                casts();
                let projs =
                    [(0, y0), (1, y1), (2, y2)].map(|(j, y)| Proj { w: &ws[j], panels: None, bias: bias(j), y });
                linears(&dev, &x, projs, m).unwrap();
                if !dev.is_cpu() {
                    let l = ledger::rows(&cd.take_ledger());
                    let n = |op: &str| l.iter().filter(|r| r.op == op).map(|r| r.launches).sum::<u64>();
                    assert_eq!(n("ct_cast"), u64::from(wdt != DType::F32), "{what}: the forward's roundings of x");
                    // One launch for the three biases (F32 weights run one `linear` each).
                    let adds = if !biased {
                        0
                    } else if wdt == DType::F32 {
                        3
                    } else {
                        1
                    };
                    assert_eq!(n("ct_add_bias"), adds, "{what}: bias launches");
                }
                for (j, y) in ys.iter().enumerate() {
                    assert_eq!(bits(y), want[j], "{what}, biases {biased}: linears' projection {j}");
                }
            }
            for operands in [DType::BF16, DType::F32] {
                for acc_dx in [false, true] {
                    let what = format!("{what}, {} operands, acc_dx {acc_dx}", operands.name());
                    let fresh = || {
                        let dws: Vec<Tensor> =
                            ns.iter().enumerate().map(|(j, &n)| up(&dw0[j], &[n, k], DType::F32)).collect();
                        (up(&dx0, &[m, k], DType::F32), dws)
                    };
                    let (mut dx, mut dws) = fresh();
                    for j in 0..3 {
                        linear_dx(&dev, &dys[j], &ws[j], &mut dx, m, acc_dx || j > 0).unwrap();
                        linear_dw(&dev, &dys[j], &x, &mut dws[j], m, true, operands).unwrap();
                    }
                    let (mut dx2, mut dws2) = fresh();
                    let [g0, g1, g2] = &mut dws2[..] else { unreachable!() };
                    casts();
                    let projs = [(0, g0), (1, g1), (2, g2)].map(|(j, dw)| GradProj { dy: &dys[j], w: &ws[j], dw });
                    linear_grads(&dev, &x, projs, &mut dx2, acc_dx, m, operands).unwrap();
                    if !dev.is_cpu() {
                        // x once for BF16 operands; each dy once in a 16-bit weight's dtype and
                        // once more in BF16 unless that is the same rounding.
                        let bf = operands == DType::BF16;
                        let per_dy = u64::from(wdt != DType::F32) + u64::from(bf && wdt != DType::BF16);
                        assert_eq!(casts(), u64::from(bf) + 3 * per_dy, "{what}: roundings");
                    }
                    assert_eq!(bits(&dx2), bits(&dx), "{what}: dx");
                    for j in 0..3 {
                        assert_eq!(bits(&dws2[j]), bits(&dws[j]), "{what}: dw of projection {j}");
                    }
                }
            }
        }
    }
}

/// `linear_residual` (y = r + x·wᵀ + b) equals copying r into y and accumulating (`linear`
/// with `accumulate`), bit for bit, on the CPU and the simulated GPU, for F32, BF16 and F16
/// weights with and without a bias, over the first m of more rows; r and the rows of y past m
/// stay as they were. On the GPU it is one GEMM reading r as its C and no copy: its declared
/// bytes are the in-place GEMM's (C read, D written) and nothing else is launched but the
/// input's rounding and the bias.
#[test]
fn a_residual_linear_reads_the_residual_in_place_of_a_copy_sim() {
    use crate::device::cuda::{ledger, CudaDevice};
    let cd = CudaDevice::sim_unshared_arch(71, "sm_90a");
    let (m, rows, k, n) = (13usize, 16usize, 24usize, 20usize);
    for dev in [Device::cpu(1).unwrap(), Device::Cuda(cd.clone())] {
        let up = |v: &[f32], shape: &[usize], dt| dev.from_f32(dt, shape, v).unwrap();
        let bits = |t: &Tensor| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let x = up(&data(rows * k, 61), &[rows, k], DType::F32);
        let r = up(&data(rows * n, 62), &[rows, n], DType::F32);
        let y0 = data(rows * n, 63);
        let b = up(&data(n, 64), &[n], DType::F32);
        for wdt in [DType::F32, DType::BF16, DType::F16] {
            let w = up(&data(n * k, 65), &[n, k], wdt);
            for bias in [None, Some(&b)] {
                let what = format!("{} {} weights, bias {}", dev.name(), wdt.name(), bias.is_some());
                let mut want = up(&y0, &[rows, n], DType::F32);
                let mut head = r.to_f32_vec().unwrap();
                head[m * n..].copy_from_slice(&y0[m * n..]);
                want.write_f32(&head).unwrap();
                linear(&dev, &x, &w, bias, &mut want, m, true).unwrap();
                let mut y = up(&y0, &[rows, n], DType::F32);
                cd.take_ledger();
                linear_residual(&dev, &x, &w, bias, &r, &mut y, m).unwrap();
                let ops = ledger::rows(&cd.take_ledger());
                assert_eq!(bits(&y), bits(&want), "{what}");
                assert_eq!(r.to_f32_vec().unwrap(), data(rows * n, 62), "{what}: the residual is read only");
                assert!(
                    y.to_f32_vec().unwrap().iter().zip(&y0).skip(m * n).all(|(a, b)| a == b),
                    "{what}: rows past m"
                );
                if !dev.is_cpu() {
                    let gemm: Vec<_> = ops.iter().filter(|o| o.op.starts_with("gemm")).collect();
                    assert_eq!(gemm.len(), 1, "{what}: {ops:?}");
                    let e = if wdt == DType::F32 { 4.0 } else { 2.0 };
                    let (mf, nf, kf) = (m as f64, n as f64, k as f64);
                    assert_eq!(gemm[0].bytes, (mf * kf + nf * kf) * e + 2.0 * mf * nf * 4.0, "{what}");
                    let mut other: Vec<&str> = ops.iter().map(|o| o.op).filter(|o| !o.starts_with("gemm")).collect();
                    other.sort();
                    let want_other: Vec<&str> = [(bias.is_some(), "ct_add_bias"), (wdt != DType::F32, "ct_cast")]
                        .into_iter()
                        .filter_map(|(on, op)| on.then_some(op))
                        .collect();
                    assert_eq!(other, want_other, "{what}: no copy");
                }
            }
        }
    }
}
