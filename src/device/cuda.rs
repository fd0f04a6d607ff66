//! The CUDA device (feature `cuda`; without it `cuda_stub.rs` stands in with the same API).
//!
//! One primary context and one stream per device; device memory from a caching allocator with
//! a budget (`cuda/alloc.rs`); the kernels of csrc/kernels/ loaded from the cubins build.rs
//! embedded for this GPU's architecture (`cuda/kernels.rs`, never PTX JIT); cuBLASLt for BF16 /
//! F32 / FP8 / NVFP4 GEMMs (`cuda/blas.rs`); how a tensor is passed to a kernel
//! (`cuda/args.rs`); NVTX ranges (`cuda/nvtx.rs`). The ops' CUDA twins live in their rooms
//! (`ops/<op>/cuda.rs`, the CUTLASS path in `ops/linear/cuda_lowp.rs`) and build on the
//! public methods here; this layer names nothing above it. Tensors on the GPU keep the dtypes the CPU
//! engine gives them: activations f32, weights f32 / BF16 / F16, FP8 KV caches and quantized
//! weights u8. GEMMs with BF16 (F16) weights round their f32 input rows to BF16 (F16) and
//! accumulate in FP32.
//!
//! Honesty note: this code compiles and links on a machine without a GPU; none of it has run
//! on one yet. `colotrain device-check` (bench/device_check.sh) compares every op with its CPU
//! twin on a GPU machine; until it has passed there, treat every kernel as unverified.
//!
//! Errors found by kernels (an out-of-vocabulary id, a bad cache slot) are written into a
//! device error word and reported at the next synchronization or device-to-host read.
//! `COLOTRAIN_CUDA_SYNC=1` synchronizes after every launch (exact attribution of faults);
//! `COLOTRAIN_CUDA_BUDGET_MB` sets the memory budget (default: 92% of the free memory).

use super::{CpuStorage, DType, Storage, Tensor};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as dr, sys, CudaContext, CudaStream};
use half::{bf16, f16};
use std::sync::{Arc, Mutex, MutexGuard};

#[path = "cuda/alloc.rs"]
mod alloc;
#[path = "cuda/args.rs"]
pub mod args;
#[path = "cuda/blas.rs"]
mod blas;
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]
#[path = "cuda/ffi.rs"]
pub mod ffi;
#[path = "cuda/kernels.rs"]
pub mod kernels;
#[path = "cuda/nvtx.rs"]
pub mod nvtx;

/// One embedded cubin (build.rs writes the list).
pub struct Cubin {
    pub module: &'static str,
    pub arch: &'static str,
    pub bytes: &'static [u8],
}

mod embedded {
    use super::Cubin;
    include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));
}
/// The architectures this binary carries kernels for (COLOTRAIN_CUDA_ARCHS at build time).
pub use blas::Elem;
pub use embedded::BUILT_ARCHS;
use embedded::CUBINS;

/// A CUDA device. Cheap to clone; the context, stream, allocator and modules are shared.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    arch: String,
    sm_count: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: kernels::Kernels,
    alloc: Mutex<alloc::Allocator>,
    blas: Mutex<blas::Blas>,
    /// 4 bytes of device memory where kernels record the first bad input they met.
    err_word: u64,
    sync_launches: bool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({})", self.name())
    }
}

/// The allocator's view of the driver.
struct DriverOps<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
}

impl alloc::Driver for DriverOps<'_> {
    fn malloc(&self, bytes: usize) -> Result<u64> {
        self.ctx.bind_to_thread().map_err(|e| anyhow!("{e}"))?;
        // SAFETY: a plain allocation in the bound context; the pointer is owned by the
        // allocator until `free`.
        unsafe { dr::malloc_sync(bytes) }.map_err(|e| anyhow!("{e}"))
    }
    fn free(&self, ptr: u64) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync and is in no free list any more; quiesce()
            // ran first, so no queued work uses it.
            let _ = unsafe { dr::free_sync(ptr) };
        }
    }
    fn quiesce(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| anyhow!("synchronize before releasing memory: {e}"))
    }
}

fn budget_from_env(free: usize) -> Result<usize> {
    match std::env::var("COLOTRAIN_CUDA_BUDGET_MB") {
        Ok(s) => {
            let mb: usize = s
                .trim()
                .parse()
                .map_err(|_| anyhow!("COLOTRAIN_CUDA_BUDGET_MB='{s}': expected a number of MiB, e.g. 40000"))?;
            Ok(mb << 20)
        }
        Err(_) => Ok(free / 100 * 92),
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: a clear error (no panic) when the driver or the GPU is missing,
    /// or when this binary has no cubin for the GPU's architecture.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            bail!(
                "cuda:{ordinal}: no CUDA driver found (libcuda.so could not be loaded): this machine has no NVIDIA \
                 driver, or its folder is not on LD_LIBRARY_PATH (this binary was built with CUDA kernels for {})",
                BUILT_ARCHS.join(", ")
            );
        }
        // cudarc panics when the driver lacks a symbol of the CUDA 13.0 API it was built for.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                anyhow!("cuda:{ordinal}: the CUDA driver is older than CUDA 13.0 (a driver symbol is missing)")
            })?
            .map_err(|e| {
                let count = CudaContext::device_count().unwrap_or(0);
                anyhow!("cuda:{ordinal}: cannot open the device ({e}); the driver reports {count} CUDA device(s)")
            })?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx.compute_capability().map_err(|e| anyhow!("cuda:{ordinal}: {e}"))?;
        let candidates = [format!("sm_{}{}a", cc.0, cc.1), format!("sm_{}{}", cc.0, cc.1)];
        let arch = candidates.iter().find(|a| BUILT_ARCHS.contains(&a.as_str())).cloned().ok_or_else(|| {
            anyhow!(
                "cuda:{ordinal} ({name}) has compute capability {}.{}, but this binary only has kernels for {}: rebuild \
                 with COLOTRAIN_CUDA_ARCHS={} cargo build --release --features cuda",
                cc.0,
                cc.1,
                BUILT_ARCHS.join(", "),
                candidates[0]
            )
        })?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow!("cuda:{ordinal}: {e}"))? as u32;
        let stream = ctx.new_stream().map_err(|e| anyhow!("cuda:{ordinal}: cannot create a stream: {e}"))?;
        let kernels = kernels::Kernels::load(&ctx, &arch).with_context(|| format!("cuda:{ordinal} ({name})"))?;
        let (free, _total) = ctx.mem_get_info().map_err(|e| anyhow!("cuda:{ordinal}: {e}"))?;
        let mut allocator = alloc::Allocator::new(budget_from_env(free)?);
        let drv = DriverOps { ctx: &ctx, stream: &stream };
        let (err_word, _) = allocator.alloc(&drv, 4, "the error word")?;
        let (ws, ws_bytes) = allocator.alloc(&drv, blas::WORKSPACE_BYTES, "the cuBLASLt workspace")?;
        let blas = blas::Blas::new(ws, ws_bytes).with_context(|| format!("cuda:{ordinal} ({name})"))?;
        let inner = Inner {
            ordinal,
            name,
            cc,
            arch,
            sm_count,
            ctx,
            stream,
            kernels,
            alloc: Mutex::new(allocator),
            blas: Mutex::new(blas),
            err_word,
            sync_launches: std::env::var("COLOTRAIN_CUDA_SYNC").map(|v| v == "1").unwrap_or(false),
        };
        let dev = CudaDevice { inner: Arc::new(inner) };
        dev.memset0(err_word, 4)?;
        dev.synchronize()?;
        Ok(dev)
    }

    pub fn name(&self) -> String {
        let i = &self.inner;
        format!("cuda:{} ({}, sm_{}{}, kernels {})", i.ordinal, i.name, i.cc.0, i.cc.1, i.arch)
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.cc
    }

    pub fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let s = CudaStorage::alloc(self, dtype, n, &format!("a {} tensor of shape {shape:?}", dtype.name()))?;
        self.memset0(s.ptr, n * dtype.size())?;
        Ok(Tensor::from_storage(shape, Storage::Cuda(s)))
    }

    /// Copies a tensor to this device (a host tensor, or another CUDA tensor).
    pub fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let n = t.numel();
        let s = CudaStorage::alloc(
            self,
            t.dtype(),
            n,
            &format!("an upload of a {} tensor of shape {:?}", t.dtype().name(), t.shape()),
        )?;
        match t.storage() {
            Storage::Cpu(c) => match c {
                CpuStorage::F32(v) => self.htod(s.ptr, v)?,
                CpuStorage::BF16(v) => self.htod(s.ptr, v)?,
                CpuStorage::F16(v) => self.htod(s.ptr, v)?,
                CpuStorage::U8(v) => self.htod(s.ptr, v)?,
                CpuStorage::U32(v) => self.htod(s.ptr, v)?,
            },
            Storage::Cuda(c) => self.dtod(s.ptr, c.ptr, n * t.dtype().size())?,
        }
        Ok(Tensor::from_storage(t.shape(), Storage::Cuda(s)))
    }

    /// Waits for the stream and reports any error a kernel recorded.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner.stream.synchronize().map_err(|e| anyhow!("{}: {e}", self.name()))?;
        let mut w = [0u32; 1];
        // SAFETY: err_word is a live 4-byte device allocation owned by this device; the stream
        // is idle, and `w` is a host buffer of 4 bytes.
        unsafe { dr::memcpy_dtoh_async(&mut w, self.inner.err_word, self.stream()) }.map_err(|e| anyhow!("{e}"))?;
        self.inner.stream.synchronize().map_err(|e| anyhow!("{}: {e}", self.name()))?;
        if w[0] != 0 {
            self.memset0(self.inner.err_word, 4)?;
            bail!("{}: {}", self.name(), describe_error(w[0]));
        }
        Ok(())
    }

    /// Bytes held by the allocator: (in use, cached, peak, budget).
    pub fn memory(&self) -> (usize, usize, usize, usize) {
        let a = self.allocator();
        (a.in_use, a.cached, a.peak, a.budget)
    }

    /// Milliseconds of device time `f` takes on this device's stream (CUDA events).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.bind()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.inner.ctx.new_event(flags).map_err(|e| anyhow!("{e}"))?;
        let end = self.inner.ctx.new_event(flags).map_err(|e| anyhow!("{e}"))?;
        start.record(&self.inner.stream).map_err(|e| anyhow!("{e}"))?;
        f()?;
        end.record(&self.inner.stream).map_err(|e| anyhow!("{e}"))?;
        self.synchronize()?;
        Ok(start.elapsed_ms(&end).map_err(|e| anyhow!("{e}"))? as f64)
    }

    // ---- what the op rooms' CUDA twins build on ---------------------------------------------

    /// The device address of the error word that kernels set on a bad index.
    pub fn err_word(&self) -> u64 {
        self.inner.err_word
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("cuda:{}: cannot bind the context: {e}", self.inner.ordinal))
    }

    /// The device's one stream: every launch and copy of this device is ordered on it.
    pub fn stream(&self) -> sys::CUstream {
        self.inner.stream.cu_stream()
    }

    fn allocator(&self) -> MutexGuard<'_, alloc::Allocator> {
        self.inner.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn blas(&self) -> MutexGuard<'_, blas::Blas> {
        self.inner.blas.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Scratch device memory, returned to the cache when dropped.
    pub fn scratch(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        let drv = DriverOps { ctx: &self.inner.ctx, stream: &self.inner.stream };
        let (ptr, class) = self.allocator().alloc(&drv, bytes, what)?;
        Ok(DevBuf { ptr, class, dev: self.clone() })
    }

    /// Zeroes `bytes` at `ptr`, queued on the stream.
    pub fn memset0(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `ptr` is a live allocation of at least `bytes` bytes on this device.
        unsafe { dr::memset_d8_async(ptr, 0, bytes, self.stream()) }.map_err(|e| anyhow!("memset: {e}"))
    }

    /// Copies `src` to `dst`, queued on the stream (the host data is staged before return).
    pub fn htod<T>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds at least size_of_val(src) bytes. A copy from pageable memory is
        // staged before the call returns, so `src` may be dropped afterwards.
        unsafe { dr::memcpy_htod_async(dst, src, self.stream()) }.map_err(|e| anyhow!("host-to-device copy: {e}"))
    }

    /// Copies to the host and waits; reports kernel-recorded errors (a synchronization point).
    pub fn dtoh<T>(&self, dst: &mut [T], src: u64) -> Result<()> {
        if !dst.is_empty() {
            self.bind()?;
            // SAFETY: `src` holds at least size_of_val(dst) bytes; `dst` is borrowed mutably
            // until the synchronization below, which completes the copy.
            unsafe { dr::memcpy_dtoh_async(dst, src, self.stream()) }
                .map_err(|e| anyhow!("device-to-host copy: {e}"))?;
        }
        self.synchronize()
    }

    /// Copies `bytes` from `src` to `dst` on the device, queued on the stream.
    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both are live allocations of at least `bytes` bytes on this device.
        unsafe { dr::memcpy_dtod_async(dst, src, bytes, self.stream()) }.map_err(|e| anyhow!("device copy: {e}"))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let drv = DriverOps { ctx: &self.ctx, stream: &self.stream };
        if let Ok(mut a) = self.alloc.lock() {
            let ws = self.blas.lock().map(|b| b.workspace()).ok();
            a.free(self.err_word, alloc::size_class(4));
            if let Some((p, c)) = ws {
                a.free(p, c);
            }
            let _ = a.release(&drv);
        }
    }
}

fn describe_error(code: u32) -> String {
    match code as i32 {
        ffi::CT_ERR_TOKEN_ID => "a token id is out of the vocabulary (embedding)".into(),
        ffi::CT_ERR_GATHER_ROW => "gather_rows: a row index is out of range".into(),
        ffi::CT_ERR_KV_SLOT => "kv_write: a cache slot lies outside the KV cache".into(),
        ffi::CT_ERR_TARGET => "a target token is outside the vocabulary (log_softmax_gather)".into(),
        ffi::CT_ERR_ATTN_META => "paged attention: q_start / ctx_len / block tables are inconsistent".into(),
        c => format!("a kernel reported error code {c}"),
    }
}

/// Device memory that returns to the allocator's cache when dropped.
pub struct DevBuf {
    /// The device address.
    pub ptr: u64,
    class: usize,
    dev: CudaDevice,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        self.dev.allocator().free(self.ptr, self.class);
    }
}

/// The storage of a CUDA tensor: `len` elements of `dtype` in one device allocation.
pub struct CudaStorage {
    buf: DevBuf,
    ptr: u64,
    len: usize,
    dtype: DType,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage({} x {} on cuda:{} at {:#x})",
            self.dtype.name(),
            self.len,
            self.buf.dev.inner.ordinal,
            self.ptr
        )
    }
}

impl CudaStorage {
    fn alloc(dev: &CudaDevice, dtype: DType, len: usize, what: &str) -> Result<CudaStorage> {
        let buf = dev.scratch(len * dtype.size(), what)?;
        Ok(CudaStorage { ptr: buf.ptr, buf, len, dtype })
    }

    fn dev(&self) -> &CudaDevice {
        &self.buf.dev
    }

    /// The ordinal of the device this storage lives on.
    pub fn ordinal(&self) -> usize {
        self.buf.dev.inner.ordinal
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device_ptr(&self) -> usize {
        self.ptr as usize
    }

    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.len];
        self.read_f32_into(&mut out)?;
        Ok(out)
    }

    pub fn try_clone(&self, shape: &[usize]) -> Result<Tensor> {
        let s = CudaStorage::alloc(self.dev(), self.dtype, self.len, "a tensor copy")?;
        self.dev().dtod(s.ptr, self.ptr, self.len * self.dtype.size())?;
        Ok(Tensor::from_storage(shape, Storage::Cuda(s)))
    }

    pub fn copy_from(&mut self, src: &CudaStorage) -> Result<()> {
        if src.dtype != self.dtype || src.len != self.len {
            bail!("copy_from: {} x {} into {} x {}", src.dtype.name(), src.len, self.dtype.name(), self.len);
        }
        self.dev().dtod(self.ptr, src.ptr, self.len * self.dtype.size())
    }

    /// The first `out.len()` elements as f32 (any float dtype).
    pub fn read_f32_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() > self.len {
            bail!("read of {} values from a tensor of {}", out.len(), self.len);
        }
        match self.dtype {
            DType::F32 => self.dev().dtoh(out, self.ptr),
            DType::BF16 => {
                let mut h = vec![bf16::ZERO; out.len()];
                self.dev().dtoh(&mut h, self.ptr)?;
                out.iter_mut().zip(&h).for_each(|(o, v)| *o = v.to_f32());
                Ok(())
            }
            DType::F16 => {
                let mut h = vec![f16::ZERO; out.len()];
                self.dev().dtoh(&mut h, self.ptr)?;
                out.iter_mut().zip(&h).for_each(|(o, v)| *o = v.to_f32());
                Ok(())
            }
            d => bail!("read_f32_into from a {} tensor", d.name()),
        }
    }

    /// The first `out.len()` raw elements (any dtype of that size; device check and tests).
    pub fn read_raw<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        if std::mem::size_of_val(out) > self.len * self.dtype.size() {
            bail!("read of {} bytes from a tensor of {}", std::mem::size_of_val(out), self.len * self.dtype.size());
        }
        self.dev().dtoh(out, self.ptr)
    }

    pub fn write_u32(&mut self, data: &[u32]) -> Result<()> {
        if self.dtype != DType::U32 || data.len() > self.len {
            bail!("write_u32 of {} values into {} x {}", data.len(), self.dtype.name(), self.len);
        }
        self.dev().htod(self.ptr, data)
    }

    pub fn write_f32(&mut self, data: &[f32]) -> Result<()> {
        if data.len() > self.len {
            bail!("write of {} values into a tensor of {}", data.len(), self.len);
        }
        match self.dtype {
            DType::F32 => self.dev().htod(self.ptr, data),
            DType::BF16 => self.dev().htod(self.ptr, &data.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
            DType::F16 => self.dev().htod(self.ptr, &data.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()),
            d => bail!("write_f32 into a {} tensor", d.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn opening_a_device_without_a_gpu_is_a_clear_error() {
        match super::CudaDevice::new(0) {
            // A machine with a GPU (and a matching cubin) opens it.
            Ok(d) => assert!(d.name().starts_with("cuda:0")),
            Err(e) => {
                let m = format!("{e:#}");
                assert!(m.contains("cuda:0") && (m.contains("driver") || m.contains("device")), "{m}");
            }
        }
        let e = format!("{:#}", crate::device::Device::parse("cuda:99").unwrap_err());
        assert!(e.contains("cuda:99"), "{e}");
    }
}
