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
//! caches), `super::norm` and `super::rope` (the CPU twin of [`qk_rope_kv`]). Must not: allocate in steady state (the CPU scratch is thread-local).

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
    /// Which of the step's sequences attend on the tensor cores ([`plan_packed`]).
    pub packed: Packed,
}

/// The sequences of a step that are whole (each sequence's queries are its whole context: it
/// starts at position 0), when they are the step's last ones: the scheduler puts sequences
/// that continue from the cache (decoding, or a prefill's later chunk) first and newly
/// admitted ones after, so a prefill step is a few continuing sequences, then whole ones.
#[derive(Debug, Default)]
pub struct Packed {
    /// The continuing sequences before the whole ones (they attend through the cache).
    pub from: usize,
    /// The rows before the whole sequences', and the keys those continuing rows attend.
    pub row0: usize,
    pub prefix_attended: u64,
    /// The whole sequences' row offsets from row0 (0 first); empty: none attend packed.
    pub offsets: Vec<usize>,
    /// Their device copy when `from` > 0 (with `from` = 0 they are q_start's prefix). None:
    /// a metadata set without one (tests), whose steps with continuing sequences stay paged.
    pub cu: Option<Tensor>, // (S + 1) u32
    /// The forward's log-sum-exp rows, reserved with the step's buffers (None: allocated per
    /// call).
    pub lse: Option<Tensor>, // (tokens, heads) f32
}

/// Fills `meta.packed` for a step with host offsets `q_start` (S + 1) and `ctx_len` (S): the
/// whole sequences after the continuing ones, if every sequence after the first whole one is
/// whole and one of them has more than one query (a prefill: decode steps, which run as CUDA
/// graphs, must not switch kernels). Uploads their offsets when continuing sequences precede
/// them (one copy of S + 1 values at most).
pub fn plan_packed(meta: &mut AttnMeta, q_start: &[u32], ctx_len: &[u32]) -> Result<()> {
    let p = &mut meta.packed;
    p.offsets.clear();
    let q_len = |s: usize| q_start[s + 1].saturating_sub(q_start[s]);
    let n = ctx_len.len().min(q_start.len().saturating_sub(1));
    let from = (0..n).find(|&s| q_len(s) == ctx_len[s]).unwrap_or(n);
    if !(from..n).all(|s| q_len(s) == ctx_len[s]) || !(from..n).any(|s| q_len(s) > 1) {
        return Ok(());
    }
    if from > 0 && p.cu.is_none() {
        return Ok(());
    }
    let row0 = q_start[from];
    p.offsets.extend(q_start[from..=n].iter().map(|&x| (x - row0) as usize));
    (p.from, p.row0, p.prefix_attended) = (from, row0 as usize, attended_keys(&q_start[..=from], &ctx_len[..from]));
    if from > 0 {
        if let Some(cu) = p.cu.as_mut() {
            let rel: Vec<u32> = q_start[from..=n].iter().map(|&x| x - row0).collect();
            cu.write_u32(&rel)?;
        }
    }
    Ok(())
}

/// The attention of a prefill step on a CUDA device with a BF16 cache, where `meta.packed`
/// names whole sequences ([`plan_packed`]): their own keys and values are all they attend, so
/// theirs is causal attention over the packed q, k, v rows, the training forward on the tensor
/// cores (`ct_attn_fwd_tc`), instead of the paged prefill kernel on the CUDA cores. The
/// continuing sequences before them run [`paged_attention`] alone. Both read keys and values
/// rounded to BF16; the tensor cores also round q and the probabilities (FP32 accumulation and
/// softmax): within BF16 rounding of [`paged_attention`]. Returns false, launching nothing,
/// where it does not apply (the CPU, an F32, F16 or FP8 cache, no whole sequences, a head_dim
/// the kernel does not take): then the caller runs [`paged_attention`].
#[allow(clippy::too_many_arguments)]
pub fn packed_prefill(
    dev: &Device,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &mut AttnMeta,
    out: &mut Tensor,
    heads: usize,
) -> Result<bool> {
    let bf16 = |c: &Tensor| c.dtype() == crate::device::DType::BF16;
    if dev.is_cpu() || meta.packed.offsets.is_empty() || !bf16(k_cache) || !bf16(v_cache) {
        return Ok(false);
    }
    let (_, hkv, _, d) = cache_dims(k_cache)?;
    let s = grad::Shape { heads, kv_heads: hkv, head_dim: d };
    if !train::tensor_cores_fit(&s) || heads % hkv != 0 {
        return Ok(false);
    }
    let (from, row0) = (meta.packed.from, meta.packed.row0);
    let t = meta.num_tokens.saturating_sub(row0);
    if meta.packed.offsets.last() != Some(&t) || from + meta.packed.offsets.len() != meta.num_seqs + 1 {
        bail!(
            "packed prefill: offsets {:?} after {from} sequences for a step of {} sequences",
            meta.packed.offsets,
            meta.num_seqs
        );
    }
    check_rows(q, meta.num_tokens, heads * d, "attention queries")?;
    check_rows(out, meta.num_tokens, heads * d, "attention output")?;
    if from > 0 {
        // The continuing sequences: their prefix of the metadata.
        let whole = (meta.num_seqs, meta.num_tokens, meta.attended);
        (meta.num_seqs, meta.num_tokens, meta.attended) = (from, row0, meta.packed.prefix_attended);
        let r = paged_attention(dev, q, k_cache, v_cache, 1.0, 1.0, meta, out, heads);
        (meta.num_seqs, meta.num_tokens, meta.attended) = whole;
        r?;
    }
    let rows = |x: &Tensor, w: usize| x.view(row0 * w, &[t, w]);
    let (qv, kv, vv) = (rows(q, heads * d)?, rows(k, hkv * d)?, rows(v, hkv * d)?);
    let n = meta.packed.offsets.len();
    let cu = match (from, &meta.packed.cu) {
        (0, _) => meta.q_start.view(0, &[n])?,
        (_, Some(cu)) => cu.view(0, &[n])?,
        (_, None) => bail!("packed prefill: continuing sequences and no device offsets"),
    };
    let mut o = rows(out, heads * d)?;
    let mut lse = match &meta.packed.lse {
        Some(l) if l.numel() >= t * heads => l.view(0, &[t, heads])?,
        _ => dev.uninit(crate::device::DType::F32, &[t, heads])?,
    };
    let x = train::Packed { q: &qv, k: &kv, v: &vv, cu: &cu, offsets: &meta.packed.offsets };
    train::fwd_tensor_cores(dev, &s, &x, &mut o, &mut lse)?;
    Ok(true)
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

/// A layer's attention inputs, ready: q (T, H·D) and k (T, Hkv·D) normalized per head in place
/// where `norms` gives them (Qwen3's q_norm and k_norm, D values each, and eps), rotated by RoPE
/// (cos, sin (T, D/2)), then k and v written into the paged caches at the batch's slots. CPU:
/// `norm::head_rmsnorm`, `rope::rope` and [`kv_write`], in that order. CUDA: one launch
/// (ct_qk_rope_kv) with those kernels' arithmetic, the same bits as their five launches.
#[allow(clippy::too_many_arguments)]
pub fn qk_rope_kv(
    dev: &Device,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    norms: Option<(&Tensor, &Tensor, f32)>,
    cos: &Tensor,
    sin: &Tensor,
    caches: (&mut Tensor, &mut Tensor),
    scales: (f32, f32),
    meta: &AttnMeta,
    heads: usize,
) -> Result<()> {
    let (_, hkv, _, d) = cache_dims(caches.0)?;
    let m = meta.num_tokens;
    check_rows(q, m, heads * d, "attention queries")?;
    check_rows(cos, m, d / 2, "RoPE cos")?;
    check_rows(sin, m, d / 2, "RoPE sin")?;
    if let Some((qn, kn, _)) = norms {
        if qn.numel() != d || kn.numel() != d {
            bail!("per-head norms of {} and {} values for heads of {d}", qn.numel(), kn.numel());
        }
    }
    match dev {
        Device::Cpu(_) => {
            if let Some((qn, kn, eps)) = norms {
                super::norm::head_rmsnorm(dev, q, qn, eps, m, heads)?;
                super::norm::head_rmsnorm(dev, k, kn, eps, m, hkv)?;
            }
            super::rope::rope(dev, q, cos, sin, m, heads)?;
            super::rope::rope(dev, k, cos, sin, m, hkv)?;
            kv_write(dev, k, v, caches.0, caches.1, scales.0, scales.1, meta)
        }
        Device::Cuda(c) => {
            check_rows(k, m, hkv * d, "kv_write keys")?;
            check_rows(v, m, hkv * d, "kv_write values")?;
            cuda::qk_rope_kv(c, q, k, v, norms, (cos, sin), caches, scales, meta, heads)
        }
    }
}

/// out[..T] (T, H·D) = attention of q (T, H·D) over the paged caches (FP8 caches decoded as
/// e4m3(code) · scale). out is f32, or on a CUDA device BF16 / F16: the f32 results rounded
/// as `ct_cast` rounds them (what a BF16 o_proj multiplies; [`packed_prefill`] alike).
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
