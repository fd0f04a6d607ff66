//! The timing half of `colotrain device-check` (the op-by-op comparison lives in
//! src/cli/device_check/): GEMMs per format and path against cuBLASLt, decode throughput of a
//! random 1.5B-shaped model against the memory-bandwidth bound, and the in-place resync of a
//! 7B-shaped model's linears per recipe against a device copy of the same bytes. Inputs are
//! random (device Philox normals), never zeros. Device time by CUDA events, or wall time around
//! a synchronized loop where host work is part of the cost. Not yet run on a GPU.

use crate::device::cuda::args::ptr;
use crate::device::cuda::{CudaDevice, DeviceGraph, Elem};
use crate::device::{DType, Device, Tensor};
use crate::ops::elementwise::fill_normal;
use crate::ops::linear::cuda_lowp::{self as lowp, Path};
use crate::ops::quantize::ActQuant;
use crate::quant::nvfp4::Nvfp4Opts;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct GemmRow {
    pub shape: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub format: String,
    pub path: String,
    pub ms: Option<f64>,
    pub tflops: Option<f64>,
    /// Time of cuBLASLt in the same format divided by this row's time (> 1: faster).
    pub vs_cublaslt: Option<f64>,
    /// Time of the BF16 cuBLASLt GEMM of the same shape divided by this row's time.
    pub vs_bf16: Option<f64>,
    pub note: String,
}

fn random(d: &CudaDevice, dtype: DType, shape: &[usize], seed: u64, std: f32) -> Result<Tensor> {
    let mut t = d.zeros(dtype, shape)?;
    fill_normal(d, &mut t, seed, 0, 0.0, std)?;
    Ok(t)
}

/// Mean device milliseconds of `f` over `iters` calls, after two warm-up calls.
fn time_ms(d: &CudaDevice, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let total = d.time_ms(|| {
        for _ in 0..iters {
            f()?;
        }
        Ok(())
    })?;
    Ok(total / iters as f64)
}

/// BF16 (cuBLASLt), FP8 and NVFP4 (CUTLASS, cuBLASLt, emulated) GEMMs at each (label, m, n, k).
pub fn gemms(d: &CudaDevice, shapes: &[(String, usize, usize, usize)], iters: usize) -> Result<Vec<GemmRow>> {
    let mut rows = Vec::new();
    for (si, (label, m, n, k)) in shapes.iter().enumerate() {
        let (m, n, k) = (*m, *n, *k);
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        let w = random(d, DType::BF16, &[n, k], 100 + si as u64, 1.0 / (k as f32).sqrt())?;
        let x = random(d, DType::F32, &[m, k], 200 + si as u64, 1.0)?;
        let xb = random(d, DType::BF16, &[m, k], 200 + si as u64, 1.0)?;
        let y = d.zeros(DType::F32, &[m, n])?;
        let (wp, xbp, yp) =
            (ptr(d, &w, &[DType::BF16], "w")?, ptr(d, &xb, &[DType::BF16], "x")?, ptr(d, &y, &[DType::F32], "y")?);
        let mut bf16_ms = None;
        let mut row = |format: &str, path: &str, ms: Result<f64>, base: Option<f64>| {
            let (ms, note) = match ms {
                Ok(t) => (Some(t), String::new()),
                Err(e) => (None, format!("{e:#}")),
            };
            rows.push(GemmRow {
                shape: label.clone(),
                m,
                n,
                k,
                format: format.into(),
                path: path.into(),
                ms,
                tflops: ms.map(|t| flops / (t * 1e-3) / 1e12),
                vs_cublaslt: match (base, ms) {
                    (Some(b), Some(t)) => Some(b / t),
                    _ => None,
                },
                vs_bf16: match (bf16_ms, ms) {
                    (Some(b), Some(t)) => Some(b / t),
                    _ => None,
                },
                note,
            });
            if format == "bf16" {
                bf16_ms = ms;
            }
            ms
        };
        row("bf16", "cublaslt", time_ms(d, iters, || d.gemm(Elem::BF16, wp, xbp, yp, m, n, k, 1.0, false, None)), None);
        // Activation scales from the input's amax, as a calibration pass would set them.
        let amax = crate::ops::quantize::amax(d, ptr(d, &x, &[DType::F32], "x")?, DType::F32, m * k, None)?;
        for (format, act) in [
            (QFormat::Fp8, ActQuant::Fp8 { scale: amax / 448.0 }),
            (QFormat::Nvfp4, ActQuant::Nvfp4 { global: amax / 2688.0, opts: Nvfp4Opts::default() }),
        ] {
            let name = if format == QFormat::Fp8 { "fp8" } else { "nvfp4" };
            let mut wq = QTensor::alloc_on(&Device::Cuda(d.clone()), format, n, k, Nvfp4Opts::default())?;
            crate::ops::quantize::requantize(&Device::Cuda(d.clone()), &w, &mut wq, "bench weight")?;
            let qa = lowp::quantize_act(d, &x, m, &act)?;
            let base = row(
                name,
                "cublaslt",
                time_ms(d, iters, || lowp::gemm_q(d, &qa, &wq, yp, Path::CublasLt).map(|_| ())),
                None,
            );
            if lowp::cutlass_supports(d, format, n, k) {
                row(
                    name,
                    "cutlass",
                    time_ms(d, iters, || lowp::gemm_q(d, &qa, &wq, yp, Path::Cutlass).map(|_| ())),
                    base,
                );
            } else {
                row(
                    name,
                    "cutlass",
                    Err(anyhow::anyhow!("no CUTLASS kernel for this GPU / shape in this build")),
                    None,
                );
            }
            if format == QFormat::Nvfp4 {
                row(name, "mma", time_ms(d, iters, || lowp::gemm_q(d, &qa, &wq, yp, Path::Mma).map(|_| ())), base);
            }
            row(
                name,
                "emulated",
                time_ms(d, iters, || lowp::gemm_q(d, &qa, &wq, yp, Path::Emulated).map(|_| ())),
                base,
            );
        }
    }
    Ok(rows)
}

/// Device-to-device copy bandwidth in bytes/s (read + write counted), over `bytes`.
pub fn copy_bandwidth(d: &CudaDevice, bytes: usize) -> Result<f64> {
    let a = d.scratch(bytes, "bandwidth source")?;
    let b = d.scratch(bytes, "bandwidth target")?;
    d.memset0(a.ptr, bytes)?;
    let ms = time_ms(d, 10, || d.dtod(b.ptr, a.ptr, bytes))?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3))
}

#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub batch: usize,
    pub context: usize,
    pub ms_per_step: f64,
    /// The same step as a CUDA-graph replay (forward and LM head; sampling outside); None
    /// when the capture failed.
    pub graph_ms_per_step: Option<f64>,
    /// The launch ledger's roofline time of one eager step on the GPU this device is (H200 or
    /// B300): a model, printed next to the measurement.
    pub model_ms_per_step: f64,
    pub tokens_per_s: f64,
    /// Weights + KV cache read per step at the measured copy bandwidth.
    pub bound_tokens_per_s: f64,
    pub fraction_of_bound: f64,
}

/// A random BF16 model of `cfg` on `d`: norms 1, biases 0, the rest N(0, 0.02²).
fn random_weights(d: &CudaDevice, cfg: &crate::model::ModelConfig) -> Result<crate::model::ModelWeights> {
    let mut tensors = Vec::new();
    for (i, (name, shape)) in crate::model::weights::param_specs(cfg).into_iter().enumerate() {
        let mut t = d.zeros(DType::BF16, &shape)?;
        let (mean, std) = if name.ends_with("norm.weight") {
            (1.0, 0.0)
        } else if name.ends_with(".bias") {
            (0.0, 0.0)
        } else {
            (0.0, 0.02)
        };
        fill_normal(d, &mut t, 7, i as u64, mean, std)?;
        tensors.push(t);
    }
    crate::model::ModelWeights::from_ordered(cfg, tensors)
}

/// Decode steps of a random BF16 model of `cfg` at each batch size, every sequence at
/// `context` cached tokens: forward, LM head and sampling (T = 1), as the engine runs them.
pub fn decode(
    d: &CudaDevice,
    cfg: &crate::model::ModelConfig,
    batches: &[usize],
    context: usize,
    steps: usize,
) -> Result<Vec<DecodeRow>> {
    use crate::model::transformer::{ForwardBuffers, KvLayer, Transformer};
    let dev = Device::Cuda(d.clone());
    let w = random_weights(d, cfg)?;
    let tf = Transformer::new(&dev, cfg.clone())?;
    // (2 GiB on a GPU; 1 MiB on the simulator, where the bound means nothing.)
    let bw = copy_bandwidth(d, if d.is_sim() { 1 << 20 } else { 2 << 30 })?;
    let bs = 16usize;
    let mut out = Vec::new();
    for &batch in batches {
        let per_seq = (context + 2 * steps + 4).div_ceil(bs);
        let nb = per_seq * batch;
        let mut kv = Vec::new();
        for l in 0..cfg.num_layers {
            let shape = [nb, cfg.num_kv_heads, bs, cfg.head_dim];
            let (mut k, mut v) = (d.zeros(DType::BF16, &shape)?, d.zeros(DType::BF16, &shape)?);
            fill_normal(d, &mut k, 8, 2 * l as u64, 0.0, 1.0)?;
            fill_normal(d, &mut v, 8, 2 * l as u64 + 1, 0.0, 1.0)?;
            kv.push(KvLayer { k, v, k_scale: 1.0, v_scale: 1.0 });
        }
        // BF16 weights on a GPU: the engine's BF16 operands, as a run decodes.
        let mut b = ForwardBuffers::new(&dev, cfg, batch, batch, batch, per_seq, bs, true)?;
        let tables: Vec<u32> = (0..nb as u32).collect();
        b.meta.block_tables.write_u32(&tables)?;
        b.meta.q_start.write_u32(&(0..=batch as u32).collect::<Vec<_>>())?;
        b.sel.write_u32(&(0..batch as u32).collect::<Vec<_>>())?;
        b.meta.num_seqs = batch;
        b.meta.num_tokens = batch;
        let mut tokens = vec![0u32; batch];
        let mut lps = vec![0f32; batch];
        // One decode step: its inputs copied in, the forward and the LM head eagerly or as a
        // replay of `graph`, then sampling (outside the graph: it copies to the host).
        let mut step =
            |pos: usize, b: &mut ForwardBuffers, kv: &mut [KvLayer], graph: Option<&DeviceGraph>| -> Result<()> {
                let ids: Vec<u32> = (0..batch).map(|s| ((s * 7919 + pos * 104729) % cfg.vocab_size) as u32).collect();
                b.ids.write_u32(&ids)?;
                b.positions.write_u32(&vec![pos as u32; batch])?;
                b.meta.ctx_len.write_u32(&vec![pos as u32 + 1; batch])?;
                b.meta.attended = (batch * (pos + 1)) as u64;
                let slots: Vec<u32> = (0..batch).map(|s| (s * per_seq * bs + pos) as u32).collect();
                b.meta.slot_mapping.write_u32(&slots)?;
                match graph {
                    Some(g) => d.replay(g, b.meta.attended)?,
                    None => {
                        tf.forward(&dev, &w, None, b, kv)?;
                        tf.logits(&dev, &w, b, batch)?;
                    }
                }
                let params: Vec<crate::ops::sample::SampleParams> = (0..batch)
                    .map(|s| crate::ops::sample::SampleParams {
                        temperature: 1.0,
                        top_k: 0,
                        top_p: 1.0,
                        seed: 1,
                        request: s as u64,
                        sample: 0,
                        position: pos as u32,
                    })
                    .collect();
                crate::ops::sample::sample(&dev, &b.logits, &params, &mut tokens, &mut lps)
            };
        step(context, &mut b, &mut kv, None)?;
        step(context + 1, &mut b, &mut kv, None)?;
        d.synchronize()?;
        d.take_ledger();
        let t0 = Instant::now();
        for s in 0..steps {
            step(context + 2 + s, &mut b, &mut kv, None)?;
        }
        d.synchronize()?;
        let secs = t0.elapsed().as_secs_f64() / steps as f64;
        let model_ms_per_step = d.take_ledger().total().seconds[d.ledger_gpu()] / steps as f64 * 1e3;
        // The same steps replayed as one CUDA graph (captured after the eager steps; the
        // positions go on where they stopped, one more slot per step). A capture that fails
        // leaves the eager row standing, with the reason.
        let graph = d.capture(&d.graph_pool(), || {
            tf.forward(&dev, &w, None, &mut b, &mut kv)?;
            tf.logits(&dev, &w, &mut b, batch)
        });
        let graph_ms_per_step = match graph {
            Ok(graph) => {
                let pos0 = context + 2 + steps;
                step(pos0, &mut b, &mut kv, Some(&graph))?;
                d.synchronize()?;
                let t0 = Instant::now();
                for s in 0..steps {
                    step(pos0 + 1 + s, &mut b, &mut kv, Some(&graph))?;
                }
                d.synchronize()?;
                Some(t0.elapsed().as_secs_f64() / steps as f64 * 1e3)
            }
            Err(e) => {
                eprintln!("decode at batch {batch}: no graph timing: {e:#}");
                None
            }
        };
        // Bytes per step: every weight except the embedding table (only `batch` rows of it are
        // read; a tied head reads it whole), the KV cache of every sequence, and the new KV.
        let head_tied = cfg.tie_word_embeddings;
        let emb = (cfg.vocab_size * cfg.hidden_size * 2) as f64;
        let weights = w.size_bytes() as f64 - if head_tied { 0.0 } else { emb };
        let kv_bytes = (batch * (context + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2) as f64;
        let bound = batch as f64 / ((weights + kv_bytes) / bw);
        let tps = batch as f64 / secs;
        out.push(DecodeRow {
            batch,
            context,
            ms_per_step: secs * 1e3,
            graph_ms_per_step,
            model_ms_per_step,
            tokens_per_s: tps,
            bound_tokens_per_s: bound,
            fraction_of_bound: tps / bound,
        });
    }
    Ok(out)
}

#[derive(Clone, Debug, Serialize)]
pub struct ResyncRow {
    pub recipe: String,
    pub tensors: usize,
    pub weight_bytes: usize,
    pub ms: f64,
    pub copy_ms: f64,
    pub vs_copy: f64,
}

/// One in-place resync of every linear of a 7B-shaped model (BF16 weights on the device) per
/// recipe, against a device copy of the same BF16 bytes. `bf16` is the zero-copy engine.
pub fn resync(d: &CudaDevice, cfg: &crate::model::ModelConfig) -> Result<Vec<ResyncRow>> {
    let dev = Device::Cuda(d.clone());
    let shapes: Vec<(String, Vec<usize>)> = crate::model::weights::param_specs(cfg)
        .into_iter()
        .filter(|(n, s)| n.contains(".layers.") && n.ends_with("proj.weight") && s.len() == 2)
        .collect();
    let mut weights = Vec::new();
    for (i, (_, shape)) in shapes.iter().enumerate() {
        weights.push(random(d, DType::BF16, shape, 300 + i as u64, 0.02)?);
    }
    let bytes: usize = weights.iter().map(|t| t.size_bytes()).sum();
    let mut copies: Vec<Tensor> = weights.iter().map(|t| d.zeros(DType::BF16, t.shape())).collect::<Result<_>>()?;
    let copy_ms = {
        let mut run = || -> Result<()> {
            for (c, w) in copies.iter_mut().zip(&weights) {
                c.copy_from(w)?;
            }
            Ok(())
        };
        run()?;
        d.time_ms(run)?
    };
    let mut rows = vec![ResyncRow {
        recipe: "bf16 (zero-copy)".into(),
        tensors: weights.len(),
        weight_bytes: bytes,
        ms: 0.0,
        copy_ms,
        vs_copy: 0.0,
    }];
    drop(copies);
    let recipes = [
        ("fp8", QFormat::Fp8, Nvfp4Opts::default()),
        ("nvfp4", QFormat::Nvfp4, Nvfp4Opts::default()),
        ("nvfp4+rht+sr", QFormat::Nvfp4, Nvfp4Opts { rht: Some(5), stochastic: Some(6) }),
    ];
    for (recipe, format, opts) in recipes {
        let mut qs: Vec<QTensor> =
            shapes.iter().map(|(_, s)| QTensor::alloc_on(&dev, format, s[0], s[1], opts)).collect::<Result<_>>()?;
        let mut run = || -> Result<()> {
            for ((name, _), (q, w)) in shapes.iter().zip(qs.iter_mut().zip(&weights)) {
                crate::ops::quantize::requantize(&dev, w, q, name)?;
            }
            Ok(())
        };
        run()?;
        d.synchronize()?;
        // Wall time: the per-tensor amax read-back (a host synchronization) is part of the cost.
        let t0 = Instant::now();
        run()?;
        d.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        rows.push(ResyncRow {
            recipe: recipe.into(),
            tensors: qs.len(),
            weight_bytes: bytes,
            ms,
            copy_ms,
            vs_copy: ms / copy_ms,
        });
    }
    Ok(rows)
}

/// One row of the training attention timing.
#[derive(Debug, serde::Serialize)]
pub struct AttentionRow {
    pub kernel: String,
    pub ms: f64,
    /// Causal attention's FLOPs (4·T²/2·H·D forward, 2.5× that for the backward) per second.
    pub tflops: f64,
}

/// The training attention at `t` tokens (one sequence), `heads` over `kv_heads` of `d`: the
/// forward and the backward on CUDA cores and on tensor cores, each the mean of
/// `iters` runs after one warm-up (at 16k tokens the CUDA-core kernels take seconds).
pub fn attention(
    d: &CudaDevice,
    t: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    iters: usize,
) -> Result<Vec<AttentionRow>> {
    use crate::ops::attention::grad::Shape;
    use crate::ops::attention::train::{self, Packed};
    let dev = Device::Cuda(d.clone());
    let s = Shape { heads, kv_heads, head_dim: hd };
    let q = random(d, DType::F32, &[t, heads * hd], 1, 1.0)?;
    let k = random(d, DType::F32, &[t, kv_heads * hd], 2, 1.0)?;
    let v = random(d, DType::F32, &[t, kv_heads * hd], 3, 1.0)?;
    let dout = random(d, DType::F32, &[t, heads * hd], 4, 1.0)?;
    let cu = dev.upload(Tensor::from_u32_host(&[2], vec![0, t as u32])?)?;
    let x = Packed { q: &q, k: &k, v: &v, cu: &cu, offsets: &[0, t] };
    let (mut o, mut lse) = (d.zeros(DType::F32, &[t, heads * hd])?, d.zeros(DType::F32, &[t, heads])?);
    let (mut dq, mut dk, mut dv) = (
        d.zeros(DType::F32, &[t, heads * hd])?,
        d.zeros(DType::F32, &[t, kv_heads * hd])?,
        d.zeros(DType::F32, &[t, kv_heads * hd])?,
    );
    let fwd_flop = 4.0 * (t * t) as f64 / 2.0 * (heads * hd) as f64;
    let mut rows = Vec::new();
    let mut row = |kernel: &str, ms: f64, flop: f64| {
        rows.push(AttentionRow { kernel: kernel.into(), ms, tflops: flop / (ms * 1e-3) / 1e12 });
    };
    let once = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let total = d.time_ms(|| (0..iters).try_for_each(|_| f()))?;
        Ok(total / iters as f64)
    };
    let ms = once(&mut || train::fwd(&dev, &s, &x, &mut o, &mut lse))?;
    row("forward, CUDA cores (f32)", ms, fwd_flop);
    let ms = once(&mut || train::fwd_tensor_cores(&dev, &s, &x, &mut o, &mut lse))?;
    row("forward, tensor cores (bf16 mma)", ms, fwd_flop);
    let ms = once(&mut || train::bwd(&dev, &s, &x, &o, &lse, &dout, &mut dq, &mut dk, &mut dv))?;
    row("backward, CUDA cores (f32)", ms, 2.5 * fwd_flop);
    let ms = once(&mut || train::bwd_tensor_cores(&dev, &s, &x, &o, &lse, &dout, &mut dq, &mut dk, &mut dv))?;
    row("backward, tensor cores (bf16 mma)", ms, 2.5 * fwd_flop);
    Ok(rows)
}

/// One row of the fused-loss timing.
#[derive(Debug, serde::Serialize)]
pub struct LossRow {
    pub path: String,
    pub ms: f64,
    /// The allocator's high-water mark above what was held before the run (bytes).
    pub peak_bytes: usize,
}

/// The fused LM-head loss forward + backward (`ops::lm_head::stats` then `loss_grad`, chunks of
/// `chunk` rows) at `tokens` × `hidden` against vocabulary `vocab` (BF16 head), against the bare
/// GEMMs it is built from (logits = h·Whᵀ, dh = dz·Wh, dWh = dzᵀ·h over all rows at once, the
/// (tokens, vocab) logits materialized): time and peak memory of each, the mean of `iters` runs
/// after one warm-up.
pub fn fused_loss(
    d: &CudaDevice,
    tokens: usize,
    hidden: usize,
    vocab: usize,
    chunk: usize,
    iters: usize,
) -> Result<Vec<LossRow>> {
    use crate::ops::{linear, lm_head};
    let dev = Device::Cuda(d.clone());
    let h = random(d, DType::F32, &[tokens, hidden], 5, 1.0)?;
    let wh = random(d, DType::BF16, &[vocab, hidden], 6, 0.02)?;
    let rows = dev.upload(Tensor::from_u32_host(&[tokens], (0..tokens as u32).collect())?)?;
    let targets =
        dev.upload(Tensor::from_u32_host(&[tokens], (0..tokens as u32).map(|i| i * 7919 % vocab as u32).collect())?)?;
    let coef = d.zeros(DType::F32, &[tokens])?;
    let r = lm_head::Rows { rows: &rows, targets: &targets };
    let timed = |path: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<LossRow> {
        d.synchronize()?;
        let (in_use, cached, _, _) = d.memory();
        f()?;
        let ms = d.time_ms(|| (0..iters).try_for_each(|_| f()))? / iters as f64;
        let peak = d.memory().2.saturating_sub(in_use + cached);
        Ok(LossRow { path: path.into(), ms, peak_bytes: peak })
    };
    let mut rows_out = Vec::new();
    rows_out.push(timed("fused loss (stats + loss_grad)", &mut || {
        let (mut lp, mut en) = (d.zeros(DType::F32, &[tokens])?, d.zeros(DType::F32, &[tokens])?);
        lm_head::stats(&dev, &h, &wh, &r, 1.0, chunk, &mut lp, &mut en)?;
        let (mut dh, mut dwh) = (d.zeros(DType::F32, &[tokens, hidden])?, d.zeros(DType::F32, &[vocab, hidden])?);
        lm_head::loss_grad(&dev, &h, &wh, &r, &coef, None, 1.0, chunk, &mut dh, &mut dwh)?;
        Ok(())
    })?);
    rows_out.push(timed("bare GEMMs (logits, dh, dWh)", &mut || {
        let mut z = d.zeros(DType::F32, &[tokens, vocab])?;
        linear::linear(&dev, &h, &wh, None, &mut z, tokens, false)?;
        let (mut dh, mut dwh) = (d.zeros(DType::F32, &[tokens, hidden])?, d.zeros(DType::F32, &[vocab, hidden])?);
        linear::linear_dx(&dev, &z, &wh, &mut dh, tokens, false)?;
        linear::linear_dw(&dev, &z, &h, &mut dwh, tokens, false, DType::BF16)?;
        Ok(())
    })?);
    Ok(rows_out)
}

/// The training-step timing.
#[derive(Debug, serde::Serialize)]
pub struct TrainRow {
    pub seqs: usize,
    pub seq_len: usize,
    pub ms: f64,
    pub tokens_per_s: f64,
    /// The model FLOPs of the step's passes (6·params·tokens for forward + backward, 2·params·tokens
    /// for the old-log-prob pass, plus causal attention) per second.
    pub tflops: f64,
    pub peak_bytes: usize,
}

/// One OPD training step (`Trainer::step`: the log-prob pass, the forward, fused loss and
/// backward per micro-batch of one sequence, AdamW writing the BF16 weights) of a random BF16
/// model of `cfg` on `seqs` sequences of `seq_len` tokens (16 prompt tokens each), the mean of
/// `iters` steps after one warm-up — the shape `bench/train_step_torch.py` runs in PyTorch eager.
pub fn train_step(
    d: &CudaDevice,
    cfg: &crate::model::ModelConfig,
    seqs: usize,
    seq_len: usize,
    iters: usize,
) -> Result<TrainRow> {
    use crate::engine::rollout::Rollout;
    let prompt = 16.min(seq_len / 2);
    let toml = format!(
        "[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[objective]\nkind = \"opd\"\nmicro_batch_tokens = {seq_len}\n[optimizer]\nkind = \"adamw\"\nlr = 1e-6\n"
    );
    let job = crate::config::JobConfig::from_toml(&toml, "train-step timing")?;
    let mut tr = crate::train::trainer::Trainer::new(cfg, random_weights(d, cfg)?, &job)?;
    if !tr.on_device() {
        anyhow::bail!("the trainer fell back to the host for {}", d.name());
    }
    let mut s = crate::rand::Stream::new(31, 0);
    let vocab = cfg.vocab_size as u64;
    let rollouts: Vec<Rollout> = (0..seqs)
        .map(|i| {
            let n = seq_len - prompt;
            Rollout {
                prompt_id: i as u64,
                group: i as u64,
                prompt: (0..prompt).map(|_| s.below(vocab) as u32).collect(),
                response: (0..n).map(|_| s.below(vocab) as u32).collect(),
                sampler_logprobs: vec![-12.0; n],
                teacher_logprobs: Some((0..n).map(|_| -12.0 + s.normal() as f32).collect()),
                ..Default::default()
            }
        })
        .collect();
    tr.step(&rollouts)?;
    d.synchronize()?;
    let (in_use, cached, _, _) = d.memory();
    let ms = d.time_ms(|| (0..iters).try_for_each(|_| tr.step(&rollouts).map(|_| ())))? / iters as f64;
    let peak = d.memory().2.saturating_sub(in_use + cached);
    let tokens = seqs * seq_len;
    let params = tr.num_params() as f64;
    let attn = 4.0 * (seq_len * seq_len) as f64 / 2.0 * (cfg.num_heads * cfg.head_dim * cfg.num_layers * seqs) as f64;
    let flop = 8.0 * params * tokens as f64 + 4.5 * attn;
    Ok(TrainRow {
        seqs,
        seq_len,
        ms,
        tokens_per_s: tokens as f64 / (ms * 1e-3),
        tflops: flop / (ms * 1e-3) / 1e12,
        peak_bytes: peak,
    })
}

#[cfg(test)]
mod tests {
    /// The training timings run end to end on the simulated GPU at small shapes (their numbers
    /// mean nothing there; this checks their launches before a GPU's time is spent on them):
    /// the fused loss holds less memory than the bare GEMMs' materialized logits. The device is
    /// the test's own: the peaks are read from its allocator, which other tests of the process
    /// would share on `cuda-sim:0` (a concurrent test's blocks made a step's peak read 0).
    #[test]
    fn the_training_timings_run_on_the_simulator() {
        let d = crate::device::CudaDevice::sim_unshared(91);
        let rows = super::attention(&d, 150, 6, 2, 64, 1).unwrap();
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|r| r.ms.is_finite() && r.ms >= 0.0), "{rows:?}");
        let rows = super::fused_loss(&d, 512, 32, 3000, 64, 1).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(rows[0].peak_bytes < rows[1].peak_bytes, "{rows:?}");
        let cfg = crate::model::tiny::tiny_config(&crate::model::tiny::TinySpec {
            arch: "qwen2".into(),
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            intermediate: Some(96),
            vocab: 500,
            max_position: 256,
            tie: true,
        })
        .unwrap();
        let r = super::train_step(&d, &cfg, 2, 40, 1).unwrap();
        assert!(r.ms.is_finite() && r.ms >= 0.0 && r.tokens_per_s > 0.0 && r.peak_bytes > 0, "{r:?}");
        // The decode timing's eager steps and graph replays (a device of its own: a capture
        // must be the only one on its device).
        let own = crate::device::CudaDevice::sim_unshared(90);
        let rows = super::decode(&own, &cfg, &[2], 8, 2).unwrap();
        assert!(rows[0].ms_per_step > 0.0 && rows[0].graph_ms_per_step.is_some_and(|g| g > 0.0), "{rows:?}");
        // The ledger's model of a step reads every BF16 weight at least once (the H200's HBM:
        // 4.8 TB/s), the embedding table aside (a tied head reads it as the LM head).
        let weights = crate::model::ModelConfig::num_params(&cfg) as f64 * 2.0;
        assert!(rows[0].model_ms_per_step >= weights / 4.8e12 * 1e3, "{rows:?}");
    }
}
