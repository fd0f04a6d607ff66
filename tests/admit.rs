//! The offline admission check (`colotrain admit`, seed 000 Eqs. 5–6, App. C.2–C.3) on the
//! built-in tiny student: D̂ against an independent re-scoring of the same tokens by a plain
//! forward pass, the standard engine's floor, the bootstrap over prompts, the per-layer
//! attribution ((A−B)/(A−F) and keys vs values) against hand-built recipes, the verdict
//! α·D̂ < L through the binary, and the errors for bad candidates and flags.

mod common;

use colotrain::config::JobConfig;
use colotrain::data::dataset::{Dataset, PromptItem};
use colotrain::device::{DType, Device};
use colotrain::engine::rollout;
use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
use colotrain::engine::{Engine, EngineConfig, SamplingConfig};
use colotrain::mismatch::admit::{self, Settings, Student};
use colotrain::mismatch::budget;
use colotrain::model::LoadedModel;
use colotrain::quant::recipe::{KvScale, Recipe};
use common::{full_logits, TempDir};
use serde_json::Value;
use std::process::Command;
use std::sync::Arc;

const TINY: &str = include_str!("../configs/tiny-opd.toml");

/// |a − b| ≤ atol + rtol·|reference|.
fn close(a: f64, reference: f64, atol: f64, rtol: f64) -> bool {
    (a - reference).abs() <= atol + rtol * reference.abs()
}

/// The tiny student (f32, CPU) and the first `n` held-out arithmetic prompts.
fn student(n: usize) -> (Device, LoadedModel, Vec<PromptItem>) {
    let job = JobConfig::from_toml(TINY, "tiny-opd.toml").unwrap();
    let dev = Device::cpu(1).unwrap();
    let dir = colotrain::orchestrator::tiny::resolve(&job.model.path).unwrap();
    let lm = LoadedModel::load(&dir, &dev, DType::F32).unwrap();
    let data = Dataset::open(&job.data.train, lm.text.clone(), job.data.chat, lm.cfg.vocab_size, job.run.seed).unwrap();
    let prompts = data.heldout(n).unwrap();
    assert_eq!(prompts.len(), n);
    (dev, lm, prompts)
}

fn settings(temperature: f32, reps: usize) -> Settings {
    Settings { samples: 2, seed: 777, temperature, max_new_tokens: 16, alpha: 1.5, line: 0.184, reps }
}

/// Per prompt: (Σ_t [log q_c(y_t) − log q_0(y_t)], tokens), with q_c the candidate engine's
/// reported sampling log-probs and q_0 = log_softmax(z / T) recomputed here in f64 from the
/// logits of a plain forward pass (no engine, no quantized cache) over prompt + response.
fn reference_per_prompt(
    dev: &Device,
    lm: &LoadedModel,
    spec: &EngineSpec,
    prompts: &[PromptItem],
    s: &Settings,
) -> Vec<(f64, usize)> {
    // The candidate's samples: same engine spec, same seed, so the same tokens as the check's.
    let rw = RolloutWeights::new(dev, spec, &lm.cfg, &lm.weights, None, 0).unwrap();
    let ec = EngineConfig { kv_fp8: spec.recipe.kv_layers(), ..Default::default() };
    let mut eng = Engine::new(dev, &lm.cfg, lm.weights.dtype(), &ec, lm.text.clone()).unwrap();
    let sampling = Arc::new(SamplingConfig {
        temperature: s.temperature,
        max_new_tokens: s.max_new_tokens,
        seed: s.seed,
        ..Default::default()
    });
    let rollouts = rollout::generate(&mut eng, rw.view(&lm.weights), prompts, s.samples, &sampling, 0, 0).unwrap();
    assert_eq!(rollouts.len(), prompts.len() * s.samples as usize);
    let v = lm.cfg.vocab_size;
    let t = s.temperature as f64;
    let mut out = vec![(0.0f64, 0usize); prompts.len()];
    for r in &rollouts {
        let x = prompts.iter().position(|p| p.id == r.prompt_id).unwrap();
        assert_eq!(r.response.len(), r.sampler_logprobs.len());
        if r.response.is_empty() {
            continue;
        }
        let mut seq = r.prompt.clone();
        seq.extend_from_slice(&r.response);
        let z = full_logits(dev, lm, &seq, 64);
        for (i, (&y, &lq)) in r.response.iter().zip(&r.sampler_logprobs).enumerate() {
            // Token y = seq[p + i] is predicted by the row of position p + i − 1.
            let row = &z[(r.prompt.len() - 1 + i) * v..(r.prompt.len() + i) * v];
            let m = row.iter().map(|&a| a as f64 / t).fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|&a| (a as f64 / t - m).exp()).sum::<f64>().ln();
            let lp0 = row[y as usize] as f64 / t - lse;
            out[x].0 += lq as f64 - lp0;
            out[x].1 += 1;
        }
    }
    out
}

fn fixed_kv_recipe(n: usize, set: impl Fn(&mut Recipe)) -> EngineSpec {
    let mut recipe = Recipe::preset("bf16", n, &[], KvScale::Fixed(1.0), Default::default()).unwrap();
    set(&mut recipe);
    EngineSpec { recipe, noise_sigma: 0.0, noise_seed: 0, staleness: 0 }
}

#[test]
fn d_hat_matches_an_independent_rescoring_and_the_bootstrap_is_over_prompts() {
    let (dev, lm, prompts) = student(4);
    // T = 0.8 so that a scorer ignoring the temperature would disagree with the reference.
    let s = settings(0.8, 400);
    let st = Student { dev: &dev, cfg: &lm.cfg, w: &lm.weights, text: lm.text.clone(), calib: None };
    for name in ["bf16", "fp8-kv@1"] {
        let c = admit::parse_candidate(name, lm.cfg.num_layers, 0).unwrap();
        let e = admit::estimate(&st, &c.spec, &prompts, &s).unwrap();
        let per = reference_per_prompt(&dev, &lm, &c.spec, &prompts, &s);
        // Eq. 5: D̂ = (1/M) Σ_t [log q_c − log q_0], M = all sampled tokens pooled.
        let (sum, m) = per.iter().fold((0.0, 0usize), |(a, b), p| (a + p.0, b + p.1));
        assert!(m > 0 && m <= 4 * 2 * 16, "{m} tokens");
        assert_eq!(e.tokens, m, "{name}: token count");
        let d_ref = sum / m as f64;
        // f32 log-probs on both sides: per-token rounding ~1e-6, so atol 2e-5 on the mean.
        assert!(close(e.d_hat, d_ref, 2e-5, 1e-3), "{name}: D-hat {} vs reference {d_ref}", e.d_hat);
        // Resampled pooled means are weighted averages of the per-prompt means.
        let means: Vec<f64> = per.iter().filter(|p| p.1 > 0).map(|p| p.0 / p.1 as f64).collect();
        let (lo, hi) = means.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(e.lo <= e.d_hat + 1e-12 && e.d_hat <= e.hi + 1e-12, "{name}: {e:?}");
        assert!(
            e.lo >= lo - 2e-5 && e.hi <= hi + 2e-5,
            "{name}: interval [{}, {}] outside per-prompt means [{lo}, {hi}]",
            e.lo,
            e.hi
        );
        // The interval is the prompt-level bootstrap (each prompt's tokens together, seed = the
        // check's seed) of the reference sums; order statistics move by at most the input error.
        let b = budget::estimate(&per, 400, 777);
        assert!(
            close(e.lo, b.lo, 2e-5, 1e-3) && close(e.hi, b.hi, 2e-5, 1e-3),
            "{name}: [{}, {}] vs [{}, {}]",
            e.lo,
            e.hi,
            b.lo,
            b.hi
        );
        if name == "bf16" {
            // The floor: the standard engine against itself differs by f32 rounding only.
            assert!(e.d_hat.abs() <= 1e-5 && e.lo.abs() <= 1e-5 && e.hi.abs() <= 1e-5, "floor {e:?}");
        } else {
            // An FP8 cache at scale 1 changes the sampling distribution: log q_c ≠ log q_0.
            let moved = per.iter().any(|p| p.0.abs() > 1e-4);
            assert!(moved, "fp8-kv@1 left every log-prob unchanged: {per:?}");
        }
    }
}

#[test]
fn per_layer_attribution_matches_hand_built_recipes() {
    let (dev, lm, prompts) = student(3);
    let n = lm.cfg.num_layers;
    assert_eq!(n, 4);
    let s = settings(1.0, 200);
    let st = Student { dev: &dev, cfg: &lm.cfg, w: &lm.weights, text: lm.text.clone(), calib: None };
    let cands = vec![
        admit::parse_candidate("fp8-kv@1", n, 0).unwrap(),
        admit::parse_candidate("fp8-kv+first-layer-kv@1", n, 0).unwrap(),
    ];
    let (floor, v) = admit::check(&st, &cands, &prompts, &s, true).unwrap();
    assert_eq!(v.len(), 2);
    let d = |spec: &EngineSpec| admit::estimate(&st, spec, &prompts, &s).unwrap().d_hat;
    // F: the standard engine against itself.
    let f = d(&fixed_kv_recipe(n, |_| {}));
    assert!(close(floor.d_hat, f, 1e-12, 0.0), "floor {} vs {f}", floor.d_hat);
    let a = &v[0];
    assert_eq!(a.candidate, "fp8-kv@1");
    let pl = a.per_layer.as_ref().expect("--per-layer gives an attribution for a quantized candidate");
    // Layer l alone: FP8 keys and values on layer l, every other layer standard.
    assert_eq!(pl.layers.len(), n);
    for l in 0..n {
        let want = d(&fixed_kv_recipe(n, |r| r.layers[l].set_kv_fp8(true)));
        assert!(close(pl.layers[l], want, 1e-12, 0.0), "layer {l}: {} vs {want}", pl.layers[l]);
    }
    // App. C.2: share = (A − B)/(A − F), B = FP8 KV on layers 1..3 (first layer's cache native).
    let big_a = a.estimate.d_hat;
    let big_b = d(&fixed_kv_recipe(n, |r| (1..n).for_each(|l| r.layers[l].set_kv_fp8(true))));
    let share = (big_a - big_b) / (big_a - f);
    let got = pl.first_layer_share.expect("share");
    assert!(
        close(got, share, 1e-9, 1e-9),
        "share {got} vs (A−B)/(A−F) = ({big_a} − {big_b})/({big_a} − {f}) = {share}"
    );
    // App. C.3: keys only, values only, and keys / (keys and values) of the first layer alone.
    let k = d(&fixed_kv_recipe(n, |r| r.layers[0].k_fp8 = true));
    let vv = d(&fixed_kv_recipe(n, |r| r.layers[0].v_fp8 = true));
    assert!(
        close(pl.first_keys.unwrap(), k, 1e-12, 0.0) && close(pl.first_values.unwrap(), vv, 1e-12, 0.0),
        "{pl:?}: keys {k}, values {vv}"
    );
    let kv0 = pl.layers[0];
    assert!(kv0 != 0.0);
    assert!(close(pl.keys_share.unwrap(), k / kv0, 1e-12, 1e-9), "keys share {:?} vs {k}/{kv0}", pl.keys_share);
    // Verdict of Eq. 6 with α = 1.5, L = 0.184.
    assert_eq!(a.admit, 1.5 * big_a < 0.184);
    // First layer's cache already native: no first-layer share or keys/values split to report.
    let b = &v[1];
    let pb = b.per_layer.as_ref().unwrap();
    assert!(pb.first_layer_share.is_none() && pb.first_keys.is_none() && pb.keys_share.is_none(), "{pb:?}");
    assert!(close(b.estimate.d_hat, big_b, 1e-12, 0.0), "{} vs B = {big_b}", b.estimate.d_hat);
    assert!(close(pb.layers[0], f, 1e-12, 0.0), "layer 0 alone is the standard engine: {} vs {f}", pb.layers[0]);
}

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_colotrain")).arg("admit").args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn json(args: &[&str]) -> Value {
    let (c, o, e) = cli(args);
    assert_eq!(c, 0, "colotrain admit {args:?} failed:\n{e}");
    serde_json::from_str(&o).unwrap_or_else(|err| panic!("not JSON ({err}):\n{o}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn cli_verdict_is_alpha_times_d_hat_below_the_line() {
    let base = ["--candidate", "bf16", "--candidate", "noise=1.0", "--prompts", "4", "--reps", "300", "--json"];
    let out = json(&base);
    assert_eq!((f(&out["alpha"]), f(&out["line"])), (1.5, 0.184), "defaults of Eq. 6");
    let floor = &out["floor"];
    assert!(f(&floor["d_hat"]).abs() <= 1e-5, "floor {floor}");
    let c = out["candidates"].as_array().unwrap();
    assert_eq!(c.len(), 2);
    assert_eq!(c[0]["candidate"], "bf16");
    // The standard engine as a candidate is the floor, token for token.
    assert_eq!(c[0]["estimate"], *floor);
    assert_eq!(c[1]["candidate"], "noise=1.0");
    let d = f(&c[1]["estimate"]["d_hat"]);
    let (lo, hi) = (f(&c[1]["estimate"]["lo"]), f(&c[1]["estimate"]["hi"]));
    // σ = 1 noise moves every projection by its own std: D̂ (an estimate of KL(q_c‖q_0) ≥ 0)
    // is far above the floor (README: 0.11 on 16 prompts).
    assert!(d > 0.01 && lo <= d && d <= hi, "noise=1.0: {}", c[1]);
    for v in c {
        assert_eq!(v["admit"].as_bool().unwrap(), 1.5 * f(&v["estimate"]["d_hat"]) < 0.184, "{v}");
        assert!(v.get("per_layer").is_none(), "no --per-layer: {v}");
    }
    // Place L just above α·D̂ of the noise engine: admitted; raise α by 2%: rejected.
    let line = format!("{}", 1.5 * d * 1.01);
    let with = |alpha: &str| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(["--alpha", alpha, "--line", &line]);
        let o = json(&a);
        assert!(close(f(&o["candidates"][1]["estimate"]["d_hat"]), d, 0.0, 0.0), "same seed, same D-hat");
        (o["candidates"][0]["admit"].as_bool().unwrap(), o["candidates"][1]["admit"].as_bool().unwrap())
    };
    // 1.5·D̂ < 1.5·1.01·D̂ → admit; 1.53·D̂ > 1.515·D̂ → reject. The floor (≈0) passes both.
    assert_eq!(with("1.5"), (true, true));
    assert_eq!(with("1.53"), (true, false));
}

#[test]
fn cli_table_with_per_layer_and_a_heldout_file() {
    let t = TempDir::new("admit");
    let held = t.path().join("heldout.jsonl");
    std::fs::write(&held, "{\"prompt\": \"12+30=\"}\n{\"prompt\": \"7+45=\"}\n{\"prompt\": \"60+9=\"}\n").unwrap();
    let cfg = t.path().join("run.toml");
    std::fs::write(&cfg, TINY.replace("heldout_size = 128", &format!("heldout = {:?}", held.to_str().unwrap())))
        .unwrap();
    let (c, o, e) = cli(&[
        "--config",
        cfg.to_str().unwrap(),
        "--candidate",
        "fp8-kv@1",
        "--candidate",
        "noise=0.3",
        "--per-layer",
        "--reps",
        "200",
    ]);
    assert_eq!(c, 0, "{e}");
    // The held-out file's 3 prompts (fewer than --prompts 16), 2 samples each.
    assert!(o.contains("3 prompts x 2 samples (seed 777), alpha = 1.5, L = 0.184"), "{o}");
    assert!(o.contains("standard vs itself (floor)"), "{o}");
    let row = o.lines().find(|l| l.starts_with("fp8-kv@1")).unwrap_or_else(|| panic!("{o}"));
    assert!(row.ends_with("admit") || row.ends_with("reject"), "{row}");
    let layers = o.lines().find(|l| l.contains("per layer (that layer alone):")).unwrap_or_else(|| panic!("{o}"));
    assert_eq!(layers.split(':').nth(1).unwrap().split_whitespace().count(), 4, "one value per layer: {layers}");
    assert!(o.contains("first layer's KV cache share (A-B)/(A-F):") && o.contains("first layer keys only"), "{o}");
    // The noise engine has no per-layer recipe to attribute: one attribution block only.
    assert_eq!(o.matches("per layer").count(), 1, "{o}");
    assert!(o.lines().any(|l| l.starts_with("noise=0.3")), "{o}");
}

#[test]
fn bad_candidates_and_flags_are_refused_clearly() {
    let t = TempDir::new("admit-bad");
    let fast = ["--prompts", "1", "--reps", "10"];
    let refused = |args: &[&str], want: &[&str]| {
        let mut a = args.to_vec();
        if !args.contains(&"--prompts") && !args.contains(&"--reps") {
            a.extend(fast);
        }
        let (c, o, e) = cli(&a);
        assert!(c != 0 && o.is_empty(), "{a:?} was accepted:\n{o}");
        assert!(!e.contains("panicked"), "{a:?} panicked:\n{e}");
        for w in want {
            assert!(e.contains(w), "{a:?}: stderr lacks '{w}':\n{e}");
        }
    };
    refused(
        &["--candidate", "fp9"],
        &["candidate 'fp9'", "unknown recipe 'fp9'", "expected bf16, fp8, nvfp4 or fp8-kv"],
    );
    refused(
        &["--candidate", "fp8+first-lyr"],
        &["candidate 'fp8+first-lyr'", "unknown keep_bf16 entry 'first-lyr'", "first-layer-kv"],
    );
    refused(&["--candidate", "fp8-kv@x"], &["candidate 'fp8-kv@x'", "@KV_SCALE needs a number"]);
    for sc in ["0", "-1", "nan", "inf"] {
        let c = format!("fp8-kv@{sc}");
        refused(&["--candidate", &c], &[&format!("candidate '{c}'"), "@KV_SCALE must be a positive finite number"]);
    }
    refused(&["--candidate", "noise=abc"], &["candidate 'noise=abc'", "noise=SIGMA needs a number"]);
    refused(&["--candidate", "noise=0"], &["candidate 'noise=0'", "positive finite sigma"]);
    refused(&["--candidate", "bf16", "--candidate", "noise=-1"], &["candidate 'noise=-1'"]);
    refused(&["--prompts", "1"], &["--candidate"]);
    refused(&["--candidate", "bf16", "--alpha", "abc"], &["--alpha", "abc"]);
    for a in ["--alpha=nan", "--alpha=0", "--alpha=-1", "--alpha=0.5", "--alpha=inf"] {
        refused(&["--candidate", "bf16", a], &["--alpha", "safety margin", ">= 1"]);
    }
    for l in ["--line=0", "--line=-0.1", "--line=nan", "--line=inf"] {
        refused(&["--candidate", "bf16", l], &["--line", "positive finite"]);
    }
    refused(&["--candidate", "bf16", "--prompts", "1", "--reps", "0"], &["--reps", "at least 1"]);
    refused(&["--candidate", "bf16", "--prompts", "0", "--reps", "10"], &["--prompts must be at least 1"]);
    refused(&["--candidate", "bf16", "--samples", "0"], &["--samples must be at least 1"]);
    let missing = t.path().join("none.toml");
    refused(&["--candidate", "bf16", "--config", missing.to_str().unwrap()], &["cannot read config", "none.toml"]);
    let empty = t.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let cfg = t.path().join("run.toml");
    std::fs::write(&cfg, TINY.replace("heldout_size = 128", &format!("heldout = {:?}", empty.to_str().unwrap())))
        .unwrap();
    refused(&["--candidate", "bf16", "--config", cfg.to_str().unwrap()], &["empty.jsonl", "no prompts"]);
}

#[test]
fn the_library_refuses_an_empty_prompt_set_and_zero_resamples() {
    let (dev, lm, prompts) = student(1);
    let st = Student { dev: &dev, cfg: &lm.cfg, w: &lm.weights, text: lm.text.clone(), calib: None };
    let c = admit::parse_candidate("bf16", lm.cfg.num_layers, 0).unwrap();
    let e = admit::estimate(&st, &c.spec, &[], &settings(1.0, 10)).unwrap_err().to_string();
    assert!(e.contains("at least one prompt") && e.contains("0 prompts"), "{e}");
    let e = admit::check(&st, &[c], &prompts, &settings(1.0, 0), false).unwrap_err().to_string();
    assert!(e.contains("bootstrap resample") && e.contains("0 resamples"), "{e}");
}
