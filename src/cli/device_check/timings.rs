//! The timing groups of `colotrain device-check` (the measurements are `cli/device_bench.rs`):
//! each prints its table as it finishes and returns its rows as JSON for the report. A
//! simulated GPU has no meaningful times, so there the groups are skipped.
//!
//! Owns: the timing groups' shapes and tables. May call: `device_bench`. Must not: compare
//! numerics (`checks` does).

use crate::cli::device_bench as bench;
use crate::device::cuda::CudaDevice;
use anyhow::{bail, Context, Result};

/// The timing groups, in the order they run: (name, what it measures).
pub const GROUPS: [(&str, &str); 7] = [
    ("gemm", "BF16 / FP8 / NVFP4 GEMMs per path against cuBLASLt (8192³ and Qwen2.5-7B's linears)"),
    ("decode", "decode of a random Qwen2-1.5B-shaped model at batch 1 / 64 / 256 against the bandwidth bound, eager steps and CUDA-graph replays"),
    ("resync", "in-place resync of a Qwen2.5-7B-shaped model per recipe against a copy of the same bytes"),
    (
        "attention",
        "training attention at 16k tokens, head_dim 128, GQA 7:1: forward and backward, CUDA cores vs tensor cores (PyTorch's SDPA: bench/attention_sdpa.py)",
    ),
    ("loss", "the fused LM-head loss forward + backward at V 151936, H 4096, 8192 tokens against the bare GEMMs, with peak memory"),
    (
        "train",
        "one OPD training step of a random Qwen2-1.5B-shaped BF16 model at 8 x 2048 tokens with AdamW (PyTorch eager: bench/train_step_torch.py)",
    ),
    (
        "node",
        "a short colocated OPD job of a random Qwen2-1.5B-shaped model, sync vs async k = 4, each next to the launch ledger's roofline of its own launches",
    ),
];

fn qwen2(
    layers: usize,
    hidden: usize,
    heads: usize,
    kv: usize,
    inter: usize,
    vocab: usize,
    tie: bool,
) -> Result<crate::model::ModelConfig> {
    crate::model::tiny::tiny_config(&crate::model::tiny::TinySpec {
        arch: "qwen2".into(),
        layers,
        hidden,
        heads,
        kv_heads: kv,
        head_dim: None,
        intermediate: Some(inter),
        vocab,
        max_position: 32768,
        tie,
    })
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into())
}

/// Runs timing group `name` on `d` (`iters` per GEMM, `steps` per decode batch size).
pub fn run_group(name: &str, d: &CudaDevice, iters: usize, steps: usize) -> Result<serde_json::Value> {
    match name {
        "gemm" => gemm(d, iters),
        "decode" => decode(d, steps),
        "resync" => resync(d),
        "attention" => attention(d, iters),
        "loss" => loss(d, iters),
        "train" => train(d, iters),
        "node" => Ok(serde_json::to_value(super::node_timing::node(d)?)?),
        other => bail!("no timing group '{other}'"),
    }
}

fn gemm(d: &CudaDevice, iters: usize) -> Result<serde_json::Value> {
    let mut shapes = vec![("8192^3".to_string(), 8192, 8192, 8192)];
    for m in [64usize, 4096] {
        for (name, n, k) in
            [("7B q/o", 3584, 3584), ("7B k/v", 512, 3584), ("7B gate/up", 18944, 3584), ("7B down", 3584, 18944)]
        {
            shapes.push((format!("{name} m={m}"), m, n, k));
        }
    }
    // The 4B NVFP4 engine's MLP at its decode batch (on Hopper: the W4A4 mma kernel's shapes).
    for (name, n, k) in [("4B gate/up", 9728, 2560), ("4B down", 2560, 9728)] {
        shapes.push((format!("{name} m=32"), 32, n, k));
    }
    let rows = bench::gemms(d, &shapes, iters).context("GEMM timings")?;
    println!(
        "{:<20} {:>6} {:>6} {:>6} {:<7} {:<9} {:>9} {:>8} {:>9} {:>8}",
        "GEMM", "m", "n", "k", "format", "path", "ms", "TFLOP/s", "vs cuBLASLt", "vs bf16"
    );
    for g in &rows {
        println!(
            "{:<20} {:>6} {:>6} {:>6} {:<7} {:<9} {:>9} {:>8} {:>9} {:>8} {}",
            g.shape,
            g.m,
            g.n,
            g.k,
            g.format,
            g.path,
            f(g.ms, 3),
            f(g.tflops, 1),
            f(g.vs_cublaslt, 2),
            f(g.vs_bf16, 2),
            g.note
        );
    }
    Ok(serde_json::to_value(rows)?)
}

fn decode(d: &CudaDevice, steps: usize) -> Result<serde_json::Value> {
    // Qwen2-1.5B's shape: 28 layers, hidden 1536, 12 heads / 2 KV heads, MLP 8960, tied.
    let cfg = qwen2(28, 1536, 12, 2, 8960, 151936, true)?;
    let rows = bench::decode(d, &cfg, &[1, 64, 256], 1024, steps).context("decode timing")?;
    println!(
        "{:<8} {:>8} {:>10} {:>12} {:>14} {:>9} {:>14} {:>14}",
        "decode", "context", "ms/step", "tokens/s", "bound tok/s", "of bound", "graph ms/step", "model ms/step"
    );
    for r in &rows {
        println!(
            "{:<8} {:>8} {:>10.2} {:>12.0} {:>14.0} {:>8.1}% {:>14} {:>14.3}",
            r.batch,
            r.context,
            r.ms_per_step,
            r.tokens_per_s,
            r.bound_tokens_per_s,
            100.0 * r.fraction_of_bound,
            r.graph_ms_per_step.map(|g| format!("{g:.2}")).unwrap_or_else(|| "-".into()),
            r.model_ms_per_step
        );
    }
    Ok(serde_json::to_value(rows)?)
}

fn resync(d: &CudaDevice) -> Result<serde_json::Value> {
    // Qwen2.5-7B's shape: 28 layers, hidden 3584, 28 heads / 4 KV heads, MLP 18944.
    let cfg = qwen2(28, 3584, 28, 4, 18944, 152064, false)?;
    let rows = bench::resync(d, &cfg).context("resync timing")?;
    println!("{:<18} {:>8} {:>10} {:>10} {:>10} {:>8}", "resync recipe", "tensors", "GiB", "ms", "copy ms", "vs copy");
    for r in &rows {
        println!(
            "{:<18} {:>8} {:>10.2} {:>10.2} {:>10.2} {:>8.2}",
            r.recipe,
            r.tensors,
            r.weight_bytes as f64 / (1u64 << 30) as f64,
            r.ms,
            r.copy_ms,
            r.vs_copy
        );
    }
    Ok(serde_json::to_value(rows)?)
}

fn attention(d: &CudaDevice, iters: usize) -> Result<serde_json::Value> {
    // Qwen2.5-7B's heads (28 over 4 KV heads of 128) over one 16k-token response.
    let rows = bench::attention(d, 16384, 28, 4, 128, iters.clamp(1, 2)).context("attention timing")?;
    println!("{:<36} {:>10} {:>10}", "attention, T 16384, h28/kv4, d128", "ms", "TFLOP/s");
    for r in &rows {
        println!("{:<36} {:>10.2} {:>10.1}", r.kernel, r.ms, r.tflops);
    }
    Ok(serde_json::to_value(rows)?)
}

fn loss(d: &CudaDevice, iters: usize) -> Result<serde_json::Value> {
    let rows = bench::fused_loss(d, 8192, 4096, 151936, 256, iters.clamp(1, 5)).context("fused loss timing")?;
    println!("{:<36} {:>10} {:>12}", "LM-head loss, 8192 x 4096, V 151936", "ms", "peak GiB");
    for r in &rows {
        println!("{:<36} {:>10.2} {:>12.2}", r.path, r.ms, r.peak_bytes as f64 / (1u64 << 30) as f64);
    }
    if let [fused, bare] = &rows[..] {
        println!("{:<36} {:>10.2}", "fused / bare time", fused.ms / bare.ms);
    }
    Ok(serde_json::to_value(rows)?)
}

fn train(d: &CudaDevice, iters: usize) -> Result<serde_json::Value> {
    let cfg = qwen2(28, 1536, 12, 2, 8960, 151936, true)?;
    let r = bench::train_step(d, &cfg, 8, 2048, iters.clamp(1, 3)).context("training-step timing")?;
    println!(
        "{:<36} {:>10} {:>12} {:>10} {:>10}",
        "train step, 1.5B, 8 x 2048 tokens", "ms", "tokens/s", "TFLOP/s", "peak GiB"
    );
    println!(
        "{:<36} {:>10.1} {:>12.0} {:>10.1} {:>10.2}",
        "colotrain (OPD, AdamW)",
        r.ms,
        r.tokens_per_s,
        r.tflops,
        r.peak_bytes as f64 / (1u64 << 30) as f64
    );
    Ok(serde_json::to_value(r)?)
}
