//! Per-step RL mismatch monitoring (seed 004 §3, App. B.4–B.6): ρ_asym with raw |A| and |A|/n
//! weights, and segment tail statistics with a threshold τ calibrated once from a healthy
//! window (Eq. 45: the 5% quantile of δ over every valid token of the window's first steps) or
//! given in the config. δ = log π_learner − log π_sampler at the step's start.
//!
//! Owns: [`Monitor`] (τ and the healthy pool). May call: `crate::mismatch`. Must not: change
//! training.

use crate::mismatch::segments::{rho_parts, tail_stats, Response, TailStats};
use serde::{Deserialize, Serialize};

/// `[monitor]`: the tail statistics' segment length and threshold.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// W of the diagnostic segments (the paper's analysis uses 64).
    pub segment_len: usize,
    /// Steps pooled to calibrate τ (from the run's first step); 0 disables tail statistics
    /// unless `tail_tau` is set.
    pub healthy_steps: u64,
    /// A fixed τ instead of the calibrated one.
    pub tail_tau: Option<f64>,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig { segment_len: 64, healthy_steps: 25, tail_tau: None }
    }
}

/// The `rl` object of a metrics line.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RlMetrics {
    /// Responses with A = 0 (zero-variance groups), as a share of responses.
    pub zero_adv_frac: f64,
    pub rho_asym: Option<f64>,
    pub rho_asym_len_norm: Option<f64>,
    /// τ in use (None while the healthy window is being pooled).
    pub tail_tau: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tail: Option<TailStats>,
    pub clip_frac: f64,
}

pub struct Monitor {
    cfg: MonitorConfig,
    state: MonitorState,
}

/// What a checkpoint keeps of the monitor so that a resumed run calibrates τ (or keeps using
/// it) exactly as the uninterrupted run does. Stored as the f64 bit patterns (JSON numbers
/// would lose NaNs, which a step with a non-finite loss can put in the pool, and need not
/// round-trip to the last bit).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
#[serde(from = "MonitorBits", into = "MonitorBits")]
pub struct MonitorState {
    pub tau: Option<f64>,
    /// δ values of the healthy window pooled so far (empty once τ is set).
    pub pool: Vec<f64>,
    pub steps: u64,
}

#[derive(Serialize, serde::Deserialize)]
struct MonitorBits {
    tau_bits: Option<u64>,
    pool_bits: Vec<u64>,
    steps: u64,
}

impl From<MonitorState> for MonitorBits {
    fn from(s: MonitorState) -> Self {
        MonitorBits {
            tau_bits: s.tau.map(f64::to_bits),
            pool_bits: s.pool.iter().map(|x| x.to_bits()).collect(),
            steps: s.steps,
        }
    }
}

impl From<MonitorBits> for MonitorState {
    fn from(b: MonitorBits) -> Self {
        MonitorState {
            tau: b.tau_bits.map(f64::from_bits),
            pool: b.pool_bits.into_iter().map(f64::from_bits).collect(),
            steps: b.steps,
        }
    }
}

impl Monitor {
    pub fn new(cfg: &MonitorConfig) -> Monitor {
        Monitor { cfg: cfg.clone(), state: MonitorState { tau: cfg.tail_tau, ..Default::default() } }
    }

    pub fn state(&self) -> &MonitorState {
        &self.state
    }

    /// Continues from a checkpoint's state (a fixed `tail_tau` in the config still wins).
    pub fn restore(&mut self, s: MonitorState) {
        let fixed = self.cfg.tail_tau;
        self.state = s;
        if fixed.is_some() {
            self.state.tau = fixed;
        }
    }

    /// One step: advantages per response, response lengths, the learner's and the sampler's
    /// log-probs per token (concatenated), and the clipped-token count.
    pub fn observe(
        &mut self,
        adv: &[f64],
        seq_lens: &[usize],
        logp: &[f32],
        sampler: &[f32],
        clipped: usize,
    ) -> RlMetrics {
        let delta: Vec<f64> = logp.iter().zip(sampler).map(|(a, b)| *a as f64 - *b as f64).collect();
        let valid = vec![true; delta.len()];
        let mut resp = Vec::with_capacity(adv.len());
        let mut at = 0;
        for (a, &n) in adv.iter().zip(seq_lens) {
            resp.push(Response { advantage: *a, delta: &delta[at..at + n], valid: &valid[at..at + n] });
            at += n;
        }
        self.state.steps += 1;
        if self.state.tau.is_none() && self.cfg.healthy_steps > 0 {
            self.state.pool.extend_from_slice(&delta);
            if self.state.steps >= self.cfg.healthy_steps {
                let mut s = std::mem::take(&mut self.state.pool);
                s.sort_by(f64::total_cmp);
                self.state.tau = Some(crate::mismatch::quantile(&s, 0.05));
                tracing::info!(
                    "tail threshold τ = {:.5} (5% quantile of δ over the first {} steps)",
                    self.state.tau.unwrap_or(f64::NAN),
                    self.state.steps
                );
            }
        }
        RlMetrics {
            zero_adv_frac: adv.iter().filter(|a| **a == 0.0).count() as f64 / adv.len().max(1) as f64,
            rho_asym: rho_parts(&resp, false).ratio(),
            rho_asym_len_norm: rho_parts(&resp, true).ratio(),
            tail_tau: self.state.tau,
            tail: self.state.tau.map(|t| tail_stats(&resp, self.cfg.segment_len, t)),
            clip_frac: clipped as f64 / delta.len().max(1) as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint's monitor state round-trips bit for bit, NaNs and all.
    #[test]
    fn monitor_state_round_trips_exactly() {
        let s = MonitorState {
            tau: Some(-0.1 / 3.0),
            pool: vec![f64::NAN, -0.0, 1e-300, 0.1 + 0.2, f64::INFINITY],
            steps: 7,
        };
        let back: MonitorState = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back.tau.map(f64::to_bits), s.tau.map(f64::to_bits));
        assert_eq!(
            back.pool.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            s.pool.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(back.steps, 7);
    }

    #[test]
    fn tau_is_calibrated_once_from_the_healthy_window() {
        let mut m = Monitor::new(&MonitorConfig { segment_len: 2, healthy_steps: 2, tail_tau: None });
        // δ = logp − sampler: step 1 gives −1..−0.1 (10 values), step 2 gives 0..0.9.
        let adv = [-1.0, 1.0];
        let lens = [5, 5];
        let s1: Vec<f32> = (0..10).map(|i| (i as f32 + 1.0) / 10.0).collect();
        let r = m.observe(&adv, &lens, &[0.0; 10], &s1, 0);
        assert!(r.tail_tau.is_none() && r.tail.is_none());
        let s2: Vec<f32> = (0..10).map(|i| -(i as f32) / 10.0).collect();
        let r = m.observe(&adv, &lens, &[0.0; 10], &s2, 3);
        // Pool: −1.0..−0.1 and 0..0.9 (20 values); numpy linear 5% quantile: position 0.95
        // between −1.0 and −0.9 → −0.905.
        let tau = r.tail_tau.unwrap();
        assert!((tau + 0.905).abs() < 1e-6, "{tau}");
        assert!((r.clip_frac - 0.3).abs() < 1e-12);
        // Step 2: δ = 0..0.9 ≥ 0: A⁻ is empty, A⁺ holds response 1's 5 tokens → ρ = 0/5.
        assert_eq!(r.rho_asym, Some(0.0));
        let r3 = m.observe(&adv, &lens, &[0.0; 10], &s1, 0);
        assert_eq!(r3.tail_tau, Some(tau), "τ stays fixed after calibration");
        // Step 3: response 0 has 5 tokens with δ < 0 (A⁻, |A| = 1), response 1 none with δ > 0.
        assert_eq!(r3.rho_asym, None);
        assert_eq!(r3.tail.as_ref().map(|t| t.tokens), Some(5));
    }
}
