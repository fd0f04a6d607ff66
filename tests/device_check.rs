//! `colotrain device-check --checks-only` on the simulated GPU: the script that will meet the
//! first real GPU, run end to end in CI — every check group in its own process, each one
//! passing on both architecture profiles, and a crashing group reported while the others go
//! on.

mod common;

use common::TempDir;
use serde_json::Value;
use std::process::Command;

fn device_check(arch: &str, device: &str, extra: &[&str]) -> (bool, String, Value) {
    let dir = TempDir::new("device-check");
    let out = dir.path().join("report.json");
    let o = Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .args(["device-check", "--device", device, "--checks-only", "--out"])
        .arg(&out)
        .args(extra)
        .env("COLOTRAIN_SIM_ARCH", arch)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    (o.status.success(), text, report)
}

fn check<'a>(r: &'a Value, op: &str, dtype: &str) -> &'a Value {
    r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["op"] == op && c["dtype"] == dtype)
        .unwrap_or_else(|| panic!("no check '{op}' ({dtype})"))
}

#[test]
fn every_check_group_passes_on_both_simulated_architectures() {
    for (arch, dev) in [("sm_90a", "cuda-sim:0"), ("sm_100a", "cuda-sim:1")] {
        let (ok, text, r) = device_check(arch, dev, &[]);
        assert!(ok, "{arch}: {text}");
        assert_eq!(r["simulated"], true);
        let groups = r["groups"].as_array().unwrap();
        let names: Vec<&str> = groups.iter().map(|g| g["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "dense",
                "rows",
                "attention",
                "attention-128",
                "quant",
                "scale-layout",
                "optim",
                "train-gemm",
                "backward",
                "decode-graph"
            ],
            "{arch}"
        );
        assert!(groups.iter().all(|g| g["status"] == "ok"), "{arch}: {groups:?}");
        let checks = r["checks"].as_array().unwrap();
        assert!(checks.len() >= 60, "{arch}: {} checks", checks.len());
        assert!(checks.iter().all(|c| c["pass"] != false), "{arch}");
        // Rows are streamed as they are measured, under one header.
        assert_eq!(text.matches("max|Δ|").count(), 1, "{text}");
        assert!(text.contains("attention h14/kv2 d128, prefill kernel"), "{text}");
        // The prefill of a BF16 cache on the tensor cores, the others' on the CUDA cores.
        for (op, dt) in [
            ("attention h14/kv2 d128, prefill kernel (tensor cores)", "bf16 cache"),
            ("attention h6/kv2 d64, prefill kernel (tensor cores)", "bf16 cache"),
            ("attention h14/kv2 d128, prefill kernel", "f32 cache"),
            ("attention h14/kv2 d128, prefill kernel", "u8 cache"),
        ] {
            assert_eq!(check(&r, op, dt)["pass"], true, "{arch} {op} {dt}");
        }
        for dt in ["f32 cache", "bf16 cache", "u8 cache"] {
            assert_eq!(check(&r, "attention h14/kv2 d128, decode kernel", dt)["pass"], true, "{arch} {dt}");
        }
        // The guard's view check agrees with what the device kernels wrote, and catches them zeroed.
        for label in ["fp8 from bf16", "nvfp4 rht+sr from f32"] {
            assert_eq!(check(&r, &format!("guard view check {label}"), "agree, caught")["pass"], true, "{arch}");
        }
        // NCCL's calls on one GPU: the ZeRO-1 pair and the split placement's weight broadcast.
        for op in
            ["reduce-scatter on the communication stream", "all-gather in place", "broadcast of two tensors in place"]
        {
            assert_eq!(check(&r, &format!("NCCL: {op} (1 GPU)"), "f32")["pass"], true, "{arch} {op}");
        }
        // The residual GEMM (C ≠ D) and the producers' BF16 outputs, bit for bit.
        for (op, dt) in [
            ("linear y = r + x·Wᵀ (C ≠ D) vs r + x·Wᵀ in place", "f32"),
            ("linear y = r + x·Wᵀ (C ≠ D) vs r + x·Wᵀ in place", "bf16"),
            ("swiglu: BF16 output vs the f32 output rounded", "bf16"),
            ("swiglu backward: BF16 dg vs the f32 dg rounded", "bf16"),
            ("swiglu backward: BF16 du vs the f32 du rounded", "bf16"),
            ("add_rmsnorm: BF16 output vs the f32 output rounded", "bf16"),
            ("add_rmsnorm: residual beside a BF16 output", "f32"),
        ] {
            assert_eq!(check(&r, op, dt)["pass"], true, "{arch} {op} {dt}");
        }
        assert!(text.contains("BF16 output vs the f32 output rounded"), "{text}");
        // The one-pass OPD and TIS losses against the two passes.
        for kind in ["OPD", "TIS"] {
            for part in ["log p(y)", "entropy", "value", "dh", "dWh"] {
                let op = format!("LM head one pass ({kind} coefficients on the GPU) vs two passes: {part}");
                assert_eq!(check(&r, &op, "f32 head")["pass"], true, "{arch} {op}");
            }
        }
        // The real W8A8 / W4A4 paths: CUTLASS's FP8 on both; its NVFP4 kernel only on sm_100.
        assert_eq!(check(&r, "W8A8 GEMM via Cutlass", "fp8")["pass"], true, "{arch}");
        assert_eq!(check(&r, "W4A4 GEMM via CublasLt", "nvfp4")["pass"], true, "{arch}");
        let w4a4 = &check(&r, "W4A4 GEMM via Cutlass", "nvfp4")["pass"];
        if arch == "sm_100a" {
            assert_eq!(*w4a4, true, "{arch}");
        } else {
            assert!(w4a4.is_null(), "{arch}: NVFP4 CUTLASS on Hopper must be a skip, got {w4a4}");
        }
        // Decode graphs against eager steps, before and after a resync and a KV release, F32
        // and FP8 engines.
        for dt in ["f32", "fp8"] {
            for op in [
                "tokens",
                "log-probs",
                "tokens, after a resync",
                "log-probs, after a resync",
                "tokens, after a KV release",
                "log-probs, after a KV release",
            ] {
                assert_eq!(check(&r, &format!("decode graph vs eager: {op}"), dt)["pass"], true, "{arch} {dt} {op}");
            }
        }
        assert!(text.contains("f32 round 1: 0 graphs captured"), "{arch}: {text}");
        assert!(
            text.contains("f32: KV cache freed, a NaN buffer of its size in between, committed again in"),
            "{arch}: {text}"
        );
    }
}

#[test]
fn a_crashing_group_is_reported_and_the_others_still_run() {
    let (ok, text, r) =
        device_check("sm_90a", "cuda-sim:2", &["--inject-crash", "rows", "--groups", "dense,rows,quant"]);
    assert!(!ok, "{text}");
    assert!(text.contains("groups not ok: rows"), "{text}");
    let status: Vec<(String, String)> = r["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["name"].as_str().unwrap().into(), g["status"].as_str().unwrap().into()))
        .collect();
    let want = [("dense", "ok"), ("rows", "crashed"), ("quant", "ok")];
    assert_eq!(status, want.map(|(a, b)| (a.to_string(), b.to_string())), "{text}");
    // The groups after the crash measured their rows.
    assert_eq!(check(&r, "W8A8 GEMM via Emulated", "fp8")["pass"], true);
    let e = Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .args(["device-check", "--device", "cuda-sim:0", "--groups", "nope"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(!e.status.success() && err.contains("no group 'nope'") && err.contains("attention-128"), "{err}");
}

/// The `node` timing group runs on the simulator at a tiny shape: both schedules finish their
/// steps on the CUDA glue, and each row carries the launch ledger's model of its own launches.
#[test]
fn the_node_timing_runs_sync_and_async_jobs_next_to_the_step_time_model() {
    let dir = TempDir::new("device-check-node");
    let out = dir.path().join("report.json");
    let o = Command::new(env!("CARGO_BIN_EXE_colotrain"))
        .args(["device-check", "--device", "cuda-sim:3", "--groups", "node", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    let r: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(r["groups"][0]["status"], "ok", "{text}");
    let rows = r["timings"]["node"].as_array().unwrap_or_else(|| panic!("no node rows: {r}"));
    let names: Vec<&str> = rows.iter().map(|x| x["schedule"].as_str().unwrap()).collect();
    assert_eq!(names, ["sync", "async k=4"], "{text}");
    for x in rows {
        assert_eq!(x["steps_measured"], 2, "{x}");
        for f in ["updates_per_hour", "step_s", "model_step_s", "rollout_s", "train_s", "gen_tokens_per_s"] {
            let v = x[f].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{f} = {v} in {x}");
        }
        // The model is a roofline: the simulator (the host) is far slower than an H200.
        assert!(x["model_step_s"].as_f64().unwrap() < x["step_s"].as_f64().unwrap(), "{x}");
    }
    assert!(text.contains("async / sync upd/h"), "{text}");
}
