//! NCCL on device buffers: a group of communicators over devices of this process
//! ([`CommGroup`], one per device, rank i on the i-th) and one NCCL group call queued on a
//! device's current stream ([`CudaDevice::nccl`]): reductions of F32 sums to a root and
//! broadcasts from a root, any number of them at once (ncclGroupStart … ncclGroupEnd), so a
//! reduce-scatter or an all-gather over shards of any sizes is one call without padding.
//!
//! On GPUs: ncclCommInitAll over the devices' ordinals and ncclReduce / ncclBroadcast on the
//! device's stream (cudarc, feature `cuda`). On the simulator: `sim_nccl.rs` gives the same
//! calls their meaning between simulated devices (sums in rank order from +0.0, the order of
//! `ct_col_sum`), checks that every rank makes the same call, and applies the stream-ordering
//! rule to every buffer a call reads or writes. A dry simulated device checks and counts the
//! call and moves no data.
//!
//! Not run on a GPU yet (no multi-GPU machine has been lent to this project).
//!
//! Owns: the communicators. May call: the driver (`real`, `sim`). Must not: know about
//! gradients, shards or trainers (`train::device_nccl` does).

use super::driver::Driver;
use super::{cost, ledger, CudaDevice};
use anyhow::{bail, Result};
use std::sync::Arc;

/// One operation of an NCCL group call, as rank `rank` sees it (device addresses on its own
/// device). Every rank passes the same list, with its own addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Σ over ranks of `count` F32 values at each rank's `send`, written to `recv` on rank
    /// `root` (the other ranks' `recv` is not touched).
    Reduce { root: usize, send: u64, recv: u64, count: usize },
    /// `bytes` at `buf` on rank `root` copied to `buf` on every other rank (in place).
    Broadcast { root: usize, buf: u64, bytes: usize },
}

impl Part {
    pub fn root(&self) -> usize {
        match *self {
            Part::Reduce { root, .. } | Part::Broadcast { root, .. } => root,
        }
    }

    /// Bytes of the part's data (the values reduced or broadcast).
    pub fn bytes(&self) -> usize {
        match *self {
            Part::Reduce { count, .. } => 4 * count,
            Part::Broadcast { bytes, .. } => bytes,
        }
    }
}

/// The communicators of a group of devices of one kind.
pub struct CommGroup {
    world: usize,
    kind: Kind,
}

enum Kind {
    Sim(Arc<super::sim::SimGroup>),
    /// Each rank's communicator behind its own lock (a call holds it), and whether the group
    /// was aborted (read without the locks).
    #[cfg(feature = "cuda")]
    Real(Vec<std::sync::Mutex<super::real::RealComm>>, std::sync::atomic::AtomicBool),
}

impl CommGroup {
    /// One communicator per device of `devs` (rank i on `devs[i]`): all GPUs, or all simulated.
    pub fn new(devs: &[CudaDevice]) -> Result<CommGroup> {
        if devs.is_empty() {
            bail!("an NCCL group needs at least one device");
        }
        let world = devs.len();
        if devs.iter().all(|d| d.is_sim()) {
            return Ok(CommGroup { world, kind: Kind::Sim(Arc::new(super::sim::SimGroup::new(world))) });
        }
        if devs.iter().any(|d| d.is_sim()) {
            let names: Vec<String> = devs.iter().map(|d| d.name()).collect();
            bail!("an NCCL group over {names:?}: GPUs and simulated GPUs cannot share communicators");
        }
        Self::real(devs)
    }

    #[cfg(feature = "cuda")]
    fn real(devs: &[CudaDevice]) -> Result<CommGroup> {
        let ords: Vec<usize> = devs.iter().map(|d| d.ordinal()).collect();
        let comms = super::real::RealComm::init_all(&ords)?;
        let comms = comms.into_iter().map(std::sync::Mutex::new).collect();
        Ok(CommGroup { world: devs.len(), kind: Kind::Real(comms, Default::default()) })
    }

    #[cfg(not(feature = "cuda"))]
    fn real(_devs: &[CudaDevice]) -> Result<CommGroup> {
        bail!("NCCL on GPUs: this binary was built without --features cuda")
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Wakes every rank waiting in (or later entering) a call with an error. On GPUs each
    /// communicator is aborted (ncclCommAbort: its kernels waiting for a dead peer return) at
    /// once if no call of its rank is inside NCCL, else by that rank as its call returns; every
    /// later call is refused. Not reached: a rank's thread blocked inside ncclGroupEnd itself
    /// while NCCL connects the ranks (at their first call, by default) to a peer that failed
    /// after the rendezvous; that needs NCCL's non-blocking communicators.
    pub fn abort(&self, reason: &str) {
        match &self.kind {
            Kind::Sim(g) => g.abort(reason),
            #[cfg(feature = "cuda")]
            Kind::Real(cs, aborted) => {
                aborted.store(true, std::sync::atomic::Ordering::SeqCst);
                for c in cs {
                    match c.try_lock() {
                        Ok(mut c) => c.abort(),
                        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().abort(),
                        Err(std::sync::TryLockError::WouldBlock) => {}
                    }
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
impl Drop for CommGroup {
    fn drop(&mut self) {
        if let Kind::Real(cs, aborted) = &mut self.kind {
            let aborted = *aborted.get_mut();
            let mut held: Vec<_> = cs.iter_mut().map(|c| c.get_mut().unwrap_or_else(|e| e.into_inner())).collect();
            super::real::RealComm::release(&mut held, aborted);
        }
    }
}

impl CudaDevice {
    /// Queues `parts` as one NCCL group call of rank `rank` of `comm` on the current stream
    /// (see [`super::on_stream`]). Every rank of the group must make the same call, in the same
    /// order as its other calls; the simulator checks it, a GPU would hang. The buffers stay
    /// alive and unchanged until the stream has run the call (an event recorded after it).
    pub fn nccl(&self, comm: &CommGroup, rank: usize, parts: &[Part]) -> Result<()> {
        if rank >= comm.world {
            bail!("{}: NCCL rank {rank} of a group of {}", self.name(), comm.world);
        }
        if let Some(p) = parts.iter().find(|p| p.root() >= comm.world) {
            bail!("{}: NCCL call with root {} in a group of {}", self.name(), p.root(), comm.world);
        }
        match (&self.inner.driver, &comm.kind) {
            (Driver::Sim(s), Kind::Sim(g)) => s.nccl(g, rank, parts)?,
            #[cfg(feature = "cuda")]
            (Driver::Real(r), Kind::Real(cs, aborted)) => {
                use std::sync::atomic::Ordering::SeqCst;
                let mut c = cs[rank].lock().unwrap_or_else(|e| e.into_inner());
                if c.ordinal != self.ordinal() {
                    bail!("{}: NCCL rank {rank}'s communicator is on cuda:{}", self.name(), c.ordinal);
                }
                if aborted.load(SeqCst) || c.is_gone() {
                    c.abort();
                    bail!("{}: the NCCL group was aborted after a rank failed", self.name());
                }
                let out = r.nccl(&c, parts);
                // An abort while this rank was inside NCCL left its communicator to it.
                if aborted.load(SeqCst) {
                    c.abort();
                    out?;
                    bail!("{}: the NCCL group was aborted after a rank failed", self.name());
                }
                out?
            }
            #[allow(unreachable_patterns)]
            _ => bail!("{}: an NCCL call on a communicator of another kind of device", self.name()),
        }
        // The launch ledger: the bytes each rank sends over NVLink in NCCL's ring algorithms,
        // (world − 1)/world of each part's data (a reduce-scatter's and an all-gather's bus
        // bytes); the reductions' arithmetic is NCCL's, inside those kernels.
        let share = (comm.world - 1) as f64 / comm.world as f64;
        for (name, reduce) in [("nccl reduce", true), ("nccl broadcast", false)] {
            let bytes: usize =
                parts.iter().filter(|p| matches!(p, Part::Reduce { .. }) == reduce).map(|p| p.bytes()).sum();
            if bytes > 0 {
                self.record(name, cost::copy((bytes as f64 * share) as usize, ledger::Path::Nvlink));
            }
        }
        Ok(())
    }
}
