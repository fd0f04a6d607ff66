//! The step-time model of `colotrain bench node --model-gpu h200|b300`: the roofline time of
//! each phase of one synchronous, colocated step of a job on 8 GPUs, from the model's shapes,
//! the batch, the GPU's dense peak rates, HBM and NVLink bandwidth (vendor figures,
//! REFERENCES.md). It is a model, not a measurement: each phase is max(FLOPs / peak, bytes /
//! bandwidth) under stated assumptions (mean prompt and response lengths, perfect overlap
//! inside a phase, none between phases), with the arithmetic of each row in `phases`. What the
//! code actually launches at those shapes is `node_ledger.rs`'s (`--ledger`).
//!
//! Owns: the model's arithmetic. May call: `model::ModelConfig`, the job config, the ledger's
//! GPU table. Must not: open devices or models' weights.

use crate::config::JobConfig;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The GPUs' peak rates and bandwidths: the launch ledger's (one table for both models).
pub use crate::device::cuda::ledger::{Gpu, B300, H200};

pub fn gpu(name: &str) -> Result<Gpu> {
    match name.to_ascii_lowercase().as_str() {
        "h200" => Ok(H200),
        "b300" => Ok(B300),
        other => bail!("--model-gpu '{other}': expected h200 or b300"),
    }
}

const QWEN25_7B: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
  "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
  "tie_word_embeddings": false}"#;
const QWEN3_4B: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
  "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
  "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "max_position_embeddings": 32768, "tie_word_embeddings": true}"#;

/// The published shape of the models the shipped configs name (by the directory's name), so
/// the model runs without the weights: Qwen2.5-7B (DeepSeek-R1-Distill-Qwen-7B,
/// Skywork-OR1-Math-7B) and Qwen3-4B(-Base).
pub fn known_shape(path: &Path) -> Option<ModelConfig> {
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    let json = if name.contains("qwen-7b") || name.contains("qwen2.5-7b") || name.contains("or1-math-7b") {
        QWEN25_7B
    } else if name.contains("qwen3-4b") {
        QWEN3_4B
    } else {
        return None;
    };
    ModelConfig::from_json_str(json, "built-in shape").ok()
}

/// One row of the model.
#[derive(Debug)]
pub struct Row {
    pub phase: &'static str,
    pub flops: f64,
    /// HBM bytes (or NVLink bytes for the collectives).
    pub bytes: f64,
    pub seconds: f64,
    pub bound: &'static str,
    pub note: String,
}

/// The assumptions of a modelled step.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub gpus: usize,
    pub sequences: usize,
    pub prompt: usize,
    pub response: usize,
}

fn row(phase: &'static str, flops: f64, tflops: f64, bytes: f64, bw: f64, note: String) -> Row {
    let (c, m) = (flops / (tflops * 1e12), bytes / bw);
    let (seconds, bound) = match (flops > 0.0, bytes > 0.0) {
        (false, false) => (0.0, "-"),
        _ if c >= m => (c, "compute"),
        _ => (m, "memory"),
    };
    Row { phase, flops, bytes, seconds, bound, note }
}

/// The rollout engine's weights as its recipe keeps them: `step`, the bytes one forward step
/// streams (every layer's seven linears in their weight precision — NVFP4 0.5625 B a value
/// with its E4M3 block scales, FP8 1 B, the model's BF16 2 B — its norms and biases, the final
/// norm and the BF16 LM head; the embedding table is gathered a row per token, not streamed);
/// `quantized`, the values of the linears a resync requantizes, and `codes`, their bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineWeights {
    pub step: f64,
    pub quantized: f64,
    pub codes: f64,
}

impl EngineWeights {
    /// `recipe`: one entry per layer (`Recipe::layers`); a layer without one is BF16.
    pub fn of(s: &ModelConfig, recipe: &[crate::quant::recipe::LayerRecipe]) -> EngineWeights {
        use crate::quant::recipe::Precision;
        let (c, i, q, kv) = (s.hidden_size as f64, s.intermediate_size as f64, s.q_dim() as f64, s.kv_dim() as f64);
        // The seven linears' values, in `recipe::LINEARS` order.
        let sizes = [q * c, kv * c, kv * c, c * q, i * c, i * c, c * i];
        let linears: f64 = sizes.iter().sum();
        // Everything else of a layer (norms, biases, q/k norms) in BF16.
        let rest = (s.num_params()
            - s.vocab_size * s.hidden_size * (1 + !s.tie_word_embeddings as usize)
            - s.hidden_size) as f64
            / s.num_layers as f64
            - linears;
        let mut e = EngineWeights { step: 2.0 * (s.vocab_size as f64 * c + c), quantized: 0.0, codes: 0.0 };
        for l in 0..s.num_layers {
            e.step += 2.0 * rest;
            for (j, &v) in sizes.iter().enumerate() {
                let bytes = match recipe.get(l).map(|r| r.weight[j]) {
                    Some(Precision::Nvfp4) => 0.5625,
                    Some(Precision::Fp8) => 1.0,
                    _ => 2.0,
                };
                e.step += bytes * v;
                if bytes < 2.0 {
                    (e.quantized, e.codes) = (e.quantized + v, e.codes + bytes * v);
                }
            }
        }
        e
    }
}

/// The phases of one synchronous colocated step on `w.gpus` GPUs of kind `g`: every GPU
/// decodes and teacher-scores its share of the sequences, trains its share of the tokens, then
/// ZeRO-1 reduce-scatters the FP32 gradient and all-gathers the BF16 weights, and the rollout
/// engine resyncs in place. `ew`: the engine's weights as its recipe keeps them; `kv_tok`: its
/// KV-cache bytes per token (the recipe's FP8 and BF16 layers, `Recipe::kv_bytes_per_token`).
#[allow(clippy::too_many_arguments)]
pub fn phases(
    student: &ModelConfig,
    teacher: Option<&ModelConfig>,
    recipe: &str,
    ew: EngineWeights,
    kv_tok: f64,
    g: Gpu,
    w: Workload,
) -> Vec<Row> {
    let n = student.num_params() as f64;
    let b = w.sequences as f64 / w.gpus as f64; // sequences per GPU
    let (p, r) = (w.prompt as f64, w.response as f64);
    let hbm = g.hbm_tbs * 1e12;
    // The quantized GEMMs' rate (their FLOPs dominate the engine's).
    let rate = match recipe {
        "fp8" => g.fp8_tflops,
        "nvfp4" => g.fp4_tflops.unwrap_or(g.bf16_tflops),
        _ => g.bf16_tflops,
    };
    let mut rows = Vec::new();
    // Prefill: the prompts, compute-bound.
    rows.push(row(
        "rollout: prefill",
        2.0 * n * b * p,
        rate,
        ew.step,
        hbm,
        format!("{b:.0} prompts × {p:.0} tokens per GPU"),
    ));
    // Decode: r steps, each reading the weights once and every sequence's KV so far.
    let kv_read = b * kv_tok * (r * p + r * (r + 1.0) / 2.0);
    let dec_flops = 2.0 * n * b * r;
    let dec_bytes = ew.step * r + kv_read;
    let mut d = row("rollout: decode", dec_flops, rate, dec_bytes, hbm, String::new());
    d.note =
        format!("{r:.0} steps at batch {b:.0}: weights {:.1} GB + KV {:.1} GB read", ew.step * r / 1e9, kv_read / 1e9);
    rows.push(d);
    let tokens = b * (p + r);
    if let Some(t) = teacher {
        let nt = t.num_params() as f64;
        rows.push(row(
            "teacher",
            2.0 * nt * tokens,
            g.bf16_tflops,
            2.0 * nt,
            hbm,
            format!("{tokens:.0} tokens per GPU, BF16"),
        ));
    }
    rows.push(row(
        "train",
        6.0 * n * tokens,
        g.bf16_tflops,
        2.0 * n * 3.0,
        hbm,
        format!("6·N·T over {tokens:.0} tokens per GPU (attention not counted)"),
    ));
    // AdamW on the shard: master, m, v, grad read (16 B), master, m, v written (12 B), the BF16
    // compute weight written (2 B).
    let shard = n / w.gpus as f64;
    rows.push(row(
        "optimizer",
        10.0 * shard,
        g.bf16_tflops,
        30.0 * shard,
        hbm,
        "AdamW, 30 B per shard parameter".into(),
    ));
    // Ring collectives: each GPU sends (G − 1)/G of the buffer per direction.
    let link = g.nvlink_gbs * 1e9;
    let frac = (w.gpus as f64 - 1.0) / w.gpus as f64;
    let mut c = row(
        "collectives",
        0.0,
        1.0,
        frac * (4.0 * n + 2.0 * n),
        link,
        "reduce-scatter FP32 gradient + all-gather BF16 weights over NVLink".into(),
    );
    c.bound = "NVLink";
    rows.push(c);
    // The quantized linears' BF16 values read, their codes written.
    let resync = 2.0 * ew.quantized + ew.codes;
    rows.push(row(
        "resync",
        0.0,
        1.0,
        resync,
        hbm,
        if resync == 0.0 {
            "the engine reads the trainer's weights in place".into()
        } else {
            "requantize in place (one read of the quantized linears' BF16 values, one write of their codes)".into()
        },
    ));
    rows.push(Row {
        phase: "switch",
        flops: 0.0,
        bytes: 0.0,
        seconds: 0.0,
        bound: "-",
        note: "nothing moves (plan holds both phases)".into(),
    });
    rows
}

/// `bench node --model-gpu`: the table for a config (default: the two shipped GPU configs).
/// `ledger`: with the dry launch ledger, and how many of its costliest operations to print (0: all).
pub fn print(config: Option<&Path>, model_config: Option<&Path>, gpu_name: &str, ledger: Option<usize>) -> Result<()> {
    let g = gpu(gpu_name)?;
    let configs: Vec<std::path::PathBuf> = match config {
        Some(c) => vec![c.to_path_buf()],
        None => {
            vec!["configs/r1-distill-qwen-7b-opd.toml".into(), "configs/qwen3-4b-base-grpo-triage-nvfp4.toml".into()]
        }
    };
    println!(
        "step-time model (a roofline model, not a measurement): 8 × {}, BF16 {} / FP8 {} / FP4 {} TFLOP/s, HBM {} TB/s, NVLink {} GB/s per direction",
        g.name,
        g.bf16_tflops,
        g.fp8_tflops,
        g.fp4_tflops.map(|x| x.to_string()).unwrap_or_else(|| "emulated".into()),
        g.hbm_tbs,
        g.nvlink_gbs
    );
    for c in configs {
        let j = JobConfig::from_file(&c)?;
        let shape = |p: &Path| -> Result<ModelConfig> {
            match model_config {
                Some(mc) => {
                    let text = std::fs::read_to_string(mc).with_context(|| format!("cannot read {}", mc.display()))?;
                    ModelConfig::from_json_str(&text, &mc.display().to_string())
                }
                None => match known_shape(p) {
                    Some(s) => Ok(s),
                    None => ModelConfig::from_dir(p).with_context(|| {
                        format!(
                            "{}: no config.json there and not a shape this model knows (pass --model-config)",
                            p.display()
                        )
                    }),
                },
            }
        };
        let student = shape(Path::new(&j.model.path))?;
        let teacher = match &j.teacher {
            Some(t) if j.objective.kind == crate::config::ObjectiveKind::Opd => Some(shape(Path::new(&t.path))?),
            _ => None,
        };
        let w = Workload {
            gpus: 8,
            sequences: j.rollout.prompts_per_step * j.rollout.samples_per_prompt,
            prompt: 256,
            response: j.rollout.max_new_tokens.min(4096),
        };
        // The KV cache's bytes per token as the recipe keeps it (the NVFP4 config keeps it
        // in BF16: `keep_bf16 = ["attention", "kv"]`).
        let spec = j.engine.spec(student.num_layers).with_context(|| format!("{}: [engine]", c.display()))?;
        let kv_tok = spec.recipe.kv_bytes_per_token(student.kv_dim(), 2) as f64;
        let ew = EngineWeights::of(&student, &spec.recipe.layers);
        let rows = phases(&student, teacher.as_ref(), &j.engine.recipe, ew, kv_tok, g, w);
        println!(
            "\n{} ({:.2}B parameters, engine {}): {} sequences, assumed {} prompt + {} response tokens each",
            c.display(),
            student.num_params() as f64 / 1e9,
            j.engine.recipe,
            w.sequences,
            w.prompt,
            w.response
        );
        println!("| phase | TFLOP | GB | bound | ms | note |\n|---|---|---|---|---|---|");
        let mut total = 0.0;
        for r in &rows {
            total += r.seconds;
            println!(
                "| {} | {:.1} | {:.2} | {} | {:.1} | {} |",
                r.phase,
                r.flops / 1e12,
                r.bytes / 1e9,
                r.bound,
                r.seconds * 1e3,
                r.note
            );
        }
        println!(
            "| step | | | | {:.1} | {:.0} updates/hour if nothing overlaps |",
            total * 1e3,
            3600.0 / total.max(1e-12)
        );
        super::node_ledger::print_memory(&j, &student, teacher.as_ref(), w.gpus, g)?;
        if let Some(top) = ledger {
            super::node_ledger::print(&j, &student, teacher.as_ref(), w, g, &rows, top)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model's rows against hand arithmetic for a 7B-shaped student on 8 H200s.
    #[test]
    fn the_rows_follow_the_roofline_arithmetic() {
        let s = known_shape(Path::new("models/DeepSeek-R1-Distill-Qwen-7B")).unwrap();
        let n = s.num_params() as f64;
        // Qwen2.5-7B: 7.62B parameters.
        assert!((n / 1e9 - 7.62).abs() < 0.01, "{n}");
        let w = Workload { gpus: 8, sequences: 64, prompt: 256, response: 4096 };
        let kv_tok = 2.0 * 28.0 * 512.0 * 2.0;
        // A BF16 engine streams every parameter but the (untied) embedding table's.
        let ew = EngineWeights::of(&s, &[]);
        let embed = 152064.0 * 3584.0;
        assert_eq!((ew.step, ew.quantized, ew.codes), (2.0 * (n - embed), 0.0, 0.0));
        let rows = phases(&s, Some(&s), "bf16", ew, kv_tok, H200, w);
        let get = |p: &str| rows.iter().find(|r| r.phase == p).unwrap();
        // Training: 6·N·T FLOPs at 989 TFLOP/s, T = 8 × (256 + 4096).
        let t = get("train");
        let want = 6.0 * n * 8.0 * 4352.0 / 989e12;
        assert!((t.seconds - want).abs() <= 1e-12 + 1e-9 * want && t.bound == "compute");
        // Collectives: 7/8 of 6 bytes per parameter at 450 GB/s.
        let c = get("collectives");
        let want = 7.0 / 8.0 * 6.0 * n / 450e9;
        assert!((c.seconds - want).abs() <= 1e-12 + 1e-9 * want, "{} vs {want}", c.seconds);
        // Decode at batch 8 is memory-bound: weights (2 B each) once per step plus the KV.
        let d = get("rollout: decode");
        assert_eq!(d.bound, "memory");
        let want = (2.0 * (n - embed) * 4096.0 + 8.0 * kv_tok * (4096.0 * 256.0 + 4096.0 * 4097.0 / 2.0)) / 4.8e12;
        assert!((d.seconds - want).abs() <= 1e-9 * want, "{} vs {want}", d.seconds);
        // The BF16 engine reads the trainer's weights in place: no resync work.
        assert_eq!(get("resync").seconds, 0.0);
        // NVFP4 on Hopper: half a byte per weight (plus scales), at the BF16 rate.
        let q = phases(&s, None, "nvfp4", ew, kv_tok / 2.0, H200, w);
        assert!(q.iter().all(|r| r.phase != "teacher"));
        assert!(gpu("a100").is_err());
    }

    /// The NVFP4 config's engine (Qwen3-4B, tied head, `keep_bf16 = ["attention", "kv"]`):
    /// attention and the LM head stream 2 B a value, the MLP's linears 0.5625 B; a resync reads
    /// the MLP's BF16 values and writes their codes.
    #[test]
    fn engine_weights_follow_the_recipe() {
        use crate::quant::recipe::{KvScale, Recipe};
        let s = known_shape(Path::new("models/Qwen3-4B-Base")).unwrap();
        let keep = ["attention".to_string(), "kv".to_string()];
        let r = Recipe::preset("nvfp4", 36, &keep, KvScale::Calibrated, Default::default()).unwrap();
        let ew = EngineWeights::of(&s, &r.layers);
        let (c, i, q, kv, v) = (2560.0, 9728.0, 4096.0, 1024.0, 151936.0);
        let attn = 2.0 * (q * c + 2.0 * kv * c + c * q);
        let mlp = 3.0 * c * i;
        // Per layer: two norms of C and the q/k norms of head_dim 128, in BF16.
        let norms = 2.0 * (2.0 * c + 2.0 * 128.0);
        let want = 36.0 * (attn + 0.5625 * mlp + norms) + 2.0 * (v * c + c);
        assert!((ew.step - want).abs() <= 1e-9 * want, "{} vs {want}", ew.step);
        assert_eq!((ew.quantized, ew.codes), (36.0 * mlp, 36.0 * 0.5625 * mlp));
        let w = Workload { gpus: 8, sequences: 256, prompt: 256, response: 4096 };
        let rows = phases(&s, None, "nvfp4", ew, 2.0 * 36.0 * 1024.0 * 2.0, H200, w);
        let resync = rows.iter().find(|r| r.phase == "resync").unwrap();
        assert_eq!(resync.bytes, 2.0 * 36.0 * mlp + 36.0 * 0.5625 * mlp);
        assert!(gpu("a100").is_err());
    }
}
