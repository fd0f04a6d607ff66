//! The real driver (feature `cuda`): cudarc over the CUDA driver API. One primary context and
//! two streams per device (compute and communication, see `driver::Stream`); the kernels
//! loaded from the cubins build.rs embedded for this GPU's
//! architecture (never PTX JIT); cuBLASLt opened at the first GEMM, so a machine without
//! libcublasLt can still run and check every kernel that does not need it.
//!
//! Owns: the context, the stream, the loaded functions, the cuBLASLt handle. May call: cudarc.
//! Must not: be reached except through `driver::Driver`.

use super::blas::Blas;
use super::driver::{current_stream, Cutlass, CutlassArgs, Event, GemmKey, GemmOperands, Graph, Launch};
use super::kernels::Kernel;
use super::{ffi, Cubin};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as dr, sys, CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;
use std::sync::{Arc, Mutex};

#[path = "real_nccl.rs"]
mod nccl;
pub(super) use nccl::RealComm;

/// What opening a GPU tells the glue about it.
pub(super) struct Props {
    pub name: String,
    pub cc: (i32, i32),
    pub sm_count: u32,
    pub free: usize,
}

/// An instantiated CUDA graph of this device's compute stream.
pub(crate) struct RealGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects are not internally synchronized (concurrent calls on one graph
// must be serialized), but they may be used from any thread. A RealGraph is only reached
// through `&` by its owner (one engine, driven by one worker thread at a time: the engine's
// `&mut self` methods), so two threads never call into it at once.
unsafe impl Send for RealGraph {}

pub(super) struct Real {
    ctx: Arc<CudaContext>,
    /// The compute and the communication stream (`Stream as usize`).
    streams: [Arc<CudaStream>; 2],
    /// The primary contexts of the GPUs peer copies read from.
    peers: Mutex<std::collections::HashMap<usize, Arc<CudaContext>>>,
    functions: Vec<CudaFunction>,
    /// Created at the first GEMM; the workspace is the device's (allocated at open).
    blas: Mutex<Option<Blas>>,
    workspace: Mutex<(u64, usize)>,
    /// The physical memory mapped into each reservation (`map`), by its address.
    mapped: Mutex<std::collections::HashMap<u64, sys::CUmemGenericAllocationHandle>>,
}

impl Real {
    /// Opens GPU `ordinal`: a clear error (no panic) when the driver or the GPU is missing.
    pub fn open(ordinal: usize) -> Result<(Real, Props)> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            bail!(
                "cuda:{ordinal}: no CUDA driver found (libcuda.so could not be loaded): this machine has no NVIDIA \
                 driver, or its folder is not on LD_LIBRARY_PATH (this binary was built with CUDA kernels for {}; \
                 --device cuda-sim:{ordinal} runs them on the simulator)",
                super::BUILT_ARCHS.join(", ")
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
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow!("cuda:{ordinal}: {e}"))? as u32;
        let stream = || ctx.new_stream().map_err(|e| anyhow!("cuda:{ordinal}: cannot create a stream: {e}"));
        let streams = [stream()?, stream()?];
        let (free, _total) = ctx.mem_get_info().map_err(|e| anyhow!("cuda:{ordinal}: {e}"))?;
        let real = Real {
            ctx,
            streams,
            peers: Mutex::new(Default::default()),
            functions: Vec::new(),
            blas: Mutex::new(None),
            workspace: Mutex::new((0, 0)),
            mapped: Mutex::new(Default::default()),
        };
        Ok((real, Props { name, cc, sm_count, free }))
    }

    /// Loads every module's cubin for `arch` (never PTX: no JIT) and looks up every kernel.
    pub fn load_kernels(&mut self, cubins: &[Cubin], arch: &str) -> Result<()> {
        let mut modules = std::collections::HashMap::new();
        for c in cubins.iter().filter(|c| c.arch == arch) {
            let m = self.ctx.load_module(Ptx::from_binary(c.bytes.to_vec())).map_err(|e| {
                anyhow!(
                    "cannot load the {arch} cubin of csrc/kernels/{}.cu: {e} (a driver older than CUDA 13.0 \
                     rejects cubins of the pinned 13.0 toolchain)",
                    c.module
                )
            })?;
            modules.insert(c.module, m);
        }
        let mut functions = Vec::with_capacity(Kernel::ALL.len());
        for k in Kernel::ALL {
            let (name, module) = k.symbol();
            let m = modules.get(module).ok_or_else(|| anyhow!("no {arch} cubin of csrc/kernels/{module}.cu"))?;
            functions.push(
                m.load_function(name)
                    .with_context(|| format!("kernel {name} missing from csrc/kernels/{module}.cu ({arch})"))?,
            );
        }
        self.functions = functions;
        Ok(())
    }

    /// The device memory cuBLASLt may use (allocated by the device's allocator at open).
    pub fn set_workspace(&self, ptr: u64, bytes: usize) {
        *self.workspace.lock().unwrap_or_else(|e| e.into_inner()) = (ptr, bytes);
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| anyhow!("cannot bind the context: {e}"))
    }

    /// The calling thread's current stream.
    fn stream(&self) -> &Arc<CudaStream> {
        &self.streams[current_stream() as usize]
    }

    /// Waits for both streams.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        for s in &self.streams {
            s.synchronize().map_err(|e| anyhow!("{e}"))?;
        }
        Ok(())
    }

    pub fn record_event(&self) -> Result<Event> {
        self.bind()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(Event::Real(self.stream().record_event(flags).map_err(|e| anyhow!("record an event: {e}"))?))
    }

    pub fn wait_event(&self, e: &Event) -> Result<()> {
        match e {
            Event::Real(ev) => self.stream().wait(ev).map_err(|e| anyhow!("wait on an event: {e}")),
            Event::Sim { .. } => bail!("a GPU stream cannot wait on a simulated device's event"),
        }
    }

    /// Lets this context read `peer`'s memory directly (NVLink or PCIe peer to peer); where the
    /// GPUs cannot reach each other the driver stages peer copies through the host, which is
    /// logged once.
    fn enable_peer_access(&self, peer: &Arc<CudaContext>, src_ordinal: usize) -> Result<()> {
        let mut can = 0i32;
        // SAFETY: a plain query of two device handles into a local integer.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.cu_device()) }
            .result()
            .map_err(|e| anyhow!("can cuda:{src_ordinal} be reached as a peer: {e}"))?;
        if can == 0 {
            tracing::warn!("peer copies from cuda:{src_ordinal} go through the host: no peer access between the GPUs");
            return Ok(());
        }
        // SAFETY: enables access from the current (this device's) context to the peer's; the
        // only failure that is not an error is "already enabled".
        match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            e => bail!("enabling peer access to cuda:{src_ordinal}: {e:?}"),
        }
    }

    pub fn peer_copy(&self, dst: u64, src: u64, src_ordinal: usize, bytes: usize) -> Result<()> {
        self.bind()?;
        let src_ctx = {
            let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
            match peers.get(&src_ordinal) {
                Some(c) => c.clone(),
                None => {
                    let c = CudaContext::new(src_ordinal).map_err(|e| anyhow!("peer cuda:{src_ordinal}: {e}"))?;
                    // CudaContext::new made the peer's context current: this device's again.
                    self.bind()?;
                    self.enable_peer_access(&c, src_ordinal)?;
                    peers.insert(src_ordinal, c.clone());
                    c
                }
            }
        };
        // SAFETY: `dst` is a live allocation of at least `bytes` bytes on this device and `src`
        // one on cuda:`src_ordinal` (the collective checked both lengths); the collective keeps
        // the source alive and unchanged until this stream has run the copy.
        unsafe {
            dr::memcpy_peer_async(self.ctx.cu_ctx(), dst, src_ctx.cu_ctx(), src, bytes, self.stream().cu_stream())
        }
        .map_err(|e| anyhow!("peer copy from cuda:{src_ordinal}: {e}"))
    }

    /// Pinned device memory on this GPU, for cuMemCreate and its granularity.
    fn vmm_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct; all-zero is its documented default for the unused fields.
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = self.ctx.ordinal() as i32;
        p
    }

    /// A GPU writes memory handed out uninitialized when it writes it: nothing to do.
    pub fn poison(&self, _ptr: u64, _bytes: usize) -> Result<()> {
        Ok(())
    }

    pub fn granularity(&self) -> Result<usize> {
        let mut g = 0usize;
        let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: queries into a local with a valid property struct.
        unsafe { sys::cuMemGetAllocationGranularity(&mut g, &self.vmm_prop(), flag) }
            .result()
            .map_err(|e| anyhow!("virtual memory granularity: {e}"))?;
        Ok(g.max(1))
    }

    pub fn reserve(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        let mut ptr = 0;
        // SAFETY: reserves address space only; freed by `unreserve`.
        unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, 0, 0, 0) }
            .result()
            .map_err(|e| anyhow!("reserving {bytes} bytes of device address space: {e}"))?;
        Ok(ptr)
    }

    pub fn map(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        let prop = self.vmm_prop();
        let mut h = 0;
        // SAFETY: creates a physical allocation of `bytes` (a multiple of the granularity).
        unsafe { sys::cuMemCreate(&mut h, bytes, &prop, 0) }
            .result()
            .map_err(|e| anyhow!("device memory for a mapping of {bytes} bytes: {e}"))?;
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: maps the handle over the whole reservation at `ptr` (reserved with this size,
        // not mapped: the device layer tracks that) and lets this GPU read and write it.
        let r = unsafe { sys::cuMemMap(ptr, bytes, 0, h, 0) }.result().and_then(|_| {
            unsafe { sys::cuMemSetAccess(ptr, bytes, &access, 1) }.result().inspect_err(|_| {
                let _ = unsafe { sys::cuMemUnmap(ptr, bytes) };
            })
        });
        if let Err(e) = r {
            // SAFETY: the handle is not mapped anywhere; releasing frees it.
            let _ = unsafe { sys::cuMemRelease(h) };
            bail!("mapping {bytes} bytes at {ptr:#x}: {e}");
        }
        self.mapped.lock().unwrap_or_else(|e| e.into_inner()).insert(ptr, h);
        Ok(())
    }

    pub fn unmap(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.synchronize()?;
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        let h = *mapped.get(&ptr).ok_or_else(|| anyhow!("unmap at {ptr:#x}: nothing is mapped there"))?;
        // SAFETY: both streams drained, so no queued work reads the range; the handle was
        // mapped over exactly [ptr, ptr + bytes) by `map`. On failure the mapping stays, and
        // so does its entry (a later unmap or the drop tries again).
        unsafe { sys::cuMemUnmap(ptr, bytes) }.result().map_err(|e| anyhow!("unmap at {ptr:#x}: {e}"))?;
        mapped.remove(&ptr);
        // SAFETY: no longer mapped anywhere. The range is unmapped whatever this returns, which
        // is what the caller goes by; a handle the driver would not release is only logged.
        if let Err(e) = unsafe { sys::cuMemRelease(h) }.result() {
            tracing::warn!("cuda:{}: releasing an unmapped allocation's memory failed: {e}", self.ctx.ordinal());
        }
        Ok(())
    }

    pub fn unreserve(&self, ptr: u64, bytes: usize) {
        if self.mapped.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&ptr) {
            let _ = self.unmap(ptr, bytes);
        }
        if self.bind().is_ok() {
            // SAFETY: the range was reserved by `reserve` with this size and is unmapped.
            let _ = unsafe { sys::cuMemAddressFree(ptr, bytes) };
        }
    }

    pub fn malloc(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        // SAFETY: a plain allocation in the bound context; the pointer is owned by the
        // allocator until `free`.
        unsafe { dr::malloc_sync(bytes) }.map_err(|e| anyhow!("{e}"))
    }

    pub fn free(&self, ptr: u64) {
        if self.bind().is_ok() {
            // SAFETY: `ptr` came from malloc_sync and is in no free list any more; the
            // allocator quiesced the stream first, so no queued work uses it.
            let _ = unsafe { dr::free_sync(ptr) };
        }
    }

    pub fn memset0(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: `ptr` is a live allocation of at least `bytes` bytes on this device.
        unsafe { dr::memset_d8_async(ptr, 0, bytes, self.stream().cu_stream()) }.map_err(|e| anyhow!("memset: {e}"))
    }

    pub fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `dst` holds at least src.len() bytes. A copy from pageable memory is staged
        // before the call returns, so `src` may be dropped afterwards.
        unsafe { dr::memcpy_htod_async(dst, src, self.stream().cu_stream()) }
            .map_err(|e| anyhow!("host-to-device copy: {e}"))
    }

    pub fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: `src` holds at least dst.len() bytes; `dst` is borrowed mutably until the
        // synchronization below, which completes the copy.
        unsafe { dr::memcpy_dtoh_async(dst, src, self.stream().cu_stream()) }
            .map_err(|e| anyhow!("device-to-host copy: {e}"))?;
        self.synchronize()
    }

    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: both are live allocations of at least `bytes` bytes on this device.
        unsafe { dr::memcpy_dtod_async(dst, src, bytes, self.stream().cu_stream()) }
            .map_err(|e| anyhow!("device copy: {e}"))
    }

    fn function(&self, k: Kernel) -> Result<&CudaFunction> {
        self.functions.get(k.index()).ok_or_else(|| anyhow!("kernel {} is not loaded", k.name()))
    }

    pub fn set_max_dynamic_smem(&self, k: Kernel, bytes: u32) -> Result<()> {
        let f = self.function(k)?;
        // SAFETY: `f` is a live function of a loaded module; the attribute only raises the
        // dynamic shared memory limit of later launches.
        unsafe {
            dr::function::set_function_attribute(
                f.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| anyhow!("{e}"))
    }

    /// Thread-local capture mode: another thread's allocations (the other GPUs' workers) stay
    /// legal while this one captures; this thread's are refused by the driver.
    pub fn begin_capture(&self) -> Result<()> {
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow!("begin a CUDA-graph capture: {e}"))
    }

    pub fn end_capture(&self) -> Result<Graph> {
        let g = self
            .stream()
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow!("end the CUDA-graph capture: {e}"))?
            .ok_or_else(|| anyhow!("the CUDA-graph capture recorded nothing"))?;
        Ok(Graph::Real(RealGraph(g)))
    }

    pub fn replay(&self, g: &RealGraph) -> Result<()> {
        // cudarc launches a graph on the stream it was captured on: the compute stream.
        if !Arc::ptr_eq(self.stream(), &self.streams[0]) {
            bail!("a CUDA graph replays on the compute stream only");
        }
        g.0.launch().map_err(|e| anyhow!("launch the CUDA graph: {e}"))
    }

    pub fn launch(&self, l: &Launch) -> Result<()> {
        let f = self.function(l.k)?;
        let mut args = [l.params as *mut std::ffi::c_void];
        // SAFETY: `params` points at the kernel's one parameter, its ct_*_params struct, which
        // outlives this call; the driver copies the parameter at launch (see kernels.rs).
        unsafe {
            dr::launch_kernel(f.cu_function(), l.grid, (l.block, 1, 1), l.smem, self.stream().cu_stream(), &mut args)
        }
        .map_err(|e| anyhow!("{e}"))
    }

    pub fn gemm(&self, key: GemmKey, ops: GemmOperands) -> Result<()> {
        self.bind()?;
        let mut blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        if blas.is_none() {
            let (ws, ws_bytes) = *self.workspace.lock().unwrap_or_else(|e| e.into_inner());
            *blas = Some(Blas::new(ws, ws_bytes)?);
        }
        match blas.as_mut() {
            Some(b) => b.gemm(self.stream().cu_stream(), key, ops),
            None => bail!("cuBLASLt is not open"),
        }
    }

    /// Whether this build compiled CUTLASS GEMM `g` (build.rs: COLOTRAIN_CUDA_ARCHS).
    pub fn cutlass_built(&self, g: Cutlass) -> bool {
        launcher(g).is_some()
    }

    pub fn cutlass_workspace(&self, g: Cutlass, a: &CutlassArgs) -> Result<usize> {
        let f = launcher(g).ok_or_else(|| anyhow!("this build has no {}", g.name()))?;
        let args = ffi_args(a);
        let mut bytes = 0usize;
        // SAFETY: query mode (workspace_bytes non-null): the launcher only reads `args`.
        let rc = unsafe { f(&args, std::ptr::null_mut(), &mut bytes, std::ptr::null_mut()) };
        if rc != 0 {
            bail!("{}: workspace query failed with status {rc}", g.name());
        }
        Ok(bytes)
    }

    pub fn cutlass(&self, g: Cutlass, a: &CutlassArgs, ws: u64) -> Result<bool> {
        let f = launcher(g).ok_or_else(|| anyhow!("this build has no {}", g.name()))?;
        self.bind()?;
        let args = ffi_args(a);
        // SAFETY: `args` points at device buffers of the shapes it states (checked by the
        // callers), the workspace has the size the query asked for, and the stream is this
        // device's, whose context is current on this thread (the CUDA runtime inside the
        // launcher adopts it).
        let rc = unsafe { f(&args, ws as *mut std::ffi::c_void, std::ptr::null_mut(), self.stream_handle()) };
        match rc {
            0 => Ok(true),
            -1 => Ok(false),
            s => bail!("{} m={} n={} k={} failed with cutlass::Status {s}", g.name(), a.m, a.n, a.k),
        }
    }

    pub fn stream_handle(&self) -> *mut std::ffi::c_void {
        self.stream().cu_stream() as *mut std::ffi::c_void
    }

    pub fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.bind()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(|e| anyhow!("{e}"))?;
        let end = self.ctx.new_event(flags).map_err(|e| anyhow!("{e}"))?;
        start.record(self.stream()).map_err(|e| anyhow!("{e}"))?;
        f()?;
        end.record(self.stream()).map_err(|e| anyhow!("{e}"))?;
        self.synchronize()?;
        Ok(start.elapsed_ms(&end).map_err(|e| anyhow!("{e}"))? as f64)
    }
}

type Launcher =
    unsafe extern "C" fn(*const ffi::ct_gemm_lp_args, *mut std::ffi::c_void, *mut usize, *mut std::ffi::c_void) -> i32;

/// The launcher of CUTLASS GEMM `g`, if this build compiled it.
fn launcher(g: Cutlass) -> Option<Launcher> {
    match g {
        #[cfg(colotrain_cutlass_sm90)]
        Cutlass::Fp8Sm90 => Some(ffi::ct_fp8_gemm_sm90a as Launcher),
        #[cfg(colotrain_cutlass_sm100)]
        Cutlass::Fp8Sm100 => Some(ffi::ct_fp8_gemm_sm100a as Launcher),
        #[cfg(colotrain_cutlass_sm100)]
        Cutlass::Nvfp4Sm100 => Some(ffi::ct_nvfp4_gemm_sm100a as Launcher),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

fn ffi_args(a: &CutlassArgs) -> ffi::ct_gemm_lp_args {
    let ptr = |p: u64| p as *const std::ffi::c_void;
    ffi::ct_gemm_lp_args {
        a: ptr(a.a),
        b: ptr(a.b),
        sfa: ptr(a.sfa),
        sfb: ptr(a.sfb),
        d: a.d as *mut f32,
        // The callers checked that the sizes fit the kernels' 32-bit sizes.
        m: a.m as i32,
        n: a.n as i32,
        k: a.k as i32,
        alpha: a.alpha,
    }
}
