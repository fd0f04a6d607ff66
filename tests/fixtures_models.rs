//! The CPU backend against transformers (f32, eager attention) on the three fixture models of
//! scripts/make_fixtures.py: logits, per-token log-probs (2e-4 absolute, as specified), and
//! greedy continuations (exact).

mod common;

use colotrain::device::{DType, Device};
use colotrain::engine::{Engine, EngineConfig, Request, SamplingConfig};
use common::*;
use std::sync::Arc;

fn engine_for(lm: &colotrain::model::LoadedModel, dev: &Device, ec: EngineConfig) -> Engine {
    Engine::new(dev, &lm.cfg, DType::F32, &ec, None).unwrap()
}

#[test]
fn logits_match_transformers() {
    let dev = Device::cpu(2).unwrap();
    for name in FIXTURE_MODELS {
        let lm = load_fixture(name, &dev, DType::F32);
        let r = Ref::open(&fixtures().join("ref").join(format!("{name}.safetensors")));
        let (shape, ids) = r.u32s("input_ids");
        let (_, want) = r.f32("logits");
        let (b, t, v) = (shape[0], shape[1], lm.cfg.vocab_size);
        for row in 0..b {
            // Prefill in uneven chunks so that chunked prefill over the paged cache is checked too.
            for chunk in [t, 7] {
                let got = full_logits(&dev, &lm, &ids[row * t..(row + 1) * t], chunk);
                // f32 vs f32 with different summation orders: logits are O(1..10).
                assert_close(
                    &format!("{name} row {row} chunk {chunk} logits"),
                    &got,
                    &want[row * t * v..(row + 1) * t * v],
                    1e-4,
                    1e-4,
                );
            }
        }
    }
}

#[test]
fn score_logprobs_match_transformers() {
    let dev = Device::cpu(2).unwrap();
    for name in FIXTURE_MODELS {
        let lm = load_fixture(name, &dev, DType::F32);
        let r = Ref::open(&fixtures().join("ref").join(format!("{name}.safetensors")));
        let (shape, ids) = r.u32s("input_ids");
        let (_, want) = r.f32("logprobs");
        let t = shape[1];
        // Small step budget: prefill of both sequences is split across steps and batched, and
        // scored in chunks of 5 rows.
        let ec = EngineConfig { max_tokens_per_step: 10, logits_rows: 5, score_rows: 5, ..Default::default() };
        let mut e = engine_for(&lm, &dev, ec);
        let sampling = Arc::new(SamplingConfig { max_new_tokens: 0, ..Default::default() });
        for row in 0..shape[0] {
            let prompt = ids[row * t..(row + 1) * t].to_vec();
            e.add(Request { id: row as u64, sample: 0, prompt, sampling: sampling.clone(), prompt_logprobs: true })
                .unwrap();
        }
        let done = e.run_to_completion(&lm.weights, |_| {}).unwrap();
        assert_eq!(done.len(), shape[0]);
        for (row, c) in done.iter().enumerate() {
            assert_eq!(c.prompt_logprobs.len(), t - 1);
            assert_close(
                &format!("{name} row {row} logprobs"),
                &c.prompt_logprobs,
                &want[row * (t - 1)..(row + 1) * (t - 1)],
                2e-4,
                0.0,
            );
        }
    }
}

#[test]
fn greedy_continuations_match_transformers_exactly() {
    let dev = Device::cpu(2).unwrap();
    for name in FIXTURE_MODELS {
        let lm = load_fixture(name, &dev, DType::F32);
        let r = Ref::open(&fixtures().join("ref").join(format!("{name}.safetensors")));
        let (_, prompt) = r.u32s("greedy_prompt");
        let (_, want) = r.u32s("greedy_tokens");
        let sampling = Arc::new(SamplingConfig {
            temperature: 0.0,
            max_new_tokens: want.len(),
            ignore_eos: true,
            ..Default::default()
        });
        // Alone, and in a batch with other prompts (different lengths, joining at once).
        for others in [0usize, 5] {
            let mut e = engine_for(&lm, &dev, EngineConfig::default());
            for k in 0..others {
                let p: Vec<u32> =
                    (0..(3 + 2 * k) as u32).map(|x| (x * 7 + k as u32) % lm.cfg.vocab_size as u32).collect();
                e.add(Request {
                    id: 100 + k as u64,
                    sample: 0,
                    prompt: p,
                    sampling: sampling.clone(),
                    prompt_logprobs: false,
                })
                .unwrap();
            }
            e.add(Request {
                id: 0,
                sample: 0,
                prompt: prompt.clone(),
                sampling: sampling.clone(),
                prompt_logprobs: false,
            })
            .unwrap();
            let done = e.run_to_completion(&lm.weights, |_| {}).unwrap();
            let c = done.iter().find(|c| c.id == 0).unwrap();
            assert_eq!(c.tokens, want, "{name} with {others} other sequences");
        }
    }
}

#[test]
fn bf16_weights_stay_close_to_f32() {
    // BF16 storage rounds each weight to 8 bits of mantissa (relative error ≤ 2^-9): the
    // log-probs move by a few 1e-2 at most on these O(1) logits, never more.
    let dev = Device::cpu(2).unwrap();
    let name = "qwen2_tied_sharded";
    let lm32 = load_fixture(name, &dev, DType::F32);
    let lm16 = load_fixture(name, &dev, DType::BF16);
    assert_eq!(lm16.weights.dtype(), DType::BF16);
    let ids: Vec<u32> = (0..20).map(|i| (i * 13 % 160) as u32).collect();
    let a = full_logits(&dev, &lm32, &ids, 20);
    let b = full_logits(&dev, &lm16, &ids, 20);
    assert_close("bf16 vs f32 logits", &b, &a, 0.1, 0.05);
    assert!(a.iter().zip(&b).any(|(x, y)| x != y), "bf16 weights must actually be rounded");
}

/// Weights stored as F16 load exactly: every value read back (as F32 or as F16 in memory) is the
/// F16 rounding of the original, and the model's logits stay within F16 weight rounding of the
/// F32 model's (|a − b| ≤ 2e-2 + 2e-2·|b|: inputs and weights of O(0.1), 11-bit mantissas).
#[test]
fn f16_safetensors_load_exactly() {
    let dev = Device::cpu(2).unwrap();
    let t = TempDir::new("f16");
    for name in FIXTURE_MODELS {
        let src = fixtures().join("models").join(name);
        let lm = load_fixture(name, &dev, DType::F32);
        let dir = t.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        lm.weights.save(&lm.cfg, &dir, DType::F16).unwrap();
        for dtype in [DType::F32, DType::F16] {
            let back = colotrain::model::LoadedModel::load(&dir, &dev, dtype).unwrap();
            assert_eq!(back.weights.dtype(), dtype);
            for (a, b) in lm.weights.tensors().iter().zip(back.weights.tensors()) {
                let want: Vec<u32> =
                    a.to_f32_vec().unwrap().iter().map(|&x| half::f16::from_f32(x).to_f32().to_bits()).collect();
                let got: Vec<u32> = b.to_f32_vec().unwrap().iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "{name} as {dtype:?}");
            }
        }
        let back = colotrain::model::LoadedModel::load(&dir, &dev, DType::F32).unwrap();
        let ids: Vec<u32> = (0..9u32).map(|i| (i * 7 + 3) % lm.cfg.vocab_size as u32).collect();
        let want = full_logits(&dev, &lm, &ids, 9);
        assert_close(&format!("{name} f16 logits"), &full_logits(&dev, &back, &ids, 9), &want, 2e-2, 2e-2);
    }
}
