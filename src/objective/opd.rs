//! On-policy distillation (seed 000, Eq. 1): A_t = log p_T(y_t) − log p_θ(y_t), computed from
//! the trainer's own log-probs and held fixed (verl's k1 estimator in policy-gradient form, no
//! importance correction): ℓ_t = −sg(A_t)·log p_θ(y_t), so c_t = w_t·A_t.
//! Reported loss: the per-token reverse-KL estimate Σ_t w_t·(log p_θ − log p_T) = −Σ_t w_t·A_t.

use super::{agg_weights, Coefficients, TokenStats};
use crate::config::LossAgg;
use anyhow::{Context, Result};

/// A_t per token (Eq. 1).
pub fn advantages(s: &TokenStats) -> Result<Vec<f64>> {
    let teacher = s.teacher.context("opd: teacher log-probs are missing")?;
    Ok(teacher.iter().zip(s.logp).map(|(t, p)| *t as f64 - *p as f64).collect())
}

pub fn coefficients(s: &TokenStats, agg: LossAgg) -> Result<Coefficients> {
    s.check()?;
    let a = advantages(s)?;
    let w = agg_weights(s, agg);
    let coef = w.iter().zip(&a).map(|(w, a)| (w * a) as f32).collect();
    let loss = -w.iter().zip(&a).map(|(w, a)| w * a).sum::<f64>();
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
        let s = TokenStats { seq_lens: &[2, 1], logp: &logp, sampler: None, teacher: Some(&teacher), mask: None };
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
        let s = TokenStats { seq_lens: &[1], logp: &logp, sampler: None, teacher: None, mask: None };
        assert!(coefficients(&s, LossAgg::TokenMean).unwrap_err().to_string().contains("teacher"));
    }
}
