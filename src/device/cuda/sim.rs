//! The simulated GPU (`--device cuda-sim:K`): the driver underneath the same CUDA glue, on the
//! host. Device memory is host memory (a device address is a host address, so the kernels,
//! compiled for the host by build.rs from csrc/kernels with the shim of csrc/hostemu, read and
//! write it directly), with canary bytes around every allocation (checked at free and at every
//! synchronize) and every fresh allocation poisoned with 0xFF bytes (NaN as f32). Work is queued
//! as on a stream and runs at a synchronization point; a copy to the host synchronizes first,
//! as the glue's `dtoh` does on a GPU. Each launch is checked against the hardware's rules
//! before it is queued (threads per block, grid limits, dynamic shared memory above 48 KiB only
//! after the function attribute, the architecture's shared memory limit, a pointer parameter
//! into another simulated device's memory or misaligned for the kernel). cuBLASLt and the
//! CUTLASS GEMMs are replaced by reference GEMMs that read the same operand layouts and refuse
//! what the libraries refuse (`sim_gemm.rs`).
//!
//! What it cannot catch: real concurrency beyond the shim's varied thread orders, tensor-core
//! and libm numerics, register or resource launch failures, driver and cubin loading, cuBLASLt
//! heuristics, TMA, NCCL's own behaviour (`sim_nccl.rs` gives its calls their meaning), speed.
//! Pointer parameters are found by value (a parameter word that lies inside a live simulated
//! allocation), so a pointer to freed or foreign host memory is not seen. A kernel bug the shim
//! detects (divergent warps, a thread at a different barrier, a stack overflow) ends the
//! process with the shim's message.
//!
//! Owns: the simulated memory, queue and launch rules of one device. May call: the kernel
//! library (`ct_sim_launch`), `sim_gemm`. Must not: be reached except through `driver::Driver`.

use super::driver::{current_stream, Cutlass, CutlassArgs, Event, GemmKey, GemmOperands, Launch, Stream};
use super::kernels::Kernel;
use anyhow::{anyhow, bail, Result};
use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::mem::MaybeUninit;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

#[path = "sim_graph.rs"]
mod graph;
pub(super) use graph::SimGraph;
#[path = "sim_vmm.rs"]
mod vmm;
#[path = "sim_dry.rs"]
mod dry;
#[path = "sim_nccl.rs"]
mod nccl;
pub(super) use nccl::SimGroup;

unsafe extern "C" {
    /// csrc/hostemu/sim.cpp: runs kernel `id` (Kernel::index) with grid (gx, gy), a block of
    /// bx threads, `smem` bytes of dynamic shared memory, thread order `order`, on the
    /// parameter struct at `params`. 0, or -1 for an unknown id.
    fn ct_sim_launch(id: i32, gx: u32, gy: u32, bx: u32, smem: usize, order: i32, params: *const u8) -> i32;
}

/// The shim's state is global: one simulated launch at a time in the process.
static SHIM: Mutex<()> = Mutex::new(());

/// Every live allocation of every simulated device in the process: device address → (bytes,
/// ordinal), to name the device a pointer parameter belongs to.
static OWNERS: Mutex<BTreeMap<u64, (usize, usize)>> = Mutex::new(BTreeMap::new());

fn owners() -> MutexGuard<'static, BTreeMap<u64, (usize, usize)>> {
    OWNERS.lock().unwrap_or_else(|e| e.into_inner())
}

const CANARY: usize = 256;
const CANARY_BYTE: u8 = 0xCB;
const POISON_BYTE: u8 = 0xFF;
/// Dynamic shared memory a kernel gets without raising its attribute.
const SMEM_DEFAULT: u32 = 48 * 1024;

/// The GPU a simulated device stands for (`COLOTRAIN_SIM_ARCH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Arch {
    pub name: &'static str,
    pub cc: (i32, i32),
    pub sm_count: u32,
    /// The most dynamic shared memory one block may have (bytes).
    pub smem_max: u32,
}

pub(super) const SM90A: Arch = Arch { name: "sm_90a", cc: (9, 0), sm_count: 132, smem_max: 227 * 1024 };
pub(super) const SM100A: Arch = Arch { name: "sm_100a", cc: (10, 0), sm_count: 148, smem_max: 227 * 1024 };

impl Arch {
    /// `COLOTRAIN_SIM_ARCH`: sm_90a (H200, the default: NVFP4 emulated) or sm_100a (B300).
    pub fn from_env() -> Result<Arch> {
        match std::env::var("COLOTRAIN_SIM_ARCH").as_deref() {
            Err(_) | Ok("") => Ok(SM90A),
            Ok(a) => Self::named(a).map_err(|e| anyhow!("COLOTRAIN_SIM_ARCH: {e}")),
        }
    }

    pub fn named(a: &str) -> Result<Arch> {
        match a {
            "sm_90a" => Ok(SM90A),
            "sm_100a" => Ok(SM100A),
            other => bail!("'{other}': expected sm_90a (H200) or sm_100a (B300)"),
        }
    }
}

/// How many simulated GPUs the machine has (`COLOTRAIN_SIM_DEVICES`, default 8).
pub(super) fn device_count() -> Result<usize> {
    env_usize("COLOTRAIN_SIM_DEVICES", 8)
}

/// Each simulated GPU's memory (`COLOTRAIN_SIM_MEM_MB`, default 4096 MiB: the host's memory is
/// real).
pub(super) fn capacity() -> Result<usize> {
    Ok(env_usize("COLOTRAIN_SIM_MEM_MB", 4096)? << 20)
}

fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(s) => s.trim().parse().map_err(|_| anyhow!("{name}='{s}': expected a whole number")),
    }
}

struct Alloc {
    /// The start of the host block (the front canary); the device address is base + CANARY.
    /// 0 on a dry device: the address is not backed by host memory.
    base: usize,
    bytes: usize,
}

/// One queued piece of work.
#[derive(Clone)]
enum Op {
    Memset {
        ptr: u64,
        bytes: usize,
        value: u8,
    },
    Htod {
        dst: u64,
        data: Vec<u8>,
    },
    Dtod {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Launch {
        k: Kernel,
        grid: (u32, u32),
        block: u32,
        smem: u32,
        params: Vec<MaybeUninit<u64>>,
    },
    /// Its accumulator `ops.c` is read with `key.accumulate` (y itself, or a residual: C ≠ D).
    Gemm {
        key: GemmKey,
        ops: GemmOperands,
    },
    Cutlass {
        g: Cutlass,
        args: CutlassArgs,
    },
    /// A copy from another simulated device's memory (checked live when queued).
    Peer {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// An NCCL call (`sim_nccl.rs`): its inputs were taken when it was queued; it writes
    /// what it received.
    Nccl {
        writes: Vec<(u64, Vec<u8>)>,
    },
    /// Nothing after this runs before stream `on` has run `upto` operations.
    Wait {
        on: Stream,
        upto: u64,
    },
}

impl Op {
    fn describe(&self) -> String {
        match self {
            Op::Memset { .. } => "a memset".into(),
            Op::Htod { .. } => "a host-to-device copy".into(),
            Op::Dtod { .. } => "a device copy".into(),
            Op::Launch { k, .. } => format!("kernel {}", k.name()),
            Op::Gemm { .. } => "a cuBLASLt GEMM".into(),
            Op::Cutlass { g, .. } => g.name().into(),
            Op::Peer { .. } => "a peer copy".into(),
            Op::Nccl { .. } => "an NCCL call".into(),
            Op::Wait { on, upto } => format!("a wait for the {} stream's operation {upto}", on.name()),
        }
    }
}

/// A queued operation: its place in its stream and the allocations it uses (their device
/// addresses), for the stream-ordering check.
struct Entry {
    op: Op,
    seq: u64,
    uses: Vec<u64>,
}

#[derive(Default)]
struct State {
    /// Live allocations by device address.
    allocs: BTreeMap<u64, Alloc>,
    /// The compute and the communication stream's queues (`Stream as usize`).
    queues: [VecDeque<Entry>; 2],
    /// Operations ever queued / run per stream (an event is a count of the first).
    queued: [u64; 2],
    ran: [u64; 2],
    /// Rule violations found where no error can be returned (a free), reported by the next
    /// synchronize.
    violations: Vec<String>,
    /// The dynamic shared memory limit set per kernel (Kernel::index).
    smem_attr: Vec<u32>,
    launches: u64,
    /// A CUDA-graph capture in progress (`sim_graph.rs`).
    capture: Option<graph::Capture>,
    /// Reservations whose memory is unmapped (`sim_vmm.rs`): start → bytes.
    unmapped: BTreeMap<u64, usize>,
}

pub(super) struct Sim {
    pub arch: Arch,
    ordinal: usize,
    state: Mutex<State>,
    /// A dry device (`sim_dry.rs`): every check and the ledger, no memory behind the
    /// addresses, no operation run.
    dry: bool,
}

fn layout(bytes: usize) -> Result<Layout> {
    Layout::from_size_align(bytes + 2 * CANARY, 256).map_err(|e| anyhow!("simulated allocation of {bytes} bytes: {e}"))
}

impl Sim {
    pub fn new(ordinal: usize, arch: Arch) -> Sim {
        let state = State { smem_attr: vec![SMEM_DEFAULT; Kernel::ALL.len()], ..Default::default() };
        Sim { arch, ordinal, state: Mutex::new(state), dry: false }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn name(&self) -> String {
        format!("cuda-sim:{}", self.ordinal)
    }

    pub fn bind(&self) -> Result<()> {
        Ok(())
    }

    /// Runs the queue in order, then checks every allocation's canaries; reports the first
    /// violation found since the last synchronize.
    pub fn synchronize(&self) -> Result<()> {
        let mut st = self.state();
        st.refuse_in_capture(&self.name(), "a synchronization")?;
        if !st.violations.is_empty() {
            let v = std::mem::take(&mut st.violations);
            bail!("{}: {}", self.name(), v.join("; "));
        }
        self.run_queues(&mut st)?;
        for (&ptr, a) in &st.allocs {
            check_canaries(ptr, a).map_err(|e| anyhow!("{}: {e}", self.name()))?;
        }
        Ok(())
    }

    pub fn malloc(&self, bytes: usize) -> Result<u64> {
        self.state().refuse_in_capture(&self.name(), "a device allocation (cuMemAlloc)")?;
        if self.dry {
            return self.dry_malloc(bytes);
        }
        let l = layout(bytes)?;
        // SAFETY: `l` has a non-zero size (two canaries) and a valid alignment.
        let base = unsafe { std::alloc::alloc(l) };
        if base.is_null() {
            bail!("{}: the host could not back a simulated allocation of {bytes} bytes", self.name());
        }
        // SAFETY: `base` holds bytes + 2 CANARY bytes (just allocated, exclusively ours).
        unsafe {
            std::ptr::write_bytes(base, CANARY_BYTE, CANARY);
            std::ptr::write_bytes(base.add(CANARY), POISON_BYTE, bytes);
            std::ptr::write_bytes(base.add(CANARY + bytes), CANARY_BYTE, CANARY);
        }
        let ptr = base as u64 + CANARY as u64;
        self.state().allocs.insert(ptr, Alloc { base: base as usize, bytes });
        owners().insert(ptr, (bytes, self.ordinal));
        Ok(ptr)
    }

    /// Frees a block. Freeing it while work is queued (which may still use it), or after a
    /// write past its ends, is a violation the next synchronize reports (free cannot fail).
    pub fn free(&self, ptr: u64) {
        let mut st = self.state();
        // Refused while capturing; free cannot fail, so the capture's end reports it.
        let _ = st.refuse_in_capture(&self.name(), "a device free (cuMemFree)");
        let n = st.queues.iter().map(|q| q.len()).sum::<usize>();
        if n > 0 {
            st.violations.push(format!("the block at {ptr:#x} was freed while {n} operations were queued"));
        }
        match st.allocs.remove(&ptr) {
            Some(a) => {
                owners().remove(&ptr);
                if let Err(e) = check_canaries(ptr, &a) {
                    st.violations.push(format!("{e:#}"));
                }
                if a.base == 0 {
                    return;
                }
                if let Ok(l) = layout(a.bytes) {
                    // SAFETY: `a.base` came from `alloc` with this layout and is freed once (it
                    // was just removed from the map).
                    unsafe { std::alloc::dealloc(a.base as *mut u8, l) };
                }
            }
            None => st.violations.push(format!("free of {ptr:#x}, which is not an allocation")),
        }
    }

    pub fn memset0(&self, ptr: u64, bytes: usize) -> Result<()> {
        let mut st = self.state();
        check_range(&st, ptr, bytes, "memset")?;
        st.push(Op::Memset { ptr, bytes, value: 0 }, &[ptr]);
        Ok(())
    }

    /// Fills `bytes` at `ptr` with the poison byte, queued: memory handed out uninitialized
    /// ([`super::super::CudaDevice::uninit`]) reads as NaN until a kernel writes it, also when
    /// the caching allocator hands out a block again.
    pub fn poison(&self, ptr: u64, bytes: usize) -> Result<()> {
        let mut st = self.state();
        check_range(&st, ptr, bytes, "poison fill")?;
        st.push(Op::Memset { ptr, bytes, value: POISON_BYTE }, &[ptr]);
        Ok(())
    }

    pub fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        let mut st = self.state();
        st.refuse_in_capture(&self.name(), "a host-to-device copy")?;
        check_range(&st, dst, src.len(), "host-to-device copy")?;
        let data = if self.dry { Vec::new() } else { src.to_vec() };
        st.push(Op::Htod { dst, data }, &[dst]);
        Ok(())
    }

    pub fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.synchronize()?;
        let st = self.state();
        check_range(&st, src, dst.len(), "device-to-host copy")?;
        st.check_mapped(st.alloc_of(src).as_slice(), "a device-to-host copy")
            .map_err(|e| anyhow!("{}: {e}", self.name()))?;
        if self.dry {
            dst.fill(0);
            return Ok(());
        }
        // SAFETY: [src, src + len) lies inside a live allocation (checked above) and the queue
        // is empty, so nothing writes it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let mut st = self.state();
        check_range(&st, src, bytes, "device copy source")?;
        check_range(&st, dst, bytes, "device copy destination")?;
        st.push(Op::Dtod { dst, src, bytes }, &[dst, src]);
        Ok(())
    }

    pub fn set_max_dynamic_smem(&self, k: Kernel, bytes: u32) -> Result<()> {
        if bytes > self.arch.smem_max {
            bail!(
                "{}: {bytes} bytes of dynamic shared memory for {}: the limit of {} is {} bytes",
                self.name(),
                k.name(),
                self.arch.name,
                self.arch.smem_max
            );
        }
        self.state().smem_attr[k.index()] = bytes;
        Ok(())
    }

    /// Checks the launch against the hardware's rules, copies the parameters and queues it.
    pub fn launch(&self, l: &Launch) -> Result<()> {
        let Launch { k, grid, block, smem, params, size, ptrs } = *l;
        let rule = |what: String| anyhow!("{}: launch of {} refused: {what}", self.name(), k.name());
        if block == 0 || block > 1024 {
            return Err(rule(format!("{block} threads per block (the limit is 1024)")));
        }
        if grid.0 > i32::MAX as u32 || grid.1 > 65535 || grid.2 > 65535 {
            return Err(rule(format!("grid {grid:?} (limits: x < 2^31, y and z ≤ 65535)")));
        }
        if grid.2 != 1 {
            return Err(rule(format!("grid.z = {} (the simulator runs 2-D grids only)", grid.2)));
        }
        let mut st = self.state();
        let attr = st.smem_attr[k.index()];
        if smem > attr {
            return Err(rule(if smem > SMEM_DEFAULT {
                format!(
                    "{smem} bytes of dynamic shared memory, above 48 KiB without the function attribute \
                     (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES is {attr})"
                )
            } else {
                format!("{smem} bytes of dynamic shared memory, above its attribute of {attr}")
            }));
        }
        let words = size.div_ceil(8);
        let mut buf = vec![MaybeUninit::<u64>::uninit(); words];
        // SAFETY: `params` points at the kernel's parameter struct of `size` bytes (kernels.rs);
        // an untyped copy into a buffer of at least `size` bytes, which is only ever handed
        // back to C as bytes.
        unsafe { std::ptr::copy_nonoverlapping(params as *const u8, buf.as_mut_ptr() as *mut u8, size) };
        // Pointer parameters: the struct's pointer fields (`ptr_fields.rs`; without a table,
        // every 8-byte-aligned word, where C puts pointers) that lie inside a simulated
        // allocation. Only the pointer words are read as addresses: an i32 and the padding after
        // it hold arbitrary bytes that can look like one.
        let whole = size / 8;
        let words: Vec<usize> = match ptrs {
            Some(offs) => offs.iter().filter(|&&o| o % 8 == 0 && o / 8 < whole).map(|&o| o / 8).collect(),
            None => (0..whole).collect(),
        };
        let mut uses = Vec::new();
        for i in words {
            // SAFETY: the first `whole` words were fully written by the copy above; any bit
            // pattern is a valid u64.
            let v = unsafe { buf[i].assume_init() };
            let owner = owners().range(..=v).next_back().filter(|(&s, &(b, _))| v < s + b as u64).map(|(_, o)| o.1);
            if owner == Some(self.ordinal) {
                uses.push(v);
            }
            match owner {
                Some(o) if o != self.ordinal => {
                    return Err(rule(format!(
                        "the parameter at byte {} points into the memory of cuda-sim:{o} (a pointer that belongs to \
                         another device)",
                        i * 8
                    )))
                }
                Some(_) if v % k.ptr_align() != 0 => {
                    return Err(rule(format!(
                        "the pointer parameter at byte {} ({v:#x}) is not aligned to the kernel's {}-byte elements",
                        i * 8,
                        k.ptr_align()
                    )))
                }
                _ => {}
            }
        }
        st.push(Op::Launch { k, grid: (grid.0, grid.1), block, smem, params: buf }, &uses);
        Ok(())
    }

    pub fn gemm(&self, key: GemmKey, ops: GemmOperands) -> Result<()> {
        let mut st = self.state();
        super::sim_gemm::check(&key, &ops).map_err(|e| anyhow!("{}: cuBLASLt {e}", self.name()))?;
        let GemmOperands { w, x, c, y, scales, scalars, .. } = ops;
        let (m, n, k) = (key.m, key.n, key.k);
        check_range(&st, w, super::sim_gemm::matrix_bytes(key.ab, n, k), "GEMM weight")?;
        check_range(&st, x, super::sim_gemm::matrix_bytes(key.ab, m, k), "GEMM input")?;
        check_range(&st, y, m * n * 4, "GEMM output")?;
        if key.accumulate && c != y {
            check_range(&st, c, m * n * 4, "GEMM accumulator C")?;
        }
        if let Some((sw, sx)) = scales {
            check_range(&st, sw, super::sim_gemm::sf_bytes(n, k), "GEMM weight block scales")?;
            check_range(&st, sx, super::sim_gemm::sf_bytes(m, k), "GEMM input block scales")?;
        }
        if key.device_scalars {
            check_range(&st, scalars, 8, "GEMM (alpha, beta)")?;
        }
        let mut uses = vec![w, x, y];
        uses.extend((key.accumulate && c != y).then_some(c));
        uses.extend(key.device_scalars.then_some(scalars));
        uses.extend(scales.map(|(a, b)| [a, b]).into_iter().flatten());
        st.push(Op::Gemm { key, ops }, &uses);
        Ok(())
    }

    /// The simulator's references stand for every CUTLASS kernel.
    pub fn cutlass_built(&self, _g: Cutlass) -> bool {
        true
    }

    pub fn cutlass_workspace(&self, _g: Cutlass, _a: &CutlassArgs) -> Result<usize> {
        Ok(0)
    }

    /// Checks what the GPU and CUTLASS would check, the operands' ranges, and queues the
    /// reference.
    pub fn cutlass(&self, g: Cutlass, a: &CutlassArgs, _ws: u64) -> Result<bool> {
        let mut st = self.state();
        let ok = super::sim_gemm::cutlass_check(g, self.arch.cc.0, a).map_err(|e| anyhow!("{}: {e:#}", self.name()))?;
        if !ok {
            return Ok(false);
        }
        let e = if g == Cutlass::Nvfp4Sm100 { super::driver::Elem::E2M1 } else { super::driver::Elem::E4M3 };
        check_range(&st, a.a, super::sim_gemm::matrix_bytes(e, a.m, a.k), "CUTLASS operand A")?;
        check_range(&st, a.b, super::sim_gemm::matrix_bytes(e, a.n, a.k), "CUTLASS operand B")?;
        check_range(&st, a.d, a.m * a.n * 4, "CUTLASS output D")?;
        if g == Cutlass::Nvfp4Sm100 {
            check_range(&st, a.sfa, super::sim_gemm::sf_bytes(a.m, a.k), "CUTLASS scales SFA")?;
            check_range(&st, a.sfb, super::sim_gemm::sf_bytes(a.n, a.k), "CUTLASS scales SFB")?;
        }
        st.push(Op::Cutlass { g, args: *a }, &[a.a, a.b, a.d, a.sfa, a.sfb]);
        Ok(true)
    }

    pub fn stream_handle(&self) -> *mut std::ffi::c_void {
        std::ptr::null_mut()
    }

    pub fn record_event(&self) -> Result<Event> {
        self.state().refuse_in_capture(&self.name(), "an event record")?;
        let stream = current_stream();
        Ok(Event::Sim { ordinal: self.ordinal, stream, seq: self.state().queued[stream as usize] })
    }

    pub fn wait_event(&self, e: &Event) -> Result<()> {
        self.state().refuse_in_capture(&self.name(), "an event wait")?;
        let cur = current_stream();
        match *e {
            Event::Sim { ordinal, stream, seq } if ordinal == self.ordinal => {
                if stream != cur {
                    self.state().push(Op::Wait { on: stream, upto: seq }, &[]);
                }
                Ok(())
            }
            Event::Sim { ordinal, .. } => bail!(
                "{}: a wait on an event of cuda-sim:{ordinal} (the simulator orders devices by synchronizing)",
                self.name()
            ),
            #[cfg(feature = "cuda")]
            Event::Real(_) => bail!("{}: a wait on a GPU's event", self.name()),
        }
    }

    /// Checks that `src` lies in a live allocation of cuda-sim:`src_ordinal` and `dst` in one
    /// of this device's, and queues the copy.
    pub fn peer_copy(&self, dst: u64, src: u64, src_ordinal: usize, bytes: usize) -> Result<()> {
        let mut st = self.state();
        st.refuse_in_capture(&self.name(), "a peer copy")?;
        check_range(&st, dst, bytes, "peer copy destination")?;
        let owner = owners().range(..=src).next_back().map(|(&s, &(b, o))| (s, b, o));
        match owner {
            Some((s, b, o)) if o == src_ordinal && src + bytes as u64 <= s + b as u64 => {}
            _ => bail!(
                "{}: peer copy of {bytes} bytes from {src:#x}: not inside an allocation of cuda-sim:{src_ordinal}",
                self.name()
            ),
        }
        st.push(Op::Peer { dst, src, bytes }, &[dst]);
        Ok(())
    }

    /// Runs both streams' queues: the compute stream until it is empty or waits on an event
    /// the communication stream has not reached, then the communication stream likewise, and
    /// so on. The compute stream goes first whatever the order of queueing, so work the host
    /// queued on the communication stream earlier but did not order by an event runs late, as
    /// it may on a GPU; and every operation is checked against the other stream's pending
    /// work first ([`State::check_order`]), so a missing event is an error rather than luck.
    fn run_queues(&self, st: &mut State) -> Result<()> {
        loop {
            let mut progress = false;
            for s in [Stream::Compute, Stream::Comm] {
                let i = s as usize;
                while let Some(front) = st.queues[i].front() {
                    if let Op::Wait { on, upto } = front.op {
                        if st.ran[on as usize] < upto {
                            break;
                        }
                    }
                    if let Err(e) = st.check_order(s) {
                        st.discard();
                        bail!("{}: {e}", self.name());
                    }
                    let Some(e) = st.queues[i].pop_front() else { break };
                    if let Err(err) = st.check_mapped(&e.uses, &e.op.describe()) {
                        st.discard();
                        bail!("{}: {err}", self.name());
                    }
                    st.ran[i] += 1;
                    progress = true;
                    if let Err(err) = self.run(st, e.op) {
                        st.discard();
                        return Err(err);
                    }
                }
            }
            if st.queues.iter().all(|q| q.is_empty()) {
                return Ok(());
            }
            if !progress {
                st.discard();
                bail!("{}: both streams wait on events the other never reaches", self.name());
            }
        }
    }

    pub fn time_ms(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let t = Instant::now();
        f()?;
        self.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    fn run(&self, st: &mut State, op: Op) -> Result<()> {
        if self.dry {
            st.launches += matches!(op, Op::Launch { .. }) as u64;
            return Ok(());
        }
        match op {
            // SAFETY (the three copies): every range was checked against a live allocation when
            // the op was queued, and an allocation is only freed with an empty queue.
            Op::Memset { ptr, bytes, value } => unsafe { std::ptr::write_bytes(ptr as *mut u8, value, bytes) },
            Op::Htod { dst, data } => unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len())
            },
            Op::Dtod { dst, src, bytes } => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) },
            Op::Launch { k, grid, block, smem, params } => {
                st.launches += 1;
                let order = (st.launches % 3) as i32;
                let _shim = SHIM.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: `params` holds the kernel's parameter struct; the device pointers in
                // it are host addresses of live simulated allocations (the caller keeps the
                // tensors alive until the stream reaches the kernel, as on a GPU).
                let rc = unsafe {
                    ct_sim_launch(
                        k.index() as i32,
                        grid.0,
                        grid.1,
                        block,
                        smem as usize,
                        order,
                        params.as_ptr() as *const u8,
                    )
                };
                if rc != 0 {
                    bail!("{}: the kernel library has no {} (id {})", self.name(), k.name(), k.index());
                }
            }
            Op::Gemm { key, ops } => super::sim_gemm::run(&key, &ops),
            Op::Cutlass { g, args } => super::sim_gemm::run_cutlass(g, &args),
            // SAFETY: `dst` was checked against this device's allocations and `src` against the
            // peer's when queued; the collective keeps the peer's block alive and unchanged
            // until this device has synchronized (see `train::device_coll`).
            Op::Peer { dst, src, bytes } => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) },
            // SAFETY: each destination range was checked against a live allocation of this
            // device when the call was queued (`sim_nccl.rs`).
            Op::Nccl { writes } => {
                for (dst, data) in writes {
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) }
                }
            }
            Op::Wait { .. } => {}
        }
        Ok(())
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (ptr, a) in std::mem::take(&mut st.allocs) {
            owners().remove(&ptr);
            if a.base == 0 {
                continue;
            }
            if let Ok(l) = layout(a.bytes) {
                // SAFETY: each block came from `alloc` with this layout and is freed once.
                unsafe { std::alloc::dealloc(a.base as *mut u8, l) };
            }
        }
    }
}

impl State {
    /// Queues `op` on the calling thread's current stream; `ptrs`: the device addresses it
    /// reads or writes (kept as the allocations they lie in).
    fn push(&mut self, op: Op, ptrs: &[u64]) {
        let s = current_stream() as usize;
        let mut uses: Vec<u64> = ptrs.iter().filter_map(|&p| self.alloc_of(p)).collect();
        uses.sort_unstable();
        uses.dedup();
        let me = std::thread::current().id();
        if let Some(c) = self.capture.as_mut().filter(|c| c.stream as usize == s && c.thread == me) {
            c.ops.push((op, uses));
            return;
        }
        self.queues[s].push_back(Entry { op, seq: self.queued[s], uses });
        self.queued[s] += 1;
    }

    /// Drops every queued operation (after an ordering error: what they would compute is
    /// undefined), leaving the device usable; earlier events count as reached.
    fn discard(&mut self) {
        self.queues = Default::default();
        self.ran = self.queued;
    }

    /// The start of the live allocation that holds `p`.
    fn alloc_of(&self, p: u64) -> Option<u64> {
        self.allocs.range(..=p).next_back().filter(|(&s, a)| p < s + a.bytes.max(1) as u64).map(|(&s, _)| s)
    }

    /// Before the front of stream `s` runs: an error if an operation still pending on the
    /// other stream uses one of its allocations and no wait on that stream, queued before
    /// it, covers this one (then nothing orders the two: on a GPU they may run in either
    /// order or at once). Coarse on purpose: whole allocations (two views of one buffer
    /// count as one) and every use (two reads count too).
    fn check_order(&self, s: Stream) -> Result<()> {
        let Some(x) = self.queues[s as usize].front() else { return Ok(()) };
        let o = s.other();
        if x.uses.is_empty() || self.queues[o as usize].is_empty() {
            return Ok(());
        }
        let mut covered = 0u64;
        for y in &self.queues[o as usize] {
            if let Op::Wait { on, upto } = y.op {
                if on == s {
                    covered = covered.max(upto);
                }
                continue;
            }
            if covered > x.seq {
                return Ok(());
            }
            if let Some(&a) = y.uses.iter().find(|a| x.uses.contains(a)) {
                let bytes = self.allocs.get(&a).map(|a| a.bytes).unwrap_or(0);
                bail!(
                    "stream-ordering race: {} on the {} stream and {} on the {} stream both use the allocation of \
                     {bytes} bytes at {a:#x}, and no event orders them (record an event after the one that must \
                     come first and make the other stream wait on it)",
                    x.op.describe(),
                    s.name(),
                    y.op.describe(),
                    o.name()
                );
            }
        }
        Ok(())
    }
}

/// An error unless [ptr, ptr + bytes) lies inside one live allocation.
fn check_range(st: &State, ptr: u64, bytes: usize, what: &str) -> Result<()> {
    match st.allocs.range(..=ptr).next_back() {
        Some((&start, a)) if ptr + bytes as u64 <= start + a.bytes as u64 => Ok(()),
        Some((&start, a)) if ptr < start + a.bytes as u64 => bail!(
            "{what} of {bytes} bytes at {ptr:#x} runs {} bytes past the end of its allocation ({} bytes at {start:#x})",
            ptr + bytes as u64 - (start + a.bytes as u64),
            a.bytes
        ),
        _ => bail!("{what} of {bytes} bytes at {ptr:#x}: not inside any allocation of this device"),
    }
}

fn check_canaries(ptr: u64, a: &Alloc) -> Result<()> {
    if a.base == 0 {
        return Ok(());
    }
    // SAFETY: the block [base, base + bytes + 2 CANARY) is a live host allocation.
    let (front, back) = unsafe {
        (
            std::slice::from_raw_parts(a.base as *const u8, CANARY),
            std::slice::from_raw_parts((a.base + CANARY + a.bytes) as *const u8, CANARY),
        )
    };
    if let Some(i) = back.iter().rposition(|&b| b != CANARY_BYTE) {
        bail!("a write up to {} bytes past the end of the allocation of {} bytes at {ptr:#x}", i + 1, a.bytes);
    }
    if let Some(i) = front.iter().position(|&b| b != CANARY_BYTE) {
        bail!("a write up to {} bytes before the allocation of {} bytes at {ptr:#x}", CANARY - i, a.bytes);
    }
    Ok(())
}
