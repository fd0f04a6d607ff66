//! The engine-level check of `colotrain device-check`: decode steps replayed as CUDA graphs
//! (one per batch-size bucket, `engine::graphs`) against the same padded steps launched
//! eagerly (`graph_capture = false`: the same launches with the same shapes, so the GEMMs pick
//! the same kernels), on one GPU, before and after the weights are moved in place (a resync:
//! F32 weights need no new capture, an FP8 engine's new tensor scales are captured again), and
//! after the graphed engine's KV cache was freed to the driver, a NaN-filled buffer of its size
//! allocated and freed meanwhile (where the driver may hand out the cache's old memory), and
//! the cache mapped again (the memory plan's release for the train phase: the cache is one
//! virtual-memory reservation, so it comes back at its addresses and its graphs replay).
//! Tokens and log-probs must be bitwise equal: a replay runs what its capture recorded. (An
//! eager engine without padding may differ from both by the GEMMs' choice of kernel for
//! another batch size, and one flipped draw makes a sequence diverge, so it is compared on the
//! simulator only, bitwise: tests/sim.rs.)
//!
//! Owns: the `decode-graph` group. May call: the engine, the model. Must not: time anything but
//! the KV release it prints (the timings are `timings.rs`'s).

use super::checks::{Ctx, Tol};
use crate::device::DType;
use crate::engine::{Completion, Engine, EngineConfig, Request, SamplingConfig};
use crate::model::ModelWeights;
use anyhow::Result;
use std::sync::Arc;

pub(super) fn decode_graph(x: &mut Ctx) -> Result<()> {
    use crate::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use crate::model::calib::Calibration;
    use crate::quant::recipe::{KvScale, Recipe};
    let cfg = crate::model::tiny::tiny_config(&crate::model::tiny::TinySpec {
        arch: "qwen2".into(),
        layers: 2,
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: None,
        intermediate: Some(512),
        vocab: 1024,
        max_position: 4096,
        tie: false,
    })?;
    let mut cal = Calibration::new(Calibration::fingerprint(&cfg), cfg.num_layers);
    for l in 0..cfg.num_layers {
        cal.input_amax[l] = [4.0; 4];
        cal.k_amax[l] = 6.0;
        cal.v_amax[l] = 3.0;
    }
    // Seven sequences of 6..30 new tokens: decode batches of 7 down to 1.
    let reqs = |round: u64| -> Vec<Request> {
        (0..7u64)
            .map(|id| Request {
                id,
                sample: 0,
                prompt: (0..(4 + 3 * id) as u32).map(|t| (t * 31 + id as u32 * 7 + round as u32) % 1024).collect(),
                sampling: Arc::new(SamplingConfig {
                    temperature: 1.0,
                    max_new_tokens: 6 + 4 * id as usize,
                    ignore_eos: true,
                    seed: 11 + round,
                    ..Default::default()
                }),
                prompt_logprobs: false,
            })
            .collect()
    };
    // F32 weights (FP32 GEMMs), and an FP8 rollout engine over them (the FP8 GEMM paths and the
    // activation quantization's scratch inside the graph; its tensor scales are captured again
    // after the resync).
    for recipe in ["f32", "fp8"] {
        let mut w = ModelWeights::random(&cfg, &x.gpu, DType::F32, 7, 0.2)?;
        let spec = match recipe {
            "fp8" => Some(EngineSpec {
                recipe: Recipe::preset("fp8", cfg.num_layers, &[], KvScale::Calibrated, Default::default())?,
                noise_sigma: 0.0,
                noise_seed: 0,
                staleness: 0,
            }),
            _ => None,
        };
        let mut rw = match &spec {
            Some(s) => Some(RolloutWeights::new(&x.gpu, s, &cfg, &w, Some(&cal), 0)?),
            None => None,
        };
        let ec = |capture: bool| EngineConfig {
            kv_fp8: spec.as_ref().map(|s| s.recipe.kv_layers()).unwrap_or_default(),
            graph_capture: capture,
            // 16 MiB: room for the seven sequences, little for the KV release to move.
            kv_cache_bytes: 16 << 20,
            ..Default::default()
        };
        let mut eager = Engine::new(&x.gpu, &cfg, DType::F32, &ec(false), None)?;
        let mut graphed = Engine::new(&x.gpu, &cfg, DType::F32, &ec(true), None)?;
        let mut before = graphed.graph_stats();
        for round in 0..3u64 {
            if round == 2 {
                let ms = release_and_commit(&x.gpu, &mut graphed)?;
                println!(
                    "    {recipe}: KV cache freed, a NaN buffer of its size in between, committed again in {ms:.2} ms"
                );
            }
            if round == 1 {
                for l in &mut w.layers {
                    let mut g = l.up_proj.to_f32_vec()?;
                    g.iter_mut().enumerate().for_each(|(i, v)| *v = *v * 1.25 + 0.02 * ((i % 5) as f32 - 2.0));
                    l.up_proj.write_f32(&g)?;
                }
                if let Some(rw) = rw.as_mut() {
                    rw.sync(&w, 1)?;
                }
            }
            let mut out = Vec::new();
            for e in [&mut eager, &mut graphed] {
                for r in reqs(round) {
                    e.add(r)?;
                }
                let view = match &rw {
                    Some(rw) => rw.view(&w),
                    None => (&w).into(),
                };
                let mut done = e.run_to_completion(view, |_| {})?;
                done.sort_by_key(|c| c.id);
                out.push(done);
            }
            let flat =
                |i: usize, f: &dyn Fn(&Completion) -> Vec<f32>| -> Vec<f32> { out[i].iter().flat_map(f).collect() };
            let tokens = |c: &Completion| c.tokens.iter().map(|&t| t as f32).collect();
            let lps = |c: &Completion| c.logprobs.clone();
            let when = ["", ", after a resync", ", after a KV release"][round as usize];
            let op = |what: &str| format!("decode graph vs eager: {what}{when}");
            x.record(&op("tokens"), recipe, &flat(0, &tokens), &flat(1, &tokens), Tol::Exact);
            x.record(&op("log-probs"), recipe, &flat(0, &lps), &flat(1, &lps), Tol::Exact);
            let s = graphed.graph_stats();
            let (captures, replays, eagerly) =
                (s.captures - before.captures, s.replays - before.replays, s.eager - before.eager);
            println!("    {recipe} round {round}: {captures} graphs captured, {replays} replays, {eagerly} eager decode steps, {} failed captures", s.failures);
            // After the release the cache is where it was: nothing captures again.
            if replays == 0
                || s.failures > 0
                || (round != 0 && recipe == "f32" && eagerly > 0)
                || (round == 2 && captures > 0)
            {
                anyhow::bail!("{recipe} round {round}: the decode graphs did not replay as they should: {s:?}");
            }
            before = s;
        }
    }
    Ok(())
}

/// Frees `e`'s KV cache and hands the memory to the driver, allocates a buffer of its size
/// filled with NaNs (the train phase's turn), frees that, and commits the cache again; the
/// milliseconds the release and the commit took (with the commit's zero fill finished).
fn release_and_commit(gpu: &crate::device::Device, e: &mut Engine) -> Result<f64> {
    let t = std::time::Instant::now();
    let bytes = e.release_cache()?;
    gpu.release_cached()?;
    let mut ms = t.elapsed().as_secs_f64() * 1e3;
    let n = bytes / 4;
    drop(gpu.from_f32(DType::F32, &[n], &vec![f32::NAN; n])?);
    gpu.release_cached()?;
    let t = std::time::Instant::now();
    e.commit_cache()?;
    gpu.synchronize()?;
    ms += t.elapsed().as_secs_f64() * 1e3;
    Ok(ms)
}
