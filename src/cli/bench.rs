//! `colotrain bench`: side-by-side measurements in one run (ratios, because machines are noisy).
//! - `bench train`: tokens/s of one OPD training step against PyTorch eager on the same model,
//!   batch and sequence length; peak memory of the fused LM-head loss against a naive
//!   full-logits loss.
//! - `bench resync`: the in-place engine resync per recipe against a memcpy of the weights.
//! - `bench node`: the node's throughput report (`bench_node.rs`) and step-time model
//!   (`node_model.rs`).

use crate::config::JobConfig;
use crate::device::{DType, Device};
use crate::engine::rollout::Rollout;
use crate::model::tiny::{tiny_config, write_model_dir, TinySpec};
use crate::model::{LoadedModel, ModelWeights};
use crate::ops::linear::grad as matmul;
use crate::ops::lm_head::grad as lm_head;
use crate::train::trainer::Trainer;
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Training step tokens/s vs PyTorch eager, and the fused loss's memory vs naive logits.
    Train(TrainArgs),
    /// Milliseconds per in-place engine resync, per recipe, against a memcpy of the weights.
    Resync(ResyncArgs),
    /// The node's throughput report of a short job (updates/hour, tokens/s per GPU, train
    /// MFU, the phases, utilization; JSON), or with --model-gpu the step-time model.
    Node(super::bench_node::NodeArgs),
}

#[derive(clap::Args, Debug)]
pub struct ResyncArgs {
    /// Transformer layers of the qwen2-shaped model (12: ~100M parameters, hidden 768).
    #[arg(long, default_value_t = 12)]
    pub layers: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Model directory (default: a 24.9M-parameter qwen2-shaped model made in --work).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "runs/bench")]
    pub work: PathBuf,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Python with torch + transformers for the PyTorch side (skipped when absent).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Sequence length of the loss-memory comparison.
    #[arg(long, default_value_t = 8192)]
    pub loss_tokens: usize,
    #[arg(long, default_value_t = 32000)]
    pub loss_vocab: usize,
}

pub fn run(b: Bench) -> Result<()> {
    match b {
        Bench::Train(a) => train(a),
        Bench::Resync(a) => resync(a),
        Bench::Node(a) => super::bench_node::run(a),
    }
}

/// The 24.9M-parameter qwen2-shaped model of the benchmarks (8 layers, hidden 384, GQA 6/2,
/// MLP 1024, vocab 32,000, tied embeddings).
pub fn bench_model(work: &Path) -> Result<PathBuf> {
    let dir = work.join("qwen2-25m");
    if !dir.join("config.json").exists() {
        std::fs::create_dir_all(&dir)?;
        let spec = TinySpec {
            arch: "qwen2".into(),
            layers: 8,
            hidden: 384,
            heads: 6,
            kv_heads: 2,
            head_dim: None,
            intermediate: Some(1024),
            vocab: 32000,
            max_position: 4096,
            tie: true,
        };
        let cfg = tiny_config(&spec)?;
        let w = ModelWeights::random(&cfg, &Device::cpu(0)?, DType::F32, 1, 0.05)?;
        write_model_dir(&dir, &cfg, &w, DType::F32)?;
    }
    Ok(dir)
}

fn train(a: TrainArgs) -> Result<()> {
    let dir = match &a.model {
        Some(m) => m.clone(),
        None => bench_model(&a.work)?,
    };
    let dev = Device::cpu(a.threads)?;
    let lm = LoadedModel::load(&dir, &dev, DType::F32)?;
    let v = lm.cfg.vocab_size as u64;
    let mut s = crate::rand::Stream::new(5, 0);
    let plen = a.seq / 8;
    let rl = a.seq - plen;
    let rollouts: Vec<Rollout> = (0..a.batch)
        .map(|i| Rollout {
            prompt_id: i as u64,
            sample: 0,
            group: i as u64,
            prompt: (0..plen).map(|_| s.below(v) as u32).collect(),
            response: (0..rl).map(|_| s.below(v) as u32).collect(),
            sampler_logprobs: vec![-1.0; rl],
            teacher_logprobs: Some((0..rl).map(|_| -(0.05 + 3.0 * s.uniform()) as f32).collect()),
            reward: None,
            answer: None,
            truncated: false,
            version: 0,
            ..Default::default()
        })
        .collect();
    std::fs::create_dir_all(&a.work)?;
    let rfile = a.work.join("bench-rollouts.jsonl");
    let mut text = String::new();
    for r in &rollouts {
        text.push_str(
            &serde_json::json!({"prompt_tokens": r.prompt, "response_tokens": r.response, "sampler_logprobs": r.sampler_logprobs, "teacher_logprobs": r.teacher_logprobs})
                .to_string(),
        );
        text.push('\n');
    }
    crate::util::write_atomic(&rfile, text.as_bytes())?;
    let job = JobConfig::from_toml(
        "[model]\npath = \"bench\"\n[teacher]\npath = \"bench\"\n[objective]\nchunk_size = 256\n",
        "bench",
    )?;
    let tokens = a.batch * a.seq;
    let mut tr = Trainer::new(&lm.cfg, lm.weights, &job)?;
    let times: Vec<f64> = dev.install(|| -> Result<Vec<f64>> {
        tr.step(&rollouts)?;
        let mut t = Vec::new();
        for _ in 0..a.reps {
            let t0 = Instant::now();
            tr.step(&rollouts)?;
            t.push(t0.elapsed().as_secs_f64());
        }
        Ok(t)
    })?;
    let ours = tokens as f64 / median(times);
    let torch = std::process::Command::new(&a.python)
        .args(["bench/train_torch.py", "--model"])
        .arg(&dir)
        .arg("--rollouts")
        .arg(&rfile)
        .args(["--threads", &a.threads.to_string(), "--reps", &a.reps.to_string()])
        .output();
    let theirs = match torch {
        Ok(o) if o.status.success() => {
            let line = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or_default().to_string();
            serde_json::from_str::<serde_json::Value>(&line).ok().and_then(|v| v["tokens_per_s"].as_f64())
        }
        Ok(o) => {
            eprintln!("PyTorch side failed: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or_default());
            None
        }
        Err(e) => {
            eprintln!("PyTorch side not run ({}: {e})", a.python);
            None
        }
    };
    println!(
        "one OPD step, {} ({} params), batch {} x {} tokens, {} threads, f32:",
        dir.display(),
        tr.num_params(),
        a.batch,
        a.seq,
        a.threads
    );
    println!("  colotrain      {ours:>10.1} tokens/s");
    match theirs {
        Some(t) => println!("  pytorch eager  {t:>10.1} tokens/s   ratio {:.2}", ours / t),
        None => println!("  pytorch eager  (not measured)"),
    }
    loss_memory(&dev, a.loss_tokens, a.loss_vocab, lm.cfg.hidden_size)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Peak heap of the fused chunked loss vs naive full logits for T tokens, vocab V, hidden C.
fn loss_memory(dev: &Device, t: usize, v: usize, c: usize) -> Result<()> {
    let mut s = crate::rand::Stream::new(9, 1);
    let h: Vec<f32> = (0..t * c).map(|_| s.normal() as f32).collect();
    let w: Vec<f32> = (0..v * c).map(|_| (0.02 * s.normal()) as f32).collect();
    let rows: Vec<u32> = (0..t as u32).collect();
    let targets: Vec<u32> = (0..t).map(|_| s.below(v as u64) as u32).collect();
    let coef = vec![1.0f32 / t as f32; t];
    let measure = |f: &dyn Fn()| -> usize {
        crate::util::reset_heap_peak();
        let base = crate::util::heap_live();
        f();
        crate::util::heap_peak().saturating_sub(base)
    };
    let fused = |tt: usize| {
        measure(&|| {
            dev.install(|| {
                let mut scratch = lm_head::Scratch::<f32>::new(256, c, v);
                let mut dh = vec![0.0f32; tt * c];
                let mut dw = vec![0.0f32; v * c];
                lm_head::grad(
                    c,
                    v,
                    &rows[..tt],
                    &targets[..tt],
                    &coef[..tt],
                    &h,
                    &w,
                    1.0,
                    &mut scratch,
                    &mut dh,
                    &mut dw,
                );
            })
        })
    };
    let naive = measure(&|| {
        dev.install(|| {
            let mut z = vec![0.0f32; t * v]; // (T, V) logits
            matmul::nt(t, v, c, &h, &w, &mut z, false);
            for (i, row) in z.chunks_exact_mut(v).enumerate() {
                let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let sum: f32 = row.iter().map(|x| (x - mx).exp()).sum();
                for x in row.iter_mut() {
                    *x = coef[i] * (*x - mx).exp() / sum;
                }
                row[targets[i] as usize] -= coef[i];
            }
            let mut dh = vec![0.0f32; t * c];
            let mut dw = vec![0.0f32; v * c];
            matmul::tn(t, v, c, &z, &h, &mut dw, false);
            matmul::nn(t, v, c, &z, &w, &mut dh, false);
        })
    });
    let (f_small, f_full) = (fused(t / 4), fused(t));
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!("LM-head loss memory, V = {v}, C = {c} (peak heap above the inputs):");
    println!("  naive full logits, T = {t:<6} {:>9.1} MiB", mib(naive));
    println!(
        "  fused (chunk 256), T = {t:<6} {:>9.1} MiB   ({:.1}x less)",
        mib(f_full),
        naive as f64 / f_full.max(1) as f64
    );
    println!("  fused (chunk 256), T = {:<6} {:>9.1} MiB   (beyond dh, grows by T·C only)", t / 4, mib(f_small));
    Ok(())
}

fn resync(a: ResyncArgs) -> Result<()> {
    use crate::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use crate::model::calib::Calibration;
    use crate::quant::recipe::{KvScale, Recipe};
    let spec = TinySpec {
        arch: "qwen2".into(),
        layers: a.layers,
        hidden: 768,
        heads: 12,
        kv_heads: 4,
        head_dim: None,
        intermediate: Some(2048),
        vocab: 32000,
        max_position: 4096,
        tie: true,
    };
    let cfg = tiny_config(&spec)?;
    let dev = Device::cpu(a.threads)?;
    let w = ModelWeights::random(&cfg, &dev, DType::BF16, 1, 0.02)?;
    let bytes = w.size_bytes();
    let mut cal = Calibration::new(Calibration::fingerprint(&cfg), cfg.num_layers);
    cal.input_amax = vec![[4.0; 4]; cfg.num_layers];
    cal.k_amax = vec![8.0; cfg.num_layers];
    cal.v_amax = vec![8.0; cfg.num_layers];
    println!(
        "in-place resync, qwen2-shaped model: {} parameters, {:.1} MiB of BF16 weights, {} threads",
        cfg.num_params(),
        bytes as f64 / (1 << 20) as f64,
        a.threads
    );
    // The baseline: copy the same bytes (a second BF16 copy, written in place).
    let mut dst = w.try_clone(&cfg)?;
    let memcpy = dev.install(|| -> Result<f64> {
        dst.copy_from(&w)?;
        let t0 = Instant::now();
        for _ in 0..a.reps {
            dst.copy_from(&w)?;
        }
        Ok(t0.elapsed().as_secs_f64() / a.reps as f64)
    })?;
    println!("  {:<34} {:>9.2} ms", "memcpy of the weights", memcpy * 1e3);
    let cases: Vec<(&str, EngineSpec)> = vec![
        (
            "bf16 (reads the trainer's buffers)",
            EngineSpec {
                recipe: Recipe::preset("bf16", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.0,
                noise_seed: 0,
                staleness: 0,
            },
        ),
        (
            "fp8 (W8A8, FP8 KV)",
            EngineSpec {
                recipe: Recipe::preset("fp8", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.0,
                noise_seed: 0,
                staleness: 0,
            },
        ),
        (
            "nvfp4 (W4A4, FP8 KV)",
            EngineSpec {
                recipe: Recipe::preset("nvfp4", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.0,
                noise_seed: 0,
                staleness: 0,
            },
        ),
        (
            "stale, k = 1",
            EngineSpec {
                recipe: Recipe::preset("bf16", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.0,
                noise_seed: 0,
                staleness: 1,
            },
        ),
        (
            "weight noise, sigma = 0.15",
            EngineSpec {
                recipe: Recipe::preset("bf16", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.15,
                noise_seed: 1,
                staleness: 0,
            },
        ),
    ];
    for (name, s) in cases {
        let mut rw = RolloutWeights::new(&dev, &s, &cfg, &w, Some(&cal), 0)?;
        let t = dev.install(|| -> Result<f64> {
            rw.sync(&w, 1)?;
            let t0 = Instant::now();
            for v in 0..a.reps {
                rw.sync(&w, 2 + v as u64)?;
            }
            Ok(t0.elapsed().as_secs_f64() / a.reps as f64)
        })?;
        println!("  {:<34} {:>9.2} ms   {:.2}x memcpy", name, t * 1e3, t / memcpy);
    }
    Ok(())
}
