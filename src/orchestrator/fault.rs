//! Fault injection for the tests of the failure paths: a device that fails or panics in one
//! phase of one step, which the run must report naming the device and the phase.
//!
//! Owns: [`Fault`], [`ViewFault`], [`FaultyCollective`]. May call: the device collective it
//! wraps. Must not: fire outside the step and device it names.

use crate::device::cuda::Event;
use crate::device::Tensor;
use crate::train::device_coll::DeviceCollective;
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub step: u64,
    pub rank: usize,
    pub panic: bool,
    /// "rollout" (colocated schedules that generate: not file rollouts or SFT on reference
    /// answers), "teacher", "train" or "resync" (colocated; a split placement publishes
    /// instead): at the start of that phase's work on the device; "all-gather": inside the
    /// train phase of several GPUs, after the reduce-scatter and the optimizer step, as the
    /// device's `step`-th all-gather since the run (or its resume) started begins — its peers
    /// are already in it. That is update `step`: the step itself when each step makes one
    /// update and none is skipped. "broadcast": a split placement's generator on a GPU, as it
    /// is about to join the `step`-th broadcast round of the lead's weights (the lead already
    /// waits in it): round `step` is update `step` when each step makes one update.
    pub phase: &'static str,
}

impl Fault {
    /// Fails (or panics) when `f` names this phase, step and device.
    pub fn check(f: Option<Fault>, phase: &str, step: u64, rank: usize) -> Result<()> {
        match f {
            Some(f) if f.phase == phase && f.step == step && f.rank == rank => {
                if f.panic {
                    panic!("injected panic at step {step}");
                }
                bail!("injected device error at step {step}")
            }
            _ => Ok(()),
        }
    }
}

/// Fault hooks of the mismatch guard's tests: the rollout engines' view goes wrong at the end
/// of a step, on every device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ViewFault {
    /// Step `step`'s resync is skipped: the engines keep serving the weights of the step before.
    SkipResync { step: u64 },
    /// After step `step`'s resync, one buffer of every engine's view is zeroed in place, and
    /// from then on the resyncs no longer reach the view while its counters say it is current
    /// (a wake that lost the weights and left the engine reading buffers no resync writes),
    /// until the guard repairs it.
    Corrupt { step: u64 },
}

/// The device collective with a fault: rank `fault.rank`'s `fault.step`-th all-gather (counted
/// from the start of this process's run) fails (or panics) before it enters the rendezvous,
/// where the other ranks already wait — the coordinator's abort must wake them.
pub struct FaultyCollective {
    inner: Arc<dyn DeviceCollective>,
    fault: Fault,
    gathers: AtomicU64,
}

impl FaultyCollective {
    /// `inner` itself without a fault.
    pub fn wrap(inner: Arc<dyn DeviceCollective>, fault: Option<Fault>) -> Arc<dyn DeviceCollective> {
        match fault {
            Some(fault) => Arc::new(FaultyCollective { inner, fault, gathers: AtomicU64::new(0) }),
            None => inner,
        }
    }
}

impl DeviceCollective for FaultyCollective {
    fn world(&self) -> usize {
        self.inner.world()
    }

    fn staging_columns(&self, shard: usize) -> usize {
        self.inner.staging_columns(shard)
    }

    fn reduce_scatter(&self, rank: usize, send: &Tensor, staging: &mut Tensor, recv: &mut Tensor) -> Result<Event> {
        self.inner.reduce_scatter(rank, send, staging, recv)
    }

    fn reduce_scatter_ranges(
        &self,
        rank: usize,
        send: &Tensor,
        recv: &mut Tensor,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Option<Event>> {
        self.inner.reduce_scatter_ranges(rank, send, recv, ranges)
    }

    fn all_gather_in_place(&self, rank: usize, buf: &mut Tensor) -> Result<Event> {
        if rank == self.fault.rank {
            let n = self.gathers.fetch_add(1, Ordering::SeqCst) + 1;
            Fault::check(Some(self.fault), "all-gather", n, rank)?;
        }
        self.inner.all_gather_in_place(rank, buf)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
