//! The RL objectives against PyTorch autograd (scripts/make_fixtures.py, section rl): one SGD
//! step (lr 1, no decay, no clipping, F32 weights) from the rollout file tests/fixtures/rl/
//! changes every parameter by exactly −∇L of the objective as written in the papers — GRPO
//! (seed 004 Eq. 1), TIS (Eq. 3), TRIAGE (App. C: Eqs. 16, 19), REINFORCE with the advantage
//! offset and score centering (seed 000 App. B.1). Also TRIAGE's per-token weights, α and ψ
//! against the fixture's plain-formula values.
//! Criteria (f32 vs f32, different summation orders): per tensor ‖Δθ − ∇L‖/‖∇L‖ ≤ 1e-4; the
//! loss |Δ| ≤ 1e-5 + 1e-4·|ref|; α, ψ |Δ| ≤ 1e-6 + 1e-5·|ref|.

mod common;

use colotrain::config::{JobConfig, LossAgg};
use colotrain::device::{DType, Device};
use colotrain::engine::rollout::read_file;
use colotrain::model::trainable::{TrainBatch, Trainable};
use colotrain::model::weights::param_specs;
use colotrain::objective::advantage::{advantages, Estimator};
use colotrain::objective::grpo::{self, PgConfig};
use colotrain::objective::triage::{self, TriageConfig};
use colotrain::objective::TokenStats;
use colotrain::train::trainer::{param_slices, Trainer};
use common::*;

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

fn rl_dir() -> std::path::PathBuf {
    fixtures().join("rl")
}

#[test]
fn one_sgd_step_per_rl_objective_is_theta_minus_grad() {
    let dev = Device::cpu(2).unwrap();
    let cases = [
        ("grpo", "kind = \"grpo\"\ntis = false\n".to_string()),
        ("grpo_tis", "kind = \"grpo\"\ntis = true\ntis_cap = 2.0\n".to_string()),
        ("triage", format!("kind = \"triage\"\ntis_cap = 2.0\n{TRIAGE}")),
        ("reinforce_offset", "kind = \"reinforce\"\nadvantage_offset = 0.15\n".to_string()),
        ("reinforce_centered", "kind = \"reinforce\"\nadvantage_offset = 0.15\ncentering = true\n".to_string()),
    ];
    let r = Ref::open(&rl_dir().join("qwen3_headdim.safetensors"));
    for (obj, section) in cases {
        let lm = load_fixture("qwen3_headdim", &dev, DType::F32);
        let before: Vec<Vec<f32>> = lm.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
        let rollouts = read_file(&rl_dir().join("rollouts.jsonl"), lm.cfg.vocab_size).unwrap();
        // The objective's keys first, then its [objective.triage] table (TOML order).
        let toml = format!(
            "[model]\npath = \"unused\"\n[optimizer]\nkind = \"sgd\"\nlr = 1.0\nweight_decay = 0.0\ngrad_clip = 0.0\n[rollout]\nsource = \"file\"\nfile = \"unused\"\n[objective]\nloss_agg = \"seq-mean-token-mean\"\n{section}"
        );
        let job = JobConfig::from_toml(&toml, "inline").unwrap();
        let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
        let out = tr.step(&rollouts).unwrap();
        assert!(!out.skipped && out.updates == 1, "{obj}");
        // The reported loss is the objective's own value; centering changes the gradient only
        // (its surrogate's value is not reported), so it reports REINFORCE's loss.
        let (_, want_loss) =
            r.f32(&format!("loss.{}", if obj == "reinforce_centered" { "reinforce_offset" } else { obj }));
        let wl = want_loss[0] as f64;
        assert!((out.loss - wl).abs() <= 1e-5 + 1e-4 * wl.abs(), "{obj}: loss {} vs {wl}", out.loss);
        for (((pname, _), t), b) in param_specs(&tr.cfg).iter().zip(tr.weights.tensors()).zip(&before) {
            let (_, g) = r.f32(&format!("grad.{obj}.{pname}"));
            let delta: Vec<f32> = b.iter().zip(t.to_f32_vec().unwrap()).map(|(x, y)| x - y).collect();
            let e = rel_err(&delta, &g);
            assert!(e <= 1e-4, "{obj} {pname}: update vs gradient relative error {e:e}");
        }
        if obj == "triage" {
            let st = out.triage.expect("triage statistics");
            // 11 repair segments over the batch (the fixture's count), gating on two responses.
            assert_eq!(st.repair_segments, 11);
            assert_eq!(st.gated_responses, 2);
            assert!(st.repair_active >= 1 && st.lambda == 0.5);
        }
    }
}

/// TRIAGE's gate weights, α and ψ on the fixture batch against the fixture's plain-formula values.
#[test]
fn triage_alpha_and_psi_match_the_fixture() {
    let dev = Device::cpu(2).unwrap();
    let lm = load_fixture("qwen3_headdim", &dev, DType::F32);
    let rollouts = read_file(&rl_dir().join("rollouts.jsonl"), lm.cfg.vocab_size).unwrap();
    let r = Ref::open(&rl_dir().join("qwen3_headdim.safetensors"));
    let mut b = TrainBatch::default();
    for ro in &rollouts {
        b.push(&ro.prompt, &ro.response);
    }
    let params = param_slices(&lm.weights).unwrap();
    let ps: Vec<&[f32]> = params.iter().map(|c| c.as_ref()).collect();
    let mut m = Trainable::<f32>::new(&lm.cfg);
    m.forward(&ps, &b).unwrap();
    let k = b.rows.len();
    let (mut lp, mut en) = (vec![0.0; k], vec![0.0; k]);
    m.token_stats(&ps, &b, 1.0, 8, &mut lp, &mut en);
    let (_, want_lp) = r.f32("logp");
    assert_close("logp", &lp, &want_lp, 1e-5, 1e-5);
    let lens: Vec<usize> = rollouts.iter().map(|r| r.response.len()).collect();
    let rewards: Vec<f64> = rollouts.iter().map(|r| r.reward.unwrap() as f64).collect();
    let groups: Vec<u64> = rollouts.iter().map(|r| r.group).collect();
    let a = advantages(&rewards, &groups, Estimator::Grpo { population_std: false }, 0.0).unwrap();
    let (_, want_a) = r.f32("advantages.grpo");
    assert_close("advantages", &a.iter().map(|x| *x as f32).collect::<Vec<_>>(), &want_a, 1e-6, 1e-6);
    let adv: Vec<f64> = a.iter().zip(&lens).flat_map(|(a, n)| std::iter::repeat_n(*a, *n)).collect();
    let sampler: Vec<f32> = rollouts.iter().flat_map(|r| r.sampler_logprobs.clone()).collect();
    let s = TokenStats {
        seq_lens: &lens,
        logp: &lp,
        logp_old: None,
        sampler: Some(&sampler),
        teacher: None,
        advantages: Some(&adv),
        mask: None,
    };
    let job = JobConfig::from_toml(
        &format!("[model]\npath = \"x\"\n[rollout]\nsamples_per_prompt = 2\n[objective]\nkind = \"triage\"\n{TRIAGE}"),
        "inline",
    )
    .unwrap();
    let tc: TriageConfig = job.objective.triage.clone();
    let pg = PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: Some(2.0) };
    let base = grpo::base(&s, LossAgg::SeqMeanTokenMean, &pg).unwrap();
    let (c, _) = triage::coefficients(&s, LossAgg::SeqMeanTokenMean, &pg, &tc, 0).unwrap();
    let (_, alpha) = r.f32("triage.alpha");
    let (_, psi) = r.f32("triage.psi");
    for t in 0..k {
        let want = alpha[t] as f64 * base.coef[t] + psi[t] as f64;
        let got = c.coef[t] as f64;
        assert!((got - want).abs() <= 1e-6 + 1e-5 * want.abs(), "token {t}: c = {got}, α·g + ψ = {want}");
    }
    // The response-level identity of Eq. 56 on the fixture's own α.
    let mut at = 0;
    for n in &lens {
        let mean: f64 = alpha[at..at + n].iter().map(|x| *x as f64).sum::<f64>() / *n as f64;
        assert!((mean - 1.0).abs() < 1e-5, "mean α {mean}");
        at += n;
    }
}
