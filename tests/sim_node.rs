//! One process, several simulated GPUs (issue 21): data parallelism with the trainer's state on
//! the devices (ZeRO-1 over the device collective: NCCL calls on each device's communication
//! stream, ordered by events), a fault on one GPU mid-step, and the split placement's
//! weight broadcast from the lead trainer into the generators (and a generator failing in it).
//! Tolerance for N GPUs vs one, as for the CPU devices (tests/devices.rs): SGD, so the weights
//! differ only by the gradient's summation order (per-device partial sums, then across
//! devices): |a − b| ≤ 1e-6 + 1e-5·|b|; the sampled tokens are identical (Philox keys do not
//! depend on the device). Each job has ordinals of its own (the transfer counters are per
//! device).

mod common;
#[path = "common/jobs.rs"]
mod jobs;

use colotrain::config::{CheckpointDtype, JobConfig, KvRelease, OptimizerKind, Placement, ScheduleMode};
use colotrain::orchestrator::{self as job, Fault, JobOptions};
use colotrain::train::checkpoint;
use common::TempDir;
use std::sync::Mutex;

/// The tests of this file take turns: their jobs share simulated ordinals, whose transfer
/// counters they read.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const TINY: &str = include_str!("../configs/tiny-opd.toml");

/// The tiny OPD job on `devices` simulated GPUs from cuda-sim:`first`: 4 prompts × 2 samples,
/// SGD, F32 checkpoints.
fn tiny(out: &std::path::Path, first: usize, devices: usize, steps: u64) -> JobConfig {
    let mut j = JobConfig::from_toml(TINY, "tiny-opd.toml").unwrap();
    j.run.out_dir = Some(out.to_path_buf());
    (j.run.steps, j.run.device, j.run.devices) = (steps, format!("cuda-sim:{first}"), devices);
    (j.eval.every, j.data.heldout_size) = (0, 2);
    (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (4, 2);
    (j.optimizer.kind, j.optimizer.lr) = (OptimizerKind::Sgd, 0.05);
    j.checkpoint.dtype = CheckpointDtype::F32;
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

/// After a run that failed at step 3 of 4: the checkpoint of step 2 is the only one, and a run
/// resumed from it trains on to step 4.
fn resumes_from_step_2(dir: &std::path::Path, j: &JobConfig) {
    let cks = checkpoint::list(dir).unwrap();
    assert_eq!(cks.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2]);
    let before = master(dir, j);
    job::run(j, &JobOptions { resume: Some(dir.to_path_buf()), ..Default::default() }).unwrap();
    assert_eq!(checkpoint::list(dir).unwrap().iter().map(|c| c.0).max(), Some(4));
    assert_ne!(master(dir, j), before, "the resumed run trained on");
}

fn master(dir: &std::path::Path, j: &JobConfig) -> Vec<f32> {
    let ck = checkpoint::resolve(dir).unwrap();
    checkpoint::load(&ck, j).unwrap().1
}

#[test]
fn one_two_and_four_simulated_gpus_train_the_same_weights_on_the_same_samples() {
    let _turn = serial();
    let t = TempDir::new("sim-dp");
    let mut results = Vec::new();
    for (first, n) in [(0, 1), (1, 2), (3, 4)] {
        let dir = t.path().join(format!("n{n}"));
        let j = tiny(&dir, first, n, 3);
        let s = job::run(&j, &JobOptions::default()).unwrap();
        assert_eq!(s.last.as_ref().unwrap().devices, n);
        let m = lines(&dir);
        // The trainers' state lives on the GPUs: a step moves token ids and per-token numbers,
        // not the 3.3 MiB of weights or their gradient (the last step also writes the
        // checkpoint, which reads the master back).
        for l in m.iter().filter(|l| l.get("loss").is_some() && l["step"] != 3) {
            let (up, down) =
                (l["transfer"]["h2d_bytes"].as_u64().unwrap(), l["transfer"]["d2h_bytes"].as_u64().unwrap());
            eprintln!("{n} GPUs: step {}: {up} B up, {down} B down", l["step"]);
            assert!(up < 200_000 && down < 200_000, "{n} GPUs: step {}: {up} B up, {down} B down", l["step"]);
        }
        // The device collective is NCCL's (the default), on the communication stream: no
        // peer copies, and on several GPUs per GPU and update one broadcast call (the
        // all-gather) and as many reduce calls as the reduce-scatter has buckets (the head,
        // each layer, the embedding: at least 3; tests/sim_train.rs counts them exactly).
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("ledger.json")).unwrap()).unwrap();
        let calls = |op: &str| {
            rows.iter()
                .filter(|r| r["op"] == op)
                .inspect(|r| assert_eq!(r["stream"], "communication", "{n} GPUs: {op}"))
                .map(|r| r["launches"].as_u64().unwrap())
                .sum::<u64>()
        };
        let (reduce, gather) = (calls("nccl reduce"), calls("nccl broadcast"));
        assert_eq!((gather, calls("memcpy peer")), (if n > 1 { 3 * n as u64 } else { 0 }, 0), "{n} GPUs");
        assert!(n == 1 && reduce == 0 || reduce % gather == 0 && reduce / gather >= 3, "{n} GPUs: {reduce} reduces");
        results.push((n, m, master(&dir, &j)));
    }
    let (_, m1, w1) = &results[0];
    for (n, m, w) in &results[1..] {
        assert_eq!(m.len(), m1.len());
        for (a, b) in m.iter().zip(m1).filter(|(a, _)| a.get("loss").is_some()) {
            assert_eq!(a["samples_digest"], b["samples_digest"], "{n} GPUs: step {}", a["step"]);
            assert_eq!(a["gen_tokens"], b["gen_tokens"], "{n} GPUs");
            let (la, lb) = (a["loss"].as_f64().unwrap(), b["loss"].as_f64().unwrap());
            assert!((la - lb).abs() <= 1e-6 + 1e-4 * lb.abs(), "{n} GPUs: loss {la} vs {lb}");
            assert_eq!(a["utilization"].as_array().unwrap().len(), *n);
        }
        let maxdiff = w.iter().zip(w1).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("{n} GPUs: max |Δθ| = {maxdiff:e}");
        let worst =
            w.iter().zip(w1).map(|(a, b)| ((a - b).abs() as f64 - 1e-5 * b.abs() as f64).max(0.0)).fold(0.0, f64::max);
        assert!(worst <= 1e-6, "{n} GPUs: master weights differ by up to {worst:e} beyond the relative part");
    }
}

/// BF16 compute weights on two simulated GPUs: each device rounds its shard of the FP32 master
/// into the gathered BF16 buffer, so after training every compute weight is exactly
/// bf16(master) at its own position (a shard gathered to the wrong offset, or a parameter
/// copied from the wrong place, breaks the equality).
#[test]
fn bf16_weights_on_two_simulated_gpus_are_gathered_as_the_rounded_master() {
    let _turn = serial();
    let t = TempDir::new("sim-bf16");
    let dir = t.path().join("r");
    let mut j = tiny(&dir, 0, 2, 2);
    j.model.dtype = Some("bf16".into());
    (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (2, 2);
    job::run(&j, &JobOptions::default()).unwrap();
    jobs::assert_compute_is_rounded_master(&dir, &j, "2 simulated GPUs");
}

/// Split placement, k = 2, on two simulated GPUs: cuda-sim:0 generates while cuda-sim:1 trains.
/// By default each version goes out by NCCL broadcast from the trainer's compute weights
/// straight into the generator's, in place, between its engine steps: one broadcast round per
/// update on each of the two GPUs, no peer copy, no snapshot in the memory plan. With
/// COLOTRAIN_DEVICE_COLLECTIVE=peer the trainer copies its weights into a snapshot on its own
/// device (counted in its plan, and only there) and the generator copies them from there by
/// peer copies. Either way no step moves the weights across PCIe, every step trains one step's
/// worth of groups, and no token trained on is more than k versions old.
#[test]
fn split_placement_on_two_simulated_gpus_publishes_device_to_device_within_the_bound() {
    let _turn = serial();
    let t = TempDir::new("sim-split");
    for peer in [false, true] {
        let dir = t.path().join(if peer { "peer" } else { "broadcast" });
        let mut j = tiny(&dir, 0, 2, 5);
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.placement = Placement::Split;
        j.schedule.rollout_devices = 1;
        j.schedule.max_staleness = 2;
        j.checkpoint.every = 0;
        j.validate("test").unwrap();
        // Every test of this file holds `serial()`, so no other thread reads the environment.
        if peer {
            std::env::set_var("COLOTRAIN_DEVICE_COLLECTIVE", "peer");
        }
        let s = job::run(&j, &JobOptions::default());
        std::env::remove_var("COLOTRAIN_DEVICE_COLLECTIVE");
        assert_eq!(s.unwrap().steps, 5);
        let m = lines(&dir);
        for l in m.iter().filter(|l| l.get("loss").is_some()) {
            let lag = l["max_lag"].as_u64().unwrap();
            assert!(lag <= 2, "peer {peer}: step {}: lag {lag}", l["step"]);
            assert!(l["gen_tokens"].as_u64().unwrap() > 0);
            let (up, down) =
                (l["transfer"]["h2d_bytes"].as_u64().unwrap(), l["transfer"]["d2h_bytes"].as_u64().unwrap());
            eprintln!("split (peer {peer}): step {}: lag {lag}, {up} B up, {down} B down", l["step"]);
            if l["step"] != 5 {
                assert!(up < 200_000 && down < 200_000, "peer {peer}: step {}: {up} B up, {down} B down", l["step"]);
            }
        }
        assert_eq!(m.last().unwrap()["version"].as_u64(), Some(5));
        let plan: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        let snap: Vec<(u64, u64)> =
            plan.iter().map(|p| (p["snapshot"].as_u64().unwrap(), p["weights"].as_u64().unwrap())).collect();
        assert_eq!(snap.iter().filter(|s| s.0 > 0).count(), usize::from(peer), "peer {peer}: {snap:?}");
        assert!(snap.iter().all(|&(s, w)| s == 0 || s == w), "{snap:?}");
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("ledger.json")).unwrap()).unwrap();
        let launches =
            |op: &str| rows.iter().filter(|r| r["op"] == op).map(|r| r["launches"].as_u64().unwrap()).sum::<u64>();
        let (broadcasts, peer_copies) = (launches("nccl broadcast"), launches("memcpy peer"));
        if peer {
            assert!(broadcasts == 0 && peer_copies > 0, "{broadcasts} broadcasts, {peer_copies} peer copies");
        } else {
            assert_eq!((broadcasts, peer_copies), (2 * 5, 0), "5 rounds on 2 GPUs, no peer copy");
            assert!(rows.iter().filter(|r| r["op"] == "nccl broadcast").all(|r| r["stream"] == "communication"));
        }
    }
}

/// A split placement's generator that errors, or panics, as it is about to join the third
/// broadcast round (the lead trainer already waits in it): the lead wakes with the
/// generator's error naming its device, the run stops, the checkpoint of step 2 is intact and
/// the run resumes from it.
#[test]
fn a_generator_failing_at_a_broadcast_round_wakes_the_lead_with_the_checkpoint_intact() {
    let _turn = serial();
    let t = TempDir::new("sim-split-fault");
    for panic in [false, true] {
        let dir = t.path().join(format!("p{panic}"));
        let mut j = tiny(&dir, 6, 2, 4);
        j.schedule.mode = ScheduleMode::Async;
        j.schedule.placement = Placement::Split;
        j.schedule.rollout_devices = 1;
        j.checkpoint.every = 2;
        j.validate("test").unwrap();
        let opts =
            JobOptions { fault: Some(Fault { step: 3, rank: 0, panic, phase: "broadcast" }), ..Default::default() };
        let e = format!("{:#}", job::run(&j, &opts).unwrap_err());
        assert!(e.contains("phase 'publish'") && e.contains("generator 0 on cuda-sim:6"), "{e}");
        assert!(e.contains(if panic { "it panicked" } else { "injected device error at step 3" }), "{e}");
        resumes_from_step_2(&dir, &j);
    }
}

/// A device that errors, or panics, as the train phase of step 3 of a 2-GPU run starts (its
/// peer then waits for it in the step's first collective, the log-prob exchange), or that
/// errors between the reduce-scatter and the all-gather of update 3 (its peer then waits in the
/// device collective's all-gather, and the coordinator's abort wakes it): the run stops naming
/// the device and the phase, nobody hangs, the checkpoint of step 2 is intact and the run
/// resumes from it.
#[test]
fn a_fault_on_one_simulated_gpu_mid_step_stops_the_run_with_the_checkpoint_intact() {
    let _turn = serial();
    let t = TempDir::new("sim-fault");
    for (first, panic, phase) in [(0, false, "train"), (2, true, "train"), (4, false, "all-gather")] {
        let dir = t.path().join(format!("f{panic}-{phase}"));
        let mut j = tiny(&dir, first, 2, 4);
        j.checkpoint.every = 2;
        let opts = JobOptions { fault: Some(Fault { step: 3, rank: 1, panic, phase }), ..Default::default() };
        let e = format!("{:#}", job::run(&j, &opts).unwrap_err());
        let dev = format!("worker 1 (cuda-sim:{})", first + 1);
        assert!(e.contains(&dev) && e.contains("phase 'train'"), "{e}");
        assert!(e.contains(if panic { "panicked" } else { "injected device error" }), "{e}");
        resumes_from_step_2(&dir, &j);
    }
}

/// A plan that cannot hold the KV caches and the trainer's activations at once (issue 21): with
/// rollout.kv_release = "never" it is refused before any step, naming the knob; by default the
/// caches are freed for each train phase and allocated again after it. The plan says so and its
/// peak fits the budget, every step reports what the release and the commit cost (inside the
/// switch), and the run samples and trains exactly what the same job with room for both does:
/// the same samples, bit-identical weights (and on two GPUs, the same samples and weights within
/// the data-parallel tolerance).
#[test]
fn kv_caches_are_freed_for_training_when_the_plan_cannot_hold_both() {
    let _turn = serial();
    let t = TempDir::new("sim-kv-release");
    let job_at = |dir: &std::path::Path, budget: Option<usize>, release: KvRelease| {
        let mut j = tiny(dir, 6, 1, 2);
        (j.rollout.kv_cache_mb, j.rollout.kv_release, j.run.memory_budget_mb) = (3, release, budget);
        j
    };
    let plan_of = |dir: &std::path::Path| -> serde_json::Value {
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        p[0].clone()
    };
    let free = t.path().join("free");
    let jf = job_at(&free, None, KvRelease::Auto);
    job::run(&jf, &JobOptions::default()).unwrap();
    let p = plan_of(&free);
    let n = |k: &str| p[k].as_u64().unwrap();
    let total: u64 = ["weights", "trainer", "teacher", "engine_buffers", "engine_activations", "snapshot", "kv_cache"]
        .iter()
        .map(|k| n(k))
        .sum();
    let (act, caches) = (n("activations"), n("kv_cache") + n("teacher_kv"));
    eprintln!("plan with room for both: {p}");
    assert_eq!((p["kv_release"].as_bool(), n("peak")), (Some(false), total), "{p}");
    // A budget that holds decoding (everything but the activations) and training (everything
    // but the caches), not both.
    let budget = ((total - act).max(total - caches) >> 20) + 1;
    assert!(budget << 20 < total, "activations {act} B, caches {caches} B: no MiB between the phases and {total} B");
    let never = t.path().join("never");
    let e = format!(
        "{:#}",
        job::run(&job_at(&never, Some(budget as usize), KvRelease::Never), &JobOptions::default()).unwrap_err()
    );
    assert!(e.contains("the plan does not fit device 0") && e.contains("rollout.kv_release = \"auto\""), "{e}");
    let freed = t.path().join("freed");
    let jr = job_at(&freed, Some(budget as usize), KvRelease::Auto);
    job::run(&jr, &JobOptions::default()).unwrap();
    let q = plan_of(&freed);
    assert_eq!(q["kv_release"].as_bool(), Some(true), "{q}");
    assert_eq!(q["kv_cache"], p["kv_cache"], "the same caches");
    let peak = q["peak"].as_u64().unwrap();
    assert!(
        peak <= budget << 20 && peak == (total - act).max(total - caches),
        "peak {peak} B, budget {budget} MiB: {q}"
    );
    let (mf, mr) = (lines(&free), lines(&freed));
    assert_eq!(mf.len(), mr.len());
    for (a, b) in mf.iter().zip(&mr).filter(|(a, _)| a.get("loss").is_some()) {
        let step = &a["step"];
        assert_eq!(a["samples_digest"], b["samples_digest"], "step {step}");
        assert_eq!(a["loss"], b["loss"], "step {step}");
        let (kv, switch) = (b["time"]["kv_release"].as_f64().unwrap(), b["time"]["switch"].as_f64().unwrap());
        eprintln!(
            "step {step}: caches freed and committed again in {:.2} ms (switch {:.2} ms)",
            kv * 1e3,
            switch * 1e3
        );
        assert!(kv > 0.0 && switch >= kv, "step {step}: kv_release {kv} s, switch {switch} s");
        assert_eq!(a["time"]["kv_release"].as_f64(), Some(0.0), "step {step}: the plan with room moves nothing");
        // The memory really went back: the GPU never held the caches and the activations at
        // once, so its peak is lower by about the smaller of the two (the caches, here; half of
        // them allows for what each phase allocates besides).
        let (pf, pr) = (a["mem_peak_bytes"].as_u64().unwrap(), b["mem_peak_bytes"].as_u64().unwrap());
        eprintln!("step {step}: peak {pf} B with room for both, {pr} B with the caches freed ({caches} B of caches)");
        assert!(pr + caches / 2 <= pf, "step {step}: peak {pr} B with the caches freed, {pf} B without");
    }
    let (wf, wr) = (master(&free, &jf), master(&freed, &jr));
    assert!(wf.iter().zip(&wr).all(|(a, b)| a.to_bits() == b.to_bits()), "the weights differ");
    // Two GPUs (ZeRO-1 over the device collective) freeing their caches every step ("always"):
    // the same samples, and the weights of one GPU within the data-parallel tolerance of the
    // first test (the gradient's summation order differs).
    let two = t.path().join("two");
    let mut j2 = job_at(&two, None, KvRelease::Always);
    j2.run.devices = 2;
    job::run(&j2, &JobOptions::default()).unwrap();
    let plans: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(two.join("plan.json")).unwrap()).unwrap();
    assert!(plans.len() == 2 && plans.iter().all(|p| p["kv_release"] == true), "{plans:?}");
    for (a, b) in mf.iter().zip(&lines(&two)).filter(|(a, _)| a.get("loss").is_some()) {
        assert_eq!(a["samples_digest"], b["samples_digest"], "2 GPUs: step {}", a["step"]);
        assert!(b["time"]["kv_release"].as_f64().unwrap() > 0.0, "2 GPUs: step {}", a["step"]);
    }
    let w2 = master(&two, &j2);
    let worst =
        w2.iter().zip(&wf).map(|(a, b)| ((a - b).abs() as f64 - 1e-5 * b.abs() as f64).max(0.0)).fold(0.0, f64::max);
    assert!(worst <= 1e-6, "2 GPUs: master weights differ by up to {worst:e} beyond the relative part");
}

/// A quantized rollout engine (FP8) in the synchronous colocated schedule: its KV cache and
/// the standard engine's take turns (the standard engine only calibrates and evaluates, between
/// steps), so the GPU holds one of them at a time, where the asynchronous schedule (sequences
/// in flight across updates) holds both; a GPU of the plan's size runs it, setup included.
/// Evaluating at every step hands the memory back and forth without changing what the
/// rollout engine samples.
#[test]
fn a_quantized_rollout_engine_takes_turns_with_the_standard_engines_cache() {
    let _turn = serial();
    let t = TempDir::new("sim-kv-turns");
    let job_at = |dir: &std::path::Path, mode: ScheduleMode, every: u64| {
        let mut j = tiny(dir, 6, 1, 2);
        j.engine.recipe = "fp8".into();
        (j.rollout.kv_cache_mb, j.rollout.max_seqs) = (512, 1024);
        (j.schedule.mode, j.schedule.max_staleness) = (mode, 1);
        j.eval.every = every;
        j
    };
    let plan_of = |dir: &std::path::Path| -> serde_json::Value {
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        p[0].clone()
    };
    let peaks = |dir: &std::path::Path| -> Vec<u64> {
        lines(dir).iter().filter(|l| l.get("loss").is_some()).map(|l| l["mem_peak_bytes"].as_u64().unwrap()).collect()
    };
    let (sync, sync_eval, asy) = (t.path().join("sync"), t.path().join("sync-eval"), t.path().join("async"));
    job::run(&job_at(&sync, ScheduleMode::Sync, 0), &JobOptions::default()).unwrap();
    let s = job::run(&job_at(&sync_eval, ScheduleMode::Sync, 1), &JobOptions::default()).unwrap();
    job::run(&job_at(&asy, ScheduleMode::Async, 0), &JobOptions::default()).unwrap();
    let (p, q) = (plan_of(&sync), plan_of(&asy));
    eprintln!("sync: {p}\nasync: {q}");
    assert_eq!((p["kv_turns"].as_bool(), q["kv_turns"].as_bool()), (Some(true), Some(false)));
    // The same caches (as many tokens as 1024 sequences use: the F32 standard engine's 130 MiB,
    // the FP8 engine's 34), the larger counted alone where they take turns.
    let (kv_sync, kv_async) = (p["kv_cache"].as_u64().unwrap(), q["kv_cache"].as_u64().unwrap());
    let (standard, fp8) = (kv_sync, kv_async - kv_sync);
    assert!(p["kv_tokens"] == q["kv_tokens"] && fp8 >= 16 << 20 && standard >= 2 * fp8, "{p}\n{q}");
    // Every step's peak: while the synchronous run decodes and trains, the standard engine's
    // cache is not on the GPU (holding it, the peak would be the asynchronous run's or more).
    let (ps, pa) = (peaks(&sync_eval), peaks(&asy));
    eprintln!("peaks: sync {ps:?} B, async {pa:?} B; caches {standard} B (standard), {fp8} B (FP8)");
    assert!(!ps.is_empty() && ps.len() == pa.len());
    for (s, a) in ps.iter().zip(&pa) {
        assert!(s + standard / 2 <= *a, "peak {s} B taking turns, {a} B holding both ({standard} B standard cache)");
    }
    // On a GPU of the plan's size (with half the FP8 cache to spare for what the plan does not
    // itemize), the run fits: the two caches are never allocated at once, not even while the
    // engines are built (the allocator refuses what goes over COLOTRAIN_CUDA_BUDGET_MB; a
    // process of its own, as the budget is read when a device opens).
    let total: u64 = ["weights", "trainer", "teacher", "engine_buffers", "engine_activations", "snapshot", "kv_cache"]
        .iter()
        .map(|k| p[*k].as_u64().unwrap())
        .sum();
    let budget = (total + fp8 / 2) >> 20;
    let tight = t.path().join("tight");
    std::fs::create_dir_all(&tight).unwrap();
    let config = tight.join("job.toml");
    std::fs::write(&config, job_at(&tight, ScheduleMode::Sync, 1).to_toml()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .args(["train", "--config", config.to_str().unwrap(), "--out-dir", tight.to_str().unwrap()])
        .env("COLOTRAIN_CUDA_BUDGET_MB", budget.to_string())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a {budget} MiB GPU: {}", log.lines().rev().take(5).collect::<Vec<_>>().join("\n"));
    assert_eq!(lines(&tight).iter().filter(|l| l.get("loss").is_some()).count(), 2);
    // The evaluations ran on the standard engine's cache, and the rollouts after them sampled
    // what the run without them sampled.
    assert_eq!(s.evals.len(), 3, "step 0 and both steps");
    assert!(s.evals.iter().all(|e| e.kl.is_finite()));
    let (a, b) = (lines(&sync), lines(&sync_eval));
    for (a, b) in a.iter().zip(&b).filter(|(a, _)| a.get("loss").is_some()) {
        assert_eq!(a["samples_digest"], b["samples_digest"], "step {}", a["step"]);
        assert_eq!(a["loss"], b["loss"], "step {}", a["step"]);
    }
}
