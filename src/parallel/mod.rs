//! Parallel primitives for running one model replica per device inside one process.
//!
//! Owns: collectives between ranks ([`Collective`], the in-process [`InProcess`]; with the `cuda`
//! feature also `nccl::Nccl`, behind the same trait) and the worker threads that own per-device state
//! ([`WorkerPool`], [`split_cores`]), and the phase each worker thread runs under (`phase`). May call: crossbeam, core_affinity, std threads and sync,
//! tracing. Must not: know about models, devices, tensors or training; callers put those in the
//! worker state and the buffers they pass (the collectives over device buffers are
//! `train::device_coll`, above the device layer).
//!
//! Wiring for data parallelism: `pool.set_on_failure(move |why| collective.abort(why))` so that a
//! rank that fails or panics wakes the ranks waiting for it in a collective instead of hanging.

pub mod collective;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod phase;
pub mod worker;

#[cfg(test)]
mod tests;

pub use collective::{shard_range, Collective, InProcess};
pub use worker::{split_cores, Pending, WorkerPool};
