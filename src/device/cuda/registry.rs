//! The CUDA devices open in this process, by (simulated, ordinal): opening an ordinal again
//! shares its context, streams, allocator and ledger. The per-step readings of the
//! orchestrator (bytes across PCIe, the memory peak, the launch ledger) go through here by
//! device name, so the orchestrator needs no handle on the devices its workers own.
//!
//! Owns: the registry. May call: the device's counters, allocator and ledger. Must not: keep
//! a device alive (it holds weak references).

use super::{ledger::Ledger, CudaDevice, Inner};
use anyhow::Result;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

type Registry = HashMap<(bool, usize), Weak<Inner>>;
static OPEN: Mutex<Option<Registry>> = Mutex::new(None);

/// The open device for (sim, ordinal), or a new one from `open`.
pub(super) fn shared(sim: bool, ordinal: usize, open: impl FnOnce() -> Result<Inner>) -> Result<CudaDevice> {
    let mut reg = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let reg = reg.get_or_insert_with(HashMap::new);
    if let Some(inner) = reg.get(&(sim, ordinal)).and_then(Weak::upgrade) {
        return Ok(CudaDevice { inner });
    }
    let inner = Arc::new(open()?);
    reg.insert((sim, ordinal), Arc::downgrade(&inner));
    Ok(CudaDevice { inner })
}

/// The open CUDA devices among `names` (device strings such as `cuda:1`, `cuda-sim:0`; CPU
/// devices and devices not open are left out).
fn open_among(names: &[String]) -> Vec<Arc<Inner>> {
    let reg = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let Some(reg) = reg.as_ref() else { return Vec::new() };
    names
        .iter()
        .filter_map(|name| match crate::device::DeviceSpec::parse(name) {
            Ok(crate::device::DeviceSpec::Cuda { ordinal }) => Some((false, ordinal.unwrap_or(0))),
            Ok(crate::device::DeviceSpec::CudaSim { ordinal }) => Some((true, ordinal.unwrap_or(0))),
            _ => None,
        })
        .filter_map(|key| reg.get(&key).and_then(Weak::upgrade))
        .collect()
}

/// (host → device, device → host) bytes copied so far by the open CUDA devices among `names`:
/// monotonic counters for the per-step `transfer` metrics, read as differences.
pub fn transfer_bytes_of(names: &[String]) -> (u64, u64) {
    open_among(names)
        .iter()
        .fold((0, 0), |t, i| (t.0 + i.h2d.load(Ordering::Relaxed), t.1 + i.d2h.load(Ordering::Relaxed)))
}

/// The most memory (in use + cached by the allocator) one open CUDA device among `names` held
/// since the previous call; every such device's peak then restarts from what it holds now. None
/// when none is open (CPU devices).
pub fn take_memory_peak_of(names: &[String]) -> Option<u64> {
    open_among(names)
        .iter()
        .map(|i| {
            let mut a = i.alloc.lock().unwrap_or_else(|e| e.into_inner());
            let peak = a.peak;
            a.peak = a.in_use + a.cached;
            peak as u64
        })
        .max()
}

/// The launch ledger of each open CUDA device among `names` since the previous call, in the
/// order of `names`; every such device's ledger then starts empty. Empty for CPU devices.
pub fn take_ledger_of(names: &[String]) -> Vec<Ledger> {
    open_among(names).iter().map(|i| i.ledger.lock().unwrap_or_else(|e| e.into_inner()).take()).collect()
}

impl CudaDevice {
    /// A dry simulated GPU of architecture `arch` (None: `COLOTRAIN_SIM_ARCH`), outside the
    /// registry (so it never shares an ordinal's state with a backed one, and the per-step
    /// readings above do not see it): the simulator's checks, graphs and launch ledger, with
    /// no memory behind its addresses and no operation run (`sim_dry.rs`). Its memory is a
    /// TiB, so a 7B model's weights, optimizer and activations fit. Its ordinal is
    /// [`DRY_ORDINALS`] + `ordinal`, apart from every backed simulated GPU's: the simulator tells
    /// devices apart by ordinal (a tensor's device, a pointer parameter's owner, a peer copy's
    /// source), so a dry address is never taken for a backed device's and read.
    pub fn sim_dry(ordinal: usize, arch: Option<&str>) -> Result<CudaDevice> {
        let arch = match arch {
            Some(a) => super::sim::Arch::named(a)?,
            None => super::sim::Arch::from_env()?,
        };
        unregistered(DRY_ORDINALS + ordinal, arch, true, 1 << 40)
    }

    /// A simulated GPU of architecture `arch` outside the registry (tests that must own a
    /// device alone, whatever other tests run in the process); `ordinal` only names it.
    #[cfg(test)]
    pub(crate) fn sim_unshared_arch(ordinal: usize, arch: &str) -> CudaDevice {
        let arch = super::sim::Arch::named(arch).expect("a simulated architecture");
        unregistered(ordinal, arch, false, 1 << 30).expect("a simulated device")
    }
}

/// Where the ordinals of dry simulated GPUs start.
pub const DRY_ORDINALS: usize = 1 << 20;

/// A simulated device of `arch` with `memory` bytes, dry or backed, that the registry does not
/// know.
fn unregistered(ordinal: usize, arch: super::sim::Arch, dry: bool, memory: usize) -> Result<CudaDevice> {
    let sim = if dry { super::sim::Sim::dry(ordinal, arch) } else { super::sim::Sim::new(ordinal, arch) };
    let gpu = if arch == super::sim::SM100A { "B300" } else { "H200" };
    let name = format!("{}simulated {gpu}", if dry { "dry " } else { "" });
    let drv = super::driver::Driver::Sim(sim);
    let inner = CudaDevice::with_driver(ordinal, name, arch.cc, arch.name.to_string(), arch.sm_count, memory, drv)?;
    Ok(CudaDevice { inner: Arc::new(inner) })
}
