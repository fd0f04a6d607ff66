//! The offline admission check (seed 000 §3.3, Eqs. 5–6, App. C.2–C.3): a candidate engine
//! samples a few responses with the untrained student; the standard engine re-scores the same
//! tokens with the same weights; D̂ is the token-pooled mean of log q_c − log q_0 with a bootstrap
//! interval over prompts, and admit(c) = 1[α·D̂ < L]. `--per-layer` attributes D̂ to layers, to the
//! first layer's KV cache (share (A−B)/(A−F)) and to its keys vs values.

use super::budget::{self, Estimate};
use crate::data::dataset::PromptItem;
use crate::device::Device;
use crate::engine::rollout_weights::{EngineSpec, RolloutWeights};
use crate::engine::{Engine, EngineConfig, Request, SamplingConfig};
use crate::model::calib::Calibration;
use crate::model::{ModelConfig, ModelWeights, TextTools};
use crate::quant::recipe::{KvScale, Override, Precision, Recipe};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct Settings {
    pub samples: u32,
    pub seed: u64,
    pub temperature: f32,
    pub max_new_tokens: usize,
    pub alpha: f64,
    pub line: f64,
    pub reps: usize,
}

/// A named candidate engine.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub name: String,
    pub spec: EngineSpec,
}

/// Parses `RECIPE[+KEEP...][@KV_SCALE]` (e.g. `fp8+first-layer+last-layer`, `fp8-kv@1`,
/// `nvfp4+first-layer-kv`, `bf16`) or `noise=SIGMA`.
pub fn parse_candidate(s: &str, num_layers: usize, noise_seed: u64) -> Result<Candidate> {
    if let Some(sig) = s.strip_prefix("noise=") {
        let sigma: f64 = sig.parse().map_err(|_| anyhow::anyhow!("candidate '{s}': noise=SIGMA needs a number"))?;
        if !(sigma > 0.0 && sigma.is_finite()) {
            bail!("candidate '{s}': noise=SIGMA needs a positive finite sigma, got {sig}");
        }
        let recipe = Recipe::preset("bf16", num_layers, &[], KvScale::Calibrated, Default::default())?;
        return Ok(Candidate {
            name: s.to_string(),
            spec: EngineSpec { recipe, noise_sigma: sigma, noise_seed, staleness: 0 },
        });
    }
    let (body, scale) = match s.split_once('@') {
        Some((b, sc)) => {
            let v: f32 =
                sc.parse().map_err(|_| anyhow::anyhow!("candidate '{s}': @KV_SCALE needs a number, got '{sc}'"))?;
            // A KV scale divides the cached values: 0, negative, NaN or ∞ give a garbage cache.
            if !(v > 0.0 && v.is_finite()) {
                bail!("candidate '{s}': @KV_SCALE must be a positive finite number, got {sc}");
            }
            (b, KvScale::Fixed(v))
        }
        None => (s, KvScale::Calibrated),
    };
    let mut parts = body.split('+');
    let recipe_name = parts.next().unwrap_or_default();
    let keep: Vec<String> = parts.map(str::to_string).collect();
    let recipe = Recipe::preset(recipe_name, num_layers, &keep, scale, Default::default())
        .with_context(|| format!("candidate '{s}'"))?;
    Ok(Candidate { name: s.to_string(), spec: EngineSpec { recipe, noise_sigma: 0.0, noise_seed, staleness: 0 } })
}

/// Everything the check needs about the student.
pub struct Student<'a> {
    pub dev: &'a Device,
    pub cfg: &'a ModelConfig,
    pub w: &'a ModelWeights,
    pub text: Option<Arc<TextTools>>,
    pub calib: Option<&'a Calibration>,
}

/// D̂ of one engine spec against the standard engine on `prompts`.
pub fn estimate(st: &Student, spec: &EngineSpec, prompts: &[PromptItem], s: &Settings) -> Result<Estimate> {
    if prompts.is_empty() || s.samples == 0 || s.reps == 0 {
        bail!("the admission check needs at least one prompt, one sample and one bootstrap resample (got {} prompts, {} samples, {} resamples)", prompts.len(), s.samples, s.reps);
    }
    let rw = RolloutWeights::new(st.dev, spec, st.cfg, st.w, st.calib, 0)?;
    let ec = EngineConfig { kv_fp8: spec.recipe.kv_layers(), ..Default::default() };
    let mut cand = Engine::new(st.dev, st.cfg, st.w.dtype(), &ec, st.text.clone())?;
    let sampling = Arc::new(SamplingConfig {
        temperature: s.temperature,
        max_new_tokens: s.max_new_tokens,
        seed: s.seed,
        ..Default::default()
    });
    let rollouts = crate::engine::rollout::generate(&mut cand, rw.view(st.w), prompts, s.samples, &sampling, 0, 0)?;
    let mut std_e = Engine::new(st.dev, st.cfg, st.w.dtype(), &EngineConfig::default(), None)?;
    let score = Arc::new(SamplingConfig { temperature: s.temperature, max_new_tokens: 0, ..Default::default() });
    for (i, r) in rollouts.iter().enumerate() {
        if r.response.is_empty() {
            continue;
        }
        let mut seq = r.prompt.clone();
        seq.extend_from_slice(&r.response);
        std_e.add(Request { id: i as u64, sample: 0, prompt: seq, sampling: score.clone(), prompt_logprobs: true })?;
    }
    let mut per_prompt = vec![(0.0f64, 0usize); prompts.len()];
    let index: std::collections::HashMap<u64, usize> = prompts.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
    for c in std_e.run_to_completion(st.w, |_| {})? {
        let r = &rollouts[c.id as usize];
        let q0 = &c.prompt_logprobs[r.prompt.len() - 1..];
        let x = index[&r.prompt_id];
        for (a, b) in r.sampler_logprobs.iter().zip(q0) {
            per_prompt[x].0 += (*a - *b) as f64;
            per_prompt[x].1 += 1;
        }
    }
    Ok(budget::estimate(&per_prompt, s.reps, s.seed))
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub candidate: String,
    pub estimate: Estimate,
    /// α·D̂ < L.
    pub admit: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_layer: Option<PerLayer>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PerLayer {
    /// D̂ with the candidate's recipe on one layer only (others standard).
    pub layers: Vec<f64>,
    /// App. C.2: (A − B)/(A − F): A the full candidate, B with the first layer's KV cache in the
    /// model's dtype, F the standard engine against itself.
    pub first_layer_share: Option<f64>,
    /// App. C.3: D̂ with only the first layer's keys (values) in FP8, and keys / (keys and values).
    pub first_keys: Option<f64>,
    pub first_values: Option<f64>,
    pub keys_share: Option<f64>,
}

fn only_layer(r: &Recipe, l: usize) -> Recipe {
    let mut out = r.clone();
    for (i, lr) in out.layers.iter_mut().enumerate() {
        if i != l {
            lr.weight = [Precision::Native; 7];
            lr.input = [Precision::Native; 7];
            lr.set_kv_fp8(false);
        }
    }
    out
}

/// Runs the check for every candidate (the floor, `bf16` against itself, first).
pub fn check(
    st: &Student,
    candidates: &[Candidate],
    prompts: &[PromptItem],
    s: &Settings,
    per_layer: bool,
) -> Result<(Estimate, Vec<Verdict>)> {
    let n = st.cfg.num_layers;
    let std_spec = EngineSpec {
        recipe: Recipe::preset("bf16", n, &[], KvScale::Calibrated, Default::default())?,
        noise_sigma: 0.0,
        noise_seed: 0,
        staleness: 0,
    };
    let floor = estimate(st, &std_spec, prompts, s)?;
    let mut out = Vec::new();
    for c in candidates {
        let e = estimate(st, &c.spec, prompts, s)?;
        let pl = if per_layer && !c.spec.recipe.is_standard() {
            let mut layers = Vec::with_capacity(n);
            for l in 0..n {
                let spec = EngineSpec { recipe: only_layer(&c.spec.recipe, l), ..c.spec.clone() };
                layers.push(estimate(st, &spec, prompts, s)?.d_hat);
            }
            let (mut share, mut fk, mut fv, mut ks) = (None, None, None, None);
            if c.spec.recipe.layers[0].kv_fp8() {
                let mut b = c.spec.recipe.clone();
                b.apply(&Override { layers: vec![0], kv_fp8: Some(false), ..Default::default() })?;
                let bb = estimate(st, &EngineSpec { recipe: b, ..c.spec.clone() }, prompts, s)?.d_hat;
                if e.d_hat != floor.d_hat {
                    share = Some((e.d_hat - bb) / (e.d_hat - floor.d_hat));
                }
                let side = |k: bool, v: bool| -> Result<f64> {
                    let mut r = Recipe::preset("bf16", n, &[], c.spec.recipe.kv_scale, Default::default())?;
                    r.apply(&Override { layers: vec![0], k_fp8: Some(k), v_fp8: Some(v), ..Default::default() })?;
                    Ok(estimate(st, &EngineSpec { recipe: r, noise_sigma: 0.0, ..c.spec.clone() }, prompts, s)?.d_hat)
                };
                let (k, v, kv) = (side(true, false)?, side(false, true)?, side(true, true)?);
                fk = Some(k);
                fv = Some(v);
                if kv != 0.0 {
                    ks = Some(k / kv);
                }
            }
            Some(PerLayer { layers, first_layer_share: share, first_keys: fk, first_values: fv, keys_share: ks })
        } else {
            None
        };
        out.push(Verdict {
            candidate: c.name.clone(),
            admit: budget::admit(e.d_hat, s.alpha, s.line),
            estimate: e,
            per_layer: pl,
        });
    }
    Ok((floor, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::recipe::Precision::{Fp8, Native};

    #[test]
    fn candidates_parse_to_the_recipes_they_name() {
        // fp8 on 4 layers with the first and last layers kept whole: layers 1, 2 are W8A8 with an
        // FP8 cache at the fixed scale 2; layers 0, 3 are native throughout.
        let c = parse_candidate("fp8+first-layer+last-layer@2", 4, 9).unwrap();
        assert_eq!(c.name, "fp8+first-layer+last-layer@2");
        assert_eq!(c.spec.recipe.kv_scale, KvScale::Fixed(2.0));
        assert_eq!((c.spec.noise_sigma, c.spec.noise_seed, c.spec.staleness), (0.0, 9, 0));
        let l = &c.spec.recipe.layers;
        for i in [0, 3] {
            assert!(l[i].weight == [Native; 7] && l[i].input == [Native; 7] && !l[i].kv_fp8(), "layer {i}: {:?}", l[i]);
        }
        for i in [1, 2] {
            assert!(
                l[i].weight == [Fp8; 7] && l[i].input == [Fp8; 7] && l[i].k_fp8 && l[i].v_fp8,
                "layer {i}: {:?}",
                l[i]
            );
        }
        // The FP8 cache only, first layer's cache native, calibrated scales.
        let c = parse_candidate("fp8-kv+first-layer-kv", 3, 0).unwrap();
        assert_eq!(c.spec.recipe.kv_scale, KvScale::Calibrated);
        assert_eq!(c.spec.recipe.kv_layers(), vec![(false, false), (true, true), (true, true)]);
        assert!(!c.spec.recipe.quantizes_weights());
        // Weight noise: the standard recipe plus σ.
        let c = parse_candidate("noise=0.15", 3, 5).unwrap();
        assert!(c.spec.recipe.is_standard() && c.spec.noise_sigma == 0.15 && c.spec.noise_seed == 5);
        assert!(parse_candidate("bf16", 3, 0).unwrap().spec.recipe.is_standard());
    }

    #[test]
    fn bad_candidates_name_the_candidate_and_what_was_expected() {
        for (s, want) in [
            ("fp9", "unknown recipe 'fp9'"),
            ("fp8+first", "unknown keep_bf16 entry 'first'"),
            ("fp8-kv@", "@KV_SCALE needs a number"),
            ("fp8-kv@0", "@KV_SCALE must be a positive finite number, got 0"),
            ("fp8@-0.5", "@KV_SCALE must be a positive finite number"),
            ("noise=", "noise=SIGMA needs a number"),
            ("noise=NaN", "positive finite sigma"),
            ("noise=0", "positive finite sigma, got 0"),
        ] {
            let e = format!("{:#}", parse_candidate(s, 4, 0).unwrap_err());
            assert!(e.contains(&format!("candidate '{s}'")) && e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn only_layer_keeps_one_layer_of_the_recipe() {
        // nvfp4 (W4A4 + FP8 cache) on 3 layers, layer 1 alone: layers 0 and 2 become standard.
        let r = Recipe::preset("nvfp4", 3, &[], KvScale::Fixed(1.0), Default::default()).unwrap();
        let o = only_layer(&r, 1);
        assert_eq!(o.layers[1], r.layers[1]);
        for i in [0, 2] {
            assert!(
                o.layers[i].weight == [Native; 7] && o.layers[i].input == [Native; 7] && !o.layers[i].kv_fp8(),
                "layer {i}"
            );
        }
        assert_eq!(o.kv_layers(), vec![(false, false), (true, true), (false, false)]);
        assert_eq!(o.kv_scale, KvScale::Fixed(1.0));
    }
}
