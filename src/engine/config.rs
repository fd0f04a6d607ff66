//! The engine's sizes: [`EngineConfig`] (cache, batch and logits-buffer sizes, the KV
//! dtypes, the decode graphs) and the scoring chunk of an engine that scores whole responses.
//!
//! Owns: the config and its defaults. May call: `crate::model` (the model's layer count),
//! `crate::device` (dtypes). Must not: allocate.

use crate::device::DType;
use crate::model::ModelConfig;

/// Rows of an LM-head chunk when an engine scores (`score_rows` of [`EngineConfig::scoring`]).
/// The chunk's GEMM reads the head's V × C weight once per chunk: at M rows it does 2·M·V·C
/// FLOPs over about 2·V·C + 4·M·V bytes (BF16 weight, f32 logits), M / (1 + 2M/C) FLOPs a
/// byte. At 64 rows (the sampling chunk) that is about 63 for C = 3584, memory-bound on every
/// GPU; at 512, 398, above the H200's ridge (989 TFLOP/s over 4.8 TB/s: 206) and the B300's.
pub const SCORE_ROWS: usize = 512;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    /// KV cache size in blocks; `None`: from `kv_cache_bytes`.
    pub kv_blocks: Option<usize>,
    pub kv_cache_bytes: usize,
    /// `None`: the weights' dtype.
    pub kv_dtype: Option<DType>,
    pub max_seqs: usize,
    pub max_tokens_per_step: usize,
    /// Rows of logits computed at once for sampling (and the decode graphs' largest bucket).
    pub logits_rows: usize,
    /// Rows of prompt log-probs scored per LM-head chunk. The logits buffer holds
    /// max(logits_rows, score_rows) rows × vocab.
    pub score_rows: usize,
    /// `None`: the model's max_position_embeddings.
    pub max_model_len: Option<usize>,
    /// (keys, values) in FP8 E4M3, per layer (empty: none).
    pub kv_fp8: Vec<(bool, bool)>,
    /// CUDA devices: decode steps replay a CUDA graph per batch-size bucket (`graphs.rs`).
    pub cuda_graphs: bool,
    /// Graphs kept per bucket, one per fingerprint (a stale engine's view rotates over
    /// `staleness + 1` weight copies: one graph each).
    pub graph_versions: usize,
    /// False: graph-eligible decode steps run padded to their bucket but are never captured —
    /// the same launches as a replay, eagerly (the device check's reference for the graphs).
    pub graph_capture: bool,
    /// CUDA devices with BF16 weights (on by default): the norms, the attention and SwiGLU
    /// write the inputs that only dense BF16 linears read in BF16 (`ForwardBuffers::h16`,
    /// `att16`, `act16`), the rounding each GEMM applied to their f32 values: the same bits
    /// without a cast. False: f32 (the reference).
    pub bf16_operands: bool,
}

impl EngineConfig {
    /// The (K, V) cache dtype of each layer of `cfg` for weights of `weights_dtype`: the
    /// configured KV dtype (default the weights'), or one byte a value (FP8) where `kv_fp8` says.
    pub fn kv_dtypes(&self, cfg: &ModelConfig, weights_dtype: DType) -> Vec<(DType, DType)> {
        let dt = self.kv_dtype.unwrap_or(weights_dtype);
        (0..cfg.num_layers)
            .map(|l| {
                let (k, v) = self.kv_fp8.get(l).copied().unwrap_or((false, false));
                (if k { DType::U8 } else { dt }, if v { DType::U8 } else { dt })
            })
            .collect()
    }

    /// This config for an engine that scores whole responses (the teacher's): chunks of
    /// [`SCORE_ROWS`] rows, at most a step's tokens (a step scores no more rows).
    pub fn scoring(&self) -> EngineConfig {
        EngineConfig { score_rows: SCORE_ROWS.min(self.max_tokens_per_step).max(1), ..self.clone() }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_blocks: None,
            kv_cache_bytes: 512 << 20,
            kv_dtype: None,
            max_seqs: 64,
            max_tokens_per_step: 1024,
            logits_rows: 64,
            score_rows: 64,
            max_model_len: None,
            kv_fp8: Vec::new(),
            cuda_graphs: true,
            graph_versions: 4,
            graph_capture: true,
            bf16_operands: true,
        }
    }
}
