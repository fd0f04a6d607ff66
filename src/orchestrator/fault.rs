//! Fault injection for the tests of the failure paths: a device that fails or panics in one
//! phase of one step, which the run must report naming the device and the phase.
//!
//! Owns: [`Fault`]. May call: nothing. Must not: fire outside the step and device it names.

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
