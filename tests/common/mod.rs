//! Helpers shared by the integration tests: fixture readers and a direct forward pass.
#![allow(dead_code)] // each test binary uses a different subset of these helpers

use colotrain::device::{DType, Device};
use colotrain::engine::kv_cache::KvCache;
use colotrain::model::{ForwardBuffers, LoadedModel, Transformer};
use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub const FIXTURE_MODELS: [&str; 3] = ["llama_gqa", "qwen2_tied_sharded", "qwen3_headdim"];

/// A reference tensor file written by scripts/make_fixtures.py.
pub struct Ref {
    bytes: Vec<u8>,
}

impl Ref {
    pub fn open(path: &Path) -> Ref {
        Ref { bytes: std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }
    fn view(&self, name: &str) -> (Vec<usize>, safetensors::Dtype, Vec<u8>) {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("valid fixture");
        let v = st.tensor(name).unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
        (v.shape().to_vec(), v.dtype(), v.data().to_vec())
    }
    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (s, dt, b) = self.view(name);
        assert_eq!(dt, safetensors::Dtype::F32, "{name}");
        (s, b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    pub fn i64(&self, name: &str) -> (Vec<usize>, Vec<i64>) {
        let (s, dt, b) = self.view(name);
        assert_eq!(dt, safetensors::Dtype::I64, "{name}");
        (s, b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
    }
    pub fn u32s(&self, name: &str) -> (Vec<usize>, Vec<u32>) {
        let (s, v) = self.i64(name);
        (s, v.into_iter().map(|x| x as u32).collect())
    }
}

/// Five sampled requests of 3..11 prompt tokens and 4..16 new tokens (EOS ignored): run
/// together, their decode steps have 5, 4, 3, 2 and 1 sequences, three steps each.
pub fn decode_requests(vocab: usize, seed: u64) -> Vec<colotrain::engine::Request> {
    (0..5u64)
        .map(|id| colotrain::engine::Request {
            id,
            sample: 0,
            prompt: (0..(3 + 2 * id as usize) as u32)
                .map(|x| (x * 7 + id as u32 + seed as u32) % vocab as u32)
                .collect(),
            sampling: std::sync::Arc::new(colotrain::engine::SamplingConfig {
                temperature: 1.0,
                max_new_tokens: 4 + 3 * id as usize,
                ignore_eos: true,
                seed,
                ..Default::default()
            }),
            prompt_logprobs: false,
        })
        .collect()
}

pub fn load_fixture(name: &str, dev: &Device, dtype: DType) -> LoadedModel {
    LoadedModel::load(&fixtures().join("models").join(name), dev, dtype).expect("fixture model loads")
}

/// Logits (T, V) of every position of one sequence, through the engine's forward path with a
/// fresh paged cache (prefill in chunks of `chunk` tokens).
pub fn full_logits(dev: &Device, lm: &LoadedModel, ids: &[u32], chunk: usize) -> Vec<f32> {
    let cfg = &lm.cfg;
    let bs = 16;
    let nblocks = ids.len().div_ceil(bs);
    let mut cache = KvCache::new(dev, cfg, bs, nblocks, DType::F32).unwrap();
    let t = Transformer::new(dev, cfg.clone()).unwrap();
    let bf16 = !dev.is_cpu() && lm.weights.dtype() == DType::BF16;
    let mut b = ForwardBuffers::new(dev, cfg, chunk, chunk, 1, nblocks, bs, bf16).unwrap();
    let table: Vec<u32> = (0..nblocks as u32).collect();
    let mut out = Vec::new();
    let mut start = 0;
    while start < ids.len() {
        let n = chunk.min(ids.len() - start);
        let pos: Vec<u32> = (start as u32..(start + n) as u32).collect();
        b.ids.write_u32(&ids[start..start + n]).unwrap();
        b.positions.write_u32(&pos).unwrap();
        b.meta.slot_mapping.write_u32(&pos).unwrap();
        b.meta.q_start.write_u32(&[0, n as u32]).unwrap();
        b.meta.ctx_len.write_u32(&[(start + n) as u32]).unwrap();
        b.meta.block_tables.write_u32(&table).unwrap();
        b.meta.num_seqs = 1;
        b.meta.num_tokens = n;
        t.forward(dev, &lm.weights, None, &mut b, &mut cache.layers).unwrap();
        let sel: Vec<u32> = (0..n as u32).collect();
        b.sel.write_u32(&sel).unwrap();
        t.logits(dev, &lm.weights, &mut b, n).unwrap();
        let l = b.logits.to_f32_vec().unwrap();
        out.extend_from_slice(&l[..n * cfg.vocab_size]);
        start += n;
    }
    out
}

/// Asserts |a − b| ≤ atol + rtol·|b| elementwise, reporting the worst offender.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0.0f64);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let (a, b) = (*a as f64, *b as f64);
        let excess = (a - b).abs() - (atol + rtol * b.abs());
        if !(excess <= worst.1) || a.is_nan() {
            worst = (i, excess);
        }
        assert!(a.is_finite(), "{what}[{i}] = {a} is not finite");
    }
    let (i, e) = worst;
    assert!(
        e <= 0.0,
        "{what}[{i}]: got {} want {} (|diff| exceeds atol {atol} + rtol {rtol}·|ref| by {e:e})",
        got[i],
        want[i]
    );
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "colotrain-test-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tiny model of `arch` for the f64 gradient checks (hidden `c`, MLP `i`, `heads` query heads
/// on llama/qwen2, 4 of head_dim 6 on qwen3): every feature of its architecture on (llama:
/// llama3 RoPE and all biases; qwen2: q/k/v bias and a tied head; qwen3: q/k norm).
pub fn grad_cfg(
    arch: colotrain::model::config::Arch,
    c: usize,
    i: usize,
    heads: usize,
) -> colotrain::model::config::ModelConfig {
    use colotrain::model::config::{Arch, ModelConfig, Rope, RopeScaling};
    let llama = arch == Arch::Llama;
    ModelConfig {
        arch,
        vocab_size: 23,
        hidden_size: c,
        intermediate_size: i,
        num_layers: 2,
        num_heads: if arch == Arch::Qwen3 { 4 } else { heads },
        num_kv_heads: 2,
        head_dim: if arch == Arch::Qwen3 { 6 } else { c / heads },
        rms_norm_eps: 1e-6,
        rope: if llama {
            Rope {
                theta: 10000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 4.0,
                },
            }
        } else {
            Rope { theta: 100.0, scaling: RopeScaling::None }
        },
        max_position_embeddings: 64,
        tie_word_embeddings: arch == Arch::Qwen2,
        qkv_bias: arch == Arch::Qwen2 || llama,
        o_bias: llama,
        mlp_bias: llama,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        torch_dtype: None,
    }
}

/// Three sequences of uneven prompt and response lengths (vocabulary 23).
pub fn grad_batch() -> colotrain::model::trainable::TrainBatch {
    let mut b = colotrain::model::trainable::TrainBatch::default();
    b.push(&[1, 5, 7], &[2, 9, 11, 4]);
    b.push(&[3], &[8, 22]);
    b.push(&[6, 0, 13, 14, 2], &[17]);
    b
}

/// Random f64 parameters for `grad_cfg` models: norm weights 1 + 0.2·N(0, 1), the rest 0.4·N(0, 1).
pub fn grad_params(specs: &[(String, Vec<usize>)], rng: &mut colotrain::rand::Stream) -> Vec<Vec<f64>> {
    specs
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .map(|_| if name.ends_with("norm.weight") { 1.0 + 0.2 * rng.normal() } else { 0.4 * rng.normal() })
                .collect()
        })
        .collect()
}

/// The [objective.triage] table of the RL fixture steps (tests/fixtures/rl): the gate and the
/// repair both active on the fixture batch.
pub const TRIAGE: &str = r#"
[objective.triage]
segment_len = 3
repair_segment_len = 3
tau_tail = -1.0
k_tail = 2.0
tau_sev = -0.4
tau_neg = -0.1
w_sev = 0.2
w_neg = 0.6
tau_rep = -0.05
beta = 0.1
lambda_rep = 0.5
k_rep = 0
"#;
