//! TRIAGE coefficients worked out by hand from Eqs. 52–63 (seed 004 App. C), and the
//! properties of Eqs. 56 and 65.

use super::*;

/// W = W_rep = 3, τ_tail = −1, K_tail = 2, τ_sev = −0.4, τ_neg = −0.1, w_sev = 0.2, w_neg = 0.6,
/// τ_rep = −0.05, β = 0.1, λ_rep = 0.5 from update k_rep = 10.
fn cfg() -> TriageConfig {
    TriageConfig {
        segment_len: 3,
        tau_tail: -1.0,
        k_tail: 2.0,
        tau_sev: -0.4,
        tau_neg: -0.1,
        w_sev: 0.2,
        w_neg: 0.6,
        repair_segment_len: 3,
        tau_rep: -0.05,
        beta: 0.1,
        lambda_rep: 0.5,
        k_rep: 10,
    }
}

const PG: PgConfig = PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: None };

/// Batch builder: responses as (advantage, gaps δ); logp = 0 and sampler = −δ so that
/// δ = logp − sampler exactly in f32 for these values; logp_old = logp (ratio 1).
struct Batch {
    lens: Vec<usize>,
    logp: Vec<f32>,
    sampler: Vec<f32>,
    adv: Vec<f64>,
}

fn batch(resps: &[(f64, &[f32])]) -> Batch {
    let mut b = Batch { lens: vec![], logp: vec![], sampler: vec![], adv: vec![] };
    for (a, gaps) in resps {
        b.lens.push(gaps.len());
        for g in *gaps {
            b.logp.push(0.0);
            b.sampler.push(-g);
            b.adv.push(*a);
        }
    }
    b
}

fn stats<'a>(b: &'a Batch, mask: Option<&'a [bool]>) -> TokenStats<'a> {
    TokenStats {
        seq_lens: &b.lens,
        logp: &b.logp,
        logp_old: None,
        sampler: Some(&b.sampler),
        teacher: None,
        advantages: Some(&b.adv),
        mask,
    }
}

fn close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        // f32 coefficients of f64 hand values: |Δ| ≤ 1e-7 + 1e-6·|w|.
        assert!((*g as f64 - w).abs() <= 1e-7 + 1e-6 * w.abs(), "token {i}: {g} vs {w}");
    }
}

const NEG: [f32; 7] = [-0.5, 0.2, -1.6, -1.5, -2.0, -0.3, -0.03];
const POS: [f32; 4] = [-0.3, -0.02, 0.4, -0.25];

#[test]
fn gate_by_hand_with_a_short_last_segment() {
    // Segment 0: δ̄ = −1.9/3 < τ_sev → w_mean 0.2; one tail (−1.6) → w_tail = 1 − 0.8·½ = 0.6 → 0.2.
    // Segment 1: δ̄ = −3.8/3 → 0.2; two tails → w_tail 0.2 → 0.2.
    // Segment 2 (one token, −0.03 ≥ τ_neg, no tail) → 1.
    // w = [.2, 1 (δ > 0), .2, .2, .2, .2, 1]; H = 3; α = 7w/3; c = α·A/7 = −w/3 (one response).
    let b = batch(&[(-1.0, &NEG)]);
    let (c, st) = coefficients(&stats(&b, None), LossAgg::SeqMeanTokenMean, &PG, &cfg(), 0).unwrap();
    let w = [0.2, 1.0, 0.2, 0.2, 0.2, 0.2, 1.0];
    close(&c.coef, &w.map(|w| -w / 3.0));
    assert_eq!((st.eligible_segments, st.gated_segments, st.gated_tokens, st.gated_responses), (3, 2, 5, 1));
    assert_eq!(st.repair_segments, 3);
    // Eq. 16's loss: ℓ_t = −A·ρ = 1 per token, weighted mean Σwℓ/H = 1.
    assert!((c.loss - 1.0).abs() < 1e-12, "{}", c.loss);
}

#[test]
fn masked_tokens_leave_segments_and_get_nothing() {
    // Mask token 1: segment 0 holds positions {0, 2}: δ̄ = −1.05 → 0.2 (tail count 1 → 0.6).
    // Valid weights .2 ×5 and 1 (token 6): H = 2, n = 6; c = A·w/H = −w/2; masked → 0.
    let b = batch(&[(-1.0, &NEG)]);
    let mask = [true, false, true, true, true, true, true];
    let (c, st) = coefficients(&stats(&b, Some(&mask)), LossAgg::SeqMeanTokenMean, &PG, &cfg(), 0).unwrap();
    close(&c.coef, &[-0.1, 0.0, -0.1, -0.1, -0.1, -0.1, -0.5]);
    assert_eq!(st.gated_tokens, 5);
    // Masking a whole segment removes it (positions keep their index: no re-segmenting).
    let mask = [true, true, true, false, false, false, true];
    let (c, st) = coefficients(&stats(&b, Some(&mask)), LossAgg::SeqMeanTokenMean, &PG, &cfg(), 0).unwrap();
    // Segment 0 → 0.2 on tokens 0, 2; segment 2 → 1. w = [.2, 1, .2, –, –, –, 1]: H = 2.4, n = 4.
    close(&c.coef, &[-0.2 / 2.4, -1.0 / 2.4, -0.2 / 2.4, 0.0, 0.0, 0.0, -1.0 / 2.4]);
    assert_eq!((st.eligible_segments, st.repair_segments), (2, 2));
}

#[test]
fn repair_before_and_after_k_rep() {
    // Batch: the negative response (3 repair segments) and a positive one (2): N_rep = 5.
    // Positive response, segment 0: δ̄ = 0.08/3 > τ_rep → q = 0; segment 1 (one token):
    // δ̄ = −0.25 → q = 0.2, φ'(0.2) = 0.2/√5; ψ = (0.5/5)·(1/1)·0.2/√5 = 0.0089443.
    // Base (G = 2, seq-mean-token-mean): positive 1/(2·4) = 0.125; negative −w/(2·3).
    let b = batch(&[(-1.0, &NEG), (1.0, &POS)]);
    let w = [0.2, 1.0, 0.2, 0.2, 0.2, 0.2, 1.0];
    let neg: Vec<f64> = w.iter().map(|w| -w / 6.0).collect();
    let s = stats(&b, None);
    // k = 9 < k_rep = 10: λ = 0, no repair; the gate is unchanged.
    let (c, st) = coefficients(&s, LossAgg::SeqMeanTokenMean, &PG, &cfg(), 9).unwrap();
    let mut want = neg.clone();
    want.extend([0.125; 4]);
    close(&c.coef, &want);
    assert_eq!((st.lambda, st.repair_segments, st.repair_active), (0.0, 5, 1));
    // k = 10: λ = 0.5.
    let (c, st) = coefficients(&s, LossAgg::SeqMeanTokenMean, &PG, &cfg(), 10).unwrap();
    let psi = 0.5 / 5.0 * 0.2 / 5f64.sqrt();
    let mut want = neg;
    want.extend([0.125, 0.125, 0.125, 0.125 + psi]);
    close(&c.coef, &want);
    assert_eq!((st.lambda, st.repair_active), (0.5, 1));
    // Loss: PG (½·1 from the negative response's weighted mean + ½·(−1) from the positive one)
    // plus (λ/N_rep)·φ(0.2) = 0.1·0.01·(√5 − 1).
    let want_loss = 0.5 - 0.5 + 0.1 * 0.01 * (5f64.sqrt() - 1.0);
    assert!((c.loss - want_loss).abs() < 1e-12, "{} vs {want_loss}", c.loss);
}

#[test]
fn no_negative_gap_token_and_zero_advantages_change_nothing() {
    // A negative response whose gaps are all ≥ 0: no token is gated, α ≡ 1.
    let g = [0.0f32, 0.3, 0.01, 2.0];
    let b = batch(&[(-1.0, &g), (0.0, &NEG)]);
    let s = stats(&b, None);
    let base = grpo::coefficients(&s, LossAgg::SeqMeanTokenMean, &PG).unwrap();
    let (c, st) = coefficients(&s, LossAgg::SeqMeanTokenMean, &PG, &cfg(), 100).unwrap();
    assert_eq!(c.coef, base.coef);
    // The A = 0 response: zero coefficients everywhere, no gate, no repair, but its 3 repair
    // segments count in N_rep.
    assert!(c.coef[4..].iter().all(|&x| x == 0.0));
    assert_eq!((st.gated_tokens, st.repair_active, st.repair_segments), (0, 0, 2 + 3));
}

#[test]
fn thresholds_out_of_order_are_rejected() {
    let mut t = cfg();
    t.tau_sev = -0.05;
    t.tau_neg = -0.1;
    assert!(t.validate().unwrap_err().to_string().contains("tau_sev < tau_neg < 0"));
    let mut t = cfg();
    t.segment_len = 0;
    assert!(t.validate().unwrap_err().to_string().contains("segment_len"));
    let mut t = cfg();
    t.w_sev = 0.7;
    assert!(t.validate().unwrap_err().to_string().contains("w_sev <= w_neg"));
}

/// Random batches: Eq. 56 (mean α = 1 per response), Eq. 65 (0 ≤ ψ ≤ λβ/(N_rep·n_R)) and the
/// reduction to the base objective with all gates 1 and λ = 0 (bit for bit).
#[test]
fn properties_on_random_batches() {
    let mut rng = crate::rand::Stream::new(7, 0);
    for trial in 0..200 {
        let g = 1 + rng.below(6) as usize;
        let mut resps: Vec<(f64, Vec<f32>)> = Vec::new();
        for _ in 0..g {
            let len = 1 + rng.below(12) as usize;
            let a = [-1.3, -0.4, 0.0, 0.7, 1.1][rng.below(5) as usize];
            resps.push((a, (0..len).map(|_| (rng.normal() * 0.8) as f32).collect()));
        }
        let refs: Vec<(f64, &[f32])> = resps.iter().map(|(a, v)| (*a, v.as_slice())).collect();
        let b = batch(&refs);
        let mask: Vec<bool> = (0..b.logp.len()).map(|_| rng.below(5) != 0).collect();
        let s = stats(&b, Some(&mask));
        let mut tc = cfg();
        tc.segment_len = 1 + rng.below(4) as usize;
        tc.repair_segment_len = 1 + rng.below(4) as usize;
        let agg = [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean, LossAgg::SeqMeanTokenSum][trial % 3];
        let base = grpo::base(&s, agg, &PG).unwrap();
        let (c, st) = coefficients(&s, agg, &PG, &tc, 1000).unwrap();
        // Recover α and ψ per response: on A ≠ 0 responses, c = α·g + ψ with g constant (ratio 1).
        let mut t0 = 0;
        for (i, &len) in b.lens.iter().enumerate() {
            let r = t0..t0 + len;
            t0 += len;
            let valid: Vec<usize> = r.clone().filter(|&t| mask[t]).collect();
            let a = resps[i].0;
            if valid.is_empty() || a == 0.0 {
                continue;
            }
            if a < 0.0 {
                let mean_alpha: f64 =
                    valid.iter().map(|&t| c.coef[t] as f64 / base.coef[t]).sum::<f64>() / valid.len() as f64;
                assert!((mean_alpha - 1.0).abs() < 1e-5, "trial {trial}: mean α = {mean_alpha}");
            } else {
                let lens = crate::mismatch::segments::segments(
                    &r.clone().map(|t| mask[t]).collect::<Vec<_>>(),
                    tc.repair_segment_len,
                );
                for (_, pos) in lens {
                    let bound = tc.lambda_rep * tc.beta / (st.repair_segments as f64 * pos.len() as f64);
                    for p in pos {
                        let t = r.start + p;
                        let psi = c.coef[t] as f64 - base.coef[t];
                        assert!(
                            psi >= -1e-7 && psi <= bound * (1.0 + 1e-5) + 1e-9,
                            "trial {trial}: ψ = {psi}, bound {bound}"
                        );
                    }
                }
            }
        }
        // All gates 1 (w_sev = w_neg = 1) and λ = 0: exactly the base objective.
        let mut id = tc.clone();
        id.w_sev = 1.0;
        id.w_neg = 1.0;
        id.lambda_rep = 0.0;
        let (c1, st1) = coefficients(&s, agg, &PG, &id, 1000).unwrap();
        let b1 = grpo::coefficients(&s, agg, &PG).unwrap();
        assert_eq!(c1.coef, b1.coef, "trial {trial}");
        assert_eq!(c1.loss, b1.loss, "trial {trial}");
        assert_eq!(st1.gated_tokens, 0);
    }
}
