//! Rotary embeddings on every device of the build against an f64 reference of the HF
//! `rotate_half` rotation.

use super::*;
use crate::device::DType;

/// The table and the rotation through the public ops on `dev`: the table within 1e-6 of f64
/// cos / sin of the f32 angle, the rotated rows within 1e-6 + 1e-6·|ref| of the f64 rotation.
fn rope_matches_f64(dev: &Device) {
    let (m, heads, d) = (6usize, 2usize, 8usize);
    let half = d / 2;
    let pos: Vec<u32> = vec![0, 1, 2, 7, 100, 4095];
    let inv: Vec<f32> = (0..half).map(|i| 10000f32.powf(-((2 * i) as f32) / d as f32)).collect();
    let mut s = crate::rand::Stream::new(7, 7);
    let x: Vec<f32> = (0..m * heads * d).map(|_| s.normal() as f32).collect();
    let pt = dev.upload(Tensor::from_u32_host(&[m], pos.clone()).unwrap()).unwrap();
    let ft = dev.from_f32(DType::F32, &[half], &inv).unwrap();
    let (mut ct, mut st) = (dev.zeros(DType::F32, &[m, half]).unwrap(), dev.zeros(DType::F32, &[m, half]).unwrap());
    rope_table(dev, &pt, &ft, &mut ct, &mut st, m).unwrap();
    let (c, sn) = (ct.to_f32_vec().unwrap(), st.to_f32_vec().unwrap());
    for t in 0..m {
        for i in 0..half {
            let a = (pos[t] as f32 * inv[i]) as f64;
            assert!((c[t * half + i] as f64 - a.cos()).abs() <= 1e-6, "cos[{t},{i}]");
            assert!((sn[t * half + i] as f64 - a.sin()).abs() <= 1e-6, "sin[{t},{i}]");
        }
    }
    let mut xt = dev.from_f32(DType::F32, &[m, heads * d], &x).unwrap();
    rope(dev, &mut xt, &ct, &st, m, heads).unwrap();
    let got = xt.to_f32_vec().unwrap();
    for t in 0..m {
        for h in 0..heads {
            let base = (t * heads + h) * d;
            for i in 0..half {
                let (a, b) = (x[base + i] as f64, x[base + half + i] as f64);
                let (cs, sn) = (c[t * half + i] as f64, sn[t * half + i] as f64);
                let (lo, hi) = (a * cs - b * sn, b * cs + a * sn);
                assert!((got[base + i] as f64 - lo).abs() <= 1e-6 + 1e-6 * lo.abs(), "rope lo [{t},{h},{i}]");
                assert!((got[base + half + i] as f64 - hi).abs() <= 1e-6 + 1e-6 * hi.abs(), "rope hi [{t},{h},{i}]");
            }
        }
    }
}

test_device!(rope_matches_f64, rope_matches_f64_cpu, rope_matches_f64_sim, rope_matches_f64_cuda);
