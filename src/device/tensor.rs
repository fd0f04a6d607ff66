//! Tensors: a shape and a contiguous, row-major storage on one device.
//!
//! A tensor never aliases another; views are expressed by the ops' explicit row counts and
//! offsets, the way llm.c passes (B, T) to every kernel. CPU storage is a plain `Vec`.

use super::cuda::CudaStorage;
use anyhow::{bail, Result};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    U8,
    U32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
            DType::U32 => "u32",
        }
    }

    /// Parses the names used in configs and on the command line (`f32`, `bf16`, `float32`, ...).
    pub fn parse(s: &str) -> Result<DType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" | "fp16" | "half" => DType::F16,
            _ => bail!("unknown dtype '{s}': expected one of f32, bf16, f16"),
        })
    }
}

/// Host-side storage of a CPU tensor.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    U8(Vec<u8>),
    U32(Vec<u32>),
}

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

impl CpuStorage {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::U8(v) => v.len(),
            CpuStorage::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Storage {
    pub fn is_cpu(&self) -> bool {
        matches!(self, Storage::Cpu(_))
    }
}

#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    pub fn from_storage(shape: &[usize], storage: Storage) -> Tensor {
        Tensor { shape: shape.to_vec(), storage }
    }

    pub fn cpu_zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let n = numel(shape);
        let s = match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::U8 => CpuStorage::U8(vec![0; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
        };
        Tensor { shape: shape.to_vec(), storage: Storage::Cpu(s) }
    }

    /// [`Tensor::cpu_zeros`] with every page committed now, on transparent huge pages where the
    /// kernel allows (see [`crate::util::advise_huge_pages`]): for the KV cache, which the
    /// decode loop would otherwise fault in 4 KiB at a time (batch-32 decode: `kv_write` 33 →
    /// 10 ms of a 1.6 s run) and then read through a TLB miss per page (attention −10%).
    pub fn cpu_zeros_committed(dtype: DType, shape: &[usize]) -> Tensor {
        fn committed<T: Clone>(n: usize, zero: T) -> Vec<T> {
            // Reserved (an untouched mapping at these sizes), advised, then written.
            let mut v = Vec::with_capacity(n);
            crate::util::advise_huge_pages(v.as_ptr(), n * std::mem::size_of::<T>());
            v.resize(n, zero);
            v
        }
        let n = numel(shape);
        let s = match dtype {
            DType::F32 => CpuStorage::F32(committed(n, 0.0)),
            DType::BF16 => CpuStorage::BF16(committed(n, bf16::ZERO)),
            DType::F16 => CpuStorage::F16(committed(n, f16::ZERO)),
            DType::U8 => CpuStorage::U8(committed(n, 0)),
            DType::U32 => CpuStorage::U32(committed(n, 0)),
        };
        Tensor { shape: shape.to_vec(), storage: Storage::Cpu(s) }
    }

    /// A host tensor of `dtype` holding `data` (rounded to nearest even for BF16/F16).
    pub fn from_f32_host(dtype: DType, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        if numel(shape) != data.len() {
            bail!("tensor of shape {shape:?} needs {} values, got {}", numel(shape), data.len());
        }
        let s = match dtype {
            DType::F32 => CpuStorage::F32(data.to_vec()),
            DType::BF16 => CpuStorage::BF16(data.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => CpuStorage::F16(data.iter().map(|&x| f16::from_f32(x)).collect()),
            other => bail!("cannot build a {} tensor from f32 values", other.name()),
        };
        Ok(Tensor { shape: shape.to_vec(), storage: Storage::Cpu(s) })
    }

    pub fn from_u32_host(shape: &[usize], data: Vec<u32>) -> Result<Tensor> {
        if numel(shape) != data.len() {
            bail!("tensor of shape {shape:?} needs {} values, got {}", numel(shape), data.len());
        }
        Ok(Tensor { shape: shape.to_vec(), storage: Storage::Cpu(CpuStorage::U32(data)) })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Size of dimension `i` (panics on a bad index: shapes are internal invariants).
    pub fn dim(&self, i: usize) -> usize {
        self.shape[i]
    }

    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(c) => match c {
                CpuStorage::F32(_) => DType::F32,
                CpuStorage::BF16(_) => DType::BF16,
                CpuStorage::F16(_) => DType::F16,
                CpuStorage::U8(_) => DType::U8,
                CpuStorage::U32(_) => DType::U32,
            },
            Storage::Cuda(c) => c.dtype(),
        }
    }

    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }

    /// Address of the first element: lets tests prove that two holders share one buffer.
    pub fn data_ptr(&self) -> usize {
        match &self.storage {
            Storage::Cpu(c) => match c {
                CpuStorage::F32(v) => v.as_ptr() as usize,
                CpuStorage::BF16(v) => v.as_ptr() as usize,
                CpuStorage::F16(v) => v.as_ptr() as usize,
                CpuStorage::U8(v) => v.as_ptr() as usize,
                CpuStorage::U32(v) => v.as_ptr() as usize,
            },
            Storage::Cuda(c) => c.device_ptr(),
        }
    }

    pub fn cpu(&self) -> Result<&CpuStorage> {
        match &self.storage {
            Storage::Cpu(c) => Ok(c),
            Storage::Cuda(_) => bail!("expected a CPU tensor, found a CUDA tensor"),
        }
    }

    pub fn cpu_mut(&mut self) -> Result<&mut CpuStorage> {
        match &mut self.storage {
            Storage::Cpu(c) => Ok(c),
            Storage::Cuda(_) => bail!("expected a CPU tensor, found a CUDA tensor"),
        }
    }

    pub fn f32s(&self) -> Result<&[f32]> {
        match self.cpu()? {
            CpuStorage::F32(v) => Ok(v),
            _ => bail!("expected an f32 tensor, found {}", self.dtype().name()),
        }
    }

    pub fn f32s_mut(&mut self) -> Result<&mut [f32]> {
        let dt = self.dtype();
        match self.cpu_mut()? {
            CpuStorage::F32(v) => Ok(v),
            _ => bail!("expected an f32 tensor, found {}", dt.name()),
        }
    }

    pub fn u32s(&self) -> Result<&[u32]> {
        match self.cpu()? {
            CpuStorage::U32(v) => Ok(v),
            _ => bail!("expected a u32 tensor, found {}", self.dtype().name()),
        }
    }

    pub fn u32s_mut(&mut self) -> Result<&mut [u32]> {
        let dt = self.dtype();
        match self.cpu_mut()? {
            CpuStorage::U32(v) => Ok(v),
            _ => bail!("expected a u32 tensor, found {}", dt.name()),
        }
    }

    /// Copies the tensor to host f32 values (any float dtype, any device).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::Cpu(c) => Ok(match c {
                CpuStorage::F32(v) => v.clone(),
                CpuStorage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
                CpuStorage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
                CpuStorage::U8(_) | CpuStorage::U32(_) => {
                    bail!("to_f32_vec on a {} tensor", self.dtype().name())
                }
            }),
            Storage::Cuda(c) => c.to_f32_vec(),
        }
    }

    /// A tensor of `shape` over this one's elements from `offset`, sharing its device memory
    /// (CUDA only: the flat trainer buffers with per-tensor views; host tensors own their
    /// vectors).
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<Tensor> {
        match &self.storage {
            Storage::Cuda(c) => Ok(Tensor::from_storage(shape, Storage::Cuda(c.view(offset, numel(shape))?))),
            Storage::Cpu(_) => bail!("a view of a host tensor (views are for device buffers)"),
        }
    }

    /// Copies a U32 tensor to the host (any device).
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        if self.dtype() != DType::U32 {
            bail!("to_u32_vec on a {} tensor", self.dtype().name());
        }
        match &self.storage {
            Storage::Cpu(_) => Ok(self.u32s()?.to_vec()),
            Storage::Cuda(c) => {
                let mut out = vec![0u32; c.len()];
                c.read_raw(&mut out)?;
                Ok(out)
            }
        }
    }

    /// Copies elements `start..start + n` of a U8 tensor to the host (any device).
    pub fn read_u8(&self, start: usize, n: usize) -> Result<Vec<u8>> {
        if self.dtype() != DType::U8 || start + n > self.numel() {
            bail!("read_u8 of {start}..{} from a {} tensor of {}", start + n, self.dtype().name(), self.numel());
        }
        match &self.storage {
            Storage::Cpu(CpuStorage::U8(v)) => Ok(v[start..start + n].to_vec()),
            Storage::Cpu(_) => bail!("read_u8 on a host tensor that is not u8"),
            Storage::Cuda(c) => {
                let mut out = vec![0u8; n];
                c.view(start, n)?.read_raw(&mut out)?;
                Ok(out)
            }
        }
    }

    /// Copies the first `out.len()` elements of a float tensor of any dtype to the host as f32.
    pub fn read_f32_into_any(&self, out: &mut [f32]) -> Result<()> {
        if out.len() > self.numel() {
            bail!("read of {} values from a tensor of {}", out.len(), self.numel());
        }
        match &self.storage {
            Storage::Cpu(_) => {
                CpuFloats::of(self)?.read_into(0, out);
                Ok(())
            }
            Storage::Cuda(c) => c.read_f32_into(out),
        }
    }

    /// Copies the first `out.len()` elements of an f32 tensor to the host.
    pub fn read_f32_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() > self.numel() {
            bail!("read of {} values from a tensor of {}", out.len(), self.numel());
        }
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => {
                out.copy_from_slice(&v[..out.len()]);
                Ok(())
            }
            Storage::Cuda(c) => c.read_f32_into(out),
            _ => bail!("read_f32_into from a {} tensor", self.dtype().name()),
        }
    }

    /// Overwrites the first `data.len()` elements of a u32 tensor from the host.
    pub fn write_u32(&mut self, data: &[u32]) -> Result<()> {
        if data.len() > self.numel() {
            bail!("write of {} values into a tensor of {}", data.len(), self.numel());
        }
        match &mut self.storage {
            Storage::Cpu(CpuStorage::U32(v)) => {
                v[..data.len()].copy_from_slice(data);
                Ok(())
            }
            Storage::Cuda(c) => c.write_u32(data),
            _ => bail!("write_u32 into a {} tensor", self.dtype().name()),
        }
    }

    /// Overwrites the u32 elements `offset..offset + data.len()` from the host.
    pub fn write_u32_at(&mut self, offset: usize, data: &[u32]) -> Result<()> {
        if offset + data.len() > self.numel() {
            bail!("write of {} values at {offset} into a tensor of {}", data.len(), self.numel());
        }
        match &mut self.storage {
            Storage::Cpu(CpuStorage::U32(v)) => {
                v[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            Storage::Cuda(c) => c.write_u32_at(offset, data),
            _ => bail!("write_u32_at into a {} tensor", self.dtype().name()),
        }
    }

    /// Sets every element to zero, in place (on a CUDA device, a memset queued on its stream).
    pub fn fill_zero(&mut self) -> Result<()> {
        match &mut self.storage {
            Storage::Cpu(c) => match c {
                CpuStorage::F32(v) => v.fill(0.0),
                CpuStorage::BF16(v) => v.fill(half::bf16::ZERO),
                CpuStorage::F16(v) => v.fill(f16::ZERO),
                CpuStorage::U8(v) => v.fill(0),
                CpuStorage::U32(v) => v.fill(0),
            },
            Storage::Cuda(c) => c.fill_zero()?,
        }
        Ok(())
    }

    /// Overwrites the first `data.len()` elements of a float tensor from host f32 values.
    pub fn write_f32(&mut self, data: &[f32]) -> Result<()> {
        if data.len() > self.numel() {
            bail!("write of {} values into a tensor of {}", data.len(), self.numel());
        }
        match &mut self.storage {
            Storage::Cpu(c) => match c {
                CpuStorage::F32(v) => v[..data.len()].copy_from_slice(data),
                CpuStorage::BF16(v) => {
                    for (d, s) in v.iter_mut().zip(data) {
                        *d = bf16_rne(*s);
                    }
                }
                CpuStorage::F16(v) => {
                    for (d, s) in v.iter_mut().zip(data) {
                        *d = f16::from_f32(*s);
                    }
                }
                _ => bail!("write_f32 into a {} tensor", self.dtype().name()),
            },
            Storage::Cuda(c) => c.write_f32(data)?,
        }
        Ok(())
    }

    /// A deep copy (same device, dtype and shape).
    pub fn try_clone(&self) -> Result<Tensor> {
        match &self.storage {
            Storage::Cpu(c) => Ok(Tensor { shape: self.shape.clone(), storage: Storage::Cpu(c.clone()) }),
            Storage::Cuda(c) => c.try_clone(&self.shape),
        }
    }

    /// Overwrites this tensor with `src` (same dtype and element count), in place.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        if src.dtype() != self.dtype() || src.numel() != self.numel() {
            bail!("copy_from: {} {:?} into {} {:?}", src.dtype().name(), src.shape(), self.dtype().name(), self.shape);
        }
        match (&mut self.storage, &src.storage) {
            (Storage::Cpu(d), Storage::Cpu(s)) => match (d, s) {
                (CpuStorage::F32(d), CpuStorage::F32(s)) => d.copy_from_slice(s),
                (CpuStorage::BF16(d), CpuStorage::BF16(s)) => d.copy_from_slice(s),
                (CpuStorage::F16(d), CpuStorage::F16(s)) => d.copy_from_slice(s),
                (CpuStorage::U8(d), CpuStorage::U8(s)) => d.copy_from_slice(s),
                (CpuStorage::U32(d), CpuStorage::U32(s)) => d.copy_from_slice(s),
                _ => bail!("copy_from: storage mismatch"),
            },
            (Storage::Cuda(d), Storage::Cuda(s)) => d.copy_from(s)?,
            _ => bail!("copy_from across devices"),
        }
        Ok(())
    }

    /// Reshapes without moving data (the element count must match).
    pub fn reshape(&mut self, shape: &[usize]) -> Result<()> {
        if numel(shape) != self.numel() {
            bail!("cannot reshape {:?} to {:?}", self.shape, shape);
        }
        self.shape = shape.to_vec();
        Ok(())
    }

    /// Elements the storage holds (at least `numel`).
    pub fn capacity(&self) -> usize {
        match &self.storage {
            Storage::Cpu(c) => c.len(),
            Storage::Cuda(c) => c.len(),
        }
    }

    /// Views a scratch buffer as `shape`, which may cover less than its storage (the rest is
    /// unused until a later view covers it): rows of another width in the same allocation.
    pub fn reshape_within(&mut self, shape: &[usize]) -> Result<()> {
        let capacity = self.capacity();
        if numel(shape) > capacity {
            bail!("cannot view a buffer of {capacity} elements ({:?}) as {shape:?}", self.shape);
        }
        self.shape = shape.to_vec();
        Ok(())
    }
}

/// A read-only view of float weights on the CPU, whatever their storage: plain floats, or the
/// codes and scales of a quantized weight (decoded exactly, see `crate::formats`).
#[derive(Clone, Copy)]
pub enum CpuFloats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    /// FP8 E4M3 codes with one tensor scale: value = e4m3(code) · scale.
    Fp8 {
        codes: &'a [u8],
        scale: f32,
    },
    /// NVFP4 codes (two per byte), E4M3 scales per 16 values and a global scale.
    Nvfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        global: f32,
    },
}

impl<'a> CpuFloats<'a> {
    pub fn of(t: &'a Tensor) -> Result<CpuFloats<'a>> {
        Ok(match t.cpu()? {
            CpuStorage::F32(v) => CpuFloats::F32(v),
            CpuStorage::BF16(v) => CpuFloats::BF16(v),
            CpuStorage::F16(v) => CpuFloats::F16(v),
            _ => bail!("expected a float tensor, found {}", t.dtype().name()),
        })
    }

    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            CpuFloats::F32(v) => v[i],
            CpuFloats::BF16(v) => v[i].to_f32(),
            CpuFloats::F16(v) => v[i].to_f32(),
            CpuFloats::Fp8 { .. } | CpuFloats::Nvfp4 { .. } => {
                let mut o = [0.0f32; 16];
                let b = i / 16 * 16;
                self.read_into(b, &mut o);
                o[i - b]
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuFloats::F32(v) => v.len(),
            CpuFloats::BF16(v) => v.len(),
            CpuFloats::F16(v) => v.len(),
            CpuFloats::Fp8 { codes, .. } => codes.len(),
            CpuFloats::Nvfp4 { packed, .. } => packed.len() * 2,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored bytes of values `start..start + n` (clipped at the end; NVFP4: the packed codes
    /// only, not their scales): what a reader of those values touches first, for prefetching.
    pub fn bytes(&self, start: usize, n: usize) -> &'a [u8] {
        fn range<T: bytemuck::Pod>(v: &[T], start: usize, n: usize) -> &[u8] {
            let a = start.min(v.len());
            bytemuck::cast_slice(&v[a..(a + n).min(v.len())])
        }
        match *self {
            CpuFloats::F32(v) => range(v, start, n),
            CpuFloats::BF16(v) => range(v, start, n),
            CpuFloats::F16(v) => range(v, start, n),
            CpuFloats::Fp8 { codes, .. } => range(codes, start, n),
            CpuFloats::Nvfp4 { packed, .. } => range(packed, start / 2, n.div_ceil(2)),
        }
    }

    /// Converts `range` to f32 into `out` (same length).
    #[inline]
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            CpuFloats::F32(v) => out.copy_from_slice(&v[start..start + n]),
            CpuFloats::BF16(v) => {
                // The BF16 bits are the f32's high half: a shift that vectorizes (half's
                // to_f32 also quiets NaNs, one branch per value; NaN stays NaN here too).
                for (o, x) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = f32::from_bits((x.to_bits() as u32) << 16);
                }
            }
            CpuFloats::F16(v) => {
                for (o, x) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = x.to_f32();
                }
            }
            CpuFloats::Fp8 { codes, scale } => {
                let t = crate::formats::fp8::e4m3_table();
                for (o, c) in out.iter_mut().zip(&codes[start..start + n]) {
                    *o = t[*c as usize] * scale;
                }
            }
            CpuFloats::Nvfp4 { packed, scales, global } => {
                debug_assert!(start % 16 == 0 && n % 16 == 0, "NVFP4 reads whole 16-value blocks");
                crate::formats::nvfp4::dequantize_into(packed, scales, *global, start, out)
            }
        }
    }
}

/// f32 → BF16, round to nearest even, bit-identical to `half::bf16::from_f32` (NaN keeps its sign
/// and high payload, quieted) but without branches on the value, so loops over it vectorize.
#[inline(always)]
pub fn bf16_rne(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x40) as u16;
    bf16::from_bits(if x.is_nan() { nan } else { rounded })
}

#[cfg(test)]
mod bf16_tests {
    /// Every 2^-12-th f32 bit pattern (all exponents, signs, ties, NaNs, infinities, subnormals)
    /// plus the exact ties around 1: the branch-free rounding equals half's.
    #[test]
    fn bf16_rne_equals_half_everywhere() {
        let ties = [
            0x3F80_8000u32,
            0x3F81_8000,
            0x3F80_7FFF,
            0x3F80_8001,
            0x7F7F_FFFF,
            0x7F80_0001,
            0xFF80_0001,
            0x0000_8000,
            0x8001_8000,
        ];
        for b in (0..=u32::MAX).step_by(4093).chain(ties) {
            let x = f32::from_bits(b);
            assert_eq!(super::bf16_rne(x).to_bits(), half::bf16::from_f32(x).to_bits(), "{b:#010x}");
        }
    }
}

#[cfg(test)]
mod bytes_tests {
    use super::CpuFloats;

    #[test]
    fn bytes_cover_the_range_and_clip_at_the_end() {
        let f = [1.0f32, 2.0, 3.0, 4.0];
        let b = CpuFloats::F32(&f).bytes(1, 2);
        assert_eq!(b, bytemuck::cast_slice::<f32, u8>(&f[1..3]));
        assert_eq!(CpuFloats::F32(&f).bytes(3, 10).len(), 4);
        assert!(CpuFloats::F32(&f).bytes(9, 2).is_empty());
        let h = [half::bf16::ONE; 5];
        assert_eq!(CpuFloats::BF16(&h).bytes(2, 2).len(), 4);
        let packed = [0u8; 8];
        let scales = [0u8; 1];
        // 16 NVFP4 values from value 4: bytes 2..8 of the packed codes (clipped).
        assert_eq!(CpuFloats::Nvfp4 { packed: &packed, scales: &scales, global: 1.0 }.bytes(4, 16).len(), 6);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_zeros_are_zeros_of_every_dtype() {
        // 3 MiB of f32: large enough for the huge-page advice to apply.
        let shape = [3, 256, 1024];
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::U8, DType::U32] {
            let t = Tensor::cpu_zeros_committed(dtype, &shape);
            assert_eq!((t.dtype(), t.shape()), (dtype, &shape[..]));
            let nonzero = match t.cpu().expect("a CPU tensor") {
                CpuStorage::F32(v) => v.iter().filter(|x| x.to_bits() != 0).count(),
                CpuStorage::BF16(v) => v.iter().filter(|x| x.to_bits() != 0).count(),
                CpuStorage::F16(v) => v.iter().filter(|x| x.to_bits() != 0).count(),
                CpuStorage::U8(v) => v.iter().filter(|&&x| x != 0).count(),
                CpuStorage::U32(v) => v.iter().filter(|&&x| x != 0).count(),
            };
            assert_eq!((nonzero, t.numel()), (0, 3 << 18), "{}", dtype.name());
        }
    }
}
