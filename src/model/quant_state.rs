//! A low-precision engine's quantized view of the weights: per layer, the quantized linears
//! (buffers allocated once) and how each linear's input is quantized; the FP8 KV scales.
//! `sync` rewrites every buffer in place from the trainer's weights (the in-place resync).

use super::calib::{input_slot, Calibration};
use crate::device::Device;
use crate::model::{ModelConfig, ModelWeights};
use crate::ops::linear::cuda_lowp::Kept;
use crate::ops::quantize::ActQuant;
use crate::quant::qtensor::{QFormat, QTensor};
use crate::quant::recipe::{KvScale, Precision, Recipe};
use anyhow::{bail, Context, Result};

/// One layer's low-precision linears: `w[i]` replaces the dense weight of linear i when set;
/// `act[i]` says how its input is quantized. Order: `recipe::LINEARS`.
#[derive(Debug)]
pub struct QLayer {
    pub w: [Option<QTensor>; 7],
    pub act: [ActQuant; 7],
    pub k_scale: f32,
    pub v_scale: f32,
}

#[derive(Debug)]
pub struct QuantState {
    pub recipe: Recipe,
    pub layers: Vec<QLayer>,
    pub syncs: u64,
    /// HF names of the quantized weights, per layer and linear (for error messages; built once
    /// so that a sync allocates nothing).
    names: Vec<[String; 7]>,
}

/// The dense weight of linear i of a layer.
fn dense(l: &crate::model::weights::LayerWeights, i: usize) -> &crate::device::Tensor {
    [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj][i]
}

/// The HF names of every layer's seven linears (for error messages; built once).
pub fn linear_names(cfg: &ModelConfig) -> Vec<[String; 7]> {
    (0..cfg.num_layers)
        .map(|l| {
            std::array::from_fn(|i| {
                let block = if i < 4 { "self_attn" } else { "mlp" };
                format!("model.layers.{l}.{block}.{}.weight", crate::quant::recipe::LINEARS[i])
            })
        })
        .collect()
}

/// Every quantized weight with its dense source in `w` and its name, in layer and linear order.
fn targets<'a>(
    layers: &'a mut [QLayer],
    w: &'a ModelWeights,
    names: &'a [[String; 7]],
) -> impl Iterator<Item = (&'a crate::device::Tensor, &'a mut QTensor, &'a str)> {
    layers.iter_mut().zip(&w.layers).zip(names).flat_map(|((ql, lw), names)| {
        ql.w.iter_mut().enumerate().filter_map(move |(i, q)| q.as_mut().map(|q| (dense(lw, i), q, names[i].as_str())))
    })
}

impl QuantState {
    /// Allocates every buffer the recipe needs; input and KV scales come from `calib`.
    pub fn new(
        dev: &Device,
        recipe: &Recipe,
        cfg: &ModelConfig,
        w: &ModelWeights,
        calib: Option<&Calibration>,
    ) -> Result<QuantState> {
        if recipe.layers.len() != cfg.num_layers {
            bail!("recipe has {} layers, the model {}", recipe.layers.len(), cfg.num_layers);
        }
        if recipe.needs_calibration() && calib.is_none() {
            bail!("recipe '{}' needs calibrated scales", recipe.name);
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, lr) in recipe.layers.iter().enumerate() {
            let mut wq: [Option<QTensor>; 7] = Default::default();
            let mut act = [ActQuant::None; 7];
            for i in 0..7 {
                let t = dense(&w.layers[l], i);
                let (rows, k) = (t.dim(0), t.dim(1));
                wq[i] = match lr.weight[i] {
                    Precision::Native => None,
                    Precision::Fp8 => Some(QTensor::alloc_on(dev, QFormat::Fp8, rows, k, recipe.nvfp4)?),
                    Precision::Nvfp4 => Some(
                        QTensor::alloc_on(dev, QFormat::Nvfp4, rows, k, recipe.nvfp4)
                            .with_context(|| format!("layer {l} {}", crate::quant::recipe::LINEARS[i]))?,
                    ),
                };
                // Where its GEMM is emulated (NVFP4 on Hopper, shapes the mma kernel does not
                // take) the weight is decoded once per version, not at every decode step
                // (`QTensor::decoded`); where it is CUTLASS's
                // block-scaled kernel (NVFP4 on sm_100), its scales are tiled once per version.
                // Only where the input is quantized alike (the W8A8 / W4A4 GEMM): a weight-only
                // linear decodes its weight per call (`linear_q`), keeping its memory small.
                if let Some(q) = wq[i].as_mut().filter(|_| lr.input[i] == lr.weight[i]) {
                    match Kept::on(dev, q.format, rows, k) {
                        Some(Kept::Decoded) => q.keep_decoded(dev)?,
                        Some(Kept::Swizzled) => q.keep_swizzled(dev, Kept::Swizzled.bytes(rows, k))?,
                        None => {}
                    }
                }
                let amax = calib.map(|c| c.input_amax[l][input_slot(i)]).unwrap_or(0.0);
                act[i] = match lr.input[i] {
                    Precision::Native => ActQuant::None,
                    Precision::Fp8 => ActQuant::Fp8 { scale: if amax > 0.0 { amax / 448.0 } else { 1.0 } },
                    Precision::Nvfp4 => {
                        if k % 16 != 0 {
                            bail!(
                                "layer {l} {}: NVFP4 inputs need K divisible by 16, got {k}",
                                crate::quant::recipe::LINEARS[i]
                            );
                        }
                        ActQuant::Nvfp4 { global: crate::quant::nvfp4::global_scale(amax), opts: recipe.nvfp4 }
                    }
                };
            }
            let (k_scale, v_scale) = match (lr.kv_fp8(), recipe.kv_scale, calib) {
                (false, _, _) => (1.0, 1.0),
                (true, KvScale::Fixed(s), _) => (s, s),
                (true, KvScale::Calibrated, Some(c)) => (scale_of(c.k_amax[l]), scale_of(c.v_amax[l])),
                (true, KvScale::Calibrated, None) => bail!("recipe '{}' needs calibrated KV scales", recipe.name),
            };
            layers.push(QLayer { w: wq, act, k_scale, v_scale });
        }
        let names = linear_names(cfg);
        Ok(QuantState { recipe: recipe.clone(), layers, syncs: 0, names })
    }

    /// A state from imported parts (a ModelOpt directory).
    pub fn from_parts(recipe: Recipe, layers: Vec<QLayer>, cfg: &ModelConfig) -> QuantState {
        let names = linear_names(cfg);
        QuantState { recipe, layers, syncs: 0, names }
    }

    /// Re-quantizes every quantized weight in place from `w` (fused amax + quantize).
    pub fn sync(&mut self, dev: &Device, w: &ModelWeights) -> Result<()> {
        let targets = targets(&mut self.layers, w, &self.names);
        if dev.is_cpu() {
            // Tensor by tensor, allocating nothing.
            for (src, q, name) in targets {
                crate::ops::quantize::requantize(dev, src, q, name)?;
            }
        } else {
            // One queue of kernels and one read-back of the scales for the whole model.
            let mut items: Vec<_> = targets.collect();
            crate::ops::quantize::requantize_all(dev, &mut items)?;
        }
        self.syncs += 1;
        Ok(())
    }

    /// [`Self::sync`] on CUDA with each parameter's amax of `w` already on the device (`amax`:
    /// f32 bits in parameter order, what the device optimizer reduced while it wrote `w`): one
    /// encode kernel per quantized weight, no amax pass.
    pub fn sync_known(&mut self, dev: &Device, w: &ModelWeights, amax: &crate::device::Tensor) -> Result<()> {
        // Each quantized weight's parameter index, by identity with w's tensors.
        let index: std::collections::HashMap<usize, usize> =
            w.tensors().iter().enumerate().map(|(i, t)| (*t as *const _ as usize, i)).collect();
        let targets = targets(&mut self.layers, w, &self.names);
        let mut items: Vec<_> = targets.collect();
        let slots: Vec<Option<usize>> =
            items.iter().map(|(src, _, _)| index.get(&(*src as *const _ as usize)).copied()).collect();
        crate::ops::quantize::requantize_all_known(dev, &mut items, amax, &slots)?;
        self.syncs += 1;
        Ok(())
    }

    /// The names of the quantized weights whose buffers differ from a fresh quantization of
    /// `w` (the tensor scale and `rows` sampled rows each, bit for bit: see
    /// [`QTensor::matches_fresh`]).
    pub fn stale_tensors(&self, w: &ModelWeights, rows: usize) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for ((ql, lw), names) in self.layers.iter().zip(&w.layers).zip(&self.names) {
            for (i, q) in ql.w.iter().enumerate() {
                let Some(q) = q else { continue };
                let src = dense(lw, i);
                let sample = sample_rows(q.rows, rows);
                let same = if src.storage().is_cpu() {
                    q.matches_fresh(crate::device::CpuFloats::of(src)?, &names[i], &sample)?
                } else {
                    let v = src.to_f32_vec()?;
                    q.matches_fresh(crate::device::CpuFloats::F32(&v), &names[i], &sample)?
                };
                if !same {
                    out.push(names[i].clone());
                }
            }
        }
        Ok(out)
    }

    /// Bytes of the quantized weight buffers.
    pub fn size_bytes(&self) -> usize {
        self.layers.iter().flat_map(|l| l.w.iter().flatten()).map(|q| q.size_bytes()).sum()
    }
}

/// `m` rows of `n` spread evenly from the first to the last (all of them when m >= n).
pub fn sample_rows(n: usize, m: usize) -> Vec<usize> {
    if m >= n {
        return (0..n).collect();
    }
    match m {
        0 => Vec::new(),
        1 => vec![0],
        _ => (0..m).map(|i| i * (n - 1) / (m - 1)).collect(),
    }
}

/// FP8 scale of a calibrated amax (amax / 448; 1 when nothing was observed).
pub fn scale_of(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / 448.0
    } else {
        1.0
    }
}
