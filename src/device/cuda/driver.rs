//! The one seam between the CUDA glue and what executes it. Everything above this file —
//! `CudaDevice`, the typed kernel launchers, the allocator, the op rooms' CUDA twins, the
//! engines — is the same code whether a real GPU runs it (`real.rs`, cudarc: feature `cuda`)
//! or the simulator (`sim.rs`: the kernels compiled for the host, device memory as host
//! memory). The operations are the ones the glue uses: memory, copies, synchronization, a
//! kernel launch with its parameter struct, the cuBLASLt matmul, the CUTLASS GEMMs.
//!
//! Streams: each device has two, the compute stream and the communication stream. Work goes
//! onto the calling thread's current stream ([`on_stream`], compute unless a scope says
//! otherwise), so every typed launcher and copy runs on either without an extra argument;
//! [`Event`]s order one against the other.
//!
//! Owns: [`Driver`], [`Stream`], [`Event`], the GEMM descriptor types ([`Elem`], [`GemmKey`],
//! [`Cutlass`], [`CutlassArgs`]). May call: `real`, `sim`. Must not: know about tensors or ops.

use super::kernels::Kernel;
use anyhow::Result;
use std::cell::Cell;

/// A device's two streams: kernels, GEMMs and copies of the step on `Compute`; collectives'
/// copies and reductions on `Comm`, ordered against `Compute` by events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    Compute = 0,
    Comm = 1,
}

impl Stream {
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Comm => "communication",
        }
    }

    pub fn other(self) -> Stream {
        match self {
            Stream::Compute => Stream::Comm,
            Stream::Comm => Stream::Compute,
        }
    }
}

thread_local! {
    /// The stream this thread's work goes to (one worker thread drives one device).
    static CURRENT: Cell<Stream> = const { Cell::new(Stream::Compute) };
}

/// The calling thread's current stream.
pub fn current_stream() -> Stream {
    CURRENT.with(|c| c.get())
}

/// Runs `f` with `s` as the calling thread's current stream (restored afterwards, also on error).
pub fn on_stream<T>(s: Stream, f: impl FnOnce() -> T) -> T {
    struct Restore(Stream);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(s)));
    f()
}

/// A point in one stream's work: another stream that waits on it runs nothing queued after
/// the wait before everything queued before the record has run.
pub enum Event {
    /// The simulator: `seq` operations had been queued on `stream` of device `ordinal`.
    Sim { ordinal: usize, stream: Stream, seq: u64 },
    #[cfg(feature = "cuda")]
    Real(cudarc::driver::CudaEvent),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Sim { ordinal, stream, seq } => write!(f, "event(cuda-sim:{ordinal} {} #{seq})", stream.name()),
            #[cfg(feature = "cuda")]
            Event::Real(_) => write!(f, "event(cuda)"),
        }
    }
}

/// A recorded list of the current stream's work, replayed as one launch (a CUDA graph). The
/// pointers and scalars of every operation are those of the capture: replaying it reads and
/// writes the same addresses, so the buffers it uses must stay where they are.
pub(super) enum Graph {
    /// The simulator: the captured operations, replayed by queueing them again.
    Sim(super::sim::SimGraph),
    #[cfg(feature = "cuda")]
    Real(super::real::RealGraph),
}

/// Element types of a GEMM's inputs; the output is always f32.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Elem {
    F32,
    BF16,
    F16,
    E4M3,
    E2M1,
}

/// How a GEMM reads its row-major operands: y (m, n) f32 (+)= alpha · op(x) · op(w).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Form {
    /// x (m, k), w (n, k): y = x·wᵀ — a linear's forward (the only form FP8 and NVFP4 take).
    Nt,
    /// x (m, k), w (k, n): y = x·w — a linear's data gradient, dx = dy·W.
    Nn,
    /// x (k, m), w (k, n): y = xᵀ·w — a linear's weight gradient, dW = dyᵀ·x.
    Tn,
}

/// One GEMM: y (m, n) f32 (+)= alpha · op(x) · op(w) in `form`, w and x of type `ab`;
/// `device_scalars`: alpha and beta read from device memory (cuBLASLt's device pointer mode,
/// a descriptor of its own), not passed by the host.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct GemmKey {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ab: Elem,
    pub accumulate: bool,
    pub form: Form,
    pub device_scalars: bool,
}

/// The operands of one GEMM of a [`GemmKey`] (device addresses): y = alpha · op(x) · op(w),
/// plus c with `key.accumulate` (c = y for an accumulation in place, another (m, n) f32 buffer
/// for a residual: cuBLASLt's C ≠ D); `scales`: E2M1's tiled block scales of (w, x);
/// `scalars`: with `key.device_scalars`, the device address of (alpha, beta) as two f32 (then
/// `alpha` is unused, and beta must be 1 with `key.accumulate`, else 0), otherwise 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmOperands {
    pub w: u64,
    pub x: u64,
    pub c: u64,
    pub y: u64,
    pub alpha: f32,
    pub scales: Option<(u64, u64)>,
    pub scalars: u64,
}

impl GemmKey {
    /// The GEMM's name in the launch ledger: its operands' type and form.
    pub fn op_name(&self) -> &'static str {
        use {Elem::*, Form::*};
        match (self.ab, self.form) {
            (F32, Nt) => "gemm f32 nt",
            (F32, Nn) => "gemm f32 nn",
            (F32, Tn) => "gemm f32 tn",
            (BF16, Nt) => "gemm bf16 nt",
            (BF16, Nn) => "gemm bf16 nn",
            (BF16, Tn) => "gemm bf16 tn",
            (F16, Nt) => "gemm f16 nt",
            (F16, Nn) => "gemm f16 nn",
            (F16, Tn) => "gemm f16 tn",
            (E4M3, _) => "gemm fp8",
            (E2M1, _) => "gemm nvfp4",
        }
    }
}

/// The CUTLASS GEMMs of csrc/cutlass: D (m, n) f32 = alpha · A (m, k) · B (n, k)ᵀ, A and B
/// row-major with k contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cutlass {
    /// E4M3 × E4M3, sm_90a (TMA warp-specialized WGMMA): gemm_fp8_sm90.cu.
    Fp8Sm90,
    /// E4M3 × E4M3, sm_100a / sm_103a (tcgen05): gemm_fp8_sm100.cu.
    Fp8Sm100,
    /// E2M1 × E2M1 with UE4M3 scales per 16 values in the swizzled 128×4 layout of sm_100
    /// (`ct_swizzle_sf`): gemm_nvfp4_sm100.cu.
    Nvfp4Sm100,
}

impl Cutlass {
    /// The GEMM's name in the launch ledger.
    pub fn op_name(self) -> &'static str {
        match self {
            Cutlass::Fp8Sm90 => "cutlass fp8 sm90",
            Cutlass::Fp8Sm100 => "cutlass fp8 sm100",
            Cutlass::Nvfp4Sm100 => "cutlass nvfp4 sm100",
        }
    }

    /// The compute capability major the kernel was built for.
    pub fn major(self) -> i32 {
        match self {
            Cutlass::Fp8Sm90 => 9,
            Cutlass::Fp8Sm100 | Cutlass::Nvfp4Sm100 => 10,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Cutlass::Fp8Sm90 => "ct_fp8_gemm_sm90a",
            Cutlass::Fp8Sm100 => "ct_fp8_gemm_sm100a",
            Cutlass::Nvfp4Sm100 => "ct_nvfp4_gemm_sm100a",
        }
    }
}

/// The operands of a CUTLASS GEMM (device addresses; `sfa` / `sfb` the swizzled NVFP4 scales,
/// 0 for FP8) — ct_gemm_lp_args of colotrain_kernels.h.
#[derive(Clone, Copy, Debug)]
pub struct CutlassArgs {
    pub a: u64,
    pub b: u64,
    pub sfa: u64,
    pub sfb: u64,
    pub d: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
}

/// One kernel launch: kernel `k` on a 2-D grid of 1-D blocks of `block` threads with `smem`
/// bytes of dynamic shared memory, and its parameter struct (`size` bytes at `params`, which
/// the driver copies before `launch` returns).
#[derive(Clone, Copy)]
pub(super) struct Launch {
    pub k: Kernel,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    pub params: *const std::ffi::c_void,
    pub size: usize,
    /// The byte offsets of the struct's pointer fields (`ptr_fields.rs`), for the simulator's
    /// address checks; None: every aligned word is checked.
    pub ptrs: Option<&'static [usize]>,
}

/// What executes the glue's requests: a GPU through cudarc, or the simulator.
pub(super) enum Driver {
    #[cfg(feature = "cuda")]
    Real(super::real::Real),
    Sim(super::sim::Sim),
}

/// `match` on the driver, the same call on either.
macro_rules! each {
    ($d:expr, $x:ident => $e:expr) => {
        match $d {
            #[cfg(feature = "cuda")]
            Driver::Real($x) => $e,
            Driver::Sim($x) => $e,
        }
    };
}

impl Driver {
    /// Makes the device current on the calling thread (a no-op in the simulator).
    pub fn bind(&self) -> Result<()> {
        each!(self, d => d.bind())
    }

    /// Runs everything queued, and waits for it.
    pub fn synchronize(&self) -> Result<()> {
        each!(self, d => d.synchronize())
    }

    pub fn malloc(&self, bytes: usize) -> Result<u64> {
        each!(self, d => d.malloc(bytes))
    }

    /// Frees a block that no queued work uses any more (the allocator quiesces first).
    pub fn free(&self, ptr: u64) {
        each!(self, d => d.free(ptr))
    }

    /// The size virtual-memory mappings are made in (a reservation's bytes are a multiple).
    pub fn granularity(&self) -> Result<usize> {
        each!(self, d => d.granularity())
    }

    /// Reserves `bytes` of address space (a multiple of the granularity), with no memory yet.
    pub fn reserve(&self, bytes: usize) -> Result<u64> {
        each!(self, d => d.reserve(bytes))
    }

    /// Backs the whole reservation at `ptr` with device memory (contents undefined).
    pub fn map(&self, ptr: u64, bytes: usize) -> Result<()> {
        each!(self, d => d.map(ptr, bytes))
    }

    /// Gives the reservation's memory back to the driver once the queued work has run; the
    /// address stays reserved.
    pub fn unmap(&self, ptr: u64, bytes: usize) -> Result<()> {
        each!(self, d => d.unmap(ptr, bytes))
    }

    /// Frees a reservation of `bytes` at `ptr` (unmapped first where it is mapped).
    pub fn unreserve(&self, ptr: u64, bytes: usize) {
        each!(self, d => d.unreserve(ptr, bytes))
    }

    /// Zeroes `bytes` at `ptr`, queued.
    pub fn memset0(&self, ptr: u64, bytes: usize) -> Result<()> {
        each!(self, d => d.memset0(ptr, bytes))
    }

    /// Marks `bytes` at `ptr` as not yet written: the simulator queues a fill with its poison
    /// byte (f32/BF16 NaN), a GPU does nothing.
    pub fn poison(&self, ptr: u64, bytes: usize) -> Result<()> {
        each!(self, d => d.poison(ptr, bytes))
    }

    /// Copies host bytes to `dst`, queued; the bytes are staged before this returns.
    pub fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        each!(self, d => d.htod(dst, src))
    }

    /// Copies device bytes at `src` into `dst` and waits for the copy (and all work before it).
    pub fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        each!(self, d => d.dtoh(dst, src))
    }

    /// Copies `bytes` from `src` to `dst` on the device, queued.
    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        each!(self, d => d.dtod(dst, src, bytes))
    }

    /// Raises kernel `k`'s dynamic shared memory limit to `bytes` (needed above 48 KiB).
    pub fn set_max_dynamic_smem(&self, k: Kernel, bytes: u32) -> Result<()> {
        each!(self, d => d.set_max_dynamic_smem(k, bytes))
    }

    /// Queues a kernel launch.
    pub fn launch(&self, l: &Launch) -> Result<()> {
        each!(self, d => d.launch(l))
    }

    /// The cuBLASLt matmul of `key` on `ops` (see [`GemmKey`], [`GemmOperands`]).
    pub fn gemm(&self, key: GemmKey, ops: GemmOperands) -> Result<()> {
        each!(self, d => d.gemm(key, ops))
    }

    /// Whether CUTLASS GEMM `g` can be called: a real GPU when this build compiled it, the
    /// simulator always (its references stand for every CUTLASS kernel; the architecture rule
    /// is checked at the call, as a GPU would fail to find the kernel's image).
    pub fn cutlass_built(&self, g: Cutlass) -> bool {
        each!(self, d => d.cutlass_built(g))
    }

    /// Bytes of workspace CUTLASS GEMM `g` needs for `a`.
    pub fn cutlass_workspace(&self, g: Cutlass, a: &CutlassArgs) -> Result<usize> {
        each!(self, d => d.cutlass_workspace(g, a))
    }

    /// Queues CUTLASS GEMM `g` with `ws` (of the size `cutlass_workspace` asked for); Ok(false)
    /// when the kernel's `can_implement` refuses the problem (nothing is queued then).
    pub fn cutlass(&self, g: Cutlass, a: &CutlassArgs, ws: u64) -> Result<bool> {
        each!(self, d => d.cutlass(g, a, ws))
    }

    /// Records an event on the current stream.
    pub fn record_event(&self) -> Result<Event> {
        each!(self, d => d.record_event())
    }

    /// Makes the current stream wait for `e` (a no-op when `e` is on the current stream).
    pub fn wait_event(&self, e: &Event) -> Result<()> {
        each!(self, d => d.wait_event(e))
    }

    /// Copies `bytes` from `src` in the memory of device `src_ordinal` (another GPU of this
    /// process) to `dst` on this device, queued on the current stream. The caller orders it
    /// after the peer's writes (the peer synchronized them) and keeps the source alive and
    /// unchanged until this stream has run the copy.
    pub fn peer_copy(&self, dst: u64, src: u64, src_ordinal: usize, bytes: usize) -> Result<()> {
        each!(self, d => d.peer_copy(dst, src, src_ordinal, bytes))
    }

    /// Starts recording the calling thread's current stream: work queued on it from now on is
    /// captured, not run, until [`Driver::end_capture`]. Synchronizing, copying from or to the
    /// host and allocating are errors meanwhile (as CUDA's thread-local capture mode has them).
    pub fn begin_capture(&self) -> Result<()> {
        each!(self, d => d.begin_capture())
    }

    /// Ends the capture begun on this thread's current stream; the graph of what it recorded,
    /// or the first error met while capturing.
    pub fn end_capture(&self) -> Result<Graph> {
        each!(self, d => d.end_capture())
    }

    /// Queues graph `g` on the current stream.
    pub fn replay(&self, g: &Graph) -> Result<()> {
        match (self, g) {
            (Driver::Sim(d), Graph::Sim(g)) => d.replay(g),
            #[cfg(feature = "cuda")]
            (Driver::Real(d), Graph::Real(g)) => d.replay(g),
            #[cfg(feature = "cuda")]
            _ => anyhow::bail!("a graph captured on another kind of device"),
        }
    }

    /// The stream handle (null in the simulator, which has none).
    pub fn stream_handle(&self) -> *mut std::ffi::c_void {
        each!(self, d => d.stream_handle())
    }

    /// Milliseconds `f` takes on the device: CUDA events on a GPU, wall time in the simulator.
    pub fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        each!(self, d => d.time_ms(f))
    }

    pub fn is_sim(&self) -> bool {
        matches!(self, Driver::Sim(_))
    }

    /// A dry simulated GPU (`sim_dry.rs`): its addresses have no memory behind them.
    pub fn is_dry(&self) -> bool {
        matches!(self, Driver::Sim(s) if s.is_dry())
    }
}
