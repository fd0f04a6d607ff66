//! The CUDA device: the glue between tensors and kernels, the same code on a GPU and on the
//! simulated GPU (`cuda-sim:K`). Everything that executes work goes through one seam,
//! `cuda/driver.rs`: the real driver (`cuda/real.rs`, cudarc, feature `cuda`: a primary
//! context and one stream per device, the cubins build.rs embedded for the GPU's
//! architecture, cuBLASLt in `cuda/blas.rs`) or the simulator (`cuda/sim.rs`: the kernels
//! compiled for the host, device memory as host memory with canaries and poison, a queue run
//! at synchronization points, the hardware's launch rules checked, a reference GEMM in
//! `cuda/sim_gemm.rs`).
//!
//! Above the seam: device memory from a caching allocator with a budget (`cuda/alloc.rs`), the
//! typed kernel launchers (`cuda/kernels.rs`), how a tensor is passed to a kernel
//! (`cuda/args.rs`), NVTX ranges (`cuda/nvtx.rs`). The ops' CUDA twins live in their rooms
//! (`ops/<op>/cuda.rs`, the CUTLASS path in `ops/linear/cuda_lowp.rs`) and build on the public
//! methods here; this layer names nothing above it. Tensors on the GPU keep the dtypes the CPU
//! engine gives them: activations f32, weights f32 / BF16 / F16, FP8 KV caches and quantized
//! weights u8. GEMMs with BF16 (F16) weights round their f32 input rows to BF16 (F16) and
//! accumulate in FP32. One ordinal is one device: opening it again returns the same context,
//! stream and allocator.
//!
//! Honesty note: none of this has run on a GPU yet. The simulator runs it in CI;
//! `colotrain device-check` (bench/device_check.sh) compares every op with its CPU twin on a
//! GPU machine; until it has passed there, treat every kernel as unverified on hardware.
//!
//! Errors found by kernels (an out-of-vocabulary id, a bad cache slot) are written into a
//! device error word and reported at the next synchronization or device-to-host read.
//! `COLOTRAIN_CUDA_SYNC=1` synchronizes after every launch and every CUDA-graph replay (exact
//! attribution of faults; a graph as a whole);
//! `COLOTRAIN_CUDA_BUDGET_MB` sets the memory budget (default: 92% of the free memory).

use super::{CpuStorage, DType, Storage, Tensor};
use anyhow::{anyhow, bail, Result};
use driver::Driver;
use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[path = "cuda/alloc.rs"]
mod alloc;
#[path = "cuda/args.rs"]
pub mod args;
#[cfg(feature = "cuda")]
#[path = "cuda/blas.rs"]
mod blas;
#[path = "cuda/driver.rs"]
mod driver;
#[path = "cuda/gemm_calls.rs"]
mod gemm_calls;
#[path = "cuda/graph.rs"]
mod graph;
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]
#[path = "cuda/ffi.rs"]
pub mod ffi;

// SAFETY: ct_sample_row is plain data with no padding: two u64 then six 4-byte fields, 40
// bytes at alignment 8, as ffi.rs asserts at compile time (size, alignment, every offset).
unsafe impl bytemuck::NoUninit for ffi::ct_sample_row {}
#[path = "cuda/kernels.rs"]
pub mod kernels;
#[path = "cuda/cost.rs"]
mod cost;
#[path = "cuda/ledger.rs"]
pub mod ledger;
#[path = "cuda/ptr_fields.rs"]
mod ptr_fields;
#[path = "cuda/nvtx.rs"]
pub mod nvtx;
#[path = "cuda/nccl.rs"]
pub mod nccl;
#[cfg(feature = "cuda")]
#[path = "cuda/real.rs"]
mod real;
#[path = "cuda/registry.rs"]
mod registry;
#[path = "cuda/sim.rs"]
mod sim;
#[path = "cuda/sim_gemm.rs"]
mod sim_gemm;
#[path = "cuda/vmm.rs"]
mod vmm;
#[cfg(test)]
#[path = "cuda/sim_tests.rs"]
mod sim_tests;

/// One embedded cubin (build.rs writes the list).
pub struct Cubin {
    pub module: &'static str,
    pub arch: &'static str,
    pub bytes: &'static [u8],
}

#[cfg(feature = "cuda")]
mod embedded {
    use super::Cubin;
    include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));
}
pub use driver::{current_stream, on_stream, Cutlass, CutlassArgs, Elem, Event, Form, GemmKey, GemmOperands, Stream};
/// The architectures this binary carries kernels for (COLOTRAIN_CUDA_ARCHS at build time).
#[cfg(feature = "cuda")]
pub use embedded::BUILT_ARCHS;
pub use graph::{DeviceGraph, GraphPool};
pub use kernels::TC_MAX_D;
pub use nccl::{CommGroup, Part};
pub use registry::{take_ledger_of, take_memory_peak_of, transfer_bytes_of};
/// The architectures this binary carries kernels for: none without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub const BUILT_ARCHS: &[&str] = &[];

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
    driver: Driver,
    alloc: Mutex<alloc::Allocator>,
    /// 4 bytes of device memory where kernels record the first bad input they met.
    err_word: u64,
    /// Device memory held for the device's lifetime (cuBLASLt's workspace): (pointer, class).
    held: Vec<(u64, usize)>,
    sync_launches: bool,
    /// Bytes copied host → device and device → host (`transfer_bytes_of`).
    h2d: AtomicU64,
    d2h: AtomicU64,
    /// A CUDA-graph capture in progress (`graph.rs`): its block pool, and a flag read without
    /// the lock on every allocation and free.
    capture: Mutex<Option<graph::CapturePool>>,
    capturing: AtomicBool,
    /// The launches' FLOPs and bytes since the last reading (`ledger.rs`), and while capturing,
    /// the capture's own list (kept with the graph, added at each replay).
    ledger: Mutex<ledger::Ledger>,
    captured: Mutex<ledger::Captured>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({})", self.name())
    }
}

impl alloc::Driver for Driver {
    fn malloc(&self, bytes: usize) -> Result<u64> {
        Driver::malloc(self, bytes)
    }
    fn free(&self, ptr: u64) {
        Driver::free(self, ptr)
    }
    fn quiesce(&self) -> Result<()> {
        self.synchronize().map_err(|e| anyhow!("synchronize before releasing memory: {e}"))
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
    /// Opens GPU `ordinal` (or returns the device already open for it): a clear error (no
    /// panic) when the driver or the GPU is missing, or when this binary has no cubin for the
    /// GPU's architecture.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        registry::shared(false, ordinal, || Self::open_real(ordinal))
    }

    /// Simulated GPU `ordinal` (`--device cuda-sim:K`; see `cuda/sim.rs`), of the architecture
    /// `COLOTRAIN_SIM_ARCH` names, one of `COLOTRAIN_SIM_DEVICES` with `COLOTRAIN_SIM_MEM_MB`
    /// of memory each.
    pub fn sim(ordinal: usize) -> Result<CudaDevice> {
        Self::sim_arch(ordinal, None)
    }

    /// [`CudaDevice::sim`] of architecture `arch` ("sm_90a" or "sm_100a"; None: the
    /// environment's), for tests of both dispatch paths in one process. An ordinal already open
    /// as another architecture is an error.
    pub fn sim_arch(ordinal: usize, arch: Option<&str>) -> Result<CudaDevice> {
        let want = match arch {
            Some(a) => sim::Arch::named(a)?,
            None => sim::Arch::from_env()?,
        };
        let d = registry::shared(true, ordinal, || {
            let count = sim::device_count()?;
            if ordinal >= count {
                bail!("cuda-sim:{ordinal}: the simulator has {count} devices (COLOTRAIN_SIM_DEVICES)");
            }
            let arch = want;
            let drv = Driver::Sim(sim::Sim::new(ordinal, arch));
            let name = format!("simulated {}", if arch == sim::SM100A { "B300" } else { "H200" });
            Self::with_driver(ordinal, name, arch.cc, arch.name.to_string(), arch.sm_count, sim::capacity()?, drv)
        })?;
        if d.inner.arch != want.name {
            bail!("cuda-sim:{ordinal} is already open as {}, not {}", d.inner.arch, want.name);
        }
        Ok(d)
    }

    /// A simulated H200 outside the registry (tests that must own a device alone, whatever
    /// other tests run in the process); `ordinal` only names it.
    #[cfg(test)]
    pub(crate) fn sim_unshared(ordinal: usize) -> CudaDevice {
        Self::sim_unshared_arch(ordinal, "sm_90a")
    }

    /// How many simulated GPUs there are (`COLOTRAIN_SIM_DEVICES`, default 8).
    pub fn sim_count() -> Result<usize> {
        sim::device_count()
    }

    #[cfg(not(feature = "cuda"))]
    fn open_real(ordinal: usize) -> Result<Inner> {
        bail!(
            "cuda:{ordinal}: this colotrain binary was built without CUDA support; rebuild with `cargo build \
             --release --features cuda` (see third_party/README.md), or run on the simulated GPU with \
             --device cuda-sim:{ordinal}"
        )
    }

    #[cfg(feature = "cuda")]
    fn open_real(ordinal: usize) -> Result<Inner> {
        let (mut real, props) = real::Real::open(ordinal)?;
        let (name, cc) = (props.name.clone(), props.cc);
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
        use anyhow::Context;
        real.load_kernels(embedded::CUBINS, &arch).with_context(|| format!("cuda:{ordinal} ({name})"))?;
        let mut inner = Self::with_driver(ordinal, name, cc, arch, props.sm_count, props.free, Driver::Real(real))?;
        let (ws, class) = {
            let mut a = inner.alloc.lock().unwrap_or_else(|e| e.into_inner());
            a.alloc(&inner.driver, blas::WORKSPACE_BYTES, "the cuBLASLt workspace")?
        };
        if let Driver::Real(r) = &inner.driver {
            r.set_workspace(ws, blas::WORKSPACE_BYTES);
        }
        inner.held.push((ws, class));
        Ok(inner)
    }

    /// The device state around a driver: the allocator (92% of `free`, or the budget from the
    /// environment) and the zeroed error word.
    fn with_driver(
        ordinal: usize,
        name: String,
        cc: (i32, i32),
        arch: String,
        sm_count: u32,
        free: usize,
        driver: Driver,
    ) -> Result<Inner> {
        let mut allocator = alloc::Allocator::new(budget_from_env(free)?);
        let (err_word, _) = allocator.alloc(&driver, 4, "the error word")?;
        driver.memset0(err_word, 4)?;
        driver.synchronize()?;
        Ok(Inner {
            ordinal,
            name,
            cc,
            arch,
            sm_count,
            driver,
            alloc: Mutex::new(allocator),
            err_word,
            held: Vec::new(),
            sync_launches: std::env::var("COLOTRAIN_CUDA_SYNC").map(|v| v == "1").unwrap_or(false),
            h2d: AtomicU64::new(0),
            d2h: AtomicU64::new(0),
            capture: Mutex::new(None),
            capturing: AtomicBool::new(false),
            ledger: Mutex::new(ledger::Ledger::default()),
            captured: Mutex::new(Vec::new()),
        })
    }

    pub fn name(&self) -> String {
        let i = &self.inner;
        let kind = if self.is_sim() { "cuda-sim" } else { "cuda" };
        format!("{kind}:{} ({}, sm_{}{}, kernels {})", i.ordinal, i.name, i.cc.0, i.cc.1, i.arch)
    }

    /// Whether this is a simulated GPU.
    pub fn is_sim(&self) -> bool {
        self.inner.driver.is_sim()
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The index in `ledger::GPUS` of the GPU this device is (or simulates): the B300 for
    /// Blackwell, else the H200.
    pub fn ledger_gpu(&self) -> usize {
        usize::from(self.inner.cc.0 >= 10)
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

    /// A tensor whose every element the caller writes before reading it: no memset on a GPU;
    /// on cuda-sim the block is poisoned (0xFF bytes, NaN as f32 or BF16) so a read of an
    /// element nobody wrote shows in the results. The fill is not a launch of the product and
    /// stays out of the ledger.
    pub fn uninit(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let s = CudaStorage::alloc(self, dtype, n, &format!("a {} tensor of shape {shape:?}", dtype.name()))?;
        if n > 0 {
            self.inner.driver.poison(s.ptr, n * dtype.size())?;
        }
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
        // The error word's copy to the host waits for everything queued before it.
        let mut w = [0u8; 4];
        self.inner.d2h.fetch_add(4, Ordering::Relaxed);
        self.inner.driver.dtoh(&mut w, self.inner.err_word).map_err(|e| anyhow!("{}: {e:#}", self.name()))?;
        let w = [u32::from_ne_bytes(w)];
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

    /// Returns the allocator's cached blocks to the driver, once the queued work that may still
    /// touch them is done; the bytes returned. Memory freed to the cache is this process's
    /// still: this is what makes it anyone's (cuBLAS's workspace, NCCL's buffers, a request of
    /// another size class).
    pub fn release_cached(&self) -> Result<usize> {
        let mut a = self.allocator();
        let bytes = a.cached;
        a.release(&self.inner.driver)?;
        Ok(bytes)
    }

    /// Milliseconds of device time `f` takes on this device's stream (CUDA events; wall time
    /// in the simulator).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let mut f = Some(f);
        let ms = self.inner.driver.time_ms(&mut || f.take().map(|f| f()).unwrap_or(Ok(())))?;
        self.synchronize()?;
        Ok(ms)
    }

    // ---- what the op rooms' CUDA twins build on ---------------------------------------------

    /// The device address of the error word that kernels set on a bad index.
    pub fn err_word(&self) -> u64 {
        self.inner.err_word
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.inner.driver.bind().map_err(|e| anyhow!("cuda:{}: {e:#}", self.inner.ordinal))
    }

    /// The device's one stream (null on the simulator): every launch and copy of this device
    /// is ordered on it.
    pub fn stream_handle(&self) -> *mut std::ffi::c_void {
        self.inner.driver.stream_handle()
    }

    /// The CUTLASS GEMM for operands of element type `ab` (E4M3 or E2M1) on this device, if
    /// there is one: FP8 on sm_90 and sm_100, NVFP4 on sm_100 only (Hopper has no native FP4),
    /// when this build compiled it (the simulator's references stand for every one).
    pub fn cutlass_kernel(&self, ab: Elem) -> Option<Cutlass> {
        let g = match (ab, self.inner.cc.0) {
            (Elem::E4M3, 9) => Cutlass::Fp8Sm90,
            (Elem::E4M3, 10) => Cutlass::Fp8Sm100,
            (Elem::E2M1, 10) => Cutlass::Nvfp4Sm100,
            _ => return None,
        };
        self.driver().cutlass_built(g).then_some(g)
    }

    /// Runs CUTLASS GEMM `g` on this device's stream: workspace query, scratch, the GEMM.
    /// Ok(false) when the kernel's `can_implement` refuses the problem.
    pub fn cutlass_gemm(&self, g: Cutlass, a: &CutlassArgs) -> Result<bool> {
        for (n, what) in [(a.m, "rows"), (a.n, "columns"), (a.k, "depth")] {
            args::i32_of(n, &format!("CUTLASS GEMM {what}"))?;
        }
        self.bind()?;
        let bytes = self.driver().cutlass_workspace(g, a)?;
        let ws = self.scratch(bytes, "CUTLASS workspace")?;
        let ws_ptr = if bytes == 0 { 0 } else { ws.ptr };
        let ran = self.driver().cutlass(g, a, ws_ptr).map_err(|e| anyhow!("{}: {e:#}", self.name()))?;
        if ran {
            self.record(g.op_name(), cost::cutlass(g, a));
        }
        Ok(ran)
    }

    fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    fn sync_launches(&self) -> bool {
        self.inner.sync_launches
    }

    fn allocator(&self) -> MutexGuard<'_, alloc::Allocator> {
        self.inner.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Scratch device memory, returned to the cache when dropped.
    pub fn scratch(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        if let Some(b) = self.capture_alloc(bytes, what) {
            return b;
        }
        let (ptr, class) = self.allocator().alloc(&self.inner.driver, bytes, what)?;
        Ok(DevBuf { ptr, class, dev: self.clone(), region: None })
    }

    /// Zeroes `bytes` at `ptr`, queued on the stream.
    pub fn memset0(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.inner.driver.memset0(ptr, bytes)?;
        self.record("memset", cost::memset(bytes));
        Ok(())
    }

    /// Copies `src` to `dst`, queued on the stream (the host data is staged before return).
    pub fn htod<T: bytemuck::NoUninit>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.inner.h2d.fetch_add(std::mem::size_of_val(src) as u64, Ordering::Relaxed);
        self.inner.driver.htod(dst, bytemuck::cast_slice(src))?;
        self.record("memcpy h2d", cost::copy(std::mem::size_of_val(src), ledger::Path::Pcie));
        Ok(())
    }

    /// Copies to the host and waits; reports kernel-recorded errors (a synchronization point).
    pub fn dtoh<T: bytemuck::Pod>(&self, dst: &mut [T], src: u64) -> Result<()> {
        if !dst.is_empty() {
            self.inner.d2h.fetch_add(std::mem::size_of_val(dst) as u64, Ordering::Relaxed);
            self.inner.driver.dtoh(bytemuck::cast_slice_mut(dst), src)?;
            self.record("memcpy d2h", cost::copy(std::mem::size_of_val(dst), ledger::Path::Pcie));
        }
        self.synchronize()
    }

    /// Copies `bytes` from `src` to `dst` on the device, queued on the stream.
    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.inner.driver.dtod(dst, src, bytes)?;
        self.record("memcpy d2d", cost::copy(bytes, ledger::Path::Hbm));
        Ok(())
    }

    /// An event at the current end of the calling thread's current stream (see [`on_stream`]).
    pub fn record_event(&self) -> Result<Event> {
        self.inner.driver.record_event()
    }

    /// Makes the current stream wait for `e` (recorded on this device's other stream).
    pub fn wait_event(&self, e: &Event) -> Result<()> {
        self.inner.driver.wait_event(e)
    }

    /// Queues a copy of `bytes` from `src` on `peer` (another device of this process, of the
    /// same kind) to `dst` on this device, on the current stream. Device-to-device: it counts
    /// as no host transfer. The caller keeps the source alive and unchanged until this device
    /// has run the copy.
    pub fn peer_copy(&self, dst: u64, peer: &CudaDevice, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if peer.is_sim() != self.is_sim() || peer.inner.driver.is_dry() != self.inner.driver.is_dry() {
            bail!("peer copy between {} and {}: devices of different kinds", self.name(), peer.name());
        }
        self.inner.driver.peer_copy(dst, src, peer.ordinal(), bytes)?;
        self.record("memcpy peer", cost::copy(bytes, ledger::Path::Nvlink));
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(mut a) = self.alloc.lock() {
            a.free(self.err_word, alloc::size_class(4));
            for &(p, c) in &self.held {
                a.free(p, c);
            }
            let _ = a.release(&self.driver);
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

/// Device memory that returns to the allocator's cache when dropped (or, for a reservation,
/// to the driver: `vmm.rs`).
pub struct DevBuf {
    /// The device address.
    pub ptr: u64,
    class: usize,
    dev: CudaDevice,
    region: Option<vmm::Region>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Some(r) = &self.region {
            return self.dev.drop_region(self.ptr, r);
        }
        if self.dev.capture_free(self.ptr, self.class) {
            return;
        }
        self.dev.allocator().free(self.ptr, self.class);
    }
}

/// The storage of a CUDA tensor: `len` elements of `dtype` at `ptr`, inside one device
/// allocation that it owns or shares with other views of it ([`CudaStorage::view`]: the
/// allocation is freed when its last view is dropped).
pub struct CudaStorage {
    buf: std::sync::Arc<DevBuf>,
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
        Ok(CudaStorage { ptr: buf.ptr, buf: std::sync::Arc::new(buf), len, dtype })
    }

    /// A view of `len` elements from element `offset` of this storage, sharing its allocation
    /// (the flat trainer buffers with per-tensor views). Writes through either are writes to
    /// the same device memory: the stream orders them, as for any two tensors.
    pub fn view(&self, offset: usize, len: usize) -> Result<CudaStorage> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            bail!("a view of {len} values at {offset} of a tensor of {}", self.len);
        }
        let ptr = self.ptr + (offset * self.dtype.size()) as u64;
        Ok(CudaStorage { buf: self.buf.clone(), ptr, len, dtype: self.dtype })
    }

    fn dev(&self) -> &CudaDevice {
        &self.buf.dev
    }

    /// The device the storage lives on.
    pub fn device(&self) -> &CudaDevice {
        self.dev()
    }

    /// Zeroes every element, queued on the device's stream.
    pub fn fill_zero(&mut self) -> Result<()> {
        self.dev().memset0(self.ptr, self.len * self.dtype.size())
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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
    pub fn read_raw<T: bytemuck::Pod>(&self, out: &mut [T]) -> Result<()> {
        if std::mem::size_of_val(out) > self.len * self.dtype.size() {
            bail!("read of {} bytes from a tensor of {}", std::mem::size_of_val(out), self.len * self.dtype.size());
        }
        self.dev().dtoh(out, self.ptr)
    }

    pub fn write_u32(&mut self, data: &[u32]) -> Result<()> {
        self.write_u32_at(0, data)
    }

    pub fn write_u32_at(&mut self, offset: usize, data: &[u32]) -> Result<()> {
        if self.dtype != DType::U32 || offset + data.len() > self.len {
            bail!("write_u32 of {} values at {offset} into {} x {}", data.len(), self.dtype.name(), self.len);
        }
        self.dev().htod(self.ptr + 4 * offset as u64, data)
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
