//! Comparing runs: Δ against a reference at the same step, the bracket, and the errors for runs
//! of different students or held-out sets, a missing step, and empty held-out files.

mod common;

use colotrain::config::CheckpointDtype;
use colotrain::train::eval::EvalResult;
use colotrain::train::runs::{compare, RunDir};
use common::TempDir;
use std::path::Path;
use std::process::Command;

fn fake_run(dir: &Path, model: &str, heldout: &str, d_n: f64, kl: &[f64]) {
    std::fs::create_dir_all(dir.join("eval")).unwrap();
    std::fs::write(dir.join("config.toml"), format!("[model]\npath = \"{model}\"\n[teacher]\npath = \"t\"\n")).unwrap();
    let mut m = String::from("{\"step\": 0, \"heldout_kl\": 1.0}\n");
    for s in 1..=10 {
        m.push_str(&format!("{{\"step\": {s}, \"mismatch\": {{\"d_n\": {d_n}}}}}\n"));
    }
    std::fs::write(dir.join("metrics.jsonl"), m).unwrap();
    let e = EvalResult {
        step: 10,
        kl: kl.iter().sum::<f64>() / kl.len() as f64,
        kl_per_problem: kl.to_vec(),
        acc_per_problem: vec![0.0; kl.len()],
        heldout: heldout.into(),
        student: model.into(),
        teacher: "t".into(),
        ..Default::default()
    };
    std::fs::write(dir.join("eval/step-000010.json"), serde_json::to_string(&e).unwrap()).unwrap();
}

#[test]
fn delta_level_and_errors() {
    let t = TempDir::new("budget");
    let base: Vec<f64> = (0..50).map(|i| 0.1 + 0.001 * i as f64).collect();
    let worse: Vec<f64> = base.iter().map(|x| x * 1.5).collect();
    fake_run(&t.path().join("ref"), "student", "H", 0.0005, &base);
    fake_run(&t.path().join("bad"), "student", "H", 0.3, &worse);
    fake_run(&t.path().join("other-student"), "student2", "H", 0.01, &base);
    fake_run(&t.path().join("other-heldout"), "student", "H2", 0.01, &base);
    let r = RunDir::open(&t.path().join("ref")).unwrap();
    let b = RunDir::open(&t.path().join("bad")).unwrap();
    assert!((b.mismatch_level(10).unwrap() - 0.3).abs() < 1e-12);
    let d = compare(&b.eval_at(10).unwrap(), &r.eval_at(10).unwrap(), 0.2, 1000).unwrap();
    assert!((d.delta - 0.5).abs() < 1e-9 && d.fail);
    let e = format!("{:#}", r.eval_at(20).unwrap_err());
    assert!(e.contains("no held-out evaluation at step 20") && e.contains("[10]"), "{e}");
    let os = RunDir::open(&t.path().join("other-student")).unwrap();
    let e = format!("{:#}", compare(&os.eval_at(10).unwrap(), &r.eval_at(10).unwrap(), 0.2, 100).unwrap_err());
    assert!(e.contains("different students"), "{e}");
    let oh = RunDir::open(&t.path().join("other-heldout")).unwrap();
    let e = format!("{:#}", compare(&oh.eval_at(10).unwrap(), &r.eval_at(10).unwrap(), 0.2, 100).unwrap_err());
    assert!(e.contains("different held-out sets"), "{e}");
    // Through the CLI: the bracket with one passing and one failing run.
    fake_run(&t.path().join("good"), "student", "H", 0.01, &base.iter().map(|x| x * 1.01).collect::<Vec<_>>());
    let bin = env!("CARGO_BIN_EXE_colotrain");
    let p = |n: &str| t.path().join(n).display().to_string();
    let out = Command::new(bin)
        .args(["eval", "--reference", &p("ref"), "--reps", "500", "--budget", &p("good"), &p("bad")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("B_emp(τ = 0.20) = [0.01000, 0.30000]"), "{text}");
    let out = Command::new(bin)
        .args(["eval", "--reference", &p("ref"), "--budget", &p("bad"), "--step", "5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no held-out evaluation at step 5"));
    // An empty held-out file.
    let st =
        Command::new(bin).args(["init-tiny", "--out", &p("m"), "--layers", "1", "--hidden", "32"]).output().unwrap();
    assert!(st.status.success());
    std::fs::write(t.path().join("empty.jsonl"), "").unwrap();
    let out = Command::new(bin)
        .args(["eval", "--checkpoint", &p("m"), "--teacher", &p("m"), "--heldout", &p("empty.jsonl")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("empty.jsonl: no prompts (the file is empty)"), "{e}");
}

/// `eval --checkpoint RUN/checkpoint-N --reference RUN` with no other flag evaluates exactly as
/// the run did (its teacher, held-out set, samples, length and seed come from its config): the
/// run's own last checkpoint reproduces the run's held-out KL, so Δ = 0.
#[test]
fn eval_of_a_runs_checkpoint_against_that_run_needs_no_flags() {
    use colotrain::config::JobConfig;
    use colotrain::orchestrator::{self as job, JobOptions};
    let t = TempDir::new("eval-ref");
    let dir = t.path().join("run");
    let mut j = JobConfig::from_toml(include_str!("../configs/tiny-opd.toml"), "tiny-opd.toml").unwrap();
    j.run.out_dir = Some(dir.clone());
    j.run.steps = 2;
    j.eval.every = 0;
    j.data.heldout_size = 8;
    j.rollout.prompts_per_step = 2;
    j.rollout.samples_per_prompt = 2;
    j.checkpoint.dtype = CheckpointDtype::F32;
    j.validate("test").unwrap();
    let s = job::run(&j, &JobOptions::default()).unwrap();
    let logged = s.evals.last().unwrap().kl;
    let ck = dir.join("checkpoint-000002");
    let out = Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .args(["eval", "--checkpoint", ck.to_str().unwrap(), "--reference", dir.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{se}");
    // The human lines, then the JSON object.
    let at = so.find("\n{").unwrap_or_else(|| panic!("no JSON in: {so}"));
    let v: serde_json::Value = serde_json::from_str(&so[at + 1..]).unwrap_or_else(|e| panic!("{e}: {so}"));
    let kl = v["heldout_kl"].as_f64().unwrap();
    assert!((kl - logged).abs() <= 1e-9 * logged.abs(), "{kl} vs the run's {logged}");
    assert_eq!(v["problems"].as_u64(), Some(8));
    let d = v["delta"]["delta"].as_f64().unwrap_or_else(|| panic!("{v}"));
    assert!(d.abs() <= 1e-9, "Δ = {d}");
}
