//! The orchestrator: one process, N devices. It resolves the run's models (`builtin:` names
//! are built on first use by `tiny`), plans the devices (`plan`), starts one worker thread and
//! replica per device (`replica`, `coordinator`), runs the step loop (`job`) with rollouts from
//! the synchronous, asynchronous or split schedule (`schedule`: the queue and the board between
//! generators and trainers), and injects faults for the failure-path tests (`fault`).
//!
//! Owns: the run (its worker pool, the run directory). May call: every layer below it (`train`
//! for the step, checkpoints and metrics; `parallel` for workers and collectives). Must not:
//! implement a training step or an op.
//!
//! Inside, each file imports only those before it: fault, plan, memory → holdings, mailbox, replica → coordinator →
//! guard, schedule → job → tiny → this file.

pub mod coordinator;
pub mod fault;
pub mod guard;
pub mod holdings;
pub mod job;
pub mod mailbox;
pub mod memory;
pub mod plan;
pub mod replica;
pub mod schedule;
pub mod tiny;

pub use crate::train::metrics::{summary_table, JobSummary, LogpDifference, PhaseSeconds, StepMetrics};
pub use fault::{Fault, ViewFault};
pub use job::JobOptions;
pub use plan::plan_devices;
pub use replica::Sources;

use crate::config::JobConfig;
use anyhow::Result;

/// The run's model directories: each `builtin:` name built (once, cached) and resolved; the
/// teacher only for the objective that loads it (OPD).
pub fn sources(job: &JobConfig) -> Result<Sources> {
    use anyhow::Context;
    let student =
        tiny::resolve(&job.model.path).with_context(|| format!("loading the student '{}'", job.model.path))?;
    let teacher = match &job.teacher {
        Some(t) if job.objective.kind == crate::config::ObjectiveKind::Opd => {
            Some(tiny::resolve(&t.path).with_context(|| format!("loading the teacher '{}'", t.path))?)
        }
        _ => None,
    };
    Ok(Sources { student, teacher })
}

/// Runs the `train` job: [`job::run`] with its models resolved by [`sources`] at the boundary
/// between the config and the run.
pub fn run(job: &JobConfig, opts: &JobOptions) -> Result<JobSummary> {
    job::run(job, &sources, opts)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    #[test]
    fn asking_for_more_gpus_than_are_visible_is_refused_up_front() {
        let visible = (0..64).take_while(|&k| crate::device::CudaDevice::new(k).is_ok()).count();
        match super::plan_devices("cuda", 2) {
            Ok(names) => assert!(visible >= 2 && names == ["cuda:0", "cuda:1"], "{names:?} with {visible} visible"),
            Err(e) => {
                let m = format!("{e:#}");
                assert!(visible < 2, "{m}");
                assert!(
                    m.contains("run.devices = 2 GPUs from cuda:0")
                        && m.contains(&format!("but {visible} visible"))
                        && m.contains("cuda:1 cannot be opened"),
                    "{m}"
                );
            }
        }
    }
}
