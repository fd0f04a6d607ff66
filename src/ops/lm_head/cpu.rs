//! The CPU arm of the device-level LM-head loss: the trainer's f32 twin (`grad.rs`) on the
//! tensors' slices, a BF16 head widened to f32.
//!
//! Owns: nothing. May call: `super::grad`. Must not: hold state.

use super::grad::{self, Center, Scratch};
use super::{DevCenter, Rows};
use crate::device::Tensor;
use anyhow::{bail, Result};

/// The indices the slice twin would index with, checked (it would panic on a bad one).
fn check_ids(h: &Tensor, v: usize, c: usize, r: &Rows<'_>) -> Result<()> {
    let n_h = h.numel() / c.max(1);
    if let Some(&bad) = r.rows.u32s()?.iter().find(|&&x| x as usize >= n_h) {
        bail!("LM head: row index {bad} outside the {n_h} hidden rows");
    }
    if let Some(&bad) = r.targets.u32s()?.iter().find(|&&x| x as usize >= v) {
        bail!("LM head: target {bad} outside the vocabulary of {v}");
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn stats(
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    temperature: f32,
    chunk: usize,
    logp: &mut Tensor,
    entropy: &mut Tensor,
) -> Result<()> {
    let (v, c) = (wh.dim(0), wh.dim(1));
    check_ids(h, v, c, r)?;
    let whf = wh.to_f32_vec()?;
    let mut s = Scratch::<f32>::new(chunk, c, v);
    let (rows, targets) = (r.rows.u32s()?, r.targets.u32s()?);
    grad::stats(c, v, rows, targets, h.f32s()?, &whf, temperature, &mut s, logp.f32s_mut()?, entropy.f32s_mut()?);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn loss_grad(
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    coef: &Tensor,
    center: Option<&DevCenter<'_>>,
    temperature: f32,
    chunk: usize,
    dh: &mut Tensor,
    dwh: &mut Tensor,
) -> Result<f64> {
    let (v, c) = (wh.dim(0), wh.dim(1));
    check_ids(h, v, c, r)?;
    let whf = wh.to_f32_vec()?;
    let mut s = Scratch::<f32>::new(chunk, c, v);
    let ct = match center {
        Some(ct) => {
            let ids = ct.ids.u32s()?;
            if let Some(&bad) = ids.iter().find(|&&x| x as usize >= v) {
                bail!("LM head centering: token {bad} outside the vocabulary of {v}");
            }
            Some(Center { k: ct.k, ids, probs: ct.probs.f32s()? })
        }
        None => None,
    };
    let (rows, targets) = (r.rows.u32s()?, r.targets.u32s()?);
    let loss = grad::grad_centered(
        c,
        v,
        rows,
        targets,
        coef.f32s()?,
        ct.as_ref(),
        h.f32s()?,
        &whf,
        temperature,
        &mut s,
        dh.f32s_mut()?,
        dwh.f32s_mut()?,
    );
    Ok(loss as f64)
}
