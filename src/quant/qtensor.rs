//! A quantized weight: its codes and scales in buffers allocated once, rewritten in place from
//! the trainer's weights at every sync (fused amax + quantize), and read by the engine's linears.

use super::fp8::E4M3;
use super::nvfp4::{self, Nvfp4Opts, BLOCK};
use crate::device::CpuFloats;
use anyhow::{bail, Result};
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QFormat {
    /// FP8 E4M3 with one FP32 scale per tensor (amax / 448).
    Fp8,
    /// NVFP4: E2M1, E4M3 scale per 16 along K, FP32 scale per tensor.
    Nvfp4,
}

#[derive(Clone, Debug)]
pub struct QTensor {
    pub format: QFormat,
    pub rows: usize,
    pub k: usize,
    /// FP8: one code per value (rows, K). NVFP4: two codes per byte (rows, K/2).
    pub codes: Vec<u8>,
    /// NVFP4 block scales (rows, K/16), E4M3 codes; empty for FP8.
    pub block_scales: Vec<u8>,
    /// FP8: the tensor scale; NVFP4: the global scale.
    pub scale: f32,
    pub opts: Nvfp4Opts,
    /// Row scratch for widening BF16/F16 sources (allocated once).
    scratch: Vec<f32>,
}

impl QTensor {
    /// Buffers for a (rows, K) weight.
    pub fn alloc(format: QFormat, rows: usize, k: usize, opts: Nvfp4Opts) -> Result<QTensor> {
        let (codes, block_scales) = match format {
            QFormat::Fp8 => (vec![0u8; rows * k], Vec::new()),
            QFormat::Nvfp4 => {
                if k % BLOCK != 0 {
                    bail!("NVFP4 needs the reduction dimension to be a multiple of 16, got K = {k}");
                }
                (vec![0u8; rows * k / 2], vec![0u8; rows * k / BLOCK])
            }
        };
        Ok(QTensor { format, rows, k, codes, block_scales, scale: 1.0, opts, scratch: Vec::new() })
    }

    pub fn size_bytes(&self) -> usize {
        self.codes.len() + self.block_scales.len() + 4
    }

    /// Address of the code buffer (tests prove syncs do not move it).
    pub fn codes_ptr(&self) -> usize {
        self.codes.as_ptr() as usize
    }

    /// Re-quantizes from `src` (rows·K values) in place. Fails, naming `name`, if `src` holds a
    /// non-finite value. Allocates nothing once the scratch has grown to the source's size.
    pub fn requantize(&mut self, src: CpuFloats, name: &str) -> Result<()> {
        let n = self.rows * self.k;
        if src.len() != n {
            bail!("{name}: quantizing {} values into a buffer of {n}", src.len());
        }
        // The f32 view of the source (BF16/F16 widened once into reused scratch).
        let vals: &[f32] = match src {
            CpuFloats::F32(v) => v,
            _ => {
                if self.scratch.len() != n {
                    self.scratch.resize(n, 0.0);
                }
                let s = &mut self.scratch;
                s.par_chunks_mut(self.k).enumerate().for_each(|(r, row)| src.read_into(r * row.len(), row));
                &self.scratch
            }
        };
        let amax = vals.par_iter().map(|v| v.abs()).reduce(|| 0.0f32, |a, b| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) });
        if !amax.is_finite() {
            bail!("{name}: cannot quantize a tensor holding NaN or Inf values");
        }
        match self.format {
            QFormat::Fp8 => {
                let scale = if amax > 0.0 { amax / E4M3.max() } else { 1.0 };
                self.scale = scale;
                self.codes.par_chunks_mut(4096).zip(vals.par_chunks(4096)).for_each(|(c, v)| {
                    for (c, x) in c.iter_mut().zip(v) {
                        *c = E4M3.encode(x / scale);
                    }
                });
            }
            QFormat::Nvfp4 => {
                let global = nvfp4::global_scale(amax);
                self.scale = global;
                if self.opts.rht.is_some() {
                    // The global scale covers the rotated values: their amax, not the source's.
                    let signs = nvfp4::rht_signs(self.opts.rht.unwrap_or(0));
                    let ramax = vals
                        .par_chunks(BLOCK)
                        .map(|b| {
                            let mut blk = [0.0f32; BLOCK];
                            blk.copy_from_slice(b);
                            nvfp4::rht_block(&mut blk, &signs);
                            blk.iter().fold(0.0f32, |a, v| a.max(v.abs()))
                        })
                        .reduce(|| 0.0f32, f32::max);
                    self.scale = nvfp4::global_scale(ramax);
                }
                nvfp4::quantize(vals, self.k, self.scale, &self.opts, &mut self.codes, &mut self.block_scales);
            }
        }
        Ok(())
    }

    /// The decoded view for the linear kernel.
    pub fn view(&self) -> CpuFloats<'_> {
        match self.format {
            QFormat::Fp8 => CpuFloats::Fp8 { codes: &self.codes, scale: self.scale },
            QFormat::Nvfp4 => CpuFloats::Nvfp4 { packed: &self.codes, scales: &self.block_scales, global: self.scale },
        }
    }

    /// All values, decoded (tests and export).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.k];
        self.view().read_into(0, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requantize_reuses_buffers_and_rejects_nan() {
        let mut q = QTensor::alloc(QFormat::Nvfp4, 4, 32, Nvfp4Opts::default()).unwrap();
        let ptr = q.codes_ptr();
        let mut x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        q.requantize(CpuFloats::F32(&x), "w").unwrap();
        let d = q.dequantize();
        // NVFP4's rounding error is at most one E2M1 step at the top of the block: bamax/6, and
        // the E4M3 block scale's own rounding (≤ 6.25%) on top.
        for (blk, xb) in d.chunks(16).zip(x.chunks(16)) {
            let bamax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (a, b) in blk.iter().zip(xb) {
                assert!((a - b).abs() <= bamax / 6.0 * 1.07, "{a} vs {b} (block amax {bamax})");
            }
        }
        x[5] = f32::NAN;
        let e = q.requantize(CpuFloats::F32(&x), "model.layers.0.mlp.up_proj.weight").unwrap_err().to_string();
        assert!(e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("NaN"), "{e}");
        assert_eq!(q.codes_ptr(), ptr);
        assert!(QTensor::alloc(QFormat::Nvfp4, 2, 24, Nvfp4Opts::default()).unwrap_err().to_string().contains("multiple of 16"));
    }
}
