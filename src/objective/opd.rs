//! On-policy distillation (seed 000, Eq. 1): A_t = log p_T(y_t) − log π_old(y_t), computed from
//! the trainer's log-probs at the start of the step and held fixed (verl's k1 estimator in
//! policy-gradient form, no importance correction): ℓ_t = −sg(A_t + b)·ρ_t with the ratio
//! ρ_t = exp(log p_θ − log π_old) (1 in value at the step's first update) and the advantage
//! offset b (seed 000 App. B.1, default 0), so c_t = w_t·(A_t + b)·ρ_t.
//! Reported loss: the per-token reverse-KL estimate Σ_t w_t·(log p_θ − log p_T).

use super::LossAgg;
use super::{agg_weights, Coefficients, TokenStats};
use anyhow::{Context, Result};

/// A_t per token (Eq. 1).
pub fn advantages(s: &TokenStats) -> Result<Vec<f64>> {
    let teacher = s.teacher.context("opd: teacher log-probs are missing")?;
    let old = s.logp_old.unwrap_or(s.logp);
    Ok(teacher.iter().zip(old).map(|(t, p)| *t as f64 - *p as f64).collect())
}

pub fn coefficients(s: &TokenStats, agg: LossAgg) -> Result<Coefficients> {
    coefficients_with_offset(s, agg, 0.0)
}

/// OPD with the advantage offset b added to every token's advantage.
pub fn coefficients_with_offset(s: &TokenStats, agg: LossAgg, offset: f64) -> Result<Coefficients> {
    s.check()?;
    let a = advantages(s)?;
    let w = agg_weights(s, agg);
    let teacher = s.teacher.context("opd: teacher log-probs are missing")?;
    let mut coef = Vec::with_capacity(a.len());
    let mut loss = 0.0;
    for t in 0..a.len() {
        let rho = match s.logp_old {
            Some(o) => (s.logp[t] as f64 - o[t] as f64).exp(),
            None => 1.0,
        };
        coef.push((w[t] * (a[t] + offset) * rho) as f32);
        loss += w[t] * (s.logp[t] as f64 - teacher[t] as f64);
    }
    Ok(Coefficients { coef, loss })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coefficients_by_hand() {
        // Two responses: (2 tokens) and (1 token); teacher − student per token: 0.5, −1, 2.
        let logp = [-1.0f32, -0.5, -3.0];
        let teacher = [-0.5f32, -1.5, -1.0];
        let s = TokenStats {
            seq_lens: &[2, 1],
            logp: &logp,
            logp_old: None,
            sampler: None,
            teacher: Some(&teacher),
            advantages: None,
            mask: None,
        };
        let tm = coefficients(&s, LossAgg::TokenMean).unwrap();
        assert_eq!(tm.coef, vec![0.5 / 3.0, -1.0 / 3.0, 2.0 / 3.0]);
        assert!((tm.loss - (-(0.5 - 1.0 + 2.0) / 3.0)).abs() < 1e-12);
        let smtm = coefficients(&s, LossAgg::SeqMeanTokenMean).unwrap();
        assert_eq!(smtm.coef, vec![0.5 / 4.0, -1.0 / 4.0, 2.0 / 2.0]);
        let smts = coefficients(&s, LossAgg::SeqMeanTokenSum).unwrap();
        assert_eq!(smts.coef, vec![0.5 / 2.0, -1.0 / 2.0, 2.0 / 2.0]);
        // A masked token contributes nothing and leaves the counts.
        let mask = [true, false, true];
        let s = TokenStats { mask: Some(&mask), ..s };
        let tm = coefficients(&s, LossAgg::TokenMean).unwrap();
        assert_eq!(tm.coef, vec![0.25, 0.0, 1.0]);
    }

    #[test]
    fn missing_teacher_is_an_error() {
        let logp = [-1.0f32];
        let s = TokenStats {
            seq_lens: &[1],
            logp: &logp,
            logp_old: None,
            sampler: None,
            teacher: None,
            advantages: None,
            mask: None,
        };
        assert!(coefficients(&s, LossAgg::TokenMean).unwrap_err().to_string().contains("teacher"));
    }
}
