//! Steady-state decoding allocates nothing: a counting global allocator watches engine steps
//! after every sequence has been admitted and prefilled.

use colotrain::device::{DType, Device};
use colotrain::engine::{Engine, EngineConfig, Request, SamplingConfig};
use colotrain::model::config::{Arch, ModelConfig, Rope, RopeScaling};
use colotrain::model::ModelWeights;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The counter is process-wide: the tests of this file take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn decode_steps_do_not_allocate() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = ModelConfig {
        arch: Arch::Qwen2,
        vocab_size: 300,
        hidden_size: 64,
        intermediate_size: 160,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope: Rope { theta: 10000.0, scaling: RopeScaling::None },
        max_position_embeddings: 512,
        tie_word_embeddings: true,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        torch_dtype: None,
    };
    for dtype in [DType::F32, DType::BF16] {
        let dev = Device::cpu(2).unwrap();
        let w = ModelWeights::random(&cfg, &dev, dtype, 1, 0.2).unwrap();
        let ec = EngineConfig { max_seqs: 8, ..Default::default() };
        let mut e = Engine::new(&dev, &cfg, dtype, &ec, None).unwrap();
        let s = Arc::new(SamplingConfig {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 50,
            max_new_tokens: 64,
            ignore_eos: true,
            ..Default::default()
        });
        for i in 0..8u64 {
            let prompt: Vec<u32> = (0..(5 + i as u32)).map(|t| (t * 31 + i as u32) % 300).collect();
            e.add(Request { id: i, sample: 0, prompt, sampling: s.clone(), prompt_logprobs: false }).unwrap();
        }
        // Prefill plus a few decode steps to warm every buffer and thread-local scratch.
        for _ in 0..4 {
            assert!(e.step(&w).unwrap().is_empty());
        }
        // The decode loop runs inside the device's pool, as engines' loops do.
        dev.install(|| {
            e.step(&w).unwrap();
            ALLOCS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            for _ in 0..20 {
                let done = e.step(&w).unwrap();
                assert!(done.is_empty());
            }
            COUNTING.store(false, Ordering::SeqCst);
        });
        assert_eq!(e.num_running(), 8);
        assert_eq!(ALLOCS.load(Ordering::SeqCst), 0, "{dtype:?}: allocations during 20 decode steps");
    }
}

#[test]
fn quantized_and_stale_resyncs_do_not_allocate() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use colotrain::engine::rollout_weights::{EngineSpec, RolloutWeights};
    use colotrain::model::calib::Calibration;
    use colotrain::quant::recipe::{KvScale, Recipe};
    let cfg = ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: 128,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope: Rope { theta: 10000.0, scaling: RopeScaling::None },
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        torch_dtype: None,
    };
    let dev = Device::cpu(2).unwrap();
    let mut w = ModelWeights::random(&cfg, &dev, DType::BF16, 5, 0.1).unwrap();
    let mut cal = Calibration::new(Calibration::fingerprint(&cfg), 2);
    cal.input_amax = vec![[3.0; 4]; 2];
    cal.k_amax = vec![5.0; 2];
    cal.v_amax = vec![5.0; 2];
    for (recipe, noise, stale) in [("fp8", 0.0, 0), ("nvfp4", 0.0, 0), ("nvfp4", 0.1, 2)] {
        let spec = EngineSpec {
            recipe: Recipe::preset(recipe, 2, &[], KvScale::Calibrated, Default::default()).unwrap(),
            noise_sigma: noise,
            noise_seed: 1,
            staleness: stale,
        };
        let mut rw = RolloutWeights::new(&dev, &spec, &cfg, &w, Some(&cal), 0).unwrap();
        let vals = w.layers[0].up_proj.to_f32_vec().unwrap();
        dev.install(|| {
            rw.sync(&w, 1).unwrap();
            ALLOCS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            for v in 2..5 {
                rw.sync(&w, v).unwrap();
            }
            COUNTING.store(false, Ordering::SeqCst);
        });
        assert_eq!(
            ALLOCS.load(Ordering::SeqCst),
            0,
            "{recipe} noise {noise} staleness {stale}: allocations during 3 syncs"
        );
        w.layers[0].up_proj.write_f32(&vals).unwrap();
    }
}
