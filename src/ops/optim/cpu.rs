//! The CPU twin of the optimizer step, and the reference the CUDA kernels are checked against
//! bit for bit: the f32 element loops the CPU trainer runs (`train::optimizer`).
//!
//! Owns: the element loops. May call: `crate::device`. Must not: decide clipping or skipping.

use super::{Compute, Rule, State};
use crate::device::{bf16_rne, CpuStorage, Tensor};
use anyhow::{bail, Result};
use half::f16;

/// Σ g² accumulated in f64, in index order.
pub fn sum_sq(g: &[f32]) -> f64 {
    g.iter().map(|&x| (x as f64) * (x as f64)).sum()
}

/// grad *= clip, then `rule` on master (and m, v), element by element in f32.
pub fn update(master: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &mut [f32], clip: f32, rule: &Rule) {
    if clip != 1.0 {
        grad.iter_mut().for_each(|g| *g *= clip);
    }
    match *rule {
        Rule::Sgd { lr, wd } => {
            for (p, &g) in master.iter_mut().zip(grad.iter()) {
                let g = if wd != 0.0 { g + wd * *p } else { g };
                *p -= lr * g;
            }
        }
        Rule::AdamW { decay, b1, b2, omb1, omb2, eps, step_size, bc2_sqrt } => {
            for i in 0..master.len() {
                let g = grad[i];
                let p = &mut master[i];
                *p *= decay;
                m[i] = b1 * m[i] + omb1 * g;
                v[i] = b2 * v[i] + omb2 * g * g;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                *p -= step_size * m[i] / denom;
            }
        }
    }
}

/// The compute weights rounded from `master` (RNE), and each tensor's max |w| of the rounded
/// values.
pub fn compute_from_master(master: &[f32], c: Compute<'_, '_>, tensors: &[(usize, usize)]) -> Result<()> {
    let mut amax = match c.amax {
        Some(a) => Some(a.u32s_mut()?),
        None => None,
    };
    for (t, (w, &(off, len))) in c.weights.iter_mut().zip(tensors).enumerate() {
        let src = &master[off..off + len];
        let m = match w.cpu_mut()? {
            CpuStorage::F32(w) => {
                w.copy_from_slice(src);
                w.iter().fold(0.0f32, |m, &x| m.max(x.abs()))
            }
            CpuStorage::BF16(w) => {
                w.iter_mut().zip(src).for_each(|(o, &x)| *o = bf16_rne(x));
                w.iter().fold(0.0f32, |m, &x| m.max(x.to_f32().abs()))
            }
            CpuStorage::F16(w) => {
                w.iter_mut().zip(src).for_each(|(o, &x)| *o = f16::from_f32(x));
                w.iter().fold(0.0f32, |m, &x| m.max(x.to_f32().abs()))
            }
            _ => bail!("optimizer compute weights: not a float tensor"),
        };
        if let Some(a) = amax.as_deref_mut() {
            a[t] = m.to_bits();
        }
    }
    Ok(())
}

pub fn step(st: &mut State<'_>, grad: &mut Tensor, clip: f32, rule: &Rule, out: Option<Compute<'_, '_>>) -> Result<()> {
    let (mut m0, mut v0) = (Vec::new(), Vec::new());
    let m = match st.m.as_deref_mut() {
        Some(t) => t.f32s_mut()?,
        None => &mut m0[..],
    };
    let v = match st.v.as_deref_mut() {
        Some(t) => t.f32s_mut()?,
        None => &mut v0[..],
    };
    update(st.master.f32s_mut()?, m, v, grad.f32s_mut()?, clip, rule);
    if let Some(c) = out {
        compute_from_master(st.master.f32s()?, c, st.layout.tensors())?;
    }
    Ok(())
}
