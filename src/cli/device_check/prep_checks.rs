//! A layer's attention inputs in one launch on a GPU, in the device check's attention groups:
//! `attention::qk_rope_kv` (ct_qk_rope_kv: per-head norms, RoPE, the KV write) against the five
//! launches it replaces on the same GPU, bit for bit.
//!
//! Owns: those rows. May call: `ops::attention`, `ops::norm`, `ops::rope`. Must not: time
//! anything.

use super::checks::{Ctx, Tol};
use crate::device::{DType, Tensor};
use crate::ops::attention::{self, AttnMeta};
use crate::ops::{norm, rope};
use anyhow::Result;

/// The batch of `m` (its slots) through caches `shape` (num_blocks, kv heads, block size, d):
/// with Qwen3's per-head norms (BF16 weights) into a BF16 cache and without into an FP8 one.
pub(super) fn qk_rope_kv(x: &mut Ctx, m: &AttnMeta, heads: usize, shape: [usize; 4]) -> Result<()> {
    let (t, hkv, d) = (m.num_tokens, shape[1], shape[3]);
    let q0 = x.randn(t * heads * d, 1.0);
    let (k0, v0) = (x.randn(t * hkv * d, 1.0), x.randn(t * hkv * d, 1.0));
    let angles = x.randn(t * d / 2, 3.0);
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let (qn, kn) = (x.randn(d, 0.3), x.randn(d, 0.3));
    let g = x.gpu.clone();
    for (norms, cache, scale) in [(true, DType::BF16, 1.0f32), (false, DType::U8, 0.02)] {
        let run = |fused: bool| -> Result<Vec<Vec<u8>>> {
            let mut q = g.from_f32(DType::F32, &[t, heads * d], &q0)?;
            let mut k = g.from_f32(DType::F32, &[t, hkv * d], &k0)?;
            let v = g.from_f32(DType::F32, &[t, hkv * d], &v0)?;
            let (c, s) = (g.from_f32(DType::F32, &[t, d / 2], &cos)?, g.from_f32(DType::F32, &[t, d / 2], &sin)?);
            let w = match norms {
                true => Some((g.from_f32(DType::BF16, &[d], &qn)?, g.from_f32(DType::BF16, &[d], &kn)?)),
                false => None,
            };
            let (mut kc, mut vc) = (g.zeros(cache, &shape)?, g.zeros(cache, &shape)?);
            if fused {
                let n = w.as_ref().map(|(a, b)| (a, b, 1e-6f32));
                attention::qk_rope_kv(&g, &mut q, &mut k, &v, n, &c, &s, (&mut kc, &mut vc), (scale, scale), m, heads)?;
            } else {
                if let Some((a, b)) = &w {
                    norm::head_rmsnorm(&g, &mut q, a, 1e-6, t, heads)?;
                    norm::head_rmsnorm(&g, &mut k, b, 1e-6, t, hkv)?;
                }
                rope::rope(&g, &mut q, &c, &s, t, heads)?;
                rope::rope(&g, &mut k, &c, &s, t, hkv)?;
                attention::kv_write(&g, &k, &v, &mut kc, &mut vc, scale, scale, m)?;
            }
            [&q, &k, &kc, &vc].iter().map(|x| bytes(x)).collect()
        };
        let (apart, fused) = (run(false)?, run(true)?);
        let what = if norms { "head norms + RoPE + KV write in one launch" } else { "RoPE + KV write in one launch" };
        for (i, part) in ["q", "k", "key cache", "value cache"].iter().enumerate() {
            let ok = apart[i] == fused[i];
            x.record(&format!("{what}: {part}"), cache.name(), &[1.0], &[ok as u8 as f32], Tol::Exact);
        }
    }
    Ok(())
}

/// A tensor's bytes, whatever its dtype (the comparison is bit for bit).
fn bytes(t: &Tensor) -> Result<Vec<u8>> {
    match t.dtype() {
        DType::U8 => t.read_u8(0, t.numel()),
        _ => Ok(t.to_f32_vec()?.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()),
    }
}
