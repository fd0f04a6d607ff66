//! Fault injection for the tests of the failure paths: a device that fails or panics in one
//! phase of one step, which the run must report naming the device and the phase.
//!
//! Owns: [`Fault`], [`ViewFault`]. May call: nothing. Must not: fire outside the step and device it names.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub step: u64,
    pub rank: usize,
    pub panic: bool,
    /// "rollout" (colocated schedules that generate: not file rollouts or SFT on reference
    /// answers), "teacher", "train" or "resync" (colocated; a split placement publishes instead).
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
