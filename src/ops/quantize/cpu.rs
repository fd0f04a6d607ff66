//! Quantization's CPU twin: `crate::quant`'s encoders over the rows of a tensor, in the
//! device's thread pool. The reference of csrc/kernels/quantize.cu, bit for bit.

use super::ActQuant;
use crate::device::{CpuDevice, CpuFloats, Tensor};
use crate::quant::fp8::E4M3;
use crate::quant::nvfp4;
use crate::quant::qtensor::QTensor;
use anyhow::Result;
use rayon::prelude::*;

/// y[..m] = dequant(quant(x[..m])) for rows of K = last dim.
pub fn fake_quant_rows(d: &CpuDevice, x: &Tensor, y: &mut Tensor, m: usize, q: &ActQuant) -> Result<()> {
    let k = x.dim(x.shape().len() - 1);
    let (xs, ys) = (x.f32s()?, y.f32s_mut()?);
    let ys = &mut ys[..m * k];
    ys.copy_from_slice(&xs[..m * k]);
    d.install(|| match *q {
        ActQuant::None => {}
        ActQuant::Fp8 { scale } => {
            let t = crate::quant::fp8::e4m3_table();
            ys.par_chunks_mut(4096).for_each(|c| {
                for v in c.iter_mut() {
                    *v = t[E4M3.encode(*v / scale) as usize] * scale;
                }
            });
        }
        ActQuant::Nvfp4 { global, opts } => nvfp4::fake_quantize_rows(ys, k, global, &opts),
    });
    Ok(())
}

/// Each tensor in turn, its amax and encode passes parallel over the pool.
pub fn requantize_all(d: &CpuDevice, items: &mut [(&Tensor, &mut QTensor, &str)]) -> Result<()> {
    for (src, q, name) in items.iter_mut() {
        let s = CpuFloats::of(src)?;
        d.install(|| q.requantize_cpu(s, name))?;
    }
    Ok(())
}

/// The learner's NVFP4 rounding of x's first m rows into out (F32).
pub fn learner_round(
    d: &CpuDevice,
    x: &Tensor,
    out: &mut Tensor,
    m: usize,
    k: usize,
    global: nvfp4::Global,
    opts: &nvfp4::Nvfp4Opts,
) -> Result<()> {
    let ys = &mut out.f32s_mut()?[..m * k];
    CpuFloats::of(x)?.read_into(0, ys);
    let amax = d.install(|| nvfp4::learner_round(ys, k, global, opts));
    if !amax.is_finite() {
        anyhow::bail!("learner NVFP4: a weight holds NaN or Inf values");
    }
    Ok(())
}
