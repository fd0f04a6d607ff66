//! The launch ledger (src/device/cuda/ledger.rs) on the simulated GPU: what a training step and
//! decode steps declare, counted by hand from the shapes. Each test opens a simulated GPU of
//! its own (the ledger is per device, and the tests run at once): cuda-sim:1 to cuda-sim:7.

mod common;

use colotrain::config::JobConfig;
use colotrain::device::cuda::ledger::{rows, Ledger, Row};
use colotrain::device::{CudaDevice, DType, Device};
use colotrain::engine::rollout::read_file;
use colotrain::engine::{Engine, EngineConfig};
use colotrain::train::trainer::Trainer;
use common::*;

/// The ledger's rows of operation `op` (every phase and stream), summed.
fn op(l: &Ledger, op: &str) -> Row {
    let mut it = rows(l).into_iter().filter(|r| r.op == op);
    let mut a = it.next().unwrap_or_else(|| panic!("no {op} in the ledger"));
    for r in it {
        a.launches += r.launches;
        a.replayed += r.replayed;
        a.flops += r.flops;
        a.bytes += r.bytes;
    }
    a
}

/// The ledger of one OPD step of the llama_gqa fixture in `dtype` on simulated GPU `ordinal`
/// (sm_90a) with `optimizer` (a TOML table's body), the NVFP4 learner on the MLP linears (RHT
/// on) when `learner`, and (T, R, N, V·C): the batch's tokens, its response rows, the layers'
/// linear parameters (q, k, v, o, gate, up, down) and the LM head's.
fn opd_step(
    ordinal: usize,
    dtype: DType,
    optimizer: &str,
    learner: bool,
) -> (Ledger, colotrain::model::ModelConfig, [f64; 4]) {
    let cd = CudaDevice::sim(ordinal).unwrap();
    let dev = Device::Cuda(cd.clone());
    let lm = load_fixture("llama_gqa", &dev, dtype);
    let c = lm.cfg.clone();
    let rollouts = read_file(&fixtures().join("grads").join("llama_gqa_rollouts.jsonl"), c.vocab_size).unwrap();
    let toml = format!(
        "[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[objective]\nkind = \"opd\"\n[optimizer]\n{optimizer}"
    );
    let job = JobConfig::from_toml(&toml, "inline").unwrap();
    let mut tr = Trainer::new(&c, lm.weights, &job).unwrap();
    if learner {
        let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"].iter().map(|s| s.to_string()).collect();
        let opts = colotrain::quant::nvfp4::Nvfp4Opts { rht: Some(1), stochastic: None };
        let lq = colotrain::model::learner_quant::LearnerQuant::new(&names, opts, c.num_layers).unwrap();
        tr.set_learner_quant(Some(lq)).unwrap();
    }
    cd.take_ledger();
    tr.step(&rollouts).unwrap();
    assert!(tr.on_device());
    let t: usize = rollouts.iter().map(|r| r.prompt.len() + r.response.len()).sum();
    let r: usize = rollouts.iter().map(|r| r.response.len()).sum();
    let (h, kv, i) = (c.hidden_size, c.num_kv_heads * c.head_dim, c.intermediate_size);
    let q = c.num_heads * c.head_dim;
    let n = c.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * i);
    (cd.take_ledger(), c.clone(), [t as f64, r as f64, n as f64, (c.vocab_size * h) as f64])
}

/// One OPD step (SGD, F32 weights) of the llama_gqa fixture on a simulated GPU: its GEMMs
/// declare exactly the FLOPs of the trainer's passes, counted from the model's shapes:
/// - the layers' linears: 2·T·N forward, 2·T·N for the data gradient, 2·T·N for the weight
///   gradient (N the layers' linear parameters, T the batch's tokens);
/// - the LM head (V × C) over the R response rows: its logits once, and its two gradients
///   once each. The loss pass is the statistics pass too (OPD's coefficients at ratio 1 need
///   only each token's own log-prob, which the pass evaluates on the device): the logits were
///   computed twice before, once for π_old's log-probs and entropy and once in the loss pass,
///   which recomputes them chunk by chunk rather than keeping R × V of them. TIS and TRIAGE
///   still run both passes (`sim_train.rs` counts both ways).
///
/// The training attention declares 4·D FLOPs per (query head, causal pair) forward, and the
/// step reads back from the device only what the host needs: the loss pass's log-probs and
/// entropies and the gradient norm — nothing per layer, and not the loss pass's own loss (the
/// objective reports the step's).
#[test]
fn a_training_step_declares_the_flops_of_its_passes() {
    let (l, c, [t, r, n, head]) =
        opd_step(3, DType::F32, "kind = \"sgd\"\nlr = 1.0\nweight_decay = 0.0\ngrad_clip = 0.0\n", false);
    let layers = c.num_layers as u64;
    let fwd = op(&l, "gemm f32 nt");
    assert_eq!(fwd.flops, 2.0 * t * n + 2.0 * r * head, "forward GEMMs");
    assert_eq!(fwd.launches, 7 * layers + 1);
    for form in ["gemm f32 nn", "gemm f32 tn"] {
        let g = op(&l, form);
        assert_eq!(g.flops, 2.0 * t * n + 2.0 * r * head, "{form}");
        assert_eq!(g.launches, 7 * layers + 1, "{form}");
    }
    let rollouts = read_file(&fixtures().join("grads").join("llama_gqa_rollouts.jsonl"), c.vocab_size).unwrap();
    let pairs: usize = rollouts.iter().map(|x| x.prompt.len() + x.response.len()).map(|s| s * (s + 1) / 2).sum();
    let att = op(&l, "ct_attn_fwd");
    assert_eq!(att.flops, (4 * c.head_dim * c.num_heads * pairs) as f64 * layers as f64, "attention forward");
    assert_eq!(op(&l, "memcpy d2h").launches, 3, "device-to-host reads in one training step");
    // Every launch of the step was eager, and the roofline time of each is positive.
    assert!(rows(&l).iter().all(|r| r.replayed == 0 && r.h200_s > 0.0 && r.b300_s > 0.0));
}

/// With BF16 compute weights every GEMM of a training step runs on BF16 operands (tensor
/// cores, FP32 accumulation), the layers' weight gradients included: they once ran in F32 on
/// the CUDA cores, 6.8 s of a modelled 9.0 s train phase at Qwen2.5-7B's shapes on an H200
/// (`bench node --model-gpu h200 --ledger`). The FLOPs are those of the F32 step above. With
/// the NVFP4 learner on the MLP linears too (Hopper: its forward and backward GEMMs multiply
/// the codes' BF16 unit values), with the same FLOPs: its backward once ran F32 GEMMs on its
/// rounded copies, 22.4 s of the 4B TRIAGE config's modelled 28.6 s train phase.
#[test]
fn bf16_weights_train_on_bf16_gemms_only() {
    for (ordinal, learner) in [(6, false), (7, true)] {
        let (l, c, [t, r, n, head]) = opd_step(ordinal, DType::BF16, "kind = \"adamw\"\n", learner);
        let gemms: Vec<Row> = rows(&l).into_iter().filter(|r| r.op.starts_with("gemm")).collect();
        assert!(
            gemms.iter().all(|r| r.op.starts_with("gemm bf16")),
            "learner {learner}: {:?}",
            gemms.iter().map(|r| r.op).collect::<Vec<_>>()
        );
        let dw = op(&l, "gemm bf16 tn");
        assert_eq!(dw.flops, 2.0 * t * n + 2.0 * r * head, "learner {learner}: weight-gradient GEMMs");
        assert_eq!(dw.launches, 7 * c.num_layers as u64 + 1);
        // The learner's operands per layer: codes only (9/16 byte a value), no rounded f32 copy
        // (4 more): the three BF16 weights (H·I each), the F32 gate/up input (T·H) and the F32
        // down input (T·I), each read once.
        let enc: Vec<Row> = rows(&l).into_iter().filter(|r| r.op == "ct_quant_nvfp4").collect();
        let (h, i, layers) = (c.hidden_size as f64, c.intermediate_size as f64, c.num_layers as f64);
        let bytes = layers * (3.0 * h * i * (2.0 + 0.5625) + t * (h + i) * (4.0 + 0.5625));
        assert_eq!(enc.iter().map(|r| r.launches).sum::<u64>(), if learner { 5 * c.num_layers as u64 } else { 0 });
        assert_eq!(enc.iter().map(|r| r.bytes).sum::<f64>(), if learner { bytes } else { 0.0 }, "NVFP4 encodes");
    }
}

/// Decode steps replayed from CUDA graphs count in the ledger as the same padded steps
/// launched eagerly do (`graph_capture = false`): the same launches, FLOPs and bytes per
/// operation, attention with the keys of the replaying step (not of the capture's), and the
/// replayed ones marked.
#[test]
fn replayed_decode_steps_count_as_the_same_steps_launched_eagerly() {
    let cd = CudaDevice::sim(4).unwrap();
    let dev = Device::Cuda(cd.clone());
    let lm = load_fixture("llama_gqa", &dev, DType::BF16);
    let c = lm.cfg.clone();
    // Five sequences of 4..16 new tokens: decode batches of 5, 4, 3, 2, 1.
    let reqs = |seed: u64| decode_requests(c.vocab_size, seed);
    let ec = |capture: bool| EngineConfig { cuda_graphs: true, graph_capture: capture, ..Default::default() };
    let mut ledgers = Vec::new();
    for capture in [false, true] {
        let mut e = Engine::new(&dev, &c, DType::BF16, &ec(capture), None).unwrap();
        cd.take_ledger();
        // Two rounds: the second replays every decode step of the graphed engine.
        for round in 0..2 {
            for r in reqs(round + 1) {
                e.add(r).unwrap();
            }
            e.run_to_completion(&lm.weights, |_| {}).unwrap();
        }
        assert_eq!(e.graph_stats().captures > 0, capture);
        ledgers.push(cd.take_ledger());
    }
    let (eager, graphed) = (rows(&ledgers[0]), rows(&ledgers[1]));
    assert_eq!(eager.len(), graphed.len(), "the same operations");
    for a in &eager {
        let b = graphed.iter().find(|b| b.op == a.op && b.stream == a.stream && b.phase == a.phase).unwrap();
        assert_eq!((a.launches, a.flops, a.bytes), (b.launches, b.flops, b.bytes), "{}", a.op);
        assert_eq!(a.replayed, 0, "{}", a.op);
    }
    // 2 rounds × 15 decode steps × 2 layers (the prefill steps go to the tensor cores).
    // The first round runs each of its 4 buckets' first step eagerly and replays 11 steps; the
    // second replays all 15.
    let att = graphed.iter().find(|r| r.op == "ct_paged_attention").unwrap();
    assert_eq!(att.launches, 2 * 15 * 2);
    assert_eq!(att.replayed, (11 + 15) * 2);
}

/// A prefill step's whole sequences (each starting at position 0) with a BF16 cache attend on
/// the tensor cores (the training forward, `ct_attn_fwd_tc`), not with the paged prefill
/// kernel: three prompts of 20, 27 and 34 tokens in one step launch it once per layer. With a
/// budget of 16 tokens a step the prompts are split into 6 steps (hand-counted from the
/// scheduler's order, continuing sequences first):
/// 1. prompt 0's first 16 tokens: whole, tensor cores;
/// 2. its last 4 (paged, the prefill kernel) and prompt 1's first 12 (whole, tensor cores);
/// 3. prompt 1's last 15 and prompt 2's first token (a whole sequence of one query: not a
///    prefill to pack, the step stays paged);
/// 4. and 5. 16 tokens of prompt 2 each (paged);
/// 6. its last one (the decode kernel).
///
/// So `ct_attn_fwd_tc` twice per layer and `ct_prefill_attention` four times. All
/// three score the prompts alike (log-probs near −5.3, a 199-token vocabulary):
/// - whole vs chunked, on the same simulated GPU, differ only in the attention: the tensor
///   cores round q and the probabilities to BF16 as well. |a − b| ≤ 0.01 + 0.01·|b| (about
///   0.06; measured 0.042).
/// - each vs the CPU engine (f32 activations over the same BF16 weights; the GPU's linears
///   also round their inputs to BF16): |a − b| ≤ 0.02 + 0.02·|b| (about 0.13; measured 0.090
///   for both).
#[test]
fn whole_sequence_prefills_attend_on_the_tensor_cores() {
    use colotrain::engine::{Request, SamplingConfig};
    let cd = CudaDevice::sim(5).unwrap();
    let dev = Device::Cuda(cd.clone());
    let lm = load_fixture("llama_gqa", &dev, DType::BF16);
    let cpu = Device::cpu(1).unwrap();
    let lc = load_fixture("llama_gqa", &cpu, DType::BF16);
    let c = lm.cfg.clone();
    let v = c.vocab_size as u32;
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|i| (0..20 + 7 * i).map(|t| (t * 13 + i * 5 + 3) % v).collect()).collect();
    let score = |dev: &Device, w: &colotrain::model::ModelWeights, budget: usize| {
        let ec = EngineConfig { max_tokens_per_step: budget, ..Default::default() };
        let mut e = Engine::new(dev, &c, DType::BF16, &ec, None).unwrap();
        let sampling = std::sync::Arc::new(SamplingConfig {
            temperature: 0.0,
            max_new_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        });
        for (i, p) in prompts.iter().enumerate() {
            let r = Request {
                id: i as u64,
                sample: 0,
                prompt: p.clone(),
                sampling: sampling.clone(),
                prompt_logprobs: true,
            };
            e.add(r).unwrap();
        }
        let mut out = e.run_to_completion(w, |_| {}).unwrap();
        out.sort_by_key(|o| o.id);
        out.into_iter().map(|o| o.prompt_logprobs).collect::<Vec<_>>()
    };
    let launches = |l: &Ledger, name: &str| rows(l).iter().filter(|r| r.op == name).map(|r| r.launches).sum::<u64>();
    cd.take_ledger();
    let whole = score(&dev, &lm.weights, 1024);
    let l = cd.take_ledger();
    let layers = c.num_layers as u64;
    assert_eq!(launches(&l, "ct_attn_fwd_tc"), layers, "one whole-sequence step");
    assert_eq!(launches(&l, "ct_prefill_attention") + launches(&l, "ct_prefill_attention_tc"), 0);
    let chunked = score(&dev, &lm.weights, 16);
    let l = cd.take_ledger();
    assert_eq!(launches(&l, "ct_attn_fwd_tc"), 2 * layers, "steps 1 and 2 have whole sequences");
    assert_eq!(launches(&l, "ct_prefill_attention_tc"), 4 * layers, "steps 2 to 5 continue cached sequences");
    assert_eq!(launches(&l, "ct_prefill_attention"), 0, "a BF16 cache's prefill runs on the tensor cores");
    assert_eq!(launches(&l, "ct_paged_attention"), layers, "step 6 decodes one row");
    let reference = score(&cpu, &lc.weights, 1024);
    for (what, a, b, tol) in [
        ("whole vs chunked", &whole, &chunked, 0.01),
        ("whole vs CPU", &whole, &reference, 0.02),
        ("chunked vs CPU", &chunked, &reference, 0.02),
    ] {
        let worst = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        println!("{what}: max |Δ log p| {worst:e}");
        for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
            assert_eq!(x.len(), prompts[i].len() - 1);
            assert_close(&format!("{what}, prompt {i}"), x, y, tol, tol);
        }
    }
}

/// An engine that scores (the teacher's, `EngineConfig::scoring`) runs its LM head in chunks
/// of `SCORE_ROWS` rows instead of the sampling chunk's `logits_rows`: the head's weight is
/// read once per chunk, so 64-row chunks left a long response's scoring memory-bound (the
/// 7B OPD config's teacher read its 1.09 GB head 544 times a step). Three prompts of 40, 55
/// and 70 tokens (161 scored rows, one step) in chunks of 7 rows and of `scoring()`'s:
/// - both chunkings give the same bits, on the CPU and on the simulated GPU alike (a row's
///   logits and its log-softmax do not depend on the rows beside it);
/// - on the simulated GPU the chunks are 23 (161 rows by 7) and 1: one log-softmax launch and
///   one d2h read each, and the GEMMs' FLOPs are the same while their bytes fall by the
///   head's V × C BF16 weight for every chunk saved.
#[test]
fn a_scoring_engine_reads_the_lm_head_once_per_score_rows() {
    use colotrain::engine::{Request, SamplingConfig, SCORE_ROWS};
    let cd = CudaDevice::sim(2).unwrap();
    let sim = Device::Cuda(cd.clone());
    let cpu = Device::cpu(1).unwrap();
    let lens = [40usize, 55, 70];
    let rows: usize = lens.iter().map(|l| l - 1).sum();
    assert!(rows <= SCORE_ROWS, "one chunk when scoring");
    let score =
        |dev: &Device, w: &colotrain::model::ModelWeights, c: &colotrain::model::ModelConfig, ec: &EngineConfig| {
            let mut e = Engine::new(dev, c, DType::BF16, ec, None).unwrap();
            let sampling = std::sync::Arc::new(SamplingConfig { max_new_tokens: 0, ..Default::default() });
            let v = c.vocab_size as u32;
            for (i, &n) in lens.iter().enumerate() {
                let prompt = (0..n as u32).map(|t| (t * 17 + 5 * i as u32 + 1) % v).collect();
                e.add(Request { id: i as u64, sample: 0, prompt, sampling: sampling.clone(), prompt_logprobs: true })
                    .unwrap();
            }
            let mut out = e.run_to_completion(w, |_| {}).unwrap();
            assert_eq!(e.stats.steps, 1, "one step scores all three");
            out.sort_by_key(|o| o.id);
            out.into_iter().map(|o| o.prompt_logprobs).collect::<Vec<_>>()
        };
    let small = EngineConfig { score_rows: 7, ..Default::default() };
    let big = EngineConfig::default().scoring();
    assert_eq!(big.score_rows, SCORE_ROWS);
    for dev in [&cpu, &sim] {
        let lm = load_fixture("llama_gqa", dev, DType::BF16);
        let c = lm.cfg.clone();
        cd.take_ledger();
        let a = score(dev, &lm.weights, &c, &small);
        let la = cd.take_ledger();
        let b = score(dev, &lm.weights, &c, &big);
        let lb = cd.take_ledger();
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.len(), lens[i] - 1);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(x), bits(y), "{}: prompt {i}'s log-probs in chunks of 7 and of {SCORE_ROWS}", dev.name());
            assert!(x.iter().all(|l| l.is_finite() && *l < 0.0), "{}: log-probs {x:?}", dev.name());
        }
        if dev.is_cpu() {
            continue;
        }
        let (chunks_a, chunks_b) = (rows.div_ceil(7) as u64, 1u64);
        assert_eq!(op(&la, "ct_log_softmax_gather").launches, chunks_a);
        assert_eq!(op(&lb, "ct_log_softmax_gather").launches, chunks_b);
        assert_eq!(op(&la, "memcpy d2h").launches, chunks_a, "one read of each chunk's log-probs");
        assert_eq!(op(&lb, "memcpy d2h").launches, chunks_b);
        let (ga, gb) = (op(&la, "gemm bf16 nt"), op(&lb, "gemm bf16 nt"));
        assert_eq!(ga.launches - gb.launches, chunks_a - chunks_b, "one LM-head GEMM per chunk");
        assert!((ga.flops - gb.flops).abs() <= 1e-9 * ga.flops, "FLOPs {} vs {}", ga.flops, gb.flops);
        let head = (c.vocab_size * c.hidden_size * 2) as f64;
        let saved = ga.bytes - gb.bytes;
        assert!(
            (saved - (chunks_a - chunks_b) as f64 * head).abs() <= 1e-9 * ga.bytes,
            "bytes saved {saved} vs {} head reads of {head}",
            chunks_a - chunks_b
        );
    }
}

/// An engine with BF16 weights on a simulated GPU writes the inputs that only dense BF16
/// linears read in BF16 (`EngineConfig::bf16_operands`: the norms', the attention's and
/// SwiGLU's outputs): the rounding each GEMM applied to their f32 values, so the same tokens,
/// log-probs and prompt log-probs bit for bit as with f32 inputs, decode graphs included, and
/// exactly 4 `ct_cast` launches fewer per layer and forward step: unquantized, h1 (q, k, v's),
/// the attention output (o's), h2 (gate and up's) and a (down's); with the NVFP4 recipe that
/// keeps the attention in BF16, h1 for each of q, k and v (a quantized engine runs its
/// projections one by one) and the attention output, while its MLP quantizes from f32 as
/// before. The steps mix prefill (packed on the tensor cores, and paged) with decode.
#[test]
fn an_engine_writes_its_gemm_inputs_in_bf16() {
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::quant::recipe::{KvScale, Recipe};
    let cd = CudaDevice::sim(1).unwrap();
    let dev = Device::Cuda(cd.clone());
    let lm = load_fixture("llama_gqa", &dev, DType::BF16);
    let c = lm.cfg.clone();
    let cal = stand_in_calibration(&c);
    for recipe in ["bf16", "nvfp4"] {
        let keep = vec!["attention".to_string()];
        let r = Recipe::preset(recipe, c.num_layers, &keep, KvScale::Calibrated, Default::default()).unwrap();
        let spec = EngineSpec { recipe: r, noise_sigma: 0.0, noise_seed: 0, staleness: 0 };
        let rw = (recipe != "bf16").then(|| RolloutWeights::new(&dev, &spec, &c, &lm.weights, Some(&cal), 0).unwrap());
        let run = |on: bool| {
            let ec = EngineConfig { bf16_operands: on, kv_fp8: spec.recipe.kv_layers(), ..Default::default() };
            let mut e = Engine::new(&dev, &c, DType::BF16, &ec, None).unwrap();
            for mut q in decode_requests(c.vocab_size, 3) {
                q.prompt_logprobs = true;
                e.add(q).unwrap();
            }
            let view = match &rw {
                Some(rw) => rw.view(&lm.weights),
                None => (&lm.weights).into(),
            };
            cd.take_ledger();
            let mut done = e.run_to_completion(view, |_| {}).unwrap();
            let l = cd.take_ledger();
            done.sort_by_key(|d| d.id);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let out: Vec<_> =
                done.iter().map(|d| (d.tokens.clone(), bits(&d.logprobs), bits(&d.prompt_logprobs))).collect();
            (out, op(&l, "ct_cast").launches, e.stats.steps, e.graph_stats().replays)
        };
        let (off, casts_off, steps, _) = run(false);
        let (on, casts_on, steps_on, replays) = run(true);
        assert_eq!(steps, steps_on, "{recipe}");
        assert!(replays > 0, "{recipe}: decode graphs replayed");
        assert_eq!(off.len(), 5, "{recipe}");
        assert!(off.iter().all(|o| !o.0.is_empty() && !o.2.is_empty()), "{recipe}: tokens and prompt log-probs");
        assert!(off == on, "{recipe}: the same tokens, log-probs and prompt log-probs");
        eprintln!("{recipe}: ct_cast {casts_off} -> {casts_on} over {steps} steps");
        assert_eq!(casts_off - casts_on, 4 * c.num_layers as u64 * steps, "{recipe}");
    }
}

/// A quantized engine quantizes each layer input once per forward step, however many linears
/// read it: q, k and v share the attention input's calibration, gate and up the MLP input's,
/// so a layer of W8A8 or W4A4 linears runs 4 activation quantizations (its q/k/v input, o's,
/// gate/up's, down's), not one per linear (7); the GEMMs read the same codes
/// (`ops::linear::linears_act_q`, whose unit test compares the bits). The down projection's
/// quantizer reads gate and up and computes SwiGLU itself: no SwiGLU pass; and RoPE and the KV
/// write take one launch a layer (`ct_qk_rope_kv`). Prefill and decode steps alike, decode
/// graphs included.
#[test]
fn a_quantized_engine_quantizes_each_layer_input_once() {
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::quant::recipe::{KvScale, Recipe};
    let cd = CudaDevice::sim(0).unwrap();
    let dev = Device::Cuda(cd.clone());
    let lm = load_fixture("llama_gqa", &dev, DType::BF16);
    let c = lm.cfg.clone();
    let cal = stand_in_calibration(&c);
    for (recipe, quant) in [("fp8", "ct_quant_fp8"), ("nvfp4", "ct_quant_nvfp4")] {
        let r = Recipe::preset(recipe, c.num_layers, &[], KvScale::Calibrated, Default::default()).unwrap();
        let spec = EngineSpec { recipe: r, noise_sigma: 0.0, noise_seed: 0, staleness: 0 };
        let rw = RolloutWeights::new(&dev, &spec, &c, &lm.weights, Some(&cal), 0).unwrap();
        let ec = EngineConfig { kv_fp8: spec.recipe.kv_layers(), ..Default::default() };
        let mut e = Engine::new(&dev, &c, DType::BF16, &ec, None).unwrap();
        for q in decode_requests(c.vocab_size, 5) {
            e.add(q).unwrap();
        }
        cd.take_ledger();
        let done = e.run_to_completion(rw.view(&lm.weights), |_| {}).unwrap();
        let l = cd.take_ledger();
        assert_eq!(done.len(), 5, "{recipe}");
        assert!(e.graph_stats().replays > 0, "{recipe}: decode graphs replayed");
        let launches = op(&l, quant).launches;
        eprintln!("{recipe}: {launches} {quant} over {} steps", e.stats.steps);
        assert_eq!(launches, 4 * c.num_layers as u64 * e.stats.steps, "{recipe}: activation quantizations");
        // The down projection's quantizer computes SwiGLU as it reads gate and up.
        assert!(rows(&l).iter().all(|r| r.op != "ct_swiglu"), "{recipe}: no SwiGLU pass");
        // RoPE of q and k and the KV write: one launch per layer and step, none of their own.
        assert_eq!(op(&l, "ct_qk_rope_kv").launches, c.num_layers as u64 * e.stats.steps, "{recipe}");
        assert!(
            rows(&l).iter().all(|r| r.op != "ct_rope" && r.op != "ct_kv_write"),
            "{recipe}: no RoPE or KV-write pass"
        );
    }
}

/// A calibration of fixed input, key and value ranges for the llama_gqa fixture's quantized
/// engines (the ledger tests count launches; the values only need to be finite).
fn stand_in_calibration(c: &colotrain::model::ModelConfig) -> colotrain::model::calib::Calibration {
    use colotrain::model::calib::Calibration;
    let mut cal = Calibration::new(Calibration::fingerprint(c), c.num_layers);
    for l in 0..c.num_layers {
        cal.input_amax[l] = [4.0; 4];
        cal.k_amax[l] = 6.0;
        cal.v_amax[l] = 3.0;
    }
    cal
}
