//! Ops: one room per op family, one public function per op, taking a [`Device`] and tensors and
//! dispatching to a CPU twin or a CUDA twin with the same signature.
//!
//! A room `ops/<op>/` holds `mod.rs` (the public signatures, shape comments, argument checks
//! and the dispatch by device, plus the op's parameter types), `cpu.rs` (the reference twin),
//! `cuda.rs` (the CUDA twin: buffers and the typed launcher call of csrc/kernels/<op>.cu, no
//! arithmetic of its own; run by a GPU or by the simulated GPU), `grad.rs` (the training twin: forward with saved
//! state and backward, generic over [`real::Real`]) and `tests.rs` (run on every device of the
//! build through [`test_device!`]). Beside the rooms: the CPU helpers the twins share
//! (`vecmath`: the vector exp / max / sums; `isa`, `prefetch`) and `real` (the training
//! element types).
//!
//! Conventions (llm.c style): buffers are allocated once at their maximum size and ops take the
//! number of active rows `m` explicitly; every tensor's logical shape is written next to it.
//! CPU activations are f32; weights may be f32, bf16 or f16. Owns no state. May call:
//! `crate::device`, `crate::quant`, `crate::rand`, `crate::util` (huge pages). Must not:
//! allocate in steady state (CPU scratch is thread-local and reused), know about models.

use crate::device::{Device, Tensor};
use anyhow::{bail, Result};

/// One op test on every device of the build, in the spirit of candle's `test_device!`:
/// `test_device!(check, check_cpu, check_sim, check_cuda)` defines the tests `check_cpu`
/// (`check(&Device)` on a 2-thread CPU device), `check_sim` (on the simulated GPU `cuda-sim:0`,
/// so the CUDA twin, its launches and its kernel run in every build) and, with the `cuda`
/// feature, `check_cuda` on `cuda:0` (which fails on a machine without a GPU: run those where
/// there is one).
#[cfg(test)]
macro_rules! test_device {
    ($f:ident, $cpu:ident, $sim:ident, $cuda:ident) => {
        #[test]
        fn $cpu() {
            let dev = crate::device::Device::cpu(2).expect("a CPU device");
            $f(&dev)
        }
        #[test]
        fn $sim() {
            let dev = crate::device::Device::parse("cuda-sim:0").expect("cuda-sim:0");
            $f(&dev)
        }
        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() {
            let dev = crate::device::Device::cuda(0).expect("cuda:0");
            $f(&dev)
        }
    };
}

pub mod attention;
#[cfg(test)]
mod backward_tests;
pub mod elementwise;
#[cfg(test)]
mod hostemu;
mod isa;
pub mod linear;
pub mod lm_head;
pub mod logprob;
pub mod norm;
pub mod optim;
mod prefetch;
pub mod quantize;
pub mod real;
pub mod rope;
pub mod sample;
pub mod vecmath;

/// Checks that `t` holds at least `rows` rows of `cols` values (its last dimension is `cols`).
pub(crate) fn check_rows(t: &Tensor, rows: usize, cols: usize, what: &str) -> Result<()> {
    let shape = t.shape();
    let last = shape.last().copied().unwrap_or(1);
    if last != cols || t.numel() < rows * cols {
        bail!("{what}: tensor of shape {shape:?} cannot hold {rows} rows of {cols}");
    }
    Ok(())
}

/// The fixed order of a column sum over many rows (RMSNorm's weight gradient, a bias gradient)
/// on every device, given as k, the rows of a chunk: at most k rows are added onto the total
/// in row order; more are summed in chunks of k consecutive rows, each from zero in row order,
/// and the chunks' sums added onto the total in chunk order. k = max(32, ⌈rows / 1024⌉): at
/// most 1024 chunks, so a GPU's first pass has a block per 128 columns and chunk to fill its
/// SMs and its second pass reads little. The CPU twins and the kernels (`ct_rmsnorm_dw`,
/// `ct_col_sum`) follow this one rule, so their sums are the same bits.
pub fn reduction_chunk_rows(rows: usize) -> usize {
    rows.div_ceil(1024).max(32)
}

/// total (cols) += the column sums of `rows` rows, row r's values `f(r, j)` for column j, in
/// the order of [`reduction_chunk_rows`] (the chunks summed in parallel).
pub(crate) fn column_sums<T: real::Real>(rows: usize, total: &mut [T], f: impl Fn(usize, usize) -> T + Sync) {
    use rayon::prelude::*;
    let k = reduction_chunk_rows(rows);
    let add = |r0: usize, r1: usize, acc: &mut [T]| {
        for r in r0..r1 {
            for (j, a) in acc.iter_mut().enumerate() {
                *a += f(r, j);
            }
        }
    };
    if rows <= k {
        return add(0, rows, total);
    }
    let chunks: Vec<Vec<T>> = (0..rows.div_ceil(k))
        .into_par_iter()
        .map(|c| {
            let mut acc = vec![T::zero(); total.len()];
            add(c * k, (c * k + k).min(rows), &mut acc);
            acc
        })
        .collect();
    for c in chunks {
        for (a, b) in total.iter_mut().zip(c) {
            *a += b;
        }
    }
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
pub fn reserve_scratch(dev: &Device, s: ScratchSizes) {
    if let Device::Cpu(c) = dev {
        c.broadcast(|| {
            linear::kernel::reserve(s.max_k);
            attention::reserve(attention::scratch_len(s.attn_groups, s.head_dim));
            sample::reserve(s.vocab);
        });
    }
}
