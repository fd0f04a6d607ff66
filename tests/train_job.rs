//! The main job end to end on CPU: the built-in tiny OPD job must cut held-out KL by at least
//! 40% and raise accuracy; the standard engine and the trainer agree (d_n < 1e-3) when their
//! weights agree; checkpoints load back; resuming continues exactly.

mod common;

use colotrain::config::CheckpointDtype;
use colotrain::config::JobConfig;
use colotrain::device::{DType, Device};
use colotrain::model::LoadedModel;
use colotrain::orchestrator::{self as job, JobOptions};
use colotrain::train::checkpoint;
use common::TempDir;

const TINY: &str = include_str!("../configs/tiny-opd.toml");

fn tiny(out: &std::path::Path, edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
    let mut j = JobConfig::from_toml(TINY, "tiny-opd.toml").unwrap();
    j.run.out_dir = Some(out.to_path_buf());
    edit(&mut j);
    j.validate("test").unwrap();
    j
}

fn lines(p: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn tiny_opd_job_cuts_heldout_kl_and_raises_accuracy() {
    let t = TempDir::new("tiny-job");
    let j = tiny(t.path(), |_| {});
    let s = job::run(&j, &JobOptions::default()).unwrap();
    let (first, last) = (s.evals.first().unwrap(), s.evals.last().unwrap());
    assert_eq!((first.step, last.step), (0, 300));
    assert!(last.kl <= 0.6 * first.kl, "held-out KL {} -> {} is not a 40% cut", first.kl, last.kl);
    assert!(last.accuracy > first.accuracy, "accuracy {} -> {}", first.accuracy, last.accuracy);
    let m = lines(&t.path().join("metrics.jsonl"));
    assert_eq!(m.len(), 301, "one line per step plus the step-0 evaluation");
    let step1 = &m[1];
    // The engine reads the trainer's own weights: mismatch is f32 rounding only.
    assert!(step1["mismatch"]["d_n"].as_f64().unwrap().abs() < 1e-3, "{step1}");
    for key in ["loss", "grad_norm", "entropy", "response_len", "reward", "tokens_per_s", "updates_per_hour"] {
        assert!(step1[key].is_number(), "metrics line lacks {key}: {step1}");
    }
    for key in ["rollout", "teacher", "reward", "train", "resync", "wait", "total"] {
        assert!(step1["time"][key].is_number(), "metrics line lacks time.{key}");
    }
    assert!(m[50]["heldout_kl"].is_number());
    // The final checkpoint is a model directory colotrain (and transformers) can load.
    let ck = checkpoint::resolve(t.path()).unwrap();
    let dev = Device::cpu(1).unwrap();
    let lm = LoadedModel::load(&ck, &dev, DType::F32).unwrap();
    assert_eq!(lm.cfg.num_layers, 4);
    assert!(lm.text.is_some());
}

fn master_of(dir: &std::path::Path, j: &JobConfig) -> (Vec<f32>, Vec<f32>, Vec<f32>, u64) {
    let (st, m, a, b) = checkpoint::load(dir, j).unwrap();
    (m, a, b, st.step)
}

#[test]
fn resume_continues_exactly() {
    let t = TempDir::new("resume");
    let edit = |j: &mut JobConfig| {
        j.run.steps = 6;
        j.eval.every = 0;
        j.data.heldout_size = 8;
        j.checkpoint.every = 3;
        j.checkpoint.keep = 0;
        j.rollout.prompts_per_step = 4;
        j.rollout.samples_per_prompt = 4;
    };
    let a = tiny(&t.path().join("straight"), edit);
    job::run(&a, &JobOptions::default()).unwrap();
    let b3 = tiny(&t.path().join("resumed"), |j| {
        edit(j);
        j.run.steps = 3;
    });
    job::run(&b3, &JobOptions::default()).unwrap();
    // Starting again without --resume is refused: nothing is overwritten.
    let err = format!("{:#}", job::run(&b3, &JobOptions::default()).unwrap_err());
    assert!(err.contains("already holds a run"), "{err}");
    let b6 = tiny(&t.path().join("resumed"), edit);
    job::run(
        &b6,
        &JobOptions {
            resume: Some(t.path().join("resumed")),
            progress: false,
            stop: None,
            fault: None,
            view_fault: None,
        },
    )
    .unwrap();
    let x = master_of(&t.path().join("straight").join("checkpoint-000006"), &a);
    let y = master_of(&t.path().join("resumed").join("checkpoint-000006"), &b6);
    assert_eq!(x.3, 6);
    assert!(x.0 == y.0, "master weights differ after resume");
    assert!(x.1 == y.1 && x.2 == y.2, "Adam moments differ after resume");
    let ma = lines(&t.path().join("straight").join("metrics.jsonl"));
    let mb = lines(&t.path().join("resumed").join("metrics.jsonl"));
    assert_eq!(ma.len(), mb.len());
    assert_eq!(ma[6]["loss"], mb[6]["loss"]);
    // A checkpoint of another run is refused.
    let other = tiny(&t.path().join("other"), |j| {
        edit(j);
        j.run.seed = 99;
    });
    let err = format!(
        "{:#}",
        job::run(
            &other,
            &JobOptions {
                resume: Some(t.path().join("resumed")),
                progress: false,
                stop: None,
                fault: None,
                view_fault: None
            }
        )
        .unwrap_err()
    );
    assert!(err.contains("belongs to another run"), "{err}");
}

#[test]
fn tiny_job_runs_with_every_rollout_engine() {
    let t = TempDir::new("engines-job");
    type Edit = Box<dyn Fn(&mut JobConfig)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "fp8",
            Box::new(|j| {
                j.engine.recipe = "fp8".into();
                j.engine.keep_bf16 = vec!["first-layer".into(), "last-layer".into()];
            }),
        ),
        ("nvfp4", Box::new(|j| j.engine.recipe = "nvfp4".into())),
        (
            "fp8-kv",
            Box::new(|j| {
                j.engine.recipe = "fp8-kv".into();
                j.engine.keep_bf16 = vec!["first-layer-kv".into()];
                j.engine.kv_scale = colotrain::config::KvScaleConfig::Value(1.0);
            }),
        ),
        ("noise", Box::new(|j| j.engine.noise_sigma = 0.15)),
        ("stale", Box::new(|j| j.engine.staleness = 2)),
    ];
    for (name, edit) in cases {
        let j = tiny(&t.path().join(name), |j| {
            j.run.steps = 4;
            j.eval.every = 0;
            j.data.heldout_size = 8;
            j.rollout.prompts_per_step = 4;
            j.rollout.samples_per_prompt = 4;
            edit(j);
        });
        job::run(&j, &JobOptions::default()).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let m = lines(&t.path().join(name).join("metrics.jsonl"));
        let d: Vec<f64> = m[1..].iter().map(|l| l["mismatch"]["d_n"].as_f64().unwrap()).collect();
        // Every non-standard engine differs from the trainer at some step (stale only once the
        // trainer has moved: from step 2 on).
        assert!(d.iter().any(|x| x.abs() > 1e-5), "{name}: d_n {d:?}");
        let calibrated = t.path().join(name).join("calibration.json").exists();
        assert_eq!(calibrated, matches!(name, "fp8" | "nvfp4"), "{name}: calibration.json");
    }
}

/// Runs `base` (a config text) 6 steps straight and 3 + 3 with a resume in between; the master
/// weights must be identical bit for bit and every metrics line equal but its timings (and the
/// held-out evaluation that ends the 3-step run).
fn straight_vs_resumed(t: &TempDir, name: &str, base: &str, edit: &dyn Fn(&mut JobConfig)) {
    let make = |dir: &str, steps: u64| {
        let mut j = JobConfig::from_toml(base, "base.toml").unwrap();
        j.run.out_dir = Some(t.path().join(name).join(dir));
        j.run.steps = 6;
        j.eval.every = 0;
        j.data.heldout_size = 8;
        j.checkpoint.every = 3;
        j.checkpoint.keep = 0;
        j.checkpoint.dtype = CheckpointDtype::F32;
        j.rollout.prompts_per_step = 4;
        j.rollout.samples_per_prompt = 4;
        edit(&mut j);
        j.validate("test").unwrap();
        let fixed = j.clone();
        j.run.steps = steps;
        (j, fixed)
    };
    let (a, _) = make("straight", 6);
    job::run(&a, &JobOptions::default()).unwrap();
    let (b3, b6) = make("resumed", 3);
    job::run(&b3, &JobOptions::default()).unwrap();
    job::run(&b6, &JobOptions { resume: b6.run.out_dir.clone(), ..Default::default() }).unwrap();
    let x = master_of(&a.run.out_dir.clone().unwrap().join("checkpoint-000006"), &a);
    let y = master_of(&b6.run.out_dir.clone().unwrap().join("checkpoint-000006"), &b6);
    assert!(x.0 == y.0, "{name}: master weights differ after resume");
    let strip = |mut v: serde_json::Value| {
        for k in ["time", "tokens_per_s", "updates_per_hour", "utilization", "transfer", "heldout_kl", "heldout_acc"] {
            v.as_object_mut().unwrap().remove(k);
        }
        v
    };
    let ma = lines(&a.run.out_dir.clone().unwrap().join("metrics.jsonl"));
    let mb = lines(&b6.run.out_dir.clone().unwrap().join("metrics.jsonl"));
    assert_eq!(ma.len(), mb.len(), "{name}");
    for (p, q) in ma.into_iter().zip(mb) {
        assert_eq!(strip(p), strip(q), "{name}: a metrics line differs after resume");
    }
}

/// The engines and the monitor keep state across steps that the optimizer state alone does not
/// hold: a stale engine's ring of older weights (alone and under FP8 quantization), and the RL
/// monitor's tail threshold τ calibrated over the first steps. A resumed run continues exactly.
#[test]
fn resume_is_exact_with_stale_engines_and_the_rl_monitor() {
    let t = TempDir::new("resume-state");
    let opd = include_str!("../configs/tiny-opd.toml");
    straight_vs_resumed(&t, "stale", opd, &|j| j.engine.staleness = 2);
    straight_vs_resumed(&t, "stale-fp8", opd, &|j| {
        j.engine.staleness = 1;
        j.engine.recipe = "fp8".into();
    });
    straight_vs_resumed(&t, "noise", opd, &|j| j.engine.noise_sigma = 0.15);
    straight_vs_resumed(&t, "triage-tau", include_str!("../configs/tiny-grpo-triage.toml"), &|j| {
        j.monitor.healthy_steps = 2
    });
    // τ was calibrated before the checkpoint and used after it.
    let m = lines(&t.path().join("triage-tau").join("resumed").join("metrics.jsonl"));
    assert!(m[4]["rl"]["tail_tau"].as_f64().is_some(), "{}", m[4]);
}
