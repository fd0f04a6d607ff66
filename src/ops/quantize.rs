//! Activation quantization for the emulated low-precision engines: rows of a linear's input
//! quantized with a fixed (calibrated) scale and dequantized back, as the real kernels would
//! consume them. FP8: per-tensor E4M3 with scale amax/448. NVFP4: dynamic E4M3 block scales per
//! 16 values under a fixed global scale (amax/2688), optionally rotated by the RHT.

use super::check_rows;
use crate::device::{cuda, Device, Tensor};
use crate::quant::fp8::E4M3;
use crate::quant::nvfp4::{self, Nvfp4Opts};
use anyhow::Result;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActQuant {
    None,
    Fp8 { scale: f32 },
    Nvfp4 { global: f32, opts: Nvfp4Opts },
}

/// y[..m] = dequant(quant(x[..m])) for rows of K = last dim.
pub fn fake_quant_rows(dev: &Device, x: &Tensor, y: &mut Tensor, m: usize, q: &ActQuant) -> Result<()> {
    let k = x.dim(x.shape().len() - 1);
    check_rows(y, m, k, "fake_quant output")?;
    match dev {
        Device::Cpu(d) => {
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
        Device::Cuda(c) => cuda::ops::fake_quant_rows(c, x, y, m, q),
    }
}
