//! Decoding-engine behaviour: samples independent of batch size, arrival order and preemption;
//! log-probs equal to the distribution actually sampled from; stop conditions.

mod common;

use colotrain::device::{DType, Device};
use colotrain::engine::{Completion, Engine, EngineConfig, FinishReason, Request, SamplingConfig};
use colotrain::model::config::{Arch, ModelConfig, Rope, RopeScaling};
use colotrain::model::{LoadedModel, ModelWeights};
use colotrain::ops::logprob::row_log_normalizer;
use common::*;
use std::sync::Arc;

fn tiny_cfg(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 97,
        hidden_size: 48,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope: Rope { theta: 10000.0, scaling: RopeScaling::None },
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        qkv_bias: arch == Arch::Qwen2,
        o_bias: false,
        mlp_bias: false,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        torch_dtype: None,
    }
}

fn model(arch: Arch) -> (Device, ModelConfig, ModelWeights) {
    let dev = Device::cpu(2).unwrap();
    let cfg = tiny_cfg(arch);
    // std 0.3: peaked enough that top-k/top-p truncation matters, flat enough to sample variety.
    let w = ModelWeights::random(&cfg, &dev, DType::F32, 11, 0.3).unwrap();
    (dev, cfg, w)
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32).map(|i| (0..(3 + 5 * i)).map(|t| (t * 17 + i * 3) % 97).collect()).collect()
}

fn run(
    dev: &Device,
    cfg: &ModelConfig,
    w: &ModelWeights,
    ec: EngineConfig,
    s: &Arc<SamplingConfig>,
    order: &[usize],
    n: u32,
) -> Vec<Completion> {
    let mut e = Engine::new(dev, cfg, DType::F32, &ec, None).unwrap();
    let ps = prompts();
    for &i in order {
        for k in 0..n {
            e.add(Request {
                id: i as u64,
                sample: k,
                prompt: ps[i].clone(),
                sampling: s.clone(),
                prompt_logprobs: false,
            })
            .unwrap();
        }
    }
    let out = e.run_to_completion(w, |_| {}).unwrap();
    if ec.kv_blocks.is_some() {
        assert!(e.stats.preemptions > 0, "the small cache was meant to force preemptions");
    }
    out
}

#[test]
fn samples_do_not_depend_on_batching_order_or_preemption() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let (dev, cfg, w) = model(arch);
        let s = Arc::new(SamplingConfig {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 40,
            max_new_tokens: 20,
            ignore_eos: true,
            seed: 5,
            ..Default::default()
        });
        let fwd: Vec<usize> = (0..6).collect();
        let rev: Vec<usize> = (0..6).rev().collect();
        let base = run(&dev, &cfg, &w, EngineConfig { max_seqs: 1, ..Default::default() }, &s, &fwd, 2);
        let variants = [
            run(&dev, &cfg, &w, EngineConfig::default(), &s, &fwd, 2),
            run(
                &dev,
                &cfg,
                &w,
                EngineConfig { max_seqs: 3, max_tokens_per_step: 7, ..Default::default() },
                &s,
                &rev,
                2,
            ),
            // 6 blocks of 8 tokens: far fewer than 12 sequences need, so the scheduler preempts.
            run(&dev, &cfg, &w, EngineConfig { block_size: 8, kv_blocks: Some(12), ..Default::default() }, &s, &rev, 2),
        ];
        for v in &variants {
            assert_eq!(v.len(), base.len());
            for (a, b) in v.iter().zip(&base) {
                assert_eq!((a.id, a.sample), (b.id, b.sample));
                assert_eq!(a.tokens, b.tokens, "{arch:?} request {} sample {}", a.id, a.sample);
                // The linear kernel is batch invariant, so even the log-probs agree exactly.
                assert_eq!(a.logprobs, b.logprobs);
            }
        }
        // Two samples of one prompt differ (different Philox counters).
        assert_ne!(base[0].tokens, base[1].tokens);
    }
}

/// Linears packed once (generate / score) give the same tokens and log-probs, bit for bit, as
/// the per-call packing, for every architecture, F32 and BF16 weights, tied and untied heads;
/// any mutable access to the weights drops the panels.
#[test]
fn packed_linears_decode_the_same_bits() {
    for (arch, dtype, tie) in
        [(Arch::Llama, DType::F32, false), (Arch::Qwen2, DType::BF16, true), (Arch::Qwen3, DType::F32, true)]
    {
        let dev = Device::cpu(2).unwrap();
        let cfg = ModelConfig { tie_word_embeddings: tie, ..tiny_cfg(arch) };
        let mut w = ModelWeights::random(&cfg, &dev, dtype, 12, 0.3).unwrap();
        let s = Arc::new(SamplingConfig {
            temperature: 0.8,
            top_p: 0.9,
            max_new_tokens: 12,
            ignore_eos: true,
            seed: 2,
            ..Default::default()
        });
        let order: Vec<usize> = (0..6).collect();
        let go = |w: &ModelWeights| {
            let mut e = Engine::new(&dev, &cfg, dtype, &EngineConfig::default(), None).unwrap();
            for &i in &order {
                e.add(Request {
                    id: i as u64,
                    sample: 0,
                    prompt: prompts()[i].clone(),
                    sampling: s.clone(),
                    prompt_logprobs: true,
                })
                .unwrap();
            }
            e.run_to_completion(w, |_| {}).unwrap()
        };
        let plain = go(&w);
        assert!(w.pack_panels().unwrap() && w.panels().is_some(), "{arch:?} {dtype:?}: float weights on CPU pack");
        let packed = go(&w);
        for (a, b) in plain.iter().zip(&packed) {
            assert_eq!(a.tokens, b.tokens, "{arch:?} {dtype:?} request {}", a.id);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.logprobs), bits(&b.logprobs));
            assert!(!a.prompt_logprobs.is_empty());
            assert_eq!(bits(&a.prompt_logprobs), bits(&b.prompt_logprobs));
        }
        let _ = w.tensors_mut();
        assert!(w.panels().is_none(), "mutable access drops the panels");
    }
}

/// log_softmax(z/T) over the kept set, in f64, from logits computed independently.
fn reference_logprob(z: &[f32], t: f32, y: usize, top_k: usize, top_p: f64) -> f64 {
    let s: Vec<f64> = z.iter().map(|&x| x as f64 / t as f64).collect();
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap().then(a.cmp(&b)));
    let k = if top_k == 0 { s.len() } else { top_k };
    let mx = s[idx[0]];
    let tot: f64 = idx[..k].iter().map(|&i| (s[i] - mx).exp()).sum();
    let mut kept = 0;
    let mut acc = 0.0;
    for &i in &idx[..k] {
        acc += (s[i] - mx).exp();
        kept += 1;
        if acc >= top_p * tot {
            break;
        }
    }
    assert!(idx[..kept].contains(&y), "sampled token {y} outside the kept set");
    let ks: f64 = idx[..kept].iter().map(|&i| (s[i] - mx).exp()).sum();
    s[y] - mx - ks.ln()
}

#[test]
fn logprobs_are_those_of_the_distribution_sampled_from() {
    let (dev, cfg, w) = model(Arch::Qwen2);
    let lm = LoadedModel { dir: "mem".into(), cfg: cfg.clone(), weights: w, text: None, quant: None };
    for (t, k, p) in [(1.0f32, 0u32, 1.0f32), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.8, 10, 0.7)] {
        let s = Arc::new(SamplingConfig {
            temperature: t,
            top_k: k,
            top_p: p,
            max_new_tokens: 12,
            ignore_eos: true,
            seed: 3,
            ..Default::default()
        });
        let out = run(&dev, &cfg, &lm.weights, EngineConfig::default(), &s, &[1, 4], 1);
        for c in &out {
            let full: Vec<u32> = prompts()[c.id as usize].iter().chain(&c.tokens).copied().collect();
            let z = full_logits(&dev, &lm, &full, 64);
            let v = cfg.vocab_size;
            for (i, (&y, &lp)) in c.tokens.iter().zip(&c.logprobs).enumerate() {
                let row = c.prompt_len + i - 1;
                let want = reference_logprob(&z[row * v..(row + 1) * v], t, y as usize, k as usize, p as f64);
                assert!(
                    (lp as f64 - want).abs() <= 1e-5 + 1e-5 * want.abs(),
                    "T={t} k={k} p={p} token {i}: {lp} vs {want}"
                );
                if k == 0 && p == 1.0 {
                    // No truncation: exactly the trainer's log_softmax(z / T).
                    let (mx, lse) = row_log_normalizer(&z[row * v..(row + 1) * v], t);
                    let trainer = (z[row * v + y as usize] / t - mx) as f64 - lse;
                    assert!((lp as f64 - trainer).abs() <= 1e-6, "{lp} vs {trainer}");
                }
            }
        }
    }
}

#[test]
fn stops_at_eos_max_tokens_and_model_length() {
    let (dev, mut cfg, w) = model(Arch::Llama);
    let greedy =
        Arc::new(SamplingConfig { temperature: 0.0, max_new_tokens: 30, ignore_eos: true, ..Default::default() });
    let free = run(&dev, &cfg, &w, EngineConfig::default(), &greedy, &[2], 1);
    assert_eq!(free[0].tokens.len(), 30);
    assert_eq!(free[0].finish, FinishReason::Length);
    // Make the 5th greedy token the EOS: the response ends right there with "stop".
    let eos = free[0].tokens[4];
    let first = free[0].tokens.iter().position(|&t| t == eos).unwrap();
    cfg.eos_token_ids = vec![eos];
    let s = Arc::new(SamplingConfig { ignore_eos: false, ..(*greedy).clone() });
    let out = run(&dev, &cfg, &w, EngineConfig::default(), &s, &[2], 1);
    assert_eq!(out[0].tokens, free[0].tokens[..=first].to_vec());
    assert_eq!(out[0].finish, FinishReason::Stop);
    // The model's maximum length ends a response too.
    let ec = EngineConfig { max_model_len: Some(prompts()[2].len() + 7), ..Default::default() };
    let out = run(&dev, &tiny_cfg(Arch::Llama), &w, ec, &greedy, &[2], 1);
    assert_eq!(out[0].tokens, free[0].tokens[..7].to_vec());
    assert_eq!(out[0].finish, FinishReason::Length);
}

#[test]
fn rejects_requests_that_cannot_run() {
    let (dev, cfg, _w) = model(Arch::Qwen3);
    let mut e = Engine::new(&dev, &cfg, DType::F32, &EngineConfig::default(), None).unwrap();
    let s = Arc::new(SamplingConfig::default());
    let req = |prompt: Vec<u32>, s: &Arc<SamplingConfig>| Request {
        id: 9,
        sample: 0,
        prompt,
        sampling: s.clone(),
        prompt_logprobs: false,
    };
    let err = e.add(req(vec![], &s)).unwrap_err().to_string();
    assert!(err.contains("empty prompt"), "{err}");
    let err = e.add(req(vec![1, 97, 2], &s)).unwrap_err().to_string();
    assert!(err.contains("token id 97 is outside the vocabulary"), "{err}");
    let err = e.add(req(vec![1; 300], &s)).unwrap_err().to_string();
    assert!(err.contains("maximum length"), "{err}");
    let bad = Arc::new(SamplingConfig { top_p: 1.5, ..Default::default() });
    let err = e.add(req(vec![1], &bad)).unwrap_err().to_string();
    assert!(err.contains("top_p must be in (0, 1]"), "{err}");
    let stop = Arc::new(SamplingConfig { stop: vec!["x".into()], ..Default::default() });
    let err = e.add(req(vec![1], &stop)).unwrap_err().to_string();
    assert!(err.contains("stop strings need a tokenizer"), "{err}");
    assert!(!e.has_work());
}

/// A split placement's generators score their completions with the teacher as they finish
/// (`rollout::score_completions`, a few at a time); the trainers' path scores whole batches of
/// rollouts (`rollout::score_teacher`). Both must give the teacher's exact log-probs at the
/// response tokens (the CPU kernels are batch-invariant), in the same order.
#[test]
fn teacher_scores_of_completions_equal_those_of_rollouts() {
    use colotrain::engine::rollout::{self, Rollout};
    let (dev, cfg, student) = model(Arch::Qwen2);
    let teacher = ModelWeights::random(&cfg, &dev, DType::F32, 12, 0.3).unwrap();
    let s = Arc::new(SamplingConfig { temperature: 0.8, max_new_tokens: 7, seed: 3, ..Default::default() });
    let done = run(&dev, &cfg, &student, EngineConfig::default(), &s, &[0, 1, 2, 3, 4, 5], 2);
    let ps = prompts();
    let prompt_of: Vec<&[u32]> = done.iter().map(|c| ps[c.id as usize].as_slice()).collect();
    let mut te = Engine::new(&dev, &cfg, DType::F32, &EngineConfig::default(), None).unwrap();
    // In two uneven parts, as finished completions arrive.
    let mut got = rollout::score_completions(&mut te, &teacher, &prompt_of[..3], &done[..3], 0.8).unwrap();
    got.extend(rollout::score_completions(&mut te, &teacher, &prompt_of[3..], &done[3..], 0.8).unwrap());
    let mut rs: Vec<Rollout> = done
        .iter()
        .map(|c| Rollout {
            prompt: ps[c.id as usize].clone(),
            response: c.tokens.clone(),
            sampler_logprobs: c.logprobs.clone(),
            ..Default::default()
        })
        .collect();
    rollout::score_teacher(&mut te, &teacher, &mut rs, 0.8).unwrap();
    assert_eq!(got.len(), rs.len());
    for (g, r) in got.iter().zip(&rs) {
        let want = r.teacher_logprobs.as_ref().unwrap();
        assert_eq!(g.len(), r.response.len());
        assert!(g.iter().all(|x| x.is_finite() && *x <= 0.0));
        assert_eq!(
            g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
    // A completion whose prompt does not match its request is refused, not mis-scored.
    let e = rollout::score_completions(&mut te, &teacher, &[&[1, 2]], &done[..1], 0.8).unwrap_err();
    assert!(e.to_string().contains("prompt of"), "{e}");
}

/// The memory plan counts every engine's forward buffers before the engine exists
/// (`Engine::plan_buffer_bytes`): exactly the bytes the engine then holds, for sampling and
/// scoring configs, F32 and BF16 weights, with and without BF16 operands, on the CPU and on a
/// simulated GPU. The BF16 operands' room, by hand: one (cap, max(C, H·D)) buffer shared by
/// the norms' and the attention's outputs, and one (cap, I), at 2 bytes — only for BF16
/// weights on a GPU.
#[test]
fn an_engine_holds_the_buffers_its_plan_counts() {
    let mut c = tiny_cfg(Arch::Qwen3);
    c.head_dim = 12; // H·D = 72 > C = 48: the shared room takes the wider
    let sim = Device::Cuda(colotrain::device::CudaDevice::sim(3).unwrap());
    for dev in [Device::cpu(1).unwrap(), sim] {
        let cuda = !dev.is_cpu();
        for dtype in [DType::F32, DType::BF16] {
            for on in [false, true] {
                let base =
                    EngineConfig { bf16_operands: on, max_tokens_per_step: 40, max_seqs: 4, ..Default::default() };
                for ec in [base.clone(), base.scoring()] {
                    let e = Engine::new(&dev, &c, dtype, &ec, None).unwrap();
                    let plan = Engine::plan_buffer_bytes(&c, dtype, &ec, cuda);
                    assert_eq!(
                        e.buffer_bytes(),
                        plan,
                        "{} {dtype:?} bf16 operands {on} rows {}",
                        dev.name(),
                        ec.score_rows
                    );
                }
                let room = if on && cuda && dtype == DType::BF16 { 2 * 40 * (72 + 96) } else { 0 };
                let off = EngineConfig { bf16_operands: false, ..base.clone() };
                let extra = Engine::plan_buffer_bytes(&c, dtype, &base, cuda)
                    - Engine::plan_buffer_bytes(&c, dtype, &off, cuda);
                assert_eq!(extra, room, "{} {dtype:?} bf16 operands {on}", dev.name());
            }
        }
    }
}
