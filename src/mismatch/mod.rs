//! Training–inference mismatch, measured every step over the step's sampled tokens.
//! Notation: δ_t = log p_θ(y_t) − log q(y_t) (the token gap of seed 004, Eq. 2: learner minus
//! sampler), so seed 000's d_n (Eq. 2) = mean_t [log q − log p_θ] = −mean_t δ_t.
//!
//! Owns: the per-step estimators (this file, `segments`), the RL monitor (`monitor`: ρ_asym
//! and segment tails against a calibrated τ), budgets (`budget`), the offline admission
//! check (`admit`, which drives engines and their rollouts through `crate::engine`) and the
//! online guard's decisions (`guard`). May call:
//! `engine`, `model`, `data` and below. Must not: train.

pub mod admit;
pub mod budget;
pub mod guard;
pub mod monitor;
pub mod segments;

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StepMismatch {
    /// Seed 000 Eq. 2: mean of log q − log p_θ (nats/token), estimates KL(q‖p_θ).
    pub d_n: f64,
    /// Mean |δ|.
    pub abs_mean: f64,
    /// Max |δ| (with abs_mean: what other trainers call sampling_logp_difference/{mean,max}).
    pub abs_max: f64,
    /// Fraction of tokens with |δ| < 0.05.
    pub frac_small: f64,
    /// δ quantiles (learner less likely than sampler in the lower tail).
    pub q01: f64,
    pub q05: f64,
    /// The k3 estimator of KL(q‖p_θ): mean of e^δ − 1 − δ (≥ 0 per token).
    pub k3: f64,
    pub tokens: usize,
}

/// The q-quantile of `sorted` (ascending), linear interpolation between order statistics
/// (numpy's default, "linear").
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Mismatch statistics of one step from the sampler's and the trainer's log-probs of the same
/// tokens.
pub fn step_mismatch(sampler: &[f32], learner: &[f32]) -> StepMismatch {
    let n = sampler.len().min(learner.len());
    if n == 0 {
        return StepMismatch::default();
    }
    let mut delta: Vec<f64> = learner[..n].iter().zip(&sampler[..n]).map(|(p, q)| *p as f64 - *q as f64).collect();
    let nf = n as f64;
    let d_n = -delta.iter().sum::<f64>() / nf;
    let abs_mean = delta.iter().map(|d| d.abs()).sum::<f64>() / nf;
    let abs_max = delta.iter().fold(0.0f64, |a, d| a.max(d.abs()));
    let frac_small = delta.iter().filter(|d| d.abs() < 0.05).count() as f64 / nf;
    let k3 = delta.iter().map(|&d| d.exp_m1() - d).sum::<f64>() / nf;
    delta.sort_by(|a, b| a.total_cmp(b));
    StepMismatch {
        d_n,
        abs_mean,
        abs_max,
        frac_small,
        q01: quantile(&delta, 0.01),
        q05: quantile(&delta, 0.05),
        k3,
        tokens: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimators_on_hand_made_tokens() {
        // δ = learner − sampler = [0.1, −0.2, 0.0, 0.04]
        let sampler = [-1.0f32, -0.5, -2.0, -0.04];
        let learner = [-0.9f32, -0.7, -2.0, 0.0];
        let m = step_mismatch(&sampler, &learner);
        let d = [0.1f64, -0.2, 0.0, 0.04];
        let tol = 1e-6; // inputs are f32
        assert!((m.d_n - (0.1 - 0.04) / 4.0).abs() < tol, "{}", m.d_n);
        assert!((m.abs_mean - 0.34 / 4.0).abs() < tol);
        assert!((m.abs_max - 0.2).abs() < tol);
        assert_eq!(m.frac_small, 0.5);
        let k3: f64 = d.iter().map(|x| x.exp() - 1.0 - x).sum::<f64>() / 4.0;
        assert!((m.k3 - k3).abs() < tol);
        // sorted δ = [−0.2, 0, 0.04, 0.1]; q0.05 at position 0.15: −0.2 + 0.15·0.2 = −0.17
        assert!((m.q05 - (-0.17)).abs() < tol, "{}", m.q05);
        assert!((m.q01 - (-0.194)).abs() < tol);
        assert_eq!(m.tokens, 4);
    }

    #[test]
    fn identical_log_probs_give_zero_mismatch() {
        let a = [-1.0f32, -3.0, -0.1];
        let m = step_mismatch(&a, &a);
        assert_eq!((m.d_n, m.abs_max, m.k3, m.frac_small), (0.0, 0.0, 0.0, 1.0));
    }
}
