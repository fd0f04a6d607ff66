//! Budgets (seed 000 §3.2–3.3, §4.3, App. B.1): held-out degradation Δ(c) (Eq. 3) with its
//! problem-paired percentile bootstrap and the primary rule, the empirical bracket B_emp(τ)
//! (Eq. 4), and the offline admission estimate D̂(c) (Eq. 5) with the verdict of Eq. 6.

use crate::rand::Stream;

/// The (2.5%, 97.5%) percentile interval of `stat` over `reps` resamples (with replacement) of
/// the n indices, drawn from a Philox stream of `seed`.
pub fn bootstrap(n: usize, reps: usize, seed: u64, mut stat: impl FnMut(&[usize]) -> f64) -> (f64, f64) {
    assert!(n > 0 && reps > 0);
    let mut s = Stream::new(seed, 0x424f_4f54);
    let mut idx = vec![0usize; n];
    let mut vals = Vec::with_capacity(reps);
    for _ in 0..reps {
        for v in idx.iter_mut() {
            *v = s.below(n as u64) as usize;
        }
        vals.push(stat(&idx));
    }
    vals.sort_by(|a, b| a.total_cmp(b));
    (super::quantile(&vals, 0.025), super::quantile(&vals, 0.975))
}

/// Δ(c) of a run against a reference at the same step, per held-out problem.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Delta {
    /// Eq. 3: Σ_x (K_x(c) − K_x(0)) / Σ_x K_x(0).
    pub delta: f64,
    /// 95% interval of Δ (ratio of resampled means).
    pub lo: f64,
    pub hi: f64,
    /// 95% interval of the mean paired difference (nats/token).
    pub diff_lo: f64,
    pub diff_hi: f64,
    /// Primary rule: fail iff Δ ≥ τ and the paired interval excludes zero.
    pub fail: bool,
}

pub fn delta(run: &[f64], reference: &[f64], tau: f64, reps: usize, seed: u64) -> Delta {
    assert_eq!(run.len(), reference.len());
    let n = run.len();
    let sum_ref: f64 = reference.iter().sum();
    let d = (run.iter().sum::<f64>() - sum_ref) / sum_ref;
    let diff: Vec<f64> = run.iter().zip(reference).map(|(a, b)| a - b).collect();
    let (lo, hi) = bootstrap(n, reps, seed, |ix| {
        let (a, b): (f64, f64) = ix.iter().fold((0.0, 0.0), |(a, b), &i| (a + run[i], b + reference[i]));
        a / b - 1.0
    });
    let (diff_lo, diff_hi) = bootstrap(n, reps, seed, |ix| ix.iter().map(|&i| diff[i]).sum::<f64>() / ix.len() as f64);
    let excludes_zero = diff_lo > 0.0 || diff_hi < 0.0;
    Delta { delta: d, lo, hi, diff_lo, diff_hi, fail: d >= tau && excludes_zero }
}

/// Eq. 4: [max D over passing runs, min D over failing runs], or None when some failing level
/// lies at or below a passing one ("not ordered"), or either set is empty.
pub fn bracket(runs: &[(f64, bool)]) -> Option<(f64, f64)> {
    let pass = runs.iter().filter(|r| !r.1).map(|r| r.0).fold(f64::NEG_INFINITY, f64::max);
    let fail = runs.iter().filter(|r| r.1).map(|r| r.0).fold(f64::INFINITY, f64::min);
    (pass.is_finite() && fail.is_finite() && pass < fail).then_some((pass, fail))
}

/// The offline estimate D̂ (Eq. 5): token-pooled mean of log q_c − log q_0, with a 95% bootstrap
/// interval over prompts (each prompt's tokens resampled together).
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Estimate {
    pub d_hat: f64,
    pub lo: f64,
    pub hi: f64,
    pub tokens: usize,
}

/// `per_prompt[x]` = (Σ_t (log q_c − log q_0), token count) over prompt x's sampled responses.
pub fn estimate(per_prompt: &[(f64, usize)], reps: usize, seed: u64) -> Estimate {
    let (s, n) = per_prompt.iter().fold((0.0, 0usize), |(a, b), p| (a + p.0, b + p.1));
    let (lo, hi) = bootstrap(per_prompt.len(), reps, seed, |ix| {
        let (a, b) = ix.iter().fold((0.0, 0usize), |(a, b), &i| (a + per_prompt[i].0, b + per_prompt[i].1));
        if b == 0 {
            0.0
        } else {
            a / b as f64
        }
    });
    Estimate { d_hat: s / n.max(1) as f64, lo, hi, tokens: n }
}

/// Eq. 6: admit iff α·D̂ < L.
pub fn admit(d_hat: f64, alpha: f64, line: f64) -> bool {
    alpha * d_hat < line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_interval_of_a_known_distribution() {
        // Mean of 400 draws of N(0, 1): the interval half-width is ≈ 1.96/√400 = 0.098.
        let mut s = Stream::new(1, 2);
        let x: Vec<f64> = (0..400).map(|_| s.normal()).collect();
        let m = x.iter().sum::<f64>() / 400.0;
        let (lo, hi) = bootstrap(400, 4000, 7, |ix| ix.iter().map(|&i| x[i]).sum::<f64>() / ix.len() as f64);
        assert!(lo < m && m < hi);
        assert!(((hi - lo) / 2.0 - 0.098).abs() < 0.015, "half-width {}", (hi - lo) / 2.0);
        // Deterministic for a seed.
        assert_eq!(bootstrap(400, 100, 7, |ix| ix[0] as f64), bootstrap(400, 100, 7, |ix| ix[0] as f64));
    }

    #[test]
    fn delta_and_primary_rule_by_hand() {
        let reference = [0.10, 0.20, 0.30, 0.40];
        // +25% on every problem: Δ = 0.25, the paired interval excludes zero → fail.
        let run: Vec<f64> = reference.iter().map(|x| x * 1.25).collect();
        let d = delta(&run, &reference, 0.20, 2000, 1);
        assert!((d.delta - 0.25).abs() < 1e-12 && d.fail && d.diff_lo > 0.0);
        // +10%: below τ → pass.
        let run: Vec<f64> = reference.iter().map(|x| x * 1.10).collect();
        assert!(!delta(&run, &reference, 0.20, 2000, 1).fail);
        // +30% on average but with mixed signs: the interval includes zero → pass.
        let run = [0.13 + 0.5, 0.20 - 0.15, 0.30 - 0.1, 0.40 - 0.0];
        let d = delta(&run, &reference, 0.20, 2000, 1);
        assert!(d.delta >= 0.2 && d.diff_lo <= 0.0 && !d.fail, "{d:?}");
    }

    #[test]
    fn bracket_needs_ordered_levels() {
        assert_eq!(bracket(&[(0.01, false), (0.05, false), (0.4, true), (0.6, true)]), Some((0.05, 0.4)));
        assert_eq!(bracket(&[(0.01, false), (0.05, true), (0.4, false)]), None);
        assert_eq!(bracket(&[(0.01, false)]), None);
    }

    #[test]
    fn estimate_pools_tokens() {
        let e = estimate(&[(1.0, 10), (3.0, 10)], 500, 3);
        assert!((e.d_hat - 0.2).abs() < 1e-12 && e.tokens == 20);
        assert!(e.lo <= e.d_hat && e.d_hat <= e.hi && e.lo >= 0.1 - 1e-12 && e.hi <= 0.3 + 1e-12);
        assert!(admit(0.1, 1.5, 0.184) && !admit(0.13, 1.5, 0.184));
    }
}
