//! Ops: one public function per op, taking a [`Device`] and tensors, dispatching to a CPU twin
//! (in this directory) or a CUDA twin (`crate::device::cuda::ops`) with the same signature.
//!
//! Conventions (llm.c style): buffers are allocated once at their maximum size and ops take the
//! number of active rows `m` explicitly; every tensor's logical shape is written next to it.
//! CPU activations are f32; weights may be f32, bf16 or f16. Owns no state. May call
//! `crate::device`. Must not: allocate in steady state (scratch is thread-local and reused).

pub mod attention;
pub mod elementwise;
pub mod grad;
pub mod gemm_cpu;
mod isa;
pub mod linear_cpu;
pub mod linear_panels;
pub mod logprob;
pub mod matmul;
pub mod norm;
mod prefetch;
pub mod quantize;
pub mod rope;
pub mod sample;
pub mod softmax_cpu;

use crate::device::Tensor;
use anyhow::{bail, Result};

/// Checks that `t` holds at least `rows` rows of `cols` values (its last dimension is `cols`).
pub(crate) fn check_rows(t: &Tensor, rows: usize, cols: usize, what: &str) -> Result<()> {
    let shape = t.shape();
    let last = shape.last().copied().unwrap_or(1);
    if last != cols || t.numel() < rows * cols {
        bail!("{what}: tensor of shape {shape:?} cannot hold {rows} rows of {cols}");
    }
    Ok(())
}

/// Minimum rows per rayon task for row-wise ops (keeps tiny batches on one thread).
pub(crate) fn rows_per_task(cols: usize) -> usize {
    (16384 / cols.max(1)).max(1)
}

/// Largest per-thread scratch the CPU ops will need for a model (see [`reserve_scratch`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ScratchSizes {
    /// Largest reduction dimension K of a linear (transposed input and widened weight blocks).
    pub max_k: usize,
    /// Query heads per KV head and head dimension (attention).
    pub attn_groups: usize,
    pub head_dim: usize,
    /// Vocabulary size (top-k / top-p candidate lists).
    pub vocab: usize,
}

/// Grows every CPU pool thread's scratch to `s` now, so that later steps never allocate.
pub fn reserve_scratch(dev: &crate::device::Device, s: ScratchSizes) {
    if let crate::device::Device::Cpu(c) = dev {
        c.broadcast(|| {
            linear_cpu::reserve(s.max_k);
            attention::reserve(attention::scratch_len(s.attn_groups, s.head_dim));
            sample::reserve(s.vocab);
        });
    }
}
