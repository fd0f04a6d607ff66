//! The dry simulated GPU (`CudaDevice::sim_dry`): the simulator with nothing behind it. Every
//! allocation gets an address of its own, 256-byte aligned, that no host memory backs; every
//! operation is checked and queued as on the simulator (launch rules, ranges, stream order,
//! graph captures and replays, the launch ledger above the driver) and then dropped instead of
//! run; a copy to the host reads zeros. So the glue launches at a real model's shapes (a 7B
//! model's 15 GB of weights cost no host memory) and the ledger counts what those launches
//! would do on a GPU, while no kernel computes anything: what a dry run reads back is zeros,
//! so it suits only work whose launches do not depend on the values (a decode whose length
//! is fixed, a training step).
//!
//! Owns: the dry address space. May call: the parent `sim`'s state. Must not: dereference a
//! dry address.

use super::{owners, Alloc, Arch, Sim};
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU64, Ordering};

/// Dry addresses lie in [16 TiB, 80 TiB), where Linux puts no host memory of this process:
/// a PIE binary and its heap start near 85 TiB on x86-64 (near 170 TiB on aarch64), mmap works
/// down from the top of the user space, and a non-PIE binary's heap lies far below 16 TiB. So a
/// dry address never lies inside a backed simulated allocation of another device in the same
/// process. One bump pointer for every dry device: freed ranges are not handed out again, so a
/// stale address never names a later allocation (64 TiB of them is tens of dry 8-GPU 7B steps).
const DRY_BASE: u64 = 16 << 40;
const DRY_END: u64 = 80 << 40;
const ALIGN: u64 = 256;
static NEXT: AtomicU64 = AtomicU64::new(DRY_BASE);

impl Sim {
    /// A dry simulated GPU (see the module comment).
    pub fn dry(ordinal: usize, arch: Arch) -> Sim {
        let mut s = Sim::new(ordinal, arch);
        s.dry = true;
        s
    }

    pub fn is_dry(&self) -> bool {
        self.dry
    }

    /// A dry allocation: an address and its size, registered like a backed one.
    pub(super) fn dry_malloc(&self, bytes: usize) -> Result<u64> {
        let span = (bytes.max(1) as u64).div_ceil(ALIGN) * ALIGN;
        let ptr = NEXT.fetch_add(span, Ordering::Relaxed);
        if ptr + span > DRY_END {
            bail!("{}: the dry address space is used up (64 TiB handed out in this process)", self.name());
        }
        self.state().allocs.insert(ptr, Alloc { base: 0, bytes });
        owners().insert(ptr, (bytes, self.ordinal));
        Ok(ptr)
    }
}
