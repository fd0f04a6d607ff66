//! Attention for training on any device: causal GQA over packed sequences, forward saving the
//! log-sum-exp and backward recomputing the probabilities (`grad.rs` is the CPU twin and, at
//! T = f64, the reference; csrc/kernels/attention_train.cu the CUDA twin: CUDA-core kernels,
//! the checked reference and fallback, and the tensor-core forward `fwd_tensor_cores`; the
//! backward still runs on CUDA cores).
//!
//! Owns: the device-level signatures and their checks. May call: `grad`, the CUDA launchers.
//! Must not: hold a T × T matrix.

use super::grad::{self, Shape};
use crate::device::cuda::args::{code, i32_of, ptr};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Device, Tensor};
use anyhow::{bail, Result};

/// The attention's tensors: q (T, H·D), k, v (T, Hkv·D), `cu` (sequences + 1) u32 row offsets
/// of the packed sequences (cu[0] = 0, cu[last] = T), and the same offsets on the host,
/// `offsets`: those are checked and counted, so a device's copy is never read back (a read
/// would synchronize the device at every layer's attention, forward and backward).
pub struct Packed<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub cu: &'a Tensor,
    pub offsets: &'a [usize],
}

fn check(s: &Shape, x: &Packed<'_>) -> Result<usize> {
    let (h, hkv, d) = (s.heads, s.kv_heads, s.head_dim);
    if hkv == 0 || h % hkv != 0 || d == 0 || d > 256 {
        bail!("training attention: {h} heads over {hkv} KV heads of dimension {d} (a multiple, D ≤ 256)");
    }
    let t = x.q.numel() / (h * d);
    for (a, want, what) in [(x.q, t * h * d, "queries"), (x.k, t * hkv * d, "keys"), (x.v, t * hkv * d, "values")] {
        if a.numel() != want || a.dtype() != DType::F32 {
            bail!("training attention {what}: {want} f32 values expected, found {} {}", a.numel(), a.dtype().name());
        }
    }
    if x.cu.dtype() != DType::U32 || x.cu.numel() < 2 || x.cu.numel() != x.offsets.len() {
        bail!(
            "training attention: the sequence offsets must be u32, at least [0, T], {} on the host and {} on the device",
            x.offsets.len(),
            x.cu.numel()
        );
    }
    Ok(t)
}

/// The host offsets, checked: 0 first, T last, never decreasing.
fn offsets(x: &Packed<'_>, t: usize) -> Result<Vec<usize>> {
    let v = x.offsets;
    if v[0] != 0 || v[v.len() - 1] != t || v.windows(2).any(|w| w[0] > w[1]) {
        bail!("training attention: sequence offsets {v:?} do not run from 0 to {t}");
    }
    // On the CPU the tensor is at hand: the two copies must agree.
    if let crate::device::Storage::Cpu(_) = x.cu.storage() {
        if x.cu.u32s()?.iter().zip(v).any(|(&a, &b)| a as usize != b) {
            bail!("training attention: the sequence offsets {v:?} differ from the tensor's");
        }
    }
    Ok(v.to_vec())
}

/// The (query, key) pairs causal attention computes over sequences at offsets `cu`: Σ L(L+1)/2.
fn causal_pairs(cu: &[usize]) -> u64 {
    cu.windows(2).map(|w| (w[1] - w[0]) as u64).map(|l| l * (l + 1) / 2).sum()
}

/// out (T, H·D) and lse (T, H) of causal attention (`grad::fwd`). On a CUDA device out may be
/// BF16 or F16 (a GEMM's input, not the backward's: the kernels store the rounding `ct_cast`
/// applies); on the CPU it is f32.
pub fn fwd(dev: &Device, s: &Shape, x: &Packed<'_>, out: &mut Tensor, lse: &mut Tensor) -> Result<()> {
    fwd_on(dev, s, x, out, lse, false)
}

/// Whether the tensor-core forward takes this shape: head_dim a multiple of 16, at most 128.
pub fn tensor_cores_fit(s: &Shape) -> bool {
    s.head_dim % 16 == 0 && s.head_dim <= crate::device::cuda::TC_MAX_D
}

/// [`fwd`] on the tensor cores (ct_attn_fwd_tc, flash-attention 2 style: q, k, v and the
/// probabilities rounded to BF16, FP32 accumulation and softmax): out and lse within BF16
/// rounding of [`fwd`]'s. On the CPU it is [`fwd`] (the f32 twin the tolerances refer to).
pub fn fwd_tensor_cores(dev: &Device, s: &Shape, x: &Packed<'_>, out: &mut Tensor, lse: &mut Tensor) -> Result<()> {
    if !tensor_cores_fit(s) {
        bail!("training attention on the tensor cores: head_dim {} is not a multiple of 16 up to 128", s.head_dim);
    }
    fwd_on(dev, s, x, out, lse, true)
}

fn fwd_on(dev: &Device, s: &Shape, x: &Packed<'_>, out: &mut Tensor, lse: &mut Tensor, tc: bool) -> Result<()> {
    let t = check(s, x)?;
    if out.numel() != x.q.numel() || lse.numel() != t * s.heads {
        bail!("training attention: the output must match the queries and lse hold T·H values");
    }
    match dev {
        Device::Cpu(_) => {
            let cu = offsets(x, t)?;
            grad::fwd(s, &cu, x.q.f32s()?, x.k.f32s()?, x.v.f32s()?, out.f32s_mut()?, lse.f32s_mut()?);
            Ok(())
        }
        Device::Cuda(d) => {
            let pairs = causal_pairs(&offsets(x, t)?);
            let mut p = params(d, s, x, t)?;
            p.o = ptr(d, out, &[DType::F32, DType::BF16, DType::F16], "attention output")? as *mut std::ffi::c_void;
            p.o_dtype = code(out.dtype());
            p.lse = ptr(d, lse, &[DType::F32], "attention log-sum-exp")? as *mut f32;
            if tc {
                d.k_attn_fwd_tc(p, pairs)
            } else {
                d.k_attn_fwd(p, pairs)
            }
        }
    }
}

/// The backward's shapes, checked; T.
#[allow(clippy::too_many_arguments)]
fn check_bwd(
    s: &Shape,
    x: &Packed<'_>,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
) -> Result<usize> {
    let t = check(s, x)?;
    if out.numel() != x.q.numel() || dout.numel() != x.q.numel() || dq.numel() != x.q.numel() {
        bail!("training attention backward: out, dout and dq must match the queries");
    }
    if dk.numel() != x.k.numel() || dv.numel() != x.v.numel() || lse.numel() != t * s.heads {
        bail!("training attention backward: dk and dv must match the keys, lse hold T·H values");
    }
    Ok(t)
}

/// dq (T, H·D), dk, dv (T, Hkv·D), overwritten, from dout and the forward's out and lse
/// (`grad::bwd`).
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    dev: &Device,
    s: &Shape,
    x: &Packed<'_>,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    dq: &mut Tensor,
    dk: &mut Tensor,
    dv: &mut Tensor,
) -> Result<()> {
    let t = check_bwd(s, x, out, lse, dout, dq, dk, dv)?;
    match dev {
        Device::Cpu(_) => {
            let cu = offsets(x, t)?;
            let (q, k, v) = (x.q.f32s()?, x.k.f32s()?, x.v.f32s()?);
            grad::bwd(
                s,
                &cu,
                q,
                k,
                v,
                out.f32s()?,
                lse.f32s()?,
                dout.f32s()?,
                dq.f32s_mut()?,
                dk.f32s_mut()?,
                dv.f32s_mut()?,
            );
            Ok(())
        }
        Device::Cuda(d) => bwd_cuda(d, s, x, t, out, lse, dout, dq, dk, dv, false),
    }
}

/// [`bwd`] on the tensor cores (ct_attn_bwd_dq_tc, ct_attn_bwd_dkv_tc: q, k, v, dout, the
/// probabilities and dS rounded to BF16, FP32 accumulation, no atomics): within BF16 rounding of
/// [`bwd`]'s. On the CPU it is [`bwd`] (the f32 twin the tolerances refer to).
#[allow(clippy::too_many_arguments)]
pub fn bwd_tensor_cores(
    dev: &Device,
    s: &Shape,
    x: &Packed<'_>,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    dq: &mut Tensor,
    dk: &mut Tensor,
    dv: &mut Tensor,
) -> Result<()> {
    if !tensor_cores_fit(s) {
        bail!("training attention on the tensor cores: head_dim {} is not a multiple of 16 up to 128", s.head_dim);
    }
    match dev {
        Device::Cpu(_) => bwd(dev, s, x, out, lse, dout, dq, dk, dv),
        Device::Cuda(d) => {
            let t = check_bwd(s, x, out, lse, dout, dq, dk, dv)?;
            bwd_cuda(d, s, x, t, out, lse, dout, dq, dk, dv, true)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn bwd_cuda(
    d: &CudaDevice,
    s: &Shape,
    x: &Packed<'_>,
    t: usize,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    dq: &mut Tensor,
    dk: &mut Tensor,
    dv: &mut Tensor,
    tensor_cores: bool,
) -> Result<()> {
    let pairs = causal_pairs(&offsets(x, t)?);
    let delta = d.scratch(t * s.heads * 4, "attention backward row sums")?;
    let mut p = params(d, s, x, t)?;
    let f = |a: &Tensor, what: &str| ptr(d, a, &[DType::F32], what);
    p.out = f(out, "attention output")? as *const f32;
    p.lse = f(lse, "attention log-sum-exp")? as *mut f32;
    p.dout = f(dout, "attention output gradient")? as *const f32;
    p.dq = f(dq, "query gradient")? as *mut f32;
    p.dk = f(dk, "key gradient")? as *mut f32;
    p.dv = f(dv, "value gradient")? as *mut f32;
    p.delta = delta.ptr as *mut f32;
    if tensor_cores {
        d.k_attn_bwd_tc(p, pairs)
    } else {
        d.k_attn_bwd(p, pairs)
    }
}

fn params(d: &CudaDevice, s: &Shape, x: &Packed<'_>, t: usize) -> Result<ffi::ct_attn_train_params> {
    let f = |a: &Tensor, what: &str| ptr(d, a, &[DType::F32], what);
    Ok(ffi::ct_attn_train_params {
        q: f(x.q, "queries")? as *const f32,
        k: f(x.k, "keys")? as *const f32,
        v: f(x.v, "values")? as *const f32,
        out: std::ptr::null(),
        dout: std::ptr::null(),
        o: std::ptr::null_mut(),
        o_dtype: ffi::CT_DTYPE_F32,
        lse: std::ptr::null_mut(),
        dq: std::ptr::null_mut(),
        dk: std::ptr::null_mut(),
        dv: std::ptr::null_mut(),
        delta: std::ptr::null_mut(),
        cu: ptr(d, x.cu, &[DType::U32], "sequence offsets")? as *const u32,
        num_seqs: i32_of(x.cu.numel() - 1, "sequences")?,
        tokens: i32_of(t, "attention rows")?,
        heads: i32_of(s.heads, "heads")?,
        kv_heads: i32_of(s.kv_heads, "KV heads")?,
        head_dim: i32_of(s.head_dim, "head dimension")?,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
    })
}
