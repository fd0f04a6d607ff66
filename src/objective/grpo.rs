//! Policy-gradient objectives as per-token coefficients: GRPO's clipped surrogate (seed 004 Eq. 1)
//! with asymmetric clipping ε_low / ε_high, REINFORCE (the same with a ratio of one), and
//! truncated importance sampling (seed 004 Eq. 3: × min(exp(log π_old − log π_sampler), C)).
//!
//! Per token t of response i, with aggregation weight w_t (see `agg_weights`), advantage A_i,
//! ratio ρ = exp(log π_θ − log π_old) and TIS weight v = min(exp(log π_old − log π_s), C):
//!   ℓ_t = −v·min(ρA, clip(ρ, 1−ε_low, 1+ε_high)·A)        (the reported loss is Σ_t w_t ℓ_t)
//!   c_t = w_t·v·A·ρ·1[unclipped]                          (−∂(Σ w ℓ)/∂ log π_θ(y_t))
//! where a token is clipped when A > 0 and ρ > 1+ε_high, or A < 0 and ρ < 1−ε_low.

use super::LossAgg;
use super::{agg_weights, Coefficients, TokenStats};
use anyhow::{Context, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PgConfig {
    pub eps_low: f64,
    pub eps_high: f64,
    /// TIS cap C; None disables importance correction.
    pub tis_cap: Option<f64>,
}

/// The base coefficients g_base (and the per-token base losses ℓ_t, unweighted).
pub struct Base {
    pub coef: Vec<f64>,
    pub token_loss: Vec<f64>,
    pub weights: Vec<f64>,
    pub clipped: usize,
    /// Mean TIS weight over tokens (1 without TIS).
    pub tis_mean: f64,
}

pub fn base(s: &TokenStats, agg: LossAgg, pg: &PgConfig) -> Result<Base> {
    s.check()?;
    let adv = s.advantages.context("policy gradient: advantages are missing (rewards for RL objectives)")?;
    let w = agg_weights(s, agg);
    let n = s.len();
    let (mut coef, mut token_loss) = (vec![0.0; n], vec![0.0; n]);
    let (mut clipped, mut tis_sum) = (0usize, 0.0f64);
    for t in 0..n {
        let a = adv[t];
        let old = s.logp_old.map(|o| o[t] as f64).unwrap_or(s.logp[t] as f64);
        let rho = (s.logp[t] as f64 - old).exp();
        let v = match pg.tis_cap {
            Some(c) => {
                let b = s.sampler.context("TIS needs the sampler's log-probs")?[t] as f64;
                (old - b).exp().min(c)
            }
            None => 1.0,
        };
        tis_sum += v;
        let clip_rho = rho.clamp(1.0 - pg.eps_low, 1.0 + pg.eps_high);
        token_loss[t] = -v * (rho * a).min(clip_rho * a);
        let is_clipped = (a > 0.0 && rho > 1.0 + pg.eps_high) || (a < 0.0 && rho < 1.0 - pg.eps_low);
        if is_clipped && w[t] > 0.0 {
            clipped += 1;
        }
        coef[t] = if is_clipped { 0.0 } else { w[t] * v * a * rho };
    }
    Ok(Base { coef, token_loss, weights: w, clipped, tis_mean: tis_sum / n.max(1) as f64 })
}

/// GRPO / REINFORCE (with or without TIS).
pub fn coefficients(s: &TokenStats, agg: LossAgg, pg: &PgConfig) -> Result<Coefficients> {
    let b = base(s, agg, pg)?;
    let loss = b.weights.iter().zip(&b.token_loss).map(|(w, l)| w * l).sum();
    Ok(Coefficients { coef: b.coef.iter().map(|&x| x as f32).collect(), loss })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats<'a>(
        lens: &'a [usize],
        logp: &'a [f32],
        old: &'a [f32],
        samp: &'a [f32],
        adv: &'a [f64],
    ) -> TokenStats<'a> {
        TokenStats {
            seq_lens: lens,
            logp,
            logp_old: Some(old),
            sampler: Some(samp),
            teacher: None,
            advantages: Some(adv),
            mask: None,
        }
    }

    #[test]
    fn grpo_by_hand_with_clipping_and_tis() {
        // Two responses (2 and 1 tokens), seq-mean-token-mean: w = 1/4, 1/4, 1/2.
        let lens = [2, 1];
        let old = [-1.0f32, -1.0, -2.0];
        let logp = [-1.0f32, -0.5, -2.5]; // ρ = 1, e^0.5 = 1.6487, e^−0.5 = 0.6065
        let samp = [-1.0f32, -1.5, -2.0];
        let adv = [1.0, 1.0, -2.0];
        let pg = PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: None };
        let c = coefficients(&stats(&lens, &logp, &old, &samp, &adv), LossAgg::SeqMeanTokenMean, &pg).unwrap();
        // token 0: ρ = 1 → c = 1/4·1·1; token 1: A > 0, ρ = 1.6487 > 1.28 → clipped → 0;
        // token 2: A < 0, ρ = 0.6065 < 0.8 → clipped → 0.
        assert_eq!(c.coef, vec![0.25, 0.0, 0.0]);
        let r1 = 0.5f64.exp();
        let r2 = (-0.5f64).exp();
        let want = -(0.25 * 1.0 + 0.25 * (r1.min(1.28)) + 0.5 * (-2.0 * r2).min(-2.0 * 0.8));
        assert!((c.loss - want).abs() < 1e-9, "{} vs {want}", c.loss);
        // TIS: v = min(e^{old − sampler}, 2) = 1, e^{0.5} = 1.6487, 1.
        let pg = PgConfig { tis_cap: Some(2.0), eps_low: 0.9, eps_high: 0.9 };
        let c = coefficients(&stats(&lens, &logp, &old, &samp, &adv), LossAgg::SeqMeanTokenMean, &pg).unwrap();
        let want = [0.25 * 1.0, 0.25 * r1 * r1, 0.5 * -2.0 * r2];
        for (a, b) in c.coef.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
        }
        // The cap binds: log π_old − log π_s = 1 → e = 2.718 → 2.
        let samp2 = [-2.0f32, -1.0, -2.0];
        let c = coefficients(&stats(&lens, &old, &old, &samp2, &adv), LossAgg::SeqMeanTokenMean, &pg).unwrap();
        assert!((c.coef[0] as f64 - 0.25 * 2.0).abs() < 1e-7);
    }

    #[test]
    fn zero_advantages_give_zero_coefficients() {
        let (lens, lp, adv) = ([3], [-1.0f32, -2.0, -0.1], [0.0; 3]);
        let s = TokenStats {
            seq_lens: &lens,
            logp: &lp,
            logp_old: None,
            sampler: None,
            teacher: None,
            advantages: Some(&adv),
            mask: None,
        };
        let c =
            coefficients(&s, LossAgg::TokenMean, &PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: None }).unwrap();
        assert_eq!(c.coef, vec![0.0; 3]);
        assert_eq!(c.loss, 0.0);
    }
}
