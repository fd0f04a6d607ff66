//! The simulator's virtual memory (what cuMemAddressReserve / cuMemMap / cuMemUnmap do on a
//! GPU, `real.rs`): a reservation keeps its address while its memory is unmapped and mapped
//! again. The reservation is a host block registered as an allocation of the device, so every
//! address check holds; while it is unmapped its pages go back to the host (madvise) and any
//! queued operation that uses it is an error when it would run, as a GPU faults on an unmapped
//! address. Freshly mapped memory is poisoned (its contents are undefined on a GPU).
//!
//! Owns: the set of unmapped reservations. May call: the parent `sim`'s state. Must not: know
//! about tensors or the allocator (the device layer counts mapped bytes, `cuda/vmm.rs`).

use super::{Sim, State, POISON_BYTE};
use anyhow::{bail, Result};

/// The granularity the simulator maps at: that of the GPUs it stands for (2 MiB on Hopper and
/// Blackwell), so the memory a reservation costs is the same.
const GRANULARITY: usize = 2 << 20;

impl Sim {
    pub fn granularity(&self) -> Result<usize> {
        Ok(GRANULARITY)
    }

    /// A reservation of `bytes` (a multiple of [`GRANULARITY`]) at a fixed address, unmapped.
    pub fn reserve(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 || bytes % GRANULARITY != 0 {
            bail!("{}: a reservation of {bytes} bytes is not a multiple of {GRANULARITY}", self.name());
        }
        let ptr = self.malloc(bytes)?;
        self.state().unmapped.insert(ptr, bytes);
        Ok(ptr)
    }

    /// Backs the reservation at `ptr` with memory again (poisoned: undefined until written).
    pub fn map(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.synchronize()?;
        let mut st = self.state();
        match st.unmapped.get(&ptr) {
            Some(&b) if b == bytes => {}
            _ => bail!("{}: map of {bytes} bytes at {ptr:#x}: not an unmapped reservation of that size", self.name()),
        }
        st.unmapped.remove(&ptr);
        if self.dry {
            return Ok(());
        }
        // SAFETY: [ptr, ptr + bytes) is the interior of a live host block (the reservation),
        // and no queued operation runs meanwhile (the queues are empty, the state locked).
        unsafe { std::ptr::write_bytes(ptr as *mut u8, POISON_BYTE, bytes) };
        Ok(())
    }

    /// Takes the memory of the reservation at `ptr` away, once the queued work has run; the
    /// address stays reserved.
    pub fn unmap(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.synchronize()?;
        let mut st = self.state();
        let live = st.allocs.get(&ptr).map(|a| a.bytes);
        if live != Some(bytes) || st.unmapped.contains_key(&ptr) {
            bail!("{}: unmap of {bytes} bytes at {ptr:#x}: not a mapped reservation of that size", self.name());
        }
        st.unmapped.insert(ptr, bytes);
        if !self.dry {
            release_pages(ptr, bytes);
        }
        Ok(())
    }

    /// Frees the reservation at `ptr` (mapped or not; its size is the allocation's).
    pub fn unreserve(&self, ptr: u64, _bytes: usize) {
        self.state().unmapped.remove(&ptr);
        self.free(ptr);
    }
}

impl State {
    /// An error if `uses` (allocation starts) includes an unmapped reservation.
    pub(super) fn check_mapped(&self, uses: &[u64], what: &str) -> Result<()> {
        if self.unmapped.is_empty() {
            return Ok(());
        }
        if let Some((p, b)) = uses.iter().find_map(|u| self.unmapped.get(u).map(|b| (*u, *b))) {
            bail!(
                "{what} uses the reservation of {b} bytes at {p:#x} while its memory is unmapped (a released KV \
                 cache?): on a GPU an illegal-address fault"
            );
        }
        Ok(())
    }
}

/// Hands the whole host pages inside [ptr, ptr + bytes) back to the system; they read as zeros
/// when touched again. The canaries around the block lie outside the range.
fn release_pages(ptr: u64, bytes: usize) {
    const PAGE: u64 = 4096;
    let (start, end) = (ptr.div_ceil(PAGE) * PAGE, (ptr + bytes as u64) / PAGE * PAGE);
    if end > start {
        // SAFETY: [start, end) is page-aligned and inside one live host block that only this
        // reservation uses; MADV_DONTNEED on private anonymous memory drops the pages, and a
        // later touch maps zero pages (no other effect on the block).
        unsafe { libc::madvise(start as *mut libc::c_void, (end - start) as usize, libc::MADV_DONTNEED) };
    }
}
