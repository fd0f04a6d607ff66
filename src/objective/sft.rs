//! Supervised fine-tuning: cross-entropy ℓ_t = −log p_θ(y_t); c_t = w_t. Reported loss:
//! Σ_t w_t·(−log p_θ(y_t)).

use super::LossAgg;
use super::{agg_weights, Coefficients, TokenStats};
use anyhow::Result;

pub fn coefficients(s: &TokenStats, agg: LossAgg) -> Result<Coefficients> {
    s.check()?;
    let w = agg_weights(s, agg);
    let loss = w.iter().zip(s.logp).map(|(w, l)| -w * *l as f64).sum();
    Ok(Coefficients { coef: w.iter().map(|&x| x as f32).collect(), loss })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_mean_weights_are_one_over_n() {
        let logp = [-1.0f32, -2.0, -0.5];
        let s = TokenStats {
            seq_lens: &[2, 1],
            logp: &logp,
            logp_old: None,
            sampler: None,
            teacher: None,
            advantages: None,
            mask: None,
        };
        let c = coefficients(&s, LossAgg::TokenMean).unwrap();
        assert_eq!(c.coef, vec![1.0 / 3.0; 3]);
        assert!((c.loss - 3.5 / 3.0).abs() < 1e-12);
    }
}
