//! TRIAGE (seed 004 §4, App. C): direction-aware gating of negative-advantage responses and a
//! bounded repair of positive-advantage ones, on top of the importance-corrected GRPO objective
//! (`grpo::base`). Per token the coefficient is (Eq. 12)
//!   c_t = α_t·g^base_t + ψ_t
//! - Gate (Eqs. 13–17, 52–56), all statistics detached: δ_t = log π_θ − log π_s. A response with
//!   A_i < 0 is cut into diagnostic segments of W valid positions (segment k holds the valid
//!   positions with ⌊t/W⌋ = k; the last shorter one kept). Per segment: mean gap δ̄_S and tail
//!   count k_S = #{δ < τ_tail};
//!   w_mean = w_sev if δ̄_S < τ_sev, w_neg if τ_sev ≤ δ̄_S < τ_neg, else 1           (Eq. 52)
//!   w_tail = 1 − (1 − w_sev)·min(k_S/K_tail, 1)                                      (Eq. 53)
//!   w_S = min(w_mean, w_tail)                                                        (Eq. 54)
//!   w_t = w_S on tokens with δ_t < 0 of such responses, else 1                       (Eq. 15)
//!   α_t = w_t·n_i/H_i, H_i = Σ_t w_t: the response-normalized weighted loss          (Eqs. 16–17)
//! - Repair (Eqs. 18–19, 58–63): repair segments of W_rep valid positions over every response
//!   of the update batch; N_rep counts every non-empty one (all advantages, q = 0 included). On
//!   segments of responses with A_i > 0: q_R = [τ_rep − δ̄_R]₊ with the live gap, penalty
//!   (λ_k/N_rep)·φ_β(q_R), φ_β(q) = β²(√(1+(q/β)²) − 1), λ_k = λ_rep·1[k ≥ k_rep]; its
//!   coefficient on each valid token of R is ψ = (λ_k/N_rep)(1/n_R)·q/√(1+(q/β)²)     (Eq. 63)
//!   (−∂L_rep/∂z_t, since ∂q_R/∂z_t = −1/n_R, Eq. 60).
//!
//! The paper's Table 9 values are not in its text; [`TriageConfig::default`] holds this
//! project's defaults (see the README's TRIAGE section).

use super::grpo::{self, PgConfig};
use super::LossAgg;
use super::{Coefficients, TokenStats};
use crate::mismatch::segments::segments;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Every TRIAGE threshold (config section `[objective.triage]`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TriageConfig {
    /// W: diagnostic segment length in valid tokens.
    pub segment_len: usize,
    pub tau_tail: f64,
    /// K_tail: the tail count at which attenuation reaches w_sev.
    pub k_tail: f64,
    pub tau_sev: f64,
    pub tau_neg: f64,
    pub w_sev: f64,
    pub w_neg: f64,
    /// W_rep: repair segment length.
    pub repair_segment_len: usize,
    pub tau_rep: f64,
    pub beta: f64,
    pub lambda_rep: f64,
    /// First (zero-based) update index with repair on.
    pub k_rep: u64,
}

impl Default for TriageConfig {
    /// This project's defaults (the paper's Table 9 is not in its text): W = W_rep = 64 (the
    /// paper's diagnostic length), τ_tail = −1 nat, K_tail = 4, τ_sev = −0.2, τ_neg = −0.05,
    /// w_sev = 0.1, w_neg = 0.5, τ_rep = −0.05, β = 0.1, λ_rep = 0.1, k_rep = 50.
    fn default() -> Self {
        TriageConfig {
            segment_len: 64,
            tau_tail: -1.0,
            k_tail: 4.0,
            tau_sev: -0.2,
            tau_neg: -0.05,
            w_sev: 0.1,
            w_neg: 0.5,
            repair_segment_len: 64,
            tau_rep: -0.05,
            beta: 0.1,
            lambda_rep: 0.1,
            k_rep: 50,
        }
    }
}

impl TriageConfig {
    /// The paper's constraints: τ_sev < τ_neg < 0, 0 < w_sev ≤ w_neg ≤ 1, K_tail > 0, W > 0, β > 0.
    pub fn validate(&self) -> Result<()> {
        let finite = [
            self.tau_tail,
            self.k_tail,
            self.tau_sev,
            self.tau_neg,
            self.w_sev,
            self.w_neg,
            self.tau_rep,
            self.beta,
            self.lambda_rep,
        ];
        if finite.iter().any(|x| !x.is_finite()) {
            bail!("objective.triage: every threshold must be a finite number");
        }
        if self.segment_len == 0 {
            bail!("objective.triage.segment_len: W must be at least 1 token, got 0");
        }
        if self.repair_segment_len == 0 {
            bail!("objective.triage.repair_segment_len: must be at least 1 token, got 0");
        }
        if !(self.tau_sev < self.tau_neg && self.tau_neg < 0.0) {
            bail!(
                "objective.triage: thresholds out of order: need tau_sev < tau_neg < 0, got tau_sev = {}, tau_neg = {}",
                self.tau_sev,
                self.tau_neg
            );
        }
        if !(0.0 < self.w_sev && self.w_sev <= self.w_neg && self.w_neg <= 1.0) {
            bail!(
                "objective.triage: weights out of order: need 0 < w_sev <= w_neg <= 1, got w_sev = {}, w_neg = {}",
                self.w_sev,
                self.w_neg
            );
        }
        if !(self.k_tail > 0.0) {
            bail!("objective.triage.k_tail: must be positive, got {}", self.k_tail);
        }
        if !(self.beta > 0.0) {
            bail!("objective.triage.beta: must be positive, got {}", self.beta);
        }
        if self.lambda_rep < 0.0 {
            bail!("objective.triage.lambda_rep: must be >= 0, got {}", self.lambda_rep);
        }
        Ok(())
    }

    /// λ_k = λ_rep·1[k ≥ k_rep] (Eq. 59).
    pub fn lambda(&self, k: u64) -> f64 {
        if k >= self.k_rep {
            self.lambda_rep
        } else {
            0.0
        }
    }

    /// Segment weight w_S = min(w_mean, w_tail) of a negative-advantage segment (Eqs. 52–54).
    pub fn segment_weight(&self, mean_gap: f64, tail_count: usize) -> f64 {
        let w_mean = if mean_gap < self.tau_sev {
            self.w_sev
        } else if mean_gap < self.tau_neg {
            self.w_neg
        } else {
            1.0
        };
        let w_tail = 1.0 - (1.0 - self.w_sev) * (tail_count as f64 / self.k_tail).min(1.0);
        w_mean.min(w_tail)
    }
}

/// φ_β(q) = β²(√(1+(q/β)²) − 1), written as q²/(√(1+(q/β)²) + 1) (no cancellation at small q).
pub fn phi(q: f64, beta: f64) -> f64 {
    q * q / ((1.0 + (q / beta).powi(2)).sqrt() + 1.0)
}

/// φ'_β(q) = q/√(1+(q/β)²) (Eq. 61), in [0, β) for q ≥ 0.
pub fn phi_prime(q: f64, beta: f64) -> f64 {
    q / (1.0 + (q / beta).powi(2)).sqrt()
}

/// What one TRIAGE update did (the metrics line's `triage` object).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TriageStats {
    /// Diagnostic segments of A < 0 responses, and those with w_S < 1.
    pub eligible_segments: usize,
    pub gated_segments: usize,
    /// Tokens whose raw weight w_t < 1.
    pub gated_tokens: usize,
    /// Responses with at least one gated token.
    pub gated_responses: usize,
    /// N_rep, the repair segments with q_R > 0 on A > 0 responses, and λ_k.
    pub repair_segments: usize,
    pub repair_active: usize,
    pub lambda: f64,
    /// Σ|(α−1)·g_base| / (2·Σ|g_base|): the share of base coefficient mass the gate moved.
    pub mass_moved: f64,
    /// Σψ / Σ|g_base|: repair pressure relative to the base objective.
    pub repair_mass: f64,
    /// B_amp and B_con of Eq. 7 with κ ≡ 1 (proxies: Σ[δ·c]₊ and Σ[−δ·c]₊), for the final
    /// coefficients and for the base ones.
    pub b_amp: f64,
    pub b_con: f64,
    pub b_amp_base: f64,
    pub b_con_base: f64,
}

/// TRIAGE coefficients at update index `k`. Needs advantages and sampler log-probs.
pub fn coefficients(
    s: &TokenStats,
    agg: LossAgg,
    pg: &PgConfig,
    tc: &TriageConfig,
    k: u64,
) -> Result<(Coefficients, TriageStats)> {
    tc.validate()?;
    let base = grpo::base(s, agg, pg)?;
    let adv = s.advantages.context("TRIAGE: advantages are missing")?;
    let sampler = s.sampler.context("TRIAGE needs the sampler's log-probs (δ = log π_θ − log π_s)")?;
    let n = s.len();
    let delta: Vec<f64> = (0..n).map(|t| s.logp[t] as f64 - sampler[t] as f64).collect();
    let mut alpha = vec![1.0f64; n];
    let mut psi = vec![0.0f64; n];
    let mut st = TriageStats { lambda: tc.lambda(k), ..Default::default() };
    // Pass 1: the gate, and the repair segment count N_rep over the whole update batch.
    let mut start = 0;
    let mut spans = Vec::with_capacity(s.seq_lens.len());
    for &len in s.seq_lens {
        let r = start..start + len;
        start += len;
        let valid: Vec<bool> = r.clone().map(|t| s.active(t)).collect();
        let n_i = valid.iter().filter(|v| **v).count();
        if n_i == 0 {
            continue;
        }
        let a = adv[r.start];
        st.repair_segments += segments(&valid, tc.repair_segment_len).len();
        spans.push((r.clone(), valid.clone(), a));
        if a >= 0.0 {
            continue;
        }
        let mut w = vec![1.0f64; len];
        let mut gated = 0;
        for (_, pos) in segments(&valid, tc.segment_len) {
            st.eligible_segments += 1;
            let mean = pos.iter().map(|&p| delta[r.start + p]).sum::<f64>() / pos.len() as f64;
            let tails = pos.iter().filter(|&&p| delta[r.start + p] < tc.tau_tail).count();
            let ws = tc.segment_weight(mean, tails);
            if ws < 1.0 {
                st.gated_segments += 1;
            }
            for &p in &pos {
                if delta[r.start + p] < 0.0 {
                    w[p] = ws;
                    if ws < 1.0 {
                        gated += 1;
                    }
                }
            }
        }
        if gated > 0 {
            st.gated_tokens += gated;
            st.gated_responses += 1;
            // H_i = Σ_t m w (> 0: every weight is at least w_sev > 0); α = w/w̄ = w·n_i/H_i.
            let h: f64 = (0..len).filter(|&p| valid[p]).map(|p| w[p]).sum();
            for p in (0..len).filter(|&p| valid[p]) {
                alpha[r.start + p] = w[p] * n_i as f64 / h;
            }
        }
    }
    // Pass 2: repair on positive-advantage responses.
    let lam = st.lambda;
    let mut rep_loss = 0.0;
    if st.repair_segments > 0 {
        let n_rep = st.repair_segments as f64;
        for (r, valid, a) in &spans {
            if *a <= 0.0 {
                continue;
            }
            for (_, pos) in segments(valid, tc.repair_segment_len) {
                let n_r = pos.len() as f64;
                let mean = pos.iter().map(|&p| delta[r.start + p]).sum::<f64>() / n_r;
                let q = (tc.tau_rep - mean).max(0.0);
                if q <= 0.0 {
                    continue;
                }
                st.repair_active += 1;
                rep_loss += lam / n_rep * phi(q, tc.beta);
                let c = lam / n_rep / n_r * phi_prime(q, tc.beta);
                for &p in &pos {
                    psi[r.start + p] = c;
                }
            }
        }
    }
    let mut coef = vec![0.0f32; n];
    let (mut moved, mut mass, mut psum) = (0.0, 0.0, 0.0);
    let mut pg_loss = 0.0;
    for t in 0..n {
        let g = base.coef[t];
        let c = alpha[t] * g + psi[t];
        coef[t] = c as f32;
        pg_loss += base.weights[t] * alpha[t] * base.token_loss[t];
        moved += ((alpha[t] - 1.0) * g).abs();
        mass += g.abs();
        psum += psi[t];
        st.b_amp += (delta[t] * c).max(0.0);
        st.b_con += (-delta[t] * c).max(0.0);
        st.b_amp_base += (delta[t] * g).max(0.0);
        st.b_con_base += (-delta[t] * g).max(0.0);
    }
    if mass > 0.0 {
        st.mass_moved = moved / (2.0 * mass);
        st.repair_mass = psum / mass;
    }
    Ok((Coefficients { coef, loss: pg_loss + rep_loss }, st))
}

#[cfg(test)]
#[path = "triage_tests.rs"]
mod tests;
