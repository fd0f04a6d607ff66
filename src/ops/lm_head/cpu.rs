//! The CPU arm of the device-level LM-head loss: the trainer's f32 twin (`grad.rs`) on the
//! tensors' slices, a BF16 head widened to f32.
//!
//! Owns: nothing. May call: `super::grad`. Must not: hold state.

use super::grad::{self, Center, Scratch};
use super::{Coef, Pass, Rows};
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

/// What [`Coef::Rule`] reads of a row besides its denominator.
enum RowRule {
    Sft,
    Opd {
        teacher: f32,
        offset: f64,
    },
    /// The sampler's log-prob, the advantage and the cap.
    Tis {
        sampler: f32,
        adv: f64,
        cap: f64,
    },
}

/// [`Coef::Rule`]'s c_i from the row's log-prob, w = 1/den in f64: `objective::opd` at ratio
/// 1 with a teacher, `objective::sft` without, `objective::grpo::base` with TIS at ρ = 1
/// (there ρ = exp(logp − logp_old) with logp_old = logp: 1, or NaN where logp is not finite).
fn rule(den: u32, r: RowRule, logp: f32) -> f32 {
    let w = if den == 0 { 0.0 } else { 1.0 / den as f64 };
    let l = logp as f64;
    match r {
        RowRule::Opd { teacher, offset } => (w * ((teacher as f64 - l) + offset)) as f32,
        RowRule::Sft => w as f32,
        RowRule::Tis { sampler, adv, cap } => {
            let v = (l - sampler as f64).exp().min(cap);
            let rho = if l.is_finite() { 1.0 } else { f64::NAN };
            (w * v * adv * rho) as f32
        }
    }
}

pub fn loss_grad(
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    pass: Pass<'_, '_>,
    dh: &mut Tensor,
    dwh: &mut Tensor,
) -> Result<f64> {
    let (v, c) = (wh.dim(0), wh.dim(1));
    check_ids(h, v, c, r)?;
    let (t, chunk) = (pass.temperature, pass.chunk);
    let whf = wh.to_f32_vec()?;
    let mut s = Scratch::<f32>::new(chunk, c, v);
    let (rows, targets) = (r.rows.u32s()?, r.targets.u32s()?);
    // The statistics first where the pass writes them or its coefficients need them.
    let n = rows.len();
    let (mut lp, mut en) = (vec![0.0f32; n], vec![0.0f32; n]);
    if pass.stats.is_some() || matches!(pass.coef, Coef::Rule { .. }) {
        grad::stats(c, v, rows, targets, h.f32s()?, &whf, t, &mut s, &mut lp, &mut en);
    }
    if let Some(out) = pass.stats {
        out.logp.f32s_mut()?.copy_from_slice(&lp);
        out.entropy.f32s_mut()?.copy_from_slice(&en);
    }
    let coef: Vec<f32> = match pass.coef {
        Coef::Given(k) => k.f32s()?.to_vec(),
        Coef::Rule { den, teacher, offset, tis } => {
            let (den, teacher) = (den.u32s()?, teacher.map(|x| x.f32s()).transpose()?);
            let tis = match tis {
                Some(t) => Some((t.sampler.f32s()?, t.adv.u32s()?, t.cap)),
                None => None,
            };
            let row = |i: usize| match (teacher, tis) {
                (_, Some((s, a, cap))) => {
                    let adv = f64::from_bits(a[2 * i] as u64 | (a[2 * i + 1] as u64) << 32);
                    RowRule::Tis { sampler: s[i], adv, cap }
                }
                (Some(t), None) => RowRule::Opd { teacher: t[i], offset },
                (None, None) => RowRule::Sft,
            };
            (0..n).map(|i| rule(den[i], row(i), lp[i])).collect()
        }
    };
    let ct = match pass.center {
        Some(ct) => {
            let ids = ct.ids.u32s()?;
            if let Some(&bad) = ids.iter().find(|&&x| x as usize >= v) {
                bail!("LM head centering: token {bad} outside the vocabulary of {v}");
            }
            Some(Center { k: ct.k, ids, probs: ct.probs.f32s()? })
        }
        None => None,
    };
    let loss = grad::grad_centered(
        c,
        v,
        rows,
        targets,
        &coef,
        ct.as_ref(),
        h.f32s()?,
        &whf,
        t,
        &mut s,
        dh.f32s_mut()?,
        dwh.f32s_mut()?,
    );
    Ok(loss as f64)
}
