//! A quantized weight: its codes and scales in buffers allocated once, rewritten in place from
//! the trainer's weights at every sync (fused amax + quantize), and read by the engine's linears.

use super::fp8::E4M3;
use super::nvfp4::{self, Nvfp4Opts, BLOCK};
use super::simd;
use crate::device::{CpuFloats, CpuStorage, DType, Device, Tensor};
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Values a parallel task of a requantize handles (stack buffers of this size).
const CH: usize = 8192;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QFormat {
    /// FP8 E4M3 with one FP32 scale per tensor (amax / 448).
    Fp8,
    /// NVFP4: E2M1, E4M3 scale per 16 along K, FP32 scale per tensor.
    Nvfp4,
}

#[derive(Debug)]
pub struct QTensor {
    pub format: QFormat,
    pub rows: usize,
    pub k: usize,
    /// FP8: one code per value (rows, K). NVFP4: two codes per byte (rows, K/2). u8, on the
    /// device of the weights it quantizes.
    pub codes: Tensor,
    /// NVFP4 block scales (rows, K/16), E4M3 codes; empty for FP8.
    pub block_scales: Tensor,
    /// FP8: the tensor scale; NVFP4: the global scale.
    pub scale: f32,
    pub opts: Nvfp4Opts,
    /// Where the GEMM is emulated (NVFP4 on Hopper): the unit values (e4m3, or q·bs for NVFP4:
    /// exact in BF16) as (rows, K) BF16, decoded once by each requantize on the device instead
    /// of at every GEMM (`keep_decoded`). None elsewhere.
    pub decoded: Option<Tensor>,
    /// Where an NVFP4 GEMM runs on CUTLASS's block-scaled kernel (sm_100): the block scales
    /// in its tiled layout, rewritten by each requantize instead of at every GEMM
    /// (`keep_swizzled`). None elsewhere.
    pub swizzled: Option<Tensor>,
}

impl QTensor {
    /// Host buffers for a (rows, K) weight.
    pub fn alloc(format: QFormat, rows: usize, k: usize, opts: Nvfp4Opts) -> Result<QTensor> {
        Self::alloc_on(&Device::Cpu(crate::device::CpuDevice::host()), format, rows, k, opts)
    }

    /// Bytes a (rows, K) weight takes in `format` ([`Self::size_bytes`] before allocating).
    pub fn bytes_for(format: QFormat, rows: usize, k: usize) -> usize {
        match format {
            QFormat::Fp8 => rows * k + 4,
            QFormat::Nvfp4 => rows * k / 2 + rows * k / BLOCK + 4,
        }
    }

    /// Buffers for a (rows, K) weight on `dev`.
    pub fn alloc_on(dev: &Device, format: QFormat, rows: usize, k: usize, opts: Nvfp4Opts) -> Result<QTensor> {
        let (codes, block_scales) = match format {
            QFormat::Fp8 => (rows * k, 0),
            QFormat::Nvfp4 => {
                if k % BLOCK != 0 {
                    bail!("NVFP4 needs the reduction dimension to be a multiple of 16, got K = {k}");
                }
                (rows * k / 2, rows * k / BLOCK)
            }
        };
        let codes = dev.zeros(DType::U8, &[codes])?;
        let block_scales = dev.zeros(DType::U8, &[block_scales])?;
        Ok(QTensor { format, rows, k, codes, block_scales, scale: 1.0, opts, decoded: None, swizzled: None })
    }

    /// Keeps the decoded unit values on `dev` from the next requantize on (see `decoded`).
    pub fn keep_decoded(&mut self, dev: &Device) -> Result<()> {
        if self.decoded.is_none() {
            self.decoded = Some(dev.uninit(DType::BF16, &[self.rows, self.k])?);
        }
        Ok(())
    }

    /// Keeps the tiled block scales of an NVFP4 weight on `dev` from the next requantize on
    /// (see `swizzled`); `bytes`: their size (`ops::quantize::swizzled_sf_bytes`).
    pub fn keep_swizzled(&mut self, dev: &Device, bytes: usize) -> Result<()> {
        if self.format == QFormat::Nvfp4 && self.swizzled.is_none() {
            self.swizzled = Some(dev.uninit(DType::U8, &[bytes])?);
        }
        Ok(())
    }

    pub fn size_bytes(&self) -> usize {
        let kept: usize =
            [&self.decoded, &self.swizzled].iter().filter_map(|t| t.as_ref()).map(|t| t.size_bytes()).sum();
        self.codes.size_bytes() + self.block_scales.size_bytes() + 4 + kept
    }

    /// Address of the code buffer (tests prove syncs do not move it).
    pub fn codes_ptr(&self) -> usize {
        self.codes.data_ptr()
    }

    /// The codes, on the host.
    pub fn codes_bytes(&self) -> Result<&[u8]> {
        match self.codes.cpu()? {
            CpuStorage::U8(v) => Ok(v),
            _ => bail!("quantized codes must be u8"),
        }
    }

    /// The NVFP4 block scales (E4M3 codes), on the host.
    pub fn scales_bytes(&self) -> Result<&[u8]> {
        match self.block_scales.cpu()? {
            CpuStorage::U8(v) => Ok(v),
            _ => bail!("block scales must be u8"),
        }
    }

    /// The amax a requantize of `src` quantizes against (of the rotated values under the RHT):
    /// one parallel pass. Fails, naming `name`, on a NaN or Inf.
    fn source_amax(&self, src: CpuFloats, name: &str) -> Result<f32> {
        let n = self.rows * self.k;
        if src.len() != n {
            bail!("{name}: quantizing {} values into a buffer of {n}", src.len());
        }
        let nan_max = |a: f32, b: f32| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) };
        let rht = self.opts.rht.map(nvfp4::rht_signs);
        // BF16 and F32 sources without the RHT: the largest magnitude's bits, compared as integers.
        let amax = match (src, rht.is_some()) {
            (CpuFloats::BF16(v), false) => simd::amax_bf16(v),
            (CpuFloats::F32(v), false) => simd::amax_f32(v),
            _ => (0..n.div_ceil(CH))
                .into_par_iter()
                .map(|c| {
                    let mut buf = [0.0f32; CH];
                    let len = CH.min(n - c * CH);
                    src.read_into(c * CH, &mut buf[..len]);
                    if let Some(s) = &rht {
                        for blk in buf[..len].chunks_exact_mut(BLOCK) {
                            nvfp4::rht_block(blk, s);
                        }
                    }
                    simd::amax(&buf[..len])
                })
                .reduce(|| 0.0f32, nan_max),
        };
        if !amax.is_finite() {
            bail!("{name}: cannot quantize a tensor holding NaN or Inf values");
        }
        Ok(amax)
    }

    /// The tensor scale (FP8: amax / 448) or global scale (NVFP4) for `amax`.
    fn scale_for(&self, amax: f32) -> f32 {
        match self.format {
            QFormat::Fp8 if amax > 0.0 => amax / E4M3.max(),
            QFormat::Fp8 => 1.0,
            QFormat::Nvfp4 => nvfp4::global_scale(amax),
        }
    }

    /// NVFP4 row `r` of `src` at global scale `global` into `p` (K/2 packed codes) and `s` (K/16
    /// block scales): the arithmetic of a requantize, row by row, staged through `buf` (a
    /// multiple of 16 values, the caller's, so that a task sets it up once for many rows).
    #[allow(clippy::too_many_arguments)]
    fn encode_nvfp4_row(
        k: usize,
        opts: &Nvfp4Opts,
        src: CpuFloats,
        r: usize,
        global: f32,
        rht: Option<&[f32; BLOCK]>,
        p: &mut [u8],
        s: &mut [u8],
        buf: &mut [f32],
    ) {
        // BF16 weights straight into the vector kernel (no f32 staging).
        if let (CpuFloats::BF16(v), None, None) = (src, rht, opts.stochastic) {
            if simd::quantize_nvfp4_bf16(&v[r * k..(r + 1) * k], global, p, s).is_some() {
                return;
            }
        }
        let mut at = 0;
        while at < k {
            let len = buf.len().min(k - at);
            src.read_into(r * k + at, &mut buf[..len]);
            simd::quantize_nvfp4(
                &buf[..len],
                global,
                opts,
                rht,
                (r * k + at) as u64,
                &mut p[at / 2..(at + len) / 2],
                &mut s[at / BLOCK..(at + len) / BLOCK],
            );
            at += len;
        }
    }

    /// Re-quantizes from `src` (rows·K values) in place: one parallel pass for the amax, one
    /// that encodes (reading BF16/F16 sources directly, through small stack buffers). Fails,
    /// naming `name`, if `src` holds a non-finite value. Allocates nothing.
    pub fn requantize_cpu(&mut self, src: CpuFloats, name: &str) -> Result<()> {
        let amax = self.source_amax(src, name)?;
        let scale = self.scale_for(amax);
        self.scale = scale;
        match self.format {
            QFormat::Fp8 => {
                let codes = match self.codes.cpu_mut()? {
                    CpuStorage::U8(v) => v,
                    _ => bail!("quantized codes must be u8"),
                };
                codes.par_chunks_mut(CH).enumerate().for_each(|(c, out)| {
                    let mut buf = [0.0f32; CH];
                    let len = out.len();
                    src.read_into(c * CH, &mut buf[..len]);
                    simd::encode_fp8(&buf[..len], scale, out);
                });
            }
            QFormat::Nvfp4 => {
                let (k, opts) = (self.k, self.opts);
                let rht = opts.rht.map(nvfp4::rht_signs);
                let (codes, scales) = match (self.codes.cpu_mut()?, self.block_scales.cpu_mut()?) {
                    (CpuStorage::U8(c), CpuStorage::U8(s)) => (c, s),
                    _ => bail!("quantized codes and scales must be u8"),
                };
                // Groups of whole rows in parallel (about CH values a task, so the stack buffer's
                // set-up is paid once per CH values), each row in pieces of at most CH values.
                let rows_per = (CH / k).max(1);
                codes
                    .par_chunks_mut(rows_per * k / 2)
                    .zip(scales.par_chunks_mut(rows_per * k / BLOCK))
                    .enumerate()
                    .for_each(|(g, (pg, sg))| {
                        let mut buf = [0.0f32; CH];
                        for (j, (p, s)) in pg.chunks_mut(k / 2).zip(sg.chunks_mut(k / BLOCK)).enumerate() {
                            let r = g * rows_per + j;
                            Self::encode_nvfp4_row(k, &opts, src, r, scale, rht.as_ref(), p, s, &mut buf);
                        }
                    });
            }
        }
        Ok(())
    }

    /// Whether these buffers hold what a fresh quantization of `src` gives at the sampled
    /// `rows`: the tensor scale and those rows' codes (and NVFP4 block scales), bit for bit. The
    /// amax pass reads all of `src` (the scale depends on it); only the sampled rows are encoded,
    /// and only they are read back from a device.
    pub fn matches_fresh(&self, src: CpuFloats, name: &str, rows: &[usize]) -> Result<bool> {
        let amax = self.source_amax(src, name)?;
        let scale = self.scale_for(amax);
        if scale.to_bits() != self.scale.to_bits() {
            return Ok(false);
        }
        let k = self.k;
        let rht = self.opts.rht.map(nvfp4::rht_signs);
        for &r in rows.iter().filter(|&&r| r < self.rows) {
            match self.format {
                QFormat::Fp8 => {
                    let mut want = vec![0u8; k];
                    let mut buf = vec![0.0f32; k];
                    src.read_into(r * k, &mut buf);
                    simd::encode_fp8(&buf, scale, &mut want);
                    if self.codes.read_u8(r * k, k)? != want {
                        return Ok(false);
                    }
                    let table = super::fp8::e4m3_table();
                    let unit: Vec<f32> = want.iter().map(|&c| table[c as usize]).collect();
                    if !self.kept_row_matches(r, &unit, None)? {
                        return Ok(false);
                    }
                }
                QFormat::Nvfp4 => {
                    let (mut p, mut s) = (vec![0u8; k / 2], vec![0u8; k / BLOCK]);
                    let mut buf = vec![0.0f32; CH];
                    Self::encode_nvfp4_row(k, &self.opts, src, r, scale, rht.as_ref(), &mut p, &mut s, &mut buf);
                    if self.codes.read_u8(r * k / 2, k / 2)? != p
                        || self.block_scales.read_u8(r * k / BLOCK, k / BLOCK)? != s
                    {
                        return Ok(false);
                    }
                    let mut unit = vec![0.0f32; k];
                    nvfp4::dequantize_into(&p, &s, 1.0, 0, &mut unit);
                    if !self.kept_row_matches(r, &unit, Some(&s))? {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    /// Whether row `r` of the kept GEMM operands (`decoded`, `swizzled`) holds `unit` (the
    /// row's unit values) and `scales` (its NVFP4 block scales) — what the GEMM reads on a GPU,
    /// checked like the codes.
    fn kept_row_matches(&self, r: usize, unit: &[f32], scales: Option<&[u8]>) -> Result<bool> {
        let k = self.k;
        if let Some(d) = &self.decoded {
            let got = d.view(r * k, &[k])?.to_f32_vec()?;
            if got.iter().zip(unit).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Ok(false);
            }
        }
        if let (Some(t), Some(s)) = (&self.swizzled, scales) {
            // The tiled layout of `ct_swizzle_sf`: 128 × 4 tiles of 512 bytes, K tiles
            // innermost; row r, column c at (r % 32)·16 + (r % 128 / 32)·4 + c % 4 in its tile.
            // Row r's tiles are one run of col_tiles · 512 bytes.
            let col_tiles = (k / BLOCK).div_ceil(4);
            let run = (r / 128) * col_tiles * 512;
            let bytes = t.read_u8(run, (col_tiles * 512).min(t.numel().saturating_sub(run)))?;
            for (c, &want) in s.iter().enumerate() {
                let at = (c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4;
                if bytes.get(at) != Some(&want) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The decoded view for the CPU linear kernel.
    pub fn view(&self) -> Result<CpuFloats<'_>> {
        Ok(match self.format {
            QFormat::Fp8 => CpuFloats::Fp8 { codes: self.codes_bytes()?, scale: self.scale },
            QFormat::Nvfp4 => {
                CpuFloats::Nvfp4 { packed: self.codes_bytes()?, scales: self.scales_bytes()?, global: self.scale }
            }
        })
    }

    /// All values, decoded (tests and export; host tensors).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.k];
        if let Ok(v) = self.view() {
            v.read_into(0, &mut out);
        }
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
        q.requantize_cpu(CpuFloats::F32(&x), "w").unwrap();
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
        let e = q.requantize_cpu(CpuFloats::F32(&x), "model.layers.0.mlp.up_proj.weight").unwrap_err().to_string();
        assert!(e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("NaN"), "{e}");
        assert_eq!(q.codes_ptr(), ptr);
        assert!(QTensor::alloc(QFormat::Nvfp4, 2, 24, Nvfp4Opts::default())
            .unwrap_err()
            .to_string()
            .contains("multiple of 16"));
    }
}
