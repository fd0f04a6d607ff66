//! The CPU device: a dedicated rayon thread pool (optionally pinned to cores).
//!
//! Owns: the pool. Every CPU op runs inside `install` so that N CPU "devices" in one process
//! each use their own share of the cores. May call: rayon, core_affinity.

use anyhow::Result;
use std::sync::Arc;

#[derive(Clone)]
pub struct CpuDevice {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuDevice({} threads)", self.threads)
    }
}

impl CpuDevice {
    /// `threads == 0` uses every available core. `cores`, when given, pins worker i to
    /// `cores[i % cores.len()]`.
    pub fn new(threads: usize, cores: Option<Vec<core_affinity::CoreId>>) -> Result<CpuDevice> {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let mut b = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("colotrain-cpu-{i}"));
        if let Some(cores) = cores.filter(|c| !c.is_empty()) {
            b = b.start_handler(move |i| {
                // Pinning is best effort: a refused pin only costs locality.
                let _ = core_affinity::set_for_current(cores[i % cores.len()]);
            });
        }
        let pool =
            b.build().map_err(|e| anyhow::anyhow!("cannot start a CPU thread pool of {threads} threads: {e}"))?;
        Ok(CpuDevice { pool: Arc::new(pool), threads })
    }

    /// A one-thread device for host-side buffers (quantized tensors built on the host).
    pub fn host() -> CpuDevice {
        static HOST: std::sync::OnceLock<CpuDevice> = std::sync::OnceLock::new();
        HOST.get_or_init(|| CpuDevice::new(1, None).expect("a one-thread pool")).clone()
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f` once on every thread of the pool (used to size thread-local scratch up front).
    pub fn broadcast(&self, f: impl Fn() + Sync) {
        self.pool.broadcast(|_| f());
    }
}
