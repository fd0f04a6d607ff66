//! Sampling's CUDA twin: ct_sample for greedy and untruncated rows, ct_sample_topk for rows
//! with top-k / top-p (csrc/kernels/sample.cu, sample_topk.cu); the few rows that kernel leaves
//! (see CT_TOPK_CAP) are copied to the host and drawn by the CPU twin itself, so they match the
//! CPU exactly but cost a device-to-host copy of their logits. Not yet run on a GPU.

use super::SampleParams;
use crate::device::cuda::args::{f32p, i32_of, ptr};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

/// Whether a row is truncated (top-k or top-p at a positive temperature): ct_sample_topk draws
/// it; ct_sample draws the others (greedy or the whole distribution).
pub fn truncated(p: &SampleParams, vocab: usize) -> bool {
    let cut = (p.top_k > 0 && (p.top_k as usize) < vocab) || p.top_p < 1.0;
    p.temperature > 0.0 && cut
}

/// The kernel's view of one row's sampling parameters.
pub fn sample_row_params(p: &SampleParams, vocab: usize) -> ffi::ct_sample_row {
    ffi::ct_sample_row {
        seed: p.seed,
        request: p.request,
        temperature: p.temperature,
        sample: p.sample,
        position: p.position,
        truncated: truncated(p, vocab) as u32,
        top_k: p.top_k,
        top_p: p.top_p,
    }
}

pub fn sample(
    d: &CudaDevice,
    z: &Tensor,
    params: &[SampleParams],
    tokens: &mut [u32],
    logprobs: &mut [f32],
) -> Result<()> {
    let s = params.len();
    let v = z.dim(z.shape().len() - 1);
    let zp = ptr(d, z, &[DType::F32], "sample logits")?;
    if s == 0 {
        return Ok(());
    }
    let rows: Vec<ffi::ct_sample_row> = params.iter().map(|p| sample_row_params(p, v)).collect();
    let pbuf = d.scratch(std::mem::size_of_val(rows.as_slice()), "sampling parameters")?;
    let tbuf = d.scratch(s * 4, "sampled tokens")?;
    let lbuf = d.scratch(s * 4, "sampled log-probs")?;
    let hbuf = d.scratch(s * 4, "rows left to the host")?;
    d.htod(pbuf.ptr, &rows)?;
    let kp = ffi::ct_sample_params {
        logits: zp as *const f32,
        params: pbuf.ptr as *const ffi::ct_sample_row,
        rows: i32_of(s, "rows")?,
        vocab: i32_of(v, "vocabulary")?,
        tokens: tbuf.ptr as *mut u32,
        logprobs: f32p(lbuf.ptr),
        host_rows: hbuf.ptr as *mut u32,
    };
    let truncated = rows.iter().filter(|r| r.truncated != 0).count();
    d.k_sample(kp, s - truncated)?;
    let any_truncated = truncated > 0;
    if any_truncated {
        d.k_sample_topk(kp, truncated)?;
    }
    d.dtoh(&mut tokens[..s], tbuf.ptr)?;
    d.dtoh(&mut logprobs[..s], lbuf.ptr)?;
    if !any_truncated {
        return Ok(());
    }
    // Rows the top-k kernel left (top_k above CT_TOPK_CAP, or a top-p prefix longer than its
    // sorted candidates) are drawn on the host by the CPU twin: their logits come over in one
    // copy and the rows are sampled in parallel.
    let mut host_rows = vec![0u32; s];
    d.dtoh(&mut host_rows, hbuf.ptr)?;
    let off: Vec<usize> = (0..s).filter(|&i| rows[i].truncated != 0 && host_rows[i] != 0).collect();
    if let (Some(&first), Some(&last)) = (off.first(), off.last()) {
        use rayon::prelude::*;
        let mut host = vec![0.0f32; (last - first + 1) * v];
        d.dtoh(&mut host, zp + (first * v * 4) as u64)?;
        let drawn: Vec<(u32, f32)> = off
            .par_iter()
            .map(|&i| super::sample_row(&host[(i - first) * v..(i - first + 1) * v], &params[i]))
            .collect();
        for (&i, (t, l)) in off.iter().zip(drawn) {
            tokens[i] = t;
            logprobs[i] = l;
        }
    }
    Ok(())
}
