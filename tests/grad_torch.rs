//! The backward and the objectives against PyTorch autograd (f32) on the fixture models of
//! scripts/make_fixtures.py (section grads), and one SGD step from a rollout file giving
//! θ − ∇L of the configured objective.
//! Criteria (f32 vs f32, different summation orders): per tensor ‖g − g_ref‖/‖g_ref‖ ≤ 1e-4;
//! log-probs |Δ| ≤ 1e-5 + 1e-5·|ref|; losses |Δ| ≤ 1e-4·|ref|.

mod common;

use colotrain::config::{JobConfig, LossAgg};
use colotrain::device::{DType, Device};
use colotrain::engine::rollout::read_file;
use colotrain::model::trainable::{TrainBatch, Trainable};
use colotrain::model::weights::param_specs;
use colotrain::objective::{self, TokenStats};
use colotrain::train::trainer::{param_slices, Trainer};
use common::*;

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

#[test]
fn gradients_match_pytorch_autograd() {
    let dev = Device::cpu(2).unwrap();
    for name in FIXTURE_MODELS {
        let lm = load_fixture(name, &dev, DType::F32);
        let r = Ref::open(&fixtures().join("grads").join(format!("{name}.safetensors")));
        let rollouts =
            read_file(&fixtures().join("grads").join(format!("{name}_rollouts.jsonl")), lm.cfg.vocab_size).unwrap();
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
        m.token_stats(&ps, &b, 1.0, 5, &mut lp, &mut en);
        let (_, want_lp) = r.f32("logp_t1");
        assert_close(&format!("{name} logp"), &lp, &want_lp, 1e-5, 1e-5);
        let seq_lens: Vec<usize> = rollouts.iter().map(|r| r.response.len()).collect();
        let teacher: Vec<f32> = rollouts.iter().flat_map(|r| r.teacher_logprobs.clone().unwrap()).collect();
        let stats = TokenStats {
            seq_lens: &seq_lens,
            logp: &lp,
            logp_old: None,
            sampler: None,
            teacher: Some(&teacher),
            advantages: None,
            mask: None,
        };
        let (_, coef) = r.f32("coef");
        let cases: Vec<(&str, f32, Vec<f32>)> = vec![
            ("coef", 0.7, coef),
            ("sft_token_mean", 1.0, objective::sft::coefficients(&stats, LossAgg::TokenMean).unwrap().coef),
            ("opd_token_mean", 1.0, objective::opd::coefficients(&stats, LossAgg::TokenMean).unwrap().coef),
            (
                "opd_seq_mean_token_mean",
                1.0,
                objective::opd::coefficients(&stats, LossAgg::SeqMeanTokenMean).unwrap().coef,
            ),
            (
                "opd_seq_mean_token_sum",
                1.0,
                objective::opd::coefficients(&stats, LossAgg::SeqMeanTokenSum).unwrap().coef,
            ),
        ];
        for (obj, t, c) in cases {
            m.forward(&ps, &b).unwrap();
            let mut grads: Vec<Vec<f32>> = ps.iter().map(|p| vec![0.0; p.len()]).collect();
            let loss = m.backward(&ps, &b, &c, t, 4, &mut grads).unwrap();
            let (_, want_loss) = r.f32(&format!("loss.{obj}"));
            assert!(
                (loss - want_loss[0]).abs() as f64 <= 1e-4 * want_loss[0].abs() as f64,
                "{name} {obj}: loss {loss} vs {}",
                want_loss[0]
            );
            let norm: f64 = grads.iter().flatten().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
            let (_, want_norm) = r.f32(&format!("grad_norm.{obj}"));
            assert!(
                (norm - want_norm[0] as f64).abs() <= 1e-4 * want_norm[0] as f64,
                "{name} {obj}: grad norm {norm} vs {}",
                want_norm[0]
            );
            let mut checked = 0;
            for ((pname, _), g) in param_specs(&lm.cfg).iter().zip(&grads) {
                let key = format!("grad.{obj}.{pname}");
                if !safetensors_has(name, &key) {
                    continue;
                }
                let (_, want) = r.f32(&key);
                let e = rel_err(g, &want);
                assert!(e <= 1e-4, "{name} {obj} {pname}: relative error {e:e}");
                checked += 1;
            }
            if obj == "coef" {
                assert_eq!(checked, param_specs(&lm.cfg).len(), "{name}: every tensor's coef gradient is checked");
            }
        }
    }
}

fn safetensors_has(model: &str, key: &str) -> bool {
    let f = std::fs::read(fixtures().join("grads").join(format!("{model}.safetensors"))).unwrap();
    safetensors::SafeTensors::deserialize(&f).unwrap().names().contains(&key)
}

/// The SGD reference check: lr 1, no weight decay, no clipping, F32 weights — one step from the
/// rollout file moves every parameter by exactly −∇L of the configured objective.
#[test]
fn one_sgd_step_is_theta_minus_grad() {
    let dev = Device::cpu(2).unwrap();
    for (name, obj, agg, kind) in [
        ("llama_gqa", "opd_token_mean", "token-mean", "opd"),
        ("qwen2_tied_sharded", "opd_seq_mean_token_mean", "seq-mean-token-mean", "opd"),
        ("qwen2_tied_sharded", "sft_token_mean", "token-mean", "sft"),
        ("qwen3_headdim", "opd_seq_mean_token_sum", "seq-mean-token-sum", "opd"),
    ] {
        let lm = load_fixture(name, &dev, DType::F32);
        let before: Vec<Vec<f32>> = lm.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
        let rollouts =
            read_file(&fixtures().join("grads").join(format!("{name}_rollouts.jsonl")), lm.cfg.vocab_size).unwrap();
        let toml = format!(
            r#"[model]
path = "unused"
[teacher]
path = "unused"
[objective]
kind = "{kind}"
loss_agg = "{agg}"
[optimizer]
kind = "sgd"
lr = 1.0
weight_decay = 0.0
grad_clip = 0.0
"#
        );
        let job = JobConfig::from_toml(&toml, "inline").unwrap();
        let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
        let out = tr.step(&rollouts).unwrap();
        assert!(!out.skipped);
        let r = Ref::open(&fixtures().join("grads").join(format!("{name}.safetensors")));
        for (((pname, _), t), b) in param_specs(&lm.cfg).iter().zip(tr.weights.tensors()).zip(&before) {
            let (_, g) = r.f32(&format!("grad.{obj}.{pname}"));
            let want: Vec<f32> = b.iter().zip(&g).map(|(p, g)| p - g).collect();
            let got = t.to_f32_vec().unwrap();
            // The update itself is one f32 subtraction; the gradient carries the 1e-4 criterion.
            let delta_got: Vec<f32> = got.iter().zip(b).map(|(x, y)| y - x).collect();
            let e = rel_err(&delta_got, &g);
            assert!(e <= 1e-4, "{name} {obj} {pname}: update vs gradient relative error {e:e}");
            // θ' = θ − g up to the gradient's own f32 tolerance (1e-4 of the largest entry).
            let gmax = g.iter().fold(0.0f32, |a, x| a.max(x.abs())) as f64;
            assert_close(&format!("{name} {obj} {pname}"), &got, &want, 1e-4 * gmax, 1e-6);
        }
    }
}

/// The same reference check through the whole job: `colotrain train` with rollout.source = "file",
/// SGD lr 1, F32 weights and an F32 checkpoint; the checkpoint's weights are θ − ∇L.
#[test]
fn one_job_step_from_a_rollout_file_writes_theta_minus_grad() {
    let t = TempDir::new("sgdjob");
    let name = "qwen3_headdim";
    let model = fixtures().join("models").join(name);
    let toml = format!(
        r#"[run]
steps = 1
out_dir = "{out}"
[model]
path = "{m}"
dtype = "f32"
[teacher]
path = "{m}"
dtype = "f32"
[rollout]
source = "file"
file = "{f}"
[objective]
kind = "opd"
loss_agg = "seq-mean-token-sum"
[optimizer]
kind = "sgd"
lr = 1.0
weight_decay = 0.0
grad_clip = 0.0
[checkpoint]
dtype = "f32"
"#,
        out = t.path().join("run").display(),
        m = model.display(),
        f = fixtures().join("grads").join(format!("{name}_rollouts.jsonl")).display()
    );
    let job = JobConfig::from_toml(&toml, "inline").unwrap();
    colotrain::orchestrator::run(&job, &Default::default()).unwrap();
    let dev = Device::cpu(2).unwrap();
    let before = load_fixture(name, &dev, DType::F32);
    let after =
        colotrain::model::LoadedModel::load(&t.path().join("run").join("checkpoint-000001"), &dev, DType::F32).unwrap();
    let r = Ref::open(&fixtures().join("grads").join(format!("{name}.safetensors")));
    for (((pname, _), a), b) in
        param_specs(&before.cfg).iter().zip(after.weights.tensors()).zip(before.weights.tensors())
    {
        let (_, g) = r.f32(&format!("grad.opd_seq_mean_token_sum.{pname}"));
        let delta: Vec<f32> = b.to_f32_vec().unwrap().iter().zip(a.to_f32_vec().unwrap()).map(|(x, y)| x - y).collect();
        let e = rel_err(&delta, &g);
        assert!(e <= 1e-4, "{pname}: checkpoint update vs −∇L relative error {e:e}");
    }
}
