//! The ModelOpt checkpoint layout that vLLM and TensorRT-LLM load (REFERENCES.md): export of a
//! low-precision engine's weights, and import of such a directory as a rollout engine.
//! Per quantized linear `P`: FP8 → `P.weight` F8_E4M3 (N, K), `P.weight_scale` F32 scalar
//! (amax/448), `P.input_scale` F32 scalar; NVFP4 → `P.weight` U8 (N, K/2) packed E2M1,
//! `P.weight_scale` F8_E4M3 (N, K/16), `P.weight_scale_2` F32 scalar (amax/2688),
//! `P.input_scale` F32 scalar (activation amax/2688). FP8 KV: `…k_proj.k_scale`,
//! `…v_proj.v_scale`. Excluded layers stay in the model dtype. `hf_quant_config.json` and the
//! `quantization_config` block of config.json describe it.

use super::weights::{param_specs, write_safetensors, OwnedView, SafetensorsFiles};
use super::{ModelConfig, ModelWeights};
use crate::device::{DType, Device, Tensor};
use crate::model::{QLayer, QuantState};
use crate::ops::quantize::ActQuant;
use crate::quant::qtensor::{QFormat, QTensor};
use crate::quant::recipe::{Precision, Recipe, LINEARS};
use anyhow::{bail, Context, Result};
use safetensors::Dtype as St;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

fn prefix(l: usize, i: usize) -> String {
    format!("model.layers.{l}.{}.{}", if i < 4 { "self_attn" } else { "mlp" }, LINEARS[i])
}

fn scalar(v: f32) -> OwnedView {
    OwnedView { dtype: St::F32, shape: vec![], bytes: v.to_le_bytes().to_vec() }
}

/// Writes `w` quantized by `q` (recipe, calibrated input/KV scales) in the ModelOpt layout.
pub fn export(dir: &Path, cfg: &ModelConfig, w: &ModelWeights, q: &QuantState, dtype: DType) -> Result<()> {
    let algo = if q.recipe.quantizes_weights() {
        if q.recipe.layers.iter().any(|l| l.weight.contains(&Precision::Nvfp4)) {
            "NVFP4"
        } else {
            "FP8"
        }
    } else {
        bail!("recipe '{}' quantizes no weights: nothing to export in the ModelOpt layout", q.recipe.name)
    };
    let specs = param_specs(cfg);
    let mut skip = std::collections::HashSet::new();
    let mut views = Vec::new();
    let mut exclude = vec!["lm_head".to_string()];
    for (l, (ql, lr)) in q.layers.iter().zip(&q.recipe.layers).enumerate() {
        for i in 0..7 {
            let p = prefix(l, i);
            match &ql.w[i] {
                Some(qt) => {
                    skip.insert(format!("{p}.weight"));
                    match qt.format {
                        QFormat::Fp8 => {
                            views.push((
                                format!("{p}.weight"),
                                OwnedView {
                                    dtype: St::F8_E4M3,
                                    shape: vec![qt.rows, qt.k],
                                    bytes: qt.codes_bytes()?.to_vec(),
                                },
                            ));
                            views.push((format!("{p}.weight_scale"), scalar(qt.scale)));
                        }
                        QFormat::Nvfp4 => {
                            views.push((
                                format!("{p}.weight"),
                                OwnedView {
                                    dtype: St::U8,
                                    shape: vec![qt.rows, qt.k / 2],
                                    bytes: qt.codes_bytes()?.to_vec(),
                                },
                            ));
                            views.push((
                                format!("{p}.weight_scale"),
                                OwnedView {
                                    dtype: St::F8_E4M3,
                                    shape: vec![qt.rows, qt.k / 16],
                                    bytes: qt.scales_bytes()?.to_vec(),
                                },
                            ));
                            views.push((format!("{p}.weight_scale_2"), scalar(qt.scale)));
                        }
                    }
                    let input = match ql.act[i] {
                        ActQuant::Fp8 { scale } => scale,
                        ActQuant::Nvfp4 { global, .. } => global,
                        ActQuant::None => 1.0,
                    };
                    views.push((format!("{p}.input_scale"), scalar(input)));
                }
                None => exclude.push(p),
            }
        }
        if lr.kv_fp8() {
            views.push((format!("{}.k_scale", prefix(l, 1)), scalar(ql.k_scale)));
            views.push((format!("{}.v_scale", prefix(l, 2)), scalar(ql.v_scale)));
        }
    }
    for ((name, shape), t) in specs.iter().zip(w.tensors()) {
        if skip.contains(name) {
            continue;
        }
        let vals = t.to_f32_vec()?;
        let (st, bytes) = match dtype {
            DType::F32 => (St::F32, vals.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
            _ => (St::BF16, vals.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()),
        };
        views.push((name.clone(), OwnedView { dtype: st, shape: shape.clone(), bytes }));
    }
    write_safetensors(&dir.join("model.safetensors"), views, None)?;
    let kv_algo = if q.recipe.layers.iter().any(|l| l.kv_fp8()) { json!("FP8") } else { Value::Null };
    let mut quant = json!({"quant_algo": algo, "kv_cache_quant_algo": kv_algo, "exclude_modules": exclude});
    if algo == "NVFP4" {
        quant["group_size"] = json!(16);
    }
    let hf_quant = json!({"producer": {"name": "modelopt", "version": "colotrain-export"}, "quantization": quant});
    crate::util::write_atomic(&dir.join("hf_quant_config.json"), serde_json::to_string_pretty(&hf_quant)?.as_bytes())?;
    let mut c = cfg.to_hf_json(if dtype == DType::F32 { "float32" } else { "bfloat16" });
    let mut qc = quant.clone();
    qc["quant_method"] = json!("modelopt");
    qc["producer"] = hf_quant["producer"].clone();
    c["quantization_config"] = qc;
    crate::util::write_atomic(&dir.join("config.json"), serde_json::to_string_pretty(&c)?.as_bytes())?;
    Ok(())
}

/// A ModelOpt directory's quantization: `Some` when `hf_quant_config.json` (or a
/// `quantization_config` with quant_method "modelopt") is present.
pub fn detect(dir: &Path) -> Result<Option<Value>> {
    let p = dir.join("hf_quant_config.json");
    if p.exists() {
        let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", p.display()))?;
        return Ok(Some(
            v.get("quantization").cloned().with_context(|| format!("{}: missing 'quantization'", p.display()))?,
        ));
    }
    let c = dir.join("config.json");
    if let Ok(text) = std::fs::read_to_string(&c) {
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            if let Some(qc) = v
                .get("quantization_config")
                .filter(|q| q.get("quant_method").and_then(|m| m.as_str()) == Some("modelopt"))
            {
                return Ok(Some(qc.clone()));
            }
        }
    }
    Ok(None)
}

fn f32_scalar(files: &SafetensorsFiles, name: &str) -> Result<f32> {
    let (p, v) = files.get(name)?;
    if v.dtype() != St::F32 || v.data().len() != 4 {
        bail!("{}: '{name}' must be an F32 scalar", p.display());
    }
    let b = v.data();
    Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Loads a ModelOpt directory: dense weights (quantized linears dequantized, for the trainer side
/// and for excluded layers) and the engine's quantized view built from the stored codes.
pub fn load(
    dir: &Path,
    cfg: &ModelConfig,
    dev: &Device,
    dtype: DType,
    quant: &Value,
) -> Result<(ModelWeights, QuantState)> {
    let files = SafetensorsFiles::open(dir)?;
    let algo = quant.get("quant_algo").and_then(|a| a.as_str()).unwrap_or("");
    let fmt = match algo {
        "FP8" => QFormat::Fp8,
        "NVFP4" => QFormat::Nvfp4,
        other => bail!("{}: quant_algo '{other}' is not supported (FP8 or NVFP4)", dir.display()),
    };
    let kv_fp8 = quant.get("kv_cache_quant_algo").and_then(|k| k.as_str()) == Some("FP8");
    let mut qlayers = Vec::with_capacity(cfg.num_layers);
    let mut recipe =
        Recipe::preset("bf16", cfg.num_layers, &[], crate::quant::recipe::KvScale::Fixed(1.0), Default::default())?;
    recipe.name = format!("modelopt-{}", algo.to_lowercase());
    let mut dense: HashMap<String, Tensor> = HashMap::new();
    for l in 0..cfg.num_layers {
        let mut ql = QLayer { w: Default::default(), act: [ActQuant::None; 7], k_scale: 1.0, v_scale: 1.0 };
        for i in 0..7 {
            let p = prefix(l, i);
            let has_scale = files.names().any(|n| *n == format!("{p}.weight_scale"));
            if !has_scale {
                continue;
            }
            let (path, wv) = files.get(&format!("{p}.weight"))?;
            let (rows, k) = match (fmt, wv.shape()) {
                (QFormat::Fp8, [n, k]) => (*n, *k),
                (QFormat::Nvfp4, [n, k2]) => (*n, 2 * *k2),
                (_, s) => bail!("{}: '{p}.weight' has shape {s:?}", path.display()),
            };
            let mut qt = QTensor::alloc(fmt, rows, k, Default::default())?;
            if wv.data().len() != qt.codes.numel() {
                bail!(
                    "{}: '{p}.weight' holds {} bytes, expected {}",
                    path.display(),
                    wv.data().len(),
                    qt.codes.numel()
                );
            }
            qt.codes = Tensor::from_storage(
                &[qt.codes.numel()],
                crate::device::Storage::Cpu(crate::device::CpuStorage::U8(wv.data().to_vec())),
            );
            let input = f32_scalar(&files, &format!("{p}.input_scale"))?;
            match fmt {
                QFormat::Fp8 => {
                    qt.scale = f32_scalar(&files, &format!("{p}.weight_scale"))?;
                    ql.act[i] = ActQuant::Fp8 { scale: input };
                    recipe.layers[l].weight[i] = Precision::Fp8;
                    recipe.layers[l].input[i] = Precision::Fp8;
                }
                QFormat::Nvfp4 => {
                    let (sp, sv) = files.get(&format!("{p}.weight_scale"))?;
                    if sv.data().len() != qt.block_scales.numel() {
                        bail!(
                            "{}: '{p}.weight_scale' holds {} bytes, expected {}",
                            sp.display(),
                            sv.data().len(),
                            qt.block_scales.numel()
                        );
                    }
                    qt.block_scales = Tensor::from_storage(
                        &[qt.block_scales.numel()],
                        crate::device::Storage::Cpu(crate::device::CpuStorage::U8(sv.data().to_vec())),
                    );
                    qt.scale = f32_scalar(&files, &format!("{p}.weight_scale_2"))?;
                    ql.act[i] = ActQuant::Nvfp4 { global: input, opts: Default::default() };
                    recipe.layers[l].weight[i] = Precision::Nvfp4;
                    recipe.layers[l].input[i] = Precision::Nvfp4;
                }
            }
            let deq = qt.dequantize();
            dense.insert(format!("{p}.weight"), Tensor::from_f32_host(dtype, &[rows, k], &deq)?);
            ql.w[i] = Some(qt);
        }
        if kv_fp8 && files.names().any(|n| *n == format!("{}.k_scale", prefix(l, 1))) {
            ql.k_scale = f32_scalar(&files, &format!("{}.k_scale", prefix(l, 1)))?;
            ql.v_scale = f32_scalar(&files, &format!("{}.v_scale", prefix(l, 2)))?;
            recipe.layers[l].set_kv_fp8(true);
        }
        qlayers.push(ql);
    }
    let mut tensors = Vec::new();
    for (name, shape) in param_specs(cfg) {
        let t = match dense.remove(&name) {
            Some(t) => t,
            None => super::weights::load_one(&files, &name, &shape, dtype)?,
        };
        tensors.push(dev.upload(t)?);
    }
    let w = ModelWeights::from_ordered(cfg, tensors)?;
    Ok((w, QuantState::from_parts(recipe, qlayers, cfg)))
}
