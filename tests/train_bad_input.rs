//! Bad training input: clear errors naming the file, key or line; nothing overwritten; a step
//! whose loss or gradient is not finite is skipped, counted, and never applied.

mod common;

use colotrain::config::JobConfig;
use colotrain::device::{DType, Device};
use colotrain::engine::rollout::{read_file, Rollout};
use colotrain::orchestrator::{self as job, JobOptions};
use colotrain::train::trainer::Trainer;
use common::*;
use std::process::Command;

fn cfg_err(text: &str) -> String {
    format!("{:#}", JobConfig::from_toml(text, "run.toml").unwrap_err())
}

const MIN: &str = "[model]\npath = \"m\"\n[teacher]\npath = \"t\"\n";

#[test]
fn config_errors_name_the_key() {
    let e = cfg_err(&format!("{MIN}[optimizer]\nlearning_rate = 0.1\n"));
    assert!(e.contains("run.toml") && e.contains("unknown field") && e.contains("learning_rate"), "{e}");
    let e = cfg_err(&format!("{MIN}[run]\nsteps = \"ten\"\n"));
    assert!(e.contains("run.toml") && e.contains("invalid type") && e.contains("steps"), "{e}");
    let e = cfg_err("[model]\npath = \"m\"\n[objective]\nkind = \"opd\"\n");
    assert!(e.contains("teacher: the opd objective needs a [teacher] model"), "{e}");
    let e = cfg_err(&format!("{MIN}[objective]\nloss_agg = \"mean\"\n"));
    assert!(e.contains("objective.loss_agg") && e.contains("unknown loss aggregation 'mean'"), "{e}");
    let e = cfg_err(&format!("{MIN}[rollout]\ntop_p = 0\n"));
    assert!(e.contains("rollout.top_p: must be in (0, 1]"), "{e}");
    let e = cfg_err(&format!("{MIN}[optimizer]\nbetas = [0.9, 1.5]\n"));
    assert!(e.contains("optimizer.betas[1]"), "{e}");
    let e = cfg_err(&format!("{MIN}[engine]\nrecipe = \"fp4\"\n"));
    assert!(e.contains("engine.recipe") && e.contains("unknown recipe 'fp4'"), "{e}");
    let e = cfg_err(&format!("{MIN}[rollout]\nsource = \"file\"\n"));
    assert!(e.contains("rollout.file"), "{e}");
}

/// Every mode key: an unknown spelling names the file, the key, the line, the value and every
/// spelling it accepts; the device string is checked without opening a device.
#[test]
fn unknown_modes_name_the_key_and_what_was_expected() {
    for (section, key, value, want) in [
        (
            "objective",
            "kind",
            "ppo",
            "objective.kind: unknown objective 'ppo': expected opd, sft, grpo, reinforce or triage",
        ),
        ("schedule", "mode", "eager", "schedule.mode: expected sync or async, got 'eager'"),
        ("schedule", "placement", "mixed", "schedule.placement: expected colocated or split, got 'mixed'"),
        ("rollout", "source", "web", "rollout.source: unknown source 'web': expected engine or file"),
        ("learner", "precision", "fp8", "learner.precision: expected bf16 or nvfp4, got 'fp8'"),
        ("optimizer", "kind", "adam", "optimizer.kind: unknown optimizer 'adam': expected adamw or sgd"),
        ("checkpoint", "dtype", "f16", "checkpoint.dtype: expected bf16 or f32, got 'f16'"),
    ] {
        let e = cfg_err(&format!("{MIN}[{section}]\n{key} = \"{value}\"\n"));
        assert!(e.contains("run.toml") && e.contains("line 6") && e.contains(want), "{section}.{key}: {e}");
    }
    let e = cfg_err(&format!("{MIN}[run]\ndevice = \"gpu:0\"\n"));
    assert!(e.contains("run.toml: run.device: device 'gpu:0': expected 'cpu'"), "{e}");
    // A GPU that this machine lacks is not opened while validating (only when the run starts).
    assert!(JobConfig::from_toml(&format!("{MIN}[run]\ndevice = \"cuda:7\"\n"), "run.toml").is_ok());
}

#[test]
fn model_errors_at_job_start() {
    let t = TempDir::new("jobbad");
    let run = |toml: &str| {
        let mut j = JobConfig::from_toml(toml, "run.toml").unwrap();
        j.run.out_dir = Some(t.path().join("out"));
        format!("{:#}", job::run(&j, &JobOptions::default()).unwrap_err())
    };
    let e = run("[model]\npath = \"/nonexistent/model\"\n[teacher]\npath = \"/nonexistent/t\"\n");
    assert!(e.contains("loading the student '/nonexistent/model'") && e.contains("does not exist"), "{e}");
    let e = run("[model]\npath = \"builtin:gpt5\"\n[teacher]\npath = \"x\"\n");
    assert!(e.contains("unknown built-in model 'builtin:gpt5'"), "{e}");
    // Student and teacher with different vocabularies.
    let bin = env!("CARGO_BIN_EXE_colotrain");
    for (name, vocab) in [("s", "320"), ("t", "400")] {
        let out = t.path().join(name);
        let st = Command::new(bin)
            .args(["init-tiny", "--out", out.to_str().unwrap(), "--layers", "1", "--hidden", "32", "--vocab", vocab])
            .status()
            .unwrap();
        assert!(st.success());
    }
    let e = run(&format!(
        "[model]\npath = \"{}\"\n[teacher]\npath = \"{}\"\n",
        t.path().join("s").display(),
        t.path().join("t").display()
    ));
    assert!(e.contains("different vocabularies (320 vs 400 tokens)"), "{e}");
}

#[test]
fn rollout_file_errors_name_the_line() {
    let t = TempDir::new("rollbad");
    let p = t.path().join("r.jsonl");
    let read = |s: &str| {
        std::fs::write(&p, s).unwrap();
        format!("{:#}", read_file(&p, 100).unwrap_err())
    };
    let good = r#"{"prompt_tokens": [1, 2], "response_tokens": [3, 4], "sampler_logprobs": [-0.1, -0.2]}"#;
    let e = read(&format!(
        "{good}\n{{\"prompt_tokens\": [1], \"response_tokens\": [3, 4], \"sampler_logprobs\": [-0.1]}}\n"
    ));
    assert!(e.contains("r.jsonl:2: 'sampler_logprobs' has 1 values for 2 response tokens"), "{e}");
    let e = read(&format!("{good}\n{good}\n{{\"prompt_tokens\": [1], \"response_tokens\": [3], \"sampler_logprobs\": [-0.1], \"teacher_logprobs\": [NaN]}}\n"));
    assert!(e.contains("r.jsonl:3: not a valid JSON line (it holds a non-finite number"), "{e}");
    let e = read("{\"prompt_tokens\": [1], \"response_tokens\": [300], \"sampler_logprobs\": [-0.1]}\n");
    assert!(e.contains("r.jsonl:1") && e.contains("out of vocabulary"), "{e}");
    let e = read("{\"prompt_tokens\": [1], \"response_tokens\": [3]}\n");
    assert!(e.contains("r.jsonl:1: missing field 'sampler_logprobs'"), "{e}");
    let e = read("");
    assert!(e.contains("no rollouts"), "{e}");
}

#[test]
fn non_finite_steps_are_skipped_and_counted() {
    let dev = Device::cpu(2).unwrap();
    let lm = load_fixture("qwen3_headdim", &dev, DType::F32);
    let before: Vec<Vec<f32>> = lm.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
    let job = JobConfig::from_toml(
        "[model]\npath = \"x\"\n[teacher]\npath = \"y\"\n[optimizer]\nkind = \"sgd\"\nlr = 1.0\n",
        "inline",
    )
    .unwrap();
    let mut tr = Trainer::new(&lm.cfg, lm.weights, &job).unwrap();
    // A teacher log-prob of 3e38 makes the advantages (and gradients) overflow f32.
    let r = Rollout {
        prompt_id: 0,
        sample: 0,
        group: 0,
        prompt: vec![1, 2, 3],
        response: vec![4, 5],
        sampler_logprobs: vec![-1.0, -1.0],
        teacher_logprobs: Some(vec![3e38, 3e38]),
        reward: None,
        answer: None,
        truncated: false,
        version: 0,
        ..Default::default()
    };
    let out = tr.step(&[r.clone(), r]).unwrap();
    assert!(out.skipped);
    assert_eq!(tr.skipped_steps, 1);
    assert_eq!(tr.version, 0);
    let after: Vec<Vec<f32>> = tr.weights.tensors().iter().map(|t| t.to_f32_vec().unwrap()).collect();
    assert!(before == after, "a skipped step changed the weights");
}

#[test]
fn shipped_configs_parse() {
    for f in ["configs/tiny-opd.toml", "configs/tiny-opd-split.toml", "configs/r1-distill-qwen-7b-opd.toml"] {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(f);
        let j = JobConfig::from_file(&p).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(j.objective.kind.as_str(), "opd");
    }
    let j = JobConfig::from_file(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/r1-distill-qwen-7b-opd.toml"),
    )
    .unwrap();
    assert_eq!(
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt, j.rollout.max_new_tokens, j.run.steps),
        (8, 8, 16384, 200)
    );
    assert_eq!((j.optimizer.lr, j.optimizer.weight_decay, j.optimizer.grad_clip), (1e-6, 0.01, 1.0));
    let s = JobConfig::from_file(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-opd-split.toml"))
        .unwrap();
    assert_eq!(
        (
            s.schedule.mode.as_str(),
            s.schedule.placement.as_str(),
            s.schedule.max_staleness,
            s.schedule.rollout_devices,
            s.run.devices
        ),
        ("async", "split", 4, 1, 2)
    );
}

/// The RL recipes parse and validate, with the papers' settings: seed 000 §5.5 / App. B.2 (GRPO
/// and REINFORCE on R1-Distill-7B: 16 × 8, lr 1e-6, no importance correction) and seed 004
/// App. B.1 (Qwen3-4B-Base: 16 × 16, Adam β = (0.9, 0.98), wd 0.1, NVFP4 sampler and learner,
/// TIS C = 2, TRIAGE).
#[test]
fn shipped_rl_configs_parse_with_the_papers_settings() {
    let open = |f: &str| {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(f);
        JobConfig::from_file(&p).unwrap_or_else(|e| panic!("{f}: {e:#}"))
    };
    for (f, kind) in [("r1-distill-qwen-7b-grpo.toml", "grpo"), ("r1-distill-qwen-7b-reinforce.toml", "reinforce")] {
        let j = open(f);
        assert_eq!(j.objective.kind.as_str(), kind, "{f}");
        assert_eq!(
            (j.rollout.prompts_per_step, j.rollout.samples_per_prompt, j.rollout.max_new_tokens),
            (16, 8, 16384),
            "{f}"
        );
        assert_eq!((j.optimizer.lr, j.run.steps), (1e-6, 200), "{f}");
        assert!(!j.objective.tis_enabled(), "{f}: no importance correction");
    }
    let g = open("r1-distill-qwen-7b-grpo.toml");
    assert_eq!((g.objective.clip_low, g.objective.clip_high), (0.2, 0.28));
    for f in ["qwen3-4b-base-grpo-triage-nvfp4.toml", "tiny-grpo-triage.toml"] {
        let j = open(f);
        assert_eq!(j.objective.kind.as_str(), "triage", "{f}");
        assert_eq!((j.optimizer.betas, j.optimizer.weight_decay), ([0.9, 0.98], 0.1), "{f}");
        assert_eq!((j.objective.clip_low, j.objective.clip_high, j.objective.tis_cap), (0.2, 0.28, 2.0), "{f}");
        assert_eq!((j.learner.precision.as_str(), j.engine.recipe.as_str()), ("nvfp4", "nvfp4"), "{f}");
        assert!(j.objective.tis_enabled(), "{f}: TIS on");
    }
    let q = open("qwen3-4b-base-grpo-triage-nvfp4.toml");
    assert_eq!((q.rollout.prompts_per_step, q.rollout.samples_per_prompt, q.rollout.max_new_tokens), (16, 16, 16384));
}
