//! RL through the whole job on the built-in tiny task: rewards, advantages, TRIAGE's metrics, the
//! NVFP4 learner next to the NVFP4 engine, score centering with the engine's top-k log-probs,
//! several updates per step; and RL configuration errors.

mod common;

use colotrain::config::JobConfig;
use colotrain::config::{LearnerPrecision, ObjectiveKind, RolloutSource};
use colotrain::orchestrator::{self as job, JobOptions};
use common::TempDir;

const TINY_RL: &str = include_str!("../configs/tiny-grpo-triage.toml");

fn tiny(out: &std::path::Path, edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
    let mut j = JobConfig::from_toml(TINY_RL, "tiny-grpo-triage.toml").unwrap();
    j.run.out_dir = Some(out.to_path_buf());
    j.run.steps = 3;
    j.eval.every = 0;
    j.data.heldout_size = 8;
    j.rollout.prompts_per_step = 4;
    j.rollout.samples_per_prompt = 4;
    edit(&mut j);
    j.validate("test").unwrap();
    j
}

fn lines(p: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn mean_abs_gap(dir: &std::path::Path) -> f64 {
    let m = lines(&dir.join("metrics.jsonl"));
    let v: Vec<f64> = m[1..].iter().map(|l| l["mismatch"]["abs_mean"].as_f64().unwrap()).collect();
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn triage_job_reports_rewards_gates_and_repair() {
    let t = TempDir::new("rl-triage");
    let j = tiny(&t.path().join("run"), |j| j.objective.triage.k_rep = 1);
    job::run(&j, &JobOptions::default()).unwrap();
    let m = lines(&t.path().join("run").join("metrics.jsonl"));
    for l in &m[1..] {
        let r = l["reward"].as_f64().expect("a reward per step");
        assert!((0.0..=1.0).contains(&r));
        let tr = &l["triage"];
        // 16 responses of ≥ 1 token: at least 16 repair segments (W_rep = 4).
        assert!(tr["repair_segments"].as_u64().unwrap() >= 16, "{tr}");
        assert!(l["rl"]["zero_adv_frac"].as_f64().is_some());
        assert_eq!(l["updates"].as_u64(), Some(1));
    }
    // λ is 0 at update 0 and λ_rep from k_rep = 1 on.
    assert_eq!(m[1]["triage"]["lambda"].as_f64(), Some(0.0));
    assert_eq!(m[2]["triage"]["lambda"].as_f64(), Some(0.1));
}

/// Seed 004's point: with the learner's MLP in NVFP4 too (the engine's quantizer), learner and
/// sampler disagree far less than with a full-precision learner behind an NVFP4 engine.
#[test]
fn nvfp4_learner_tracks_the_nvfp4_engine() {
    let t = TempDir::new("rl-nvfp4");
    let w4 = tiny(&t.path().join("w4a4"), |j| j.run.steps = 2);
    let bf = tiny(&t.path().join("bf16"), |j| {
        j.run.steps = 2;
        j.learner.precision = LearnerPrecision::Bf16;
    });
    job::run(&w4, &JobOptions::default()).unwrap();
    job::run(&bf, &JobOptions::default()).unwrap();
    let (a, b) = (mean_abs_gap(&t.path().join("w4a4")), mean_abs_gap(&t.path().join("bf16")));
    // Same quantizer, same scales: only summation order and attention differ.
    assert!(a < 0.25 * b, "mean |δ|: NVFP4 learner {a:.2e} vs BF16 learner {b:.2e}");
}

#[test]
fn centering_and_two_updates_per_step_run_end_to_end() {
    let t = TempDir::new("rl-center");
    let j = tiny(&t.path().join("run"), |j| {
        j.objective.kind = ObjectiveKind::Grpo;
        j.objective.centering = true;
        j.objective.centering_top_k = 8;
        j.objective.minibatches = 2;
        j.objective.updates_per_step = 2;
    });
    job::run(&j, &JobOptions::default()).unwrap();
    let m = lines(&t.path().join("run").join("metrics.jsonl"));
    assert_eq!(m.last().unwrap()["updates"].as_u64(), Some(4));
    assert_eq!(m.last().unwrap()["version"].as_u64(), Some(12));
}

#[test]
fn rl_configuration_errors_are_clear() {
    let bad = |extra: &str| -> String {
        let text = TINY_RL.replace("[objective.triage]\n", &format!("[objective.triage]\n{extra}\n"));
        format!("{:#}", JobConfig::from_toml(&text, "tiny-grpo-triage.toml").unwrap_err())
    };
    assert!(bad("tau_sev = -0.01").contains("tau_sev < tau_neg < 0"));
    assert!(bad("w_sev = 0.9").contains("w_sev <= w_neg"));
    let e = format!(
        "{:#}",
        JobConfig::from_toml(&TINY_RL.replace("segment_len = 4\nrepair", "segment_len = 0\nrepair"), "f.toml")
            .unwrap_err()
    );
    assert!(e.contains("segment_len") && e.contains("f.toml"), "{e}");
    let e = format!(
        "{:#}",
        JobConfig::from_toml(&TINY_RL.replace("samples_per_prompt = 8", "samples_per_prompt = 1"), "f.toml")
            .unwrap_err()
    );
    assert!(e.contains("rollout.samples_per_prompt") && e.contains("standard deviation is undefined"), "{e}");
    let e = format!(
        "{:#}",
        JobConfig::from_toml(&TINY_RL.replace("precision = \"nvfp4\"", "precision = \"fp4\""), "f.toml").unwrap_err()
    );
    assert!(e.contains("learner.precision"), "{e}");
}

/// Rewards missing for an RL objective (a rollout file without 'reward'), and a group of one.
#[test]
fn missing_rewards_and_singleton_groups_fail_the_step_clearly() {
    let t = TempDir::new("rl-file");
    let f = t.path().join("r.jsonl");
    let line = |g: u32, reward: &str| {
        format!("{{\"prompt_tokens\": [5, 6], \"response_tokens\": [7, 8], \"sampler_logprobs\": [-1.0, -1.0], \"group\": {g}{reward}}}\n")
    };
    std::fs::write(&f, line(0, "") + &line(0, "")).unwrap();
    let run = |name: &str| -> String {
        let j = tiny(&t.path().join(name), |j| {
            j.rollout.source = RolloutSource::File;
            j.rollout.file = Some(f.clone());
            j.run.steps = 1;
            j.data.heldout = None;
            j.engine.recipe = "bf16".into();
            j.engine.keep_bf16.clear();
            j.learner.precision = LearnerPrecision::Bf16;
        });
        format!("{:#}", job::run(&j, &JobOptions::default()).unwrap_err())
    };
    let e = run("a");
    assert!(e.contains("has no reward") && e.contains("RL objectives need rewards"), "{e}");
    std::fs::write(&f, line(0, ", \"reward\": 1") + &line(1, ", \"reward\": 0")).unwrap();
    let e = run("b");
    assert!(e.contains("single response") && e.contains("undefined"), "{e}");
}

/// A prompt file with a prompt that has no answer is refused before the run starts (its RL
/// rewards could never be computed), naming the file and the prompt.
#[test]
fn prompts_without_answers_are_refused_before_the_run() {
    let t = TempDir::new("rl-noanswer");
    let f = t.path().join("p.jsonl");
    std::fs::write(&f, "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"2+2=\"}\n").unwrap();
    let j = tiny(&t.path().join("r"), |j| {
        j.data.train = f.display().to_string();
        j.run.steps = 1;
    });
    let e = format!("{:#}", job::run(&j, &JobOptions::default()).unwrap_err());
    assert!(e.contains("p.jsonl") && e.contains("prompt #2 (in file order)") && e.contains("no \"answer\""), "{e}");
    // Nothing ran: no metrics were written.
    assert!(!t.path().join("r").join("metrics.jsonl").exists());
}
