//! Training: the step (rollouts → statistics → coefficients → fused loss + backward → update →
//! in-place rewrite of the compute weights), its data parallelism (ZeRO-1 over a collective),
//! the optimizer over FP32 master weights, checkpoints, held-out evaluation, the calibration
//! pass, the metrics a step reports, and reading finished runs.
//!
//! Owns: the trainer state. May call: `model`, `objective`, `mismatch`, `engine`, `data`,
//! `parallel` (the host collectives; `device_coll` and `device_nccl` build the device-buffer
//! ones on them),
//! `device`, `config`. Must not: reimplement ops (they live in `ops`), start devices or threads
//! (the orchestrator does).

pub mod calibrate;
pub mod checkpoint;
pub mod device_coll;
pub mod device_nccl;
mod device_state;
pub mod dp;
pub mod eval;
pub mod metrics;
pub mod optimizer;
pub mod runs;
pub mod step_inputs;
pub mod trainer;
