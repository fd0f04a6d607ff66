//! Rollout-engine precision recipes (seed 000 §4.2, App. C.1, Table 3): for every layer, each
//! linear's weight and input format and the KV cache's format; presets with their BF16
//! exceptions; layer overrides. The LM head and embeddings always stay in the model's dtype.
//!
//! Presets: `bf16` (the standard engine), `fp8` (Model Optimizer FP8: W8A8 + FP8 KV), `nvfp4`
//! (W4A4 + FP8 KV), `fp8-kv` (vLLM-style FP8 KV cache only). `keep_bf16` entries:
//! `first-layer-kv`, `first-layer`, `last-layer` (a whole layer: its linears and its KV),
//! `attention` (every layer's q/k/v/o projections), `kv` (every layer's KV cache).

use super::nvfp4::Nvfp4Opts;
use anyhow::{bail, Result};

/// The seven linears of a block, in this order everywhere.
pub const LINEARS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The model's own compute dtype (no quantization).
    Native,
    Fp8,
    Nvfp4,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Precision> {
        Ok(match s {
            "bf16" | "native" => Precision::Native,
            "fp8" => Precision::Fp8,
            "nvfp4" => Precision::Nvfp4,
            _ => bail!("unknown precision '{s}': expected bf16, fp8 or nvfp4"),
        })
    }
}

/// Where KV-cache scales come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvScale {
    /// amax / 448 of the calibration pass.
    Calibrated,
    /// A fixed scale (vLLM's default is 1.0).
    Fixed(f32),
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerRecipe {
    pub weight: [Precision; 7],
    pub input: [Precision; 7],
    /// FP8 keys / values in the KV cache (else the model's dtype).
    pub k_fp8: bool,
    pub v_fp8: bool,
}

impl LayerRecipe {
    fn uniform(p: Precision, kv_fp8: bool) -> LayerRecipe {
        LayerRecipe { weight: [p; 7], input: [p; 7], k_fp8: kv_fp8, v_fp8: kv_fp8 }
    }

    /// Keys or values (or both) in FP8.
    pub fn kv_fp8(&self) -> bool {
        self.k_fp8 || self.v_fp8
    }

    pub fn set_kv_fp8(&mut self, on: bool) {
        self.k_fp8 = on;
        self.v_fp8 = on;
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    pub name: String,
    pub layers: Vec<LayerRecipe>,
    pub kv_scale: KvScale,
    pub nvfp4: Nvfp4Opts,
}

/// A user override: layers (indices) and what to set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Override {
    pub layers: Vec<usize>,
    pub linears: Vec<String>,
    pub weight: Option<Precision>,
    pub input: Option<Precision>,
    /// FP8 keys and values (Some(true/false)); `k_fp8`/`v_fp8` set one side only.
    pub kv_fp8: Option<bool>,
    pub k_fp8: Option<bool>,
    pub v_fp8: Option<bool>,
}

impl Recipe {
    /// A preset for a model of `num_layers` layers.
    pub fn preset(
        name: &str,
        num_layers: usize,
        keep_bf16: &[String],
        kv_scale: KvScale,
        nvfp4: Nvfp4Opts,
    ) -> Result<Recipe> {
        let layer = match name {
            "bf16" => LayerRecipe::uniform(Precision::Native, false),
            "fp8" => LayerRecipe::uniform(Precision::Fp8, true),
            "nvfp4" => {
                LayerRecipe { weight: [Precision::Nvfp4; 7], input: [Precision::Nvfp4; 7], k_fp8: true, v_fp8: true }
            }
            "fp8-kv" => LayerRecipe::uniform(Precision::Native, true),
            _ => bail!("unknown recipe '{name}': expected bf16, fp8, nvfp4 or fp8-kv"),
        };
        let mut layers = vec![layer; num_layers];
        for k in keep_bf16 {
            match k.as_str() {
                "first-layer-kv" => {
                    if let Some(l) = layers.first_mut() {
                        l.set_kv_fp8(false);
                    }
                }
                "first-layer" => {
                    if let Some(l) = layers.first_mut() {
                        *l = LayerRecipe::uniform(Precision::Native, false);
                    }
                }
                "last-layer" => {
                    if let Some(l) = layers.last_mut() {
                        *l = LayerRecipe::uniform(Precision::Native, false);
                    }
                }
                // Every layer's attention projections (seed 004's recipe: NVFP4 on the MLP only).
                "attention" => {
                    for l in &mut layers {
                        for i in 0..4 {
                            l.weight[i] = Precision::Native;
                            l.input[i] = Precision::Native;
                        }
                    }
                }
                "kv" => layers.iter_mut().for_each(|l| l.set_kv_fp8(false)),
                other => bail!("unknown keep_bf16 entry '{other}': expected first-layer-kv, first-layer, last-layer, attention or kv"),
            }
        }
        Ok(Recipe { name: name.to_string(), layers, kv_scale, nvfp4 })
    }

    pub fn apply(&mut self, o: &Override) -> Result<()> {
        let n = self.layers.len();
        let lins: Vec<usize> = if o.linears.is_empty() {
            (0..7).collect()
        } else {
            o.linears
                .iter()
                .map(|l| {
                    LINEARS
                        .iter()
                        .position(|x| x == l)
                        .ok_or_else(|| anyhow::anyhow!("unknown linear '{l}': expected one of {LINEARS:?}"))
                })
                .collect::<Result<_>>()?
        };
        for &l in &o.layers {
            if l >= n {
                bail!("layer index {l} is out of range (the model has {n} layers, 0..={})", n - 1);
            }
            let lr = &mut self.layers[l];
            for &i in &lins {
                if let Some(p) = o.weight {
                    lr.weight[i] = p;
                }
                if let Some(p) = o.input {
                    lr.input[i] = p;
                }
            }
            if let Some(k) = o.kv_fp8 {
                lr.set_kv_fp8(k);
            }
            if let Some(k) = o.k_fp8 {
                lr.k_fp8 = k;
            }
            if let Some(v) = o.v_fp8 {
                lr.v_fp8 = v;
            }
        }
        Ok(())
    }

    /// Every layer runs in the model's own precision.
    pub fn is_standard(&self) -> bool {
        self.layers.iter().all(|l| !l.kv_fp8() && l.weight.iter().chain(&l.input).all(|p| *p == Precision::Native))
    }

    pub fn quantizes_weights(&self) -> bool {
        self.layers.iter().any(|l| l.weight.iter().any(|p| *p != Precision::Native))
    }

    /// Calibrated scales are needed (quantized inputs, or an FP8 cache with calibrated scales).
    pub fn needs_calibration(&self) -> bool {
        self.layers.iter().any(|l| {
            l.input.iter().any(|p| *p != Precision::Native) || (l.kv_fp8() && self.kv_scale == KvScale::Calibrated)
        })
    }

    /// (keys, values) in FP8, per layer: what the engine's cache stores.
    pub fn kv_layers(&self) -> Vec<(bool, bool)> {
        self.layers.iter().map(|l| (l.k_fp8, l.v_fp8)).collect()
    }

    /// KV-cache bytes per token with `native_bytes` per element for unquantized layers.
    pub fn kv_bytes_per_token(&self, kv_dim: usize, native_bytes: usize) -> usize {
        self.layers
            .iter()
            .map(|l| kv_dim * ((if l.k_fp8 { 1 } else { native_bytes }) + if l.v_fp8 { 1 } else { native_bytes }))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlp_only_nvfp4() {
        let r = Recipe::preset("nvfp4", 3, &["attention".into(), "kv".into()], KvScale::Calibrated, Default::default())
            .unwrap();
        for l in &r.layers {
            assert_eq!(&l.weight[..4], &[Precision::Native; 4]);
            assert_eq!(&l.weight[4..], &[Precision::Nvfp4; 3]);
            assert_eq!(&l.input[4..], &[Precision::Nvfp4; 3]);
            assert!(!l.kv_fp8());
        }
        assert!(r.quantizes_weights() && r.kv_layers().iter().all(|&(k, v)| !k && !v));
    }

    #[test]
    fn presets_and_exceptions() {
        let r = Recipe::preset(
            "fp8",
            4,
            &["first-layer".into(), "last-layer".into()],
            KvScale::Calibrated,
            Default::default(),
        )
        .unwrap();
        assert_eq!(r.layers[0], LayerRecipe::uniform(Precision::Native, false));
        assert_eq!(r.layers[3], LayerRecipe::uniform(Precision::Native, false));
        assert_eq!(r.layers[1].weight, [Precision::Fp8; 7]);
        assert!(r.layers[2].kv_fp8());
        let r =
            Recipe::preset("fp8-kv", 3, &["first-layer-kv".into()], KvScale::Fixed(1.0), Default::default()).unwrap();
        assert!(!r.layers[0].kv_fp8() && r.layers[1].kv_fp8() && !r.quantizes_weights() && !r.needs_calibration());
        // FP8 KV in bf16 bytes: 2 layers × 1 byte + 1 layer × 2 bytes, keys and values.
        assert_eq!(r.kv_bytes_per_token(8, 2), 2 * 8 * (2 + 1 + 1));
        assert!(Recipe::preset("bf16", 2, &[], KvScale::Calibrated, Default::default()).unwrap().is_standard());
        assert!(Recipe::preset("int4", 2, &[], KvScale::Calibrated, Default::default())
            .unwrap_err()
            .to_string()
            .contains("unknown recipe 'int4'"));
        let mut r = Recipe::preset("nvfp4", 2, &[], KvScale::Calibrated, Default::default()).unwrap();
        let e = r.apply(&Override { layers: vec![2], ..Default::default() }).unwrap_err().to_string();
        assert!(e.contains("layer index 2 is out of range"), "{e}");
        r.apply(&Override {
            layers: vec![1],
            linears: vec!["down_proj".into()],
            weight: Some(Precision::Fp8),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.layers[1].weight[6], Precision::Fp8);
        assert_eq!(r.layers[1].weight[5], Precision::Nvfp4);
    }
}
