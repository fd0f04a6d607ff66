//! RMSNorm's tests: the CPU row kernel against its one-row definition and an f64 reference, and
//! the public ops on every device of the build against the same reference.

use super::cpu::rms_rows;
use super::*;
use crate::device::{CpuFloats, DType};
use half::bf16;

/// f64 reference of rmsnorm for rows of c values.
fn rms_f64(x: &[f32], w: &[f32], eps: f64, c: usize) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (xr, yr) in x.chunks(c).zip(y.chunks_mut(c)) {
        let r = 1.0 / (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64 + eps).sqrt();
        for j in 0..c {
            yr[j] = xr[j] as f64 * r * w[j] as f64;
        }
    }
    y
}

/// |got − want| ≤ 1e-6 + 4e-6·|want| (f32 arithmetic over rows of ≤ 64 values).
fn close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= 1e-6 + 4e-6 * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

/// The three norms through the public ops on `dev`, against the f64 reference: the plain
/// norm, the residual add (x updated in place) and the per-head norm, with a BF16 weight.
fn norms_match_f64(dev: &Device) {
    let mut s = crate::rand::Stream::new(5, 5);
    let (m, c, heads, d) = (5usize, 48usize, 3usize, 16usize);
    let mut draw = |n: usize, sc: f64| -> Vec<f32> { (0..n).map(|_| (sc * s.normal()) as f32).collect() };
    let (x, r, w, hw) = (draw(m * c, 2.0), draw(m * c, 1.0), draw(c, 1.0), draw(d, 1.0));
    let wb: Vec<f32> = w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let t = |data: &[f32], shape: &[usize]| dev.from_f32(DType::F32, shape, data).unwrap();
    let wt = dev.from_f32(DType::BF16, &[c], &w).unwrap();
    let mut y = dev.zeros(DType::F32, &[m, c]).unwrap();
    rmsnorm(dev, &t(&x, &[m, c]), &wt, 1e-6, &mut y, m).unwrap();
    close(&y.to_f32_vec().unwrap(), &rms_f64(&x, &wb, 1e-6, c), "rmsnorm");
    let mut xt = t(&x, &[m, c]);
    add_rmsnorm(dev, &mut xt, &t(&r, &[m, c]), &wt, 1e-6, &mut y, m).unwrap();
    let sum: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
    assert_eq!(xt.to_f32_vec().unwrap(), sum, "add_rmsnorm residual");
    close(&y.to_f32_vec().unwrap(), &rms_f64(&sum, &wb, 1e-6, c), "add_rmsnorm");
    let mut xh = t(&x[..m * heads * d], &[m, heads * d]);
    head_rmsnorm(dev, &mut xh, &t(&hw, &[d]), 1e-6, m, heads).unwrap();
    close(&xh.to_f32_vec().unwrap(), &rms_f64(&x[..m * heads * d], &hw, 1e-6, d), "head_rmsnorm");
    // A shape mismatch is an error, not a panic.
    assert!(rmsnorm(dev, &t(&x, &[m, c]), &t(&hw, &[d]), 1e-6, &mut y, m).is_err());
}

test_device!(norms_match_f64, norms_match_f64_cpu, norms_match_f64_sim, norms_match_f64_cuda);

#[test]
fn interleaved_rows_give_the_one_row_definition_bitwise() {
    // The spec: y = v · rstd · w with rstd = 1 / sqrt(Σv² / c + eps), Σv² summed in order;
    // and within 2e-6 relative of an f64 reference.
    let mut s = crate::rand::Stream::new(3, 3);
    let c = 37;
    let w: Vec<f32> = (0..c).map(|_| s.normal() as f32).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    for rows in [1usize, 7, 8, 9, 16, 21] {
        let x: Vec<f32> = (0..rows * c).map(|_| (3.0 * s.normal()) as f32).collect();
        for wf in [CpuFloats::F32(&w), CpuFloats::BF16(&wb)] {
            let mut y = vec![f32::NAN; rows * c];
            rms_rows(&x, c, wf, 1e-6, &mut y);
            for r in 0..rows {
                let xr = &x[r * c..(r + 1) * c];
                let ss: f32 = xr.iter().map(|v| v * v).sum();
                let rstd = 1.0 / (ss / c as f32 + 1e-6).sqrt();
                let r64 = 1.0 / (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64 + 1e-6).sqrt();
                for j in 0..c {
                    let want = xr[j] * rstd * wf.get(j);
                    assert_eq!(y[r * c + j].to_bits(), want.to_bits(), "rows {rows} [{r},{j}]");
                    let ref64 = xr[j] as f64 * r64 * wf.get(j) as f64;
                    assert!((y[r * c + j] as f64 - ref64).abs() <= 1e-6 + 2e-6 * ref64.abs(), "f64 [{r},{j}]");
                }
            }
        }
    }
}
