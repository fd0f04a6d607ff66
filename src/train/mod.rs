//! Training: the optimizer over FP32 master weights, the step (rollouts → statistics →
//! coefficients → fused loss + backward → update → in-place rewrite of the compute weights),
//! checkpoints, and the `train` job loop with its metrics.
//!
//! Owns: the trainer state. May call: `model`, `objective`, `engine`, `data`. Must not:
//! reimplement ops (they live in `ops`).

pub mod calibrate;
pub mod dp;
pub mod checkpoint;
pub mod eval;
pub mod job;
pub mod metrics;
pub mod monitor;
pub mod optimizer;
pub mod replica;
pub mod rollout;
pub mod schedule;
pub mod step_inputs;
pub mod runs;
pub mod tiny;
pub mod trainer;
