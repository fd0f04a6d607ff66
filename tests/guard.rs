//! The mismatch guard on the tiny OPD job (CPU): a skipped resync and a corrupted view are
//! caught, classified as stale views and repaired on the same recipe; weight noise σ = 1.0 falls
//! back down its ladder within a few steps, σ = 0.02 and the standard engine never trip over
//! 300 steps; the decisions are the same straight and resumed; bad `[guard]` settings are
//! refused naming their key.

mod common;

use colotrain::config::JobConfig;
use colotrain::mismatch::guard::Line;
use colotrain::orchestrator::{self as job, JobOptions, ViewFault};
use common::TempDir;
use serde_json::Value;

const TINY: &str = include_str!("../configs/tiny-opd.toml");

/// This model and task's budget bracket B_emp (README, "Mismatch budgets": the tiny OPD job's
/// sweep at τ = 20%); the guard's line is its lower end.
const TINY_BRACKET: [f64; 2] = [0.00332, 0.00451];

/// The tiny job, small and quick, with the guard on over `ladder`.
fn tiny(out: &std::path::Path, steps: u64, ladder: &[&str], edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
    let mut j = JobConfig::from_toml(TINY, "tiny-opd.toml").unwrap();
    j.run.out_dir = Some(out.to_path_buf());
    j.run.steps = steps;
    j.eval.every = 0;
    j.data.heldout_size = 4;
    j.eval.samples_per_prompt = 1;
    j.rollout.prompts_per_step = 4;
    j.rollout.samples_per_prompt = 4;
    j.guard.enabled = true;
    j.guard.fallback = ladder.iter().map(|s| s.to_string()).collect();
    j.guard.line = Line::Named("bracket".into());
    j.guard.bracket = Some(TINY_BRACKET);
    edit(&mut j);
    j.validate("test").unwrap();
    j
}

fn lines(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v.get("loss").is_some())
        .collect()
}

/// (step, kind) of every guard event of the run.
fn events(m: &[Value]) -> Vec<(u64, String)> {
    m.iter()
        .flat_map(|l| {
            let step = l["step"].as_u64().unwrap();
            l["guard"]["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |e| (step, e["kind"].as_str().unwrap().to_string()))
        })
        .collect()
}

fn trace(m: &[Value]) -> String {
    m.iter()
        .map(|l| format!("{}:{:.4}/{}", l["step"], l["mismatch"]["d_n"].as_f64().unwrap(), l["guard"]["state"]))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn a_skipped_resync_and_a_corrupted_view_are_repaired_on_the_same_recipe() {
    let t = TempDir::new("guard-stale");
    // FP8 against the paper's line L/α: this test is about views, not about FP8's level.
    let fp8 = |j: &mut JobConfig| {
        j.engine.recipe = "fp8".into();
        j.guard.line = Line::Named("admit".into());
    };
    // Step 3's resync is skipped: the engines stay a version behind, which the guard sees at
    // the same step boundary, before any rollout reads the old weights.
    let j = tiny(&t.path().join("skip"), 6, &["fp8", "bf16"], fp8);
    job::run(&j, &JobOptions { view_fault: Some(ViewFault::SkipResync { step: 3 }), ..Default::default() }).unwrap();
    let m = lines(&t.path().join("skip"));
    assert_eq!(events(&m), vec![(3, "stale_view".to_string())], "{}", trace(&m));
    let e = &m[2]["guard"]["events"][0];
    assert!(e["engine_version"].as_u64() < e["trainer_version"].as_u64() && e["repaired"] == true, "{e}");
    assert!(m.iter().all(|l| l["guard"]["state"] == "fp8"), "{}", trace(&m));
    // After step 4's view is corrupted (one weight zeroed, and the resyncs no longer reach the
    // view while its counters say current), the next step's mismatch jumps: the check names
    // the zeroed weight (and, the trainer having moved, the others), a resync repairs it, and
    // the run goes on with FP8.
    let j = tiny(&t.path().join("corrupt"), 8, &["fp8", "bf16"], fp8);
    job::run(&j, &JobOptions { view_fault: Some(ViewFault::Corrupt { step: 4 }), ..Default::default() }).unwrap();
    let m = lines(&t.path().join("corrupt"));
    let ev = events(&m);
    let stale: Vec<u64> = ev.iter().filter(|e| e.1 == "stale_view").map(|e| e.0).collect();
    assert!(stale.len() == 1 && (5..=6).contains(&stale[0]), "{ev:?} {}", trace(&m));
    assert!(!ev.iter().any(|e| e.1 == "fallback"), "{ev:?}");
    let at = &m[stale[0] as usize - 1]["guard"]["events"];
    let found = at.as_array().unwrap().iter().find(|e| e["kind"] == "stale_view").unwrap();
    let tensors: Vec<&str> = found["tensors"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    assert!(tensors.contains(&"model.layers.0.self_attn.q_proj.weight") && found["repaired"] == true, "{found}");
    // Repaired: the steps after it measure the FP8 engine again (the faulted step's level).
    let before = m[3]["mismatch"]["d_n"].as_f64().unwrap().abs();
    let after = m[7]["mismatch"]["d_n"].as_f64().unwrap().abs();
    assert!(after < 4.0 * before.max(1e-3), "d_n {before} before the fault, {after} after the repair: {}", trace(&m));
    assert!(m.iter().all(|l| l["guard"]["state"] == "fp8"));
}

#[test]
fn heavy_noise_falls_back_light_noise_and_the_standard_engine_never_trip() {
    let t = TempDir::new("guard-noise");
    let j = tiny(&t.path().join("heavy"), 8, &["noise=1.0", "bf16"], |j| j.engine.noise_sigma = 1.0);
    job::run(&j, &JobOptions::default()).unwrap();
    let m = lines(&t.path().join("heavy"));
    let ev = events(&m);
    // The line breaches from the first step; patience 2 falls back at the second.
    assert_eq!(
        ev,
        vec![(1, "breach".to_string()), (2, "breach".to_string()), (2, "fallback".to_string())],
        "{}",
        trace(&m)
    );
    assert_eq!((m[0]["guard"]["state"].as_str(), m[2]["guard"]["state"].as_str()), (Some("noise=1.0"), Some("bf16")));
    assert!(m[0]["mismatch"]["d_n"].as_f64().unwrap() > 5.0 * TINY_BRACKET[0], "{}", trace(&m));
    // On the standard engine the trainer and the engine read the same weights.
    for l in &m[2..] {
        assert!(l["mismatch"]["d_n"].as_f64().unwrap().abs() < 1e-3, "{}", trace(&m));
    }
    // `colotrain report` draws the guard's line and marks the fall-back on the mismatch plot.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .arg("report")
        .arg(t.path().join("heavy"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(t.path().join("heavy").join("report").join("mismatch.svg")).unwrap();
    assert!(svg.contains("guard: line") && svg.contains("fall-back to bf16"), "the mismatch plot lacks the guard");
    // 300 steps each without a single breach.
    for (name, ladder, sigma) in
        [("light", ["noise=0.02", "bf16"].as_slice(), 0.02), ("standard", ["bf16"].as_slice(), 0.0)]
    {
        let j = tiny(&t.path().join(name), 300, ladder, |j| j.engine.noise_sigma = sigma);
        job::run(&j, &JobOptions::default()).unwrap();
        let m = lines(&t.path().join(name));
        assert_eq!(m.len(), 300);
        assert_eq!(events(&m), vec![], "{name}: {}", trace(&m));
        let top = m.iter().map(|l| l["guard"]["windowed"].as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!(top < m[0]["guard"]["line"].as_f64().unwrap(), "{name}: windowed {top}");
    }
}

/// Straight for 8 steps, and 4 + 4 with a resume: the same metrics lines (timings aside), so the
/// same guard decisions; the resumed run serves the rung it had fallen back to.
#[test]
fn guard_decisions_are_deterministic_and_survive_a_resume() {
    let t = TempDir::new("guard-resume");
    let make = |dir: &str, steps: u64| {
        let mut j = tiny(&t.path().join(dir), 8, &["noise=1.0", "fp8", "bf16"], |j| {
            j.engine.noise_sigma = 1.0;
            j.checkpoint.every = 4;
            j.checkpoint.keep = 0;
        });
        j.run.steps = steps;
        j
    };
    job::run(&make("straight", 8), &JobOptions::default()).unwrap();
    job::run(&make("again", 8), &JobOptions::default()).unwrap();
    job::run(&make("resumed", 4), &JobOptions::default()).unwrap();
    let r = make("resumed", 8);
    let s = job::run(&r, &JobOptions { resume: r.run.out_dir.clone(), ..Default::default() }).unwrap();
    let strip = |mut v: Value| {
        for k in ["time", "tokens_per_s", "updates_per_hour", "utilization", "transfer", "heldout_kl", "heldout_acc"] {
            v.as_object_mut().unwrap().remove(k);
        }
        v
    };
    let a = lines(&t.path().join("straight"));
    assert!(events(&a).iter().any(|e| e.1 == "fallback"), "{}", trace(&a));
    for other in ["again", "resumed"] {
        let b = lines(&t.path().join(other));
        assert_eq!(a.len(), b.len(), "{other}");
        for (p, q) in a.iter().zip(b) {
            assert_eq!(strip(p.clone()), strip(q), "{other}: a metrics line differs");
        }
    }
    // The summary of the resumed run covers the fall-backs made before the resume.
    let g = s.guard.unwrap();
    assert_eq!(g.serving, a[7]["guard"]["state"].as_str().unwrap());
    assert!(!g.fallbacks.is_empty() && g.fallbacks[0].0 <= 4, "{g:?}");
    let table = colotrain::orchestrator::summary_table(&job::JobSummary { guard: Some(g), ..Default::default() });
    assert!(table.contains("guard          serving") && table.contains("noise=1.0 -> "), "{table}");
}

#[test]
fn bad_guard_settings_are_refused_naming_the_key() {
    let base = |guard: &str| format!("{TINY}\n[guard]\nenabled = true\n{guard}\n");
    let cases = [
        ("fallback = [\"fp8\", \"bf16\"]\nstatistic = \"kl\"", "guard.statistic: unknown statistic 'kl'"),
        ("fallback = [\"fp8\", \"fp9\"]", "guard.fallback[1]: 'fp9' is not a recipe colotrain admit accepts"),
        ("fallback = [\"noise=-1\"]", "guard.fallback[0]"),
        ("fallback = []", "guard.fallback: the ladder is empty"),
        ("fallback = [\"bf16\"]\nwindow = { last = 0 }", "guard.window: last = 0"),
        ("fallback = [\"bf16\"]\nline = \"bracket\"", "needs guard.bracket"),
        ("fallback = [\"bf16\"]\nline = \"median\"", "guard.line: expected a number, \"admit\" or \"bracket\""),
        ("fallback = [\"bf16\"]\nwindow = { mean = 3 }", "window"),
        ("fallback = [\"bf16\"]\npatience = 0", "guard.patience"),
        ("fallbacks = [\"bf16\"]", "unknown field `fallbacks`"),
    ];
    for (guard, want) in cases {
        let e = format!("{:#}", JobConfig::from_toml(&base(guard), "g.toml").unwrap_err());
        assert!(e.contains("g.toml") && e.contains(want), "{guard}: {e}");
    }
    // A guard needs sampled tokens and a synchronous, colocated schedule.
    let text = format!("{TINY}\n[schedule]\nmode = \"async\"\n\n[guard]\nenabled = true\nfallback = [\"bf16\"]\n");
    let e = format!("{:#}", JobConfig::from_toml(&text, "g.toml").unwrap_err());
    assert!(e.contains("guard.enabled") && e.contains("schedule.mode"), "{e}");
}

/// On the simulated GPU (the trainer on the device, the FP8 engine's codes written by the
/// device kernels): the check re-quantizes on the host what the kernels wrote, so a repaired
/// view must compare equal bit for bit (`repaired`), and a corrupted one is found.
#[test]
fn on_the_simulated_gpu_a_corrupted_view_is_found_and_the_repair_checks_bit_for_bit() {
    let t = TempDir::new("guard-sim");
    let j = tiny(&t.path().join("sim"), 5, &["fp8", "bf16"], |j| {
        (j.run.device, j.run.devices) = ("cuda-sim:4".into(), 1);
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (2, 4);
        j.engine.recipe = "fp8".into();
        j.guard.line = Line::Named("admit".into());
        j.guard.warmup_steps = 0;
    });
    job::run(&j, &JobOptions { view_fault: Some(ViewFault::Corrupt { step: 3 }), ..Default::default() }).unwrap();
    let m = lines(&t.path().join("sim"));
    let ev = events(&m);
    let stale: Vec<&(u64, String)> = ev.iter().filter(|e| e.1 == "stale_view").collect();
    assert!(stale.len() == 1 && stale[0].0 == 4, "{ev:?} {}", trace(&m));
    let found = m[3]["guard"]["events"].as_array().unwrap().iter().find(|e| e["kind"] == "stale_view").unwrap().clone();
    assert!(found["repaired"] == true, "{found}");
    assert!(
        found["tensors"].as_array().unwrap().iter().any(|x| x == "model.layers.0.self_attn.q_proj.weight"),
        "{found}"
    );
    assert!(m.iter().all(|l| l["guard"]["state"] == "fp8"), "{}", trace(&m));
}
