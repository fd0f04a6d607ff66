//! One process, N CPU devices: data-parallel training with ZeRO-1 gives the same weights and the
//! same samples for N = 1, 2, 3; the asynchronous schedule respects its staleness bound; faults
//! (too many devices, a device error or panic mid-step, a stop request) end the run cleanly with
//! the last checkpoint intact.
//! Tolerance for N devices vs one: the gradient is summed in a different order (per-device
//! partial sums, then across devices), so after 4 SGD steps the master weights agree to
//! |a − b| ≤ 1e-6 + 1e-5·|b| (measured: max 6e-8); the sampled tokens are identical
//! (Philox keys do not depend on the device, the CPU kernels are batch-invariant).

mod common;
#[path = "common/jobs.rs"]
mod jobs;

use colotrain::config::JobConfig;
use colotrain::config::{CheckpointDtype, OptimizerKind, Placement, ScheduleMode};
use colotrain::orchestrator::{self as job, Fault, JobOptions};
use colotrain::train::checkpoint;
use common::TempDir;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

const TINY: &str = include_str!("../configs/tiny-opd.toml");

fn tiny(out: &std::path::Path, devices: usize, edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
    let mut j = JobConfig::from_toml(TINY, "tiny-opd.toml").unwrap();
    j.run.out_dir = Some(out.to_path_buf());
    j.run.steps = 4;
    j.run.device = "cpu:1".into();
    j.run.devices = devices;
    j.eval.every = 0;
    j.data.heldout_size = 8;
    j.rollout.prompts_per_step = 4;
    j.rollout.samples_per_prompt = 4;
    j.checkpoint.dtype = CheckpointDtype::F32;
    edit(&mut j);
    j.validate("test").unwrap();
    j
}

fn lines(p: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn master(dir: &std::path::Path, j: &JobConfig) -> Vec<f32> {
    let ck = checkpoint::resolve(dir).unwrap();
    checkpoint::load(&ck, j).unwrap().1
}

#[test]
fn one_two_and_three_devices_train_the_same_weights_on_the_same_samples() {
    let t = TempDir::new("dp");
    let mut results = Vec::new();
    for n in [1, 2, 3] {
        // SGD: the update is linear in the gradient, so the weights differ only by the
        // gradient's summation order (AdamW amplifies near-zero gradients' rounding through
        // m/√v, up to lr per step, whatever the number of devices).
        let j = tiny(&t.path().join(format!("n{n}")), n, |j| {
            j.optimizer.kind = OptimizerKind::Sgd;
            j.optimizer.lr = 0.05;
        });
        let s = job::run(&j, &JobOptions::default()).unwrap();
        assert_eq!(s.last.as_ref().unwrap().devices, n);
        results.push((j.clone(), lines(&t.path().join(format!("n{n}"))), master(&t.path().join(format!("n{n}")), &j)));
    }
    let (_, m1, w1) = &results[0];
    for (j, m, w) in &results[1..] {
        for (a, b) in m.iter().zip(m1).skip(1) {
            // The same tokens (the digest of every response's ids), lengths and rewards.
            assert_eq!(a["samples_digest"], b["samples_digest"], "devices {}: step {}", j.run.devices, a["step"]);
            assert_eq!(a["gen_tokens"], b["gen_tokens"], "devices {}", j.run.devices);
            assert_eq!(a["reward"], b["reward"]);
            let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            assert!((la - lb).abs() <= 1e-6 + 1e-4 * lb.abs(), "loss {la} vs {lb}");
            assert_eq!(a["utilization"].as_array().unwrap().len(), j.run.devices);
        }
        let maxdiff = w.iter().zip(w1).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("devices {}: max |Δθ| = {maxdiff:e}", j.run.devices);
        let worst =
            w.iter().zip(w1).map(|(a, b)| ((a - b).abs() as f64 - 1e-5 * b.abs() as f64).max(0.0)).fold(0.0, f64::max);
        assert!(
            worst <= 1e-6,
            "devices {}: master weights differ by up to {worst:e} beyond the relative part",
            j.run.devices
        );
    }
}

/// BF16 compute weights: the devices all-gather BF16 (each rounds its own shard of the FP32
/// master), so after training every compute weight is exactly bf16(master) at its own position
/// (a shard placed at the wrong offset, or rounded differently, breaks the equality).
#[test]
fn bf16_weights_are_gathered_as_the_rounded_master() {
    let t = TempDir::new("bf16");
    for n in [1, 3] {
        let dir = t.path().join(format!("n{n}"));
        let j = tiny(&dir, n, |j| {
            j.model.dtype = Some("bf16".into());
            j.run.steps = 2;
        });
        job::run(&j, &JobOptions::default()).unwrap();
        jobs::assert_compute_is_rounded_master(&dir, &j, &format!("devices {n}"));
    }
}

#[test]
fn async_schedule_trains_only_tokens_within_the_staleness_bound() {
    let t = TempDir::new("async");
    for k in [0u64, 1, 2] {
        let j = tiny(&t.path().join(format!("k{k}")), 2, |j| {
            j.schedule.mode = ScheduleMode::Async;
            j.schedule.max_staleness = k;
            j.run.steps = 5;
        });
        job::run(&j, &JobOptions::default()).unwrap();
        let m = lines(&t.path().join(format!("k{k}")));
        let lags: Vec<u64> = m[1..].iter().map(|l| l["max_lag"].as_u64().unwrap()).collect();
        let ages: Vec<u64> = m[1..].iter().map(|l| l["max_token_age"].as_u64().unwrap()).collect();
        let masked: Vec<u64> = m[1..].iter().map(|l| l["stale_tokens_masked"].as_u64().unwrap()).collect();
        eprintln!("k = {k}: trained lags {lags:?}, token ages {ages:?}, masked {masked:?}");
        assert!(lags.iter().all(|&l| l <= k), "k = {k}: lags {lags:?}");
        // Tokens older than k exist exactly when some were masked; the trained lag never
        // exceeds the oldest token.
        for ((&lag, &age), &n) in lags.iter().zip(&ages).zip(&masked) {
            assert!(lag <= age && (age > k) == (n > 0), "k = {k}: lag {lag}, age {age}, masked {n}");
        }
        if k == 0 {
            // The queue holds only this step's requests: nothing runs ahead, nothing is stale.
            assert!(ages.iter().all(|&a| a == 0), "k = 0: ages {ages:?}");
        }
        // Every step trains on one step's worth of complete groups.
        assert!(m[1..].iter().all(|l| l["gen_tokens"].as_u64().unwrap() > 0));
    }
    // Generation runs ahead of training: on one device (no race between engines for requests)
    // the sequences still running when a step's groups complete resume under the new weights,
    // so later steps train tokens one version old.
    let dir = t.path().join("ahead");
    let j = tiny(&dir, 1, |j| {
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.max_staleness = 2;
        j.run.steps = 4;
    });
    job::run(&j, &JobOptions::default()).unwrap();
    let ages: Vec<u64> = lines(&dir)[1..].iter().map(|l| l["max_token_age"].as_u64().unwrap()).collect();
    assert!(ages[1..].iter().all(|&a| a >= 1), "generation never ran ahead: ages {ages:?}");
}

/// Split placement: device 0 generates while device 1 trains; the generator loads each
/// published update in place between engine steps, every step trains one step's worth of
/// groups, no token is more than k versions old, and a run resumes from its checkpoint.
#[test]
fn split_placement_generates_beside_training_within_the_staleness_bound() {
    let t = TempDir::new("split");
    for k in [0u64, 2] {
        let dir = t.path().join(format!("k{k}"));
        let j = tiny(&dir, 2, |j| {
            j.schedule.mode = ScheduleMode::Async;
            j.schedule.placement = Placement::Split;
            j.schedule.rollout_devices = 1;
            j.schedule.max_staleness = k;
            j.run.steps = 5;
            j.checkpoint.every = 5;
        });
        let s = job::run(&j, &JobOptions::default()).unwrap();
        assert_eq!(s.steps, 5);
        let m = lines(&dir);
        for l in &m[1..] {
            let lag = l["max_lag"].as_u64().unwrap();
            assert!(lag <= k, "k = {k}: lag {lag}");
            assert!(l["gen_tokens"].as_u64().unwrap() > 0);
            // Device 0 only generates, device 1 only trains.
            let u = l["utilization"].as_array().unwrap();
            assert_eq!(u.len(), 2);
            assert!(u.iter().all(|x| x.as_f64().unwrap() > 0.0), "{u:?}");
        }
        // The generator holds the compute weights alone: no master, moments or gradients.
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        let (gen, tr) = (plan[0]["trainer"].as_u64().unwrap(), plan[1]["trainer"].as_u64().unwrap());
        assert!(gen * 10 < tr, "generator trainer state {gen} bytes vs the trainer's {tr}");
        // Five updates happened and were published; the checkpoint resumes.
        assert_eq!(m.last().unwrap()["version"].as_u64(), Some(5));
        let mut j2 = j.clone();
        j2.run.steps = 7;
        job::run(&j2, &JobOptions { resume: Some(dir.clone()), ..Default::default() }).unwrap();
        assert_eq!(checkpoint::list(&dir).unwrap().iter().map(|c| c.0).max(), Some(7));
    }
}

#[test]
fn a_split_placement_without_a_training_device_is_refused() {
    let t = TempDir::new("split-bad");
    let j = tiny(&t.path().join("r"), 2, |j| {
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.placement = Placement::Split;
        j.schedule.rollout_devices = 2;
    });
    let e = format!("{:#}", job::run(&j, &JobOptions::default()).unwrap_err());
    assert!(e.contains("schedule.rollout_devices = 2") && e.contains("at least 3 devices"), "{e}");
}

#[test]
fn more_cpu_devices_than_cores_is_refused() {
    let cores = std::thread::available_parallelism().unwrap().get();
    let t = TempDir::new("toomany");
    let j = tiny(&t.path().join("r"), cores + 1, |j| j.run.device = "cpu".into());
    let e = format!("{:#}", job::run(&j, &JobOptions::default()).unwrap_err());
    assert!(e.contains(&format!("run.devices = {} CPU devices", cores + 1)) && e.contains("cores"), "{e}");
}

/// A device that errors, or panics, mid-step: the run stops with an error naming the device
/// and the phase, no device hangs in a collective, and the last checkpoint is whole.
#[test]
fn a_device_failure_mid_step_stops_cleanly() {
    let t = TempDir::new("fault");
    let cases =
        [("train", false), ("train", true), ("rollout", false), ("teacher", true), ("resync", false), ("resync", true)];
    for (phase, panic) in cases {
        let dir = t.path().join(format!("{phase}-{panic}"));
        let j = tiny(&dir, 2, |j| j.checkpoint.every = 2);
        let opts = JobOptions { fault: Some(Fault { step: 3, rank: 1, panic, phase }), ..Default::default() };
        let e = format!("{:#}", job::run(&j, &opts).unwrap_err());
        assert!(e.contains("worker 1 (cpu:1)") && e.contains(&format!("phase '{phase}'")), "{e}");
        assert!(e.contains(if panic { "panicked" } else { "injected device error" }), "{e}");
        // The checkpoint of step 2 is intact and resumable; nothing of step 3 was written.
        let cks = checkpoint::list(&dir).unwrap();
        assert_eq!(cks.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2]);
        assert_eq!(master(&dir, &j).len(), checkpoint::load(&cks[0].1, &j).unwrap().0.num_params);
        job::run(&j, &JobOptions { resume: Some(dir.clone()), ..Default::default() }).unwrap();
        assert_eq!(checkpoint::list(&dir).unwrap().iter().map(|c| c.0).max(), Some(4));
    }
}

/// A stop request (what Ctrl-C sets) finishes the step, writes a checkpoint and returns.
#[test]
fn a_stop_request_checkpoints_and_returns() {
    let t = TempDir::new("stop");
    let dir = t.path().join("r");
    let j = tiny(&dir, 1, |_| {});
    let stop = Arc::new(AtomicBool::new(true));
    let s = job::run(&j, &JobOptions { stop: Some(stop), ..Default::default() }).unwrap();
    assert_eq!(s.steps, 1);
    assert_eq!(checkpoint::list(&dir).unwrap().iter().map(|c| c.0).collect::<Vec<_>>(), vec![1]);
}

/// A stop request arriving mid-run (from another thread, as Ctrl-C's handler does) lets the
/// running step finish, checkpoints it, and the run resumes from there.
#[test]
fn a_stop_request_mid_run_checkpoints_the_step_it_interrupted() {
    let t = TempDir::new("stop-mid");
    let dir = t.path().join("r");
    let j = tiny(&dir, 1, |j| j.run.steps = 60);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let (flag, finished, metrics) = (Arc::clone(&stop), Arc::clone(&done), dir.join("metrics.jsonl"));
    // Pull the flag once two steps are logged (metrics.jsonl: a header line, then one per
    // step), however long the built-in models take to build first; give up when the run ends.
    let watcher = std::thread::spawn(move || {
        while !finished.load(std::sync::atomic::Ordering::SeqCst) {
            if std::fs::read_to_string(&metrics).map(|s| s.lines().count()).unwrap_or(0) >= 3 {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    let s = job::run(&j, &JobOptions { stop: Some(stop), ..Default::default() });
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    watcher.join().unwrap();
    let s = s.unwrap();
    assert!((2..60).contains(&s.steps), "stopped after {} steps", s.steps);
    assert_eq!(checkpoint::list(&dir).unwrap().iter().map(|c| c.0).max(), Some(s.steps));
    assert_eq!(lines(&dir).len() as u64, s.steps + 1, "one metrics line per finished step");
    let j2 = JobConfig { run: colotrain::config::RunConfig { steps: s.steps + 2, ..j.run.clone() }, ..j.clone() };
    let r = job::run(&j2, &JobOptions { resume: Some(dir.clone()), ..Default::default() }).unwrap();
    assert_eq!(r.steps, s.steps + 2);
}

/// rollout.kv_cache_mb = 0: the KV caches get what the plan leaves of run.memory_budget_mb after
/// the weights, the trainer, the teacher, the engine buffers, the engines' activations and a
/// tenth kept free; and a budget too small for one block, or none on CPU, is refused before
/// any step.
#[test]
fn kv_caches_are_sized_from_what_the_plan_leaves() {
    let t = TempDir::new("plan");
    // The tiny job holds ~64 MiB before its KV caches (plan line of the other tests), 38 of
    // them its three engines' forward buffers (student, teacher, and the FP8 engine).
    let mut tokens = Vec::new();
    for (budget, recipe) in [(90usize, "bf16"), (110, "bf16"), (100, "fp8")] {
        let dir = t.path().join(format!("{recipe}-{budget}"));
        let j = tiny(&dir, 1, |j| {
            j.rollout.kv_cache_mb = 0;
            j.run.memory_budget_mb = Some(budget);
            j.run.steps = 1;
            j.engine.recipe = recipe.into();
        });
        job::run(&j, &JobOptions::default()).unwrap_or_else(|e| panic!("{recipe}: {e:#}"));
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        let p = &plan[0];
        let total: u64 = ["weights", "trainer", "teacher", "engine_buffers", "engine_activations", "kv_cache"]
            .iter()
            .map(|k| p[*k].as_u64().unwrap())
            .sum();
        // A tenth of the budget is kept free for what the plan does not itemize; the KV caches
        // take the rest but less than one block of each (KiBs here).
        let share = total as f64 / ((budget as u64) << 20) as f64;
        assert!(share <= 0.9 + 1e-9, "{recipe} {budget}: plan {total} bytes over 90% of the budget: {p}");
        assert!(share >= 0.89, "{recipe} {budget}: budget left unused ({share:.3}): {p}");
        tokens.push(p["kv_tokens"].as_u64().unwrap());
    }
    // More budget, more KV tokens.
    assert!(tokens[1] > tokens[0], "{tokens:?}");
    let e = format!(
        "{:#}",
        job::run(
            &tiny(&t.path().join("small"), 1, |j| {
                j.rollout.kv_cache_mb = 0;
                j.run.memory_budget_mb = Some(20);
            }),
            &JobOptions::default()
        )
        .unwrap_err()
    );
    assert!(
        e.contains("the plan does not fit device 0")
            && e.contains("leave no room for one KV block")
            && e.contains("20 MiB budget"),
        "{e}"
    );
    assert!(
        !t.path().join("small").join("metrics.jsonl").exists()
            || std::fs::read_to_string(t.path().join("small").join("metrics.jsonl")).unwrap().is_empty()
    );
    let e = format!(
        "{:#}",
        job::run(&tiny(&t.path().join("nobudget"), 1, |j| j.rollout.kv_cache_mb = 0), &JobOptions::default())
            .unwrap_err()
    );
    assert!(e.contains("set run.memory_budget_mb"), "{e}");
}

/// Fixed KV caches (rollout.kv_cache_mb) are checked against the budget before anything is
/// allocated: too large a cache is refused naming the device, the sizes and the knob; one that
/// fits runs.
#[test]
fn fixed_kv_caches_over_the_budget_are_refused_before_any_step() {
    let t = TempDir::new("plan-fixed");
    // First, what the plan holds with 24 MiB caches (Engine::new caps them at what the
    // sequences can use), from a run without a budget.
    let edit = |j: &mut JobConfig| {
        j.rollout.kv_cache_mb = 24;
        j.rollout.max_seqs = 64;
        j.run.steps = 1;
    };
    let dir = t.path().join("free");
    job::run(&tiny(&dir, 1, edit), &JobOptions::default()).unwrap();
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
    let before: u64 = ["weights", "trainer", "teacher", "engine_buffers", "engine_activations"]
        .iter()
        .map(|k| plan[0][*k].as_u64().unwrap())
        .sum();
    let kv = plan[0]["kv_cache"].as_u64().unwrap();
    // A budget above what lives there before the caches, below it with them.
    let budget = (before + kv / 2) >> 20;
    assert!(
        budget << 20 > before && (budget << 20) < before + kv,
        "kv {kv} bytes leaves no MiB between {before} and {}",
        before + kv
    );
    let dir = t.path().join("over");
    let e = format!(
        "{:#}",
        job::run(
            &tiny(&dir, 1, |j| {
                edit(j);
                j.run.memory_budget_mb = Some(budget as usize);
            }),
            &JobOptions::default()
        )
        .unwrap_err()
    );
    assert!(
        e.contains("the plan does not fit device 0")
            && e.contains("KV caches")
            && e.contains("rollout.kv_cache_mb = 24 each")
            && e.contains(&format!("{budget} MiB budget (run.memory_budget_mb)")),
        "{e}"
    );
    assert!(
        !dir.join("metrics.jsonl").exists() || std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().is_empty()
    );
    // With the caches' size added, it fits and runs.
    let dir = t.path().join("fits");
    job::run(
        &tiny(&dir, 1, |j| {
            edit(j);
            j.run.memory_budget_mb = Some(((before + kv) >> 20) as usize + 1);
        }),
        &JobOptions::default(),
    )
    .unwrap();
}

/// Split placement with a stale rollout engine (it reads weights one version behind what it
/// last loaded): its tokens carry the version they were sampled with, so with a staleness
/// bound of 0 the trainer leaves out every token from step 2 on (sampled from older weights).
#[test]
fn split_generators_stamp_tokens_with_the_stale_engines_version() {
    let t = TempDir::new("split-stale");
    let dir = t.path().join("r");
    let j = tiny(&dir, 2, |j| {
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.placement = Placement::Split;
        j.schedule.rollout_devices = 1;
        j.schedule.max_staleness = 0;
        j.engine.staleness = 1;
        j.run.steps = 3;
    });
    job::run(&j, &JobOptions::default()).unwrap();
    let m = lines(&dir);
    // Step 1: the ring holds version 0 twice; nothing is stale yet.
    assert_eq!(m[1]["stale_tokens_masked"].as_u64(), Some(0), "{}", m[1]);
    for l in &m[2..] {
        let (masked, gen) = (l["stale_tokens_masked"].as_u64().unwrap(), l["gen_tokens"].as_u64().unwrap());
        assert!(gen > 0 && masked == gen, "step {}: {masked} of {gen} tokens masked", l["step"]);
    }
}

/// Split over three devices (one generator, two data-parallel trainers): the generator holds the
/// teacher and the engines, the training lead holds the teacher for held-out evaluation, the
/// other trainer neither; the run trains and evaluates.
#[test]
fn split_trainers_hold_only_what_their_role_needs() {
    let t = TempDir::new("split-roles");
    let dir = t.path().join("r");
    let j = tiny(&dir, 3, |j| {
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.placement = Placement::Split;
        j.schedule.rollout_devices = 1;
        j.schedule.max_staleness = 1;
        j.run.steps = 3;
        j.engine.recipe = "fp8".into();
    });
    let s = job::run(&j, &JobOptions::default()).unwrap();
    assert!(s.evals.last().map(|e| e.kl.is_finite()).unwrap_or(false));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
    let get = |d: usize, k: &str| plan[d][k].as_u64().unwrap();
    assert!(get(0, "teacher") > 0 && get(1, "teacher") > 0 && get(2, "teacher") == 0, "{plan}");
    // The generator's FP8 engine has its own cache beside the standard one; trainers only the
    // standard engine's.
    assert!(get(0, "kv_cache") > get(2, "kv_cache"), "{plan}");
    // Every step trained on generated, teacher-scored responses (a trainer without a teacher
    // would have failed the step had anything been left to score).
    let m = lines(&dir);
    assert!(m[1..].iter().all(|l| l["gen_tokens"].as_u64().unwrap() > 0));
}
