//! Attention over a paged KV cache (vLLM layout), for prefill and decode alike: every query row
//! of the flat batch belongs to a sequence whose keys/values live in fixed-size cache blocks
//! listed in its block table; row i of a sequence with q_len new tokens and ctx_len cached
//! tokens sits at position ctx_len − q_len + i and attends causally to positions 0..=that.
//! Softmax(q·kᵀ/√D) in f32; grouped-query attention maps query head h to KV head h / (H/Hkv).
//!
//! Owns: [`AttnMeta`], the public signatures, their checks and the dispatch; the CPU twin
//! (`cpu.rs`), the CUDA twin (`cuda.rs`, kernels csrc/kernels/attention.cu — decode and the KV
//! write — and attention_prefill.cu), the training twin (`grad.rs`: dense causal attention,
//! forward saving the log-sum-exp, backward). May call: `crate::device`, `crate::quant` (FP8
//! caches). Must not: allocate in steady state (the CPU scratch is thread-local).

mod cpu;
mod cuda;
pub mod grad;
pub mod train;
#[cfg(test)]
mod tests;

pub use cpu::{reserve, scratch_len, KCHUNK};

use super::check_rows;
use crate::device::{Device, Tensor};
use anyhow::{bail, Result};

/// Per-step batch metadata. Tensors are allocated at capacity; `num_seqs`/`num_tokens` say
/// how much is live.
#[derive(Debug)]
pub struct AttnMeta {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub block_size: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    pub q_start: Tensor,      // (S+1) u32: rows of sequence s are q_start[s]..q_start[s+1]
    pub ctx_len: Tensor,      // (S) u32: cached tokens of s after this step's write
    pub block_tables: Tensor, // (S, max_blocks) u32
    pub slot_mapping: Tensor, // (T) u32: cache slot (block·block_size + offset) of each row
    /// The cached positions the rows attend, summed over the rows ([`attended_keys`]): what the
    /// launch ledger counts (the device's copies of q_start and ctx_len are not read back).
    pub attended: u64,
}

/// Σ over the rows of the positions each attends: sequence s's q_len rows end at ctx_len[s],
/// so they attend ctx − q_len + 1, …, ctx positions (`q_start` has S + 1 offsets).
pub fn attended_keys(q_start: &[u32], ctx_len: &[u32]) -> u64 {
    q_start
        .windows(2)
        .zip(ctx_len)
        .map(|(w, &c)| {
            let (q, c) = (w[1].saturating_sub(w[0]) as u64, c as u64);
            // (Inconsistent metadata, c < q, is the kernel's error to report: count nothing.)
            (q * c).saturating_sub(q * q.saturating_sub(1) / 2)
        })
        .sum()
}

/// (num_blocks, Hkv, block_size, D) of a cache tensor.
pub fn cache_dims(c: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match c.shape() {
        [a, b, c2, d] => Ok((*a, *b, *c2, *d)),
        s => bail!("KV cache tensor must be (blocks, kv_heads, block_size, head_dim), got {s:?}"),
    }
}

/// Writes the new keys/values k, v (m, Hkv·D) into the caches (num_blocks, Hkv, block_size, D)
/// at `meta.slot_mapping`. FP8 (u8) caches store e4m3_satfinite(x / scale); float caches ignore
/// the scales.
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    dev: &Device,
    k: &Tensor,
    v: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    k_scale: f32,
    v_scale: f32,
    meta: &AttnMeta,
) -> Result<()> {
    let (_, hkv, _, d) = cache_dims(k_cache)?;
    let m = meta.num_tokens;
    check_rows(k, m, hkv * d, "kv_write keys")?;
    check_rows(v, m, hkv * d, "kv_write values")?;
    match dev {
        Device::Cpu(_) => cpu::kv_write(k, v, k_cache, v_cache, k_scale, v_scale, meta),
        Device::Cuda(c) => cuda::kv_write(c, k, v, k_cache, v_cache, k_scale, v_scale, meta),
    }
}

/// out[..T] (T, H·D) = attention of q (T, H·D) over the paged caches (FP8 caches decoded as
/// e4m3(code) · scale).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dev: &Device,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k_scale: f32,
    v_scale: f32,
    meta: &AttnMeta,
    out: &mut Tensor,
    heads: usize,
) -> Result<()> {
    let (_nb, hkv, bs, d) = cache_dims(k_cache)?;
    if bs != meta.block_size {
        bail!("paged_attention: cache block size {bs} != metadata block size {}", meta.block_size);
    }
    if heads % hkv != 0 {
        bail!("paged_attention: {heads} query heads not a multiple of {hkv} KV heads");
    }
    let t_rows = meta.num_tokens;
    check_rows(q, t_rows, heads * d, "attention queries")?;
    check_rows(out, t_rows, heads * d, "attention output")?;
    match dev {
        Device::Cpu(d) => cpu::paged_attention(d, q, k_cache, v_cache, k_scale, v_scale, meta, out, heads),
        Device::Cuda(c) => cuda::paged_attention(c, q, k_cache, v_cache, k_scale, v_scale, meta, out, heads),
    }
}
