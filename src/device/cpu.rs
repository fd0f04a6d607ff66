//! The CPU device: a dedicated rayon thread pool (optionally pinned to cores).
//!
//! Owns: the pool. Every CPU op runs inside `install` so that N CPU "devices" in one process
//! each use their own share of the cores. May call: rayon, core_affinity.

use anyhow::Result;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Idle polls a hot worker spins through before it polls with `sched_yield` in between, and
/// those (~1 µs or more each) before it polls every 100 µs.
const SPINS: u32 = 256;
const YIELDS: u32 = 2000;

/// The `idle`-th empty round of a wait in [`CpuDevice::install_hot`]: spin, then
/// `sched_yield`, then (idle for milliseconds: the wait is on something else) sleep 100 µs so
/// as not to burn the core.
fn back_off(idle: u32) {
    if idle < SPINS {
        std::hint::spin_loop();
    } else if idle < SPINS + YIELDS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// Dropped when [`CpuDevice::install_hot`]'s closure ends: stops its pollers, and the pool is
/// no longer hot.
struct Release {
    done: Arc<AtomicBool>,
    hot: Arc<AtomicBool>,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        self.hot.store(false, Ordering::Release);
    }
}

#[derive(Clone)]
pub struct CpuDevice {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    /// [`CpuDevice::install_hot`]'s pollers still running on this pool.
    pollers: Arc<AtomicUsize>,
    /// An `install_hot` runs on this pool (at most one at a time).
    hot: Arc<AtomicBool>,
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
        Ok(CpuDevice { pool: Arc::new(pool), threads, pollers: Arc::default(), hot: Arc::default() })
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

    /// [`CpuDevice::install`] for a decode loop: while `f` runs, the pool's other threads poll
    /// for work instead of going to sleep. An idle rayon worker sleeps after ~33 rounds of
    /// `sched_yield` (~30 µs here), and waking it costs ~20–30 µs; a decode step's serial
    /// stretches (the KV write, norms, sampling bookkeeping) are about that long, so each
    /// linear after one paid a wake-up. Idle polls spin briefly, then `sched_yield` (so an
    /// oversubscribed machine still runs others), then, after a few ms idle, sleep 100 µs each.
    ///
    /// `f` starts only when every other thread is polling, so no poller starts inside `f`'s
    /// own work. One hot section per pool at a time: a poller may start on a thread that waits
    /// inside another job, which then resumes only when the section ends; two sections could
    /// each hold the other's waiting job. A call while the pool is hot (nested or from another
    /// thread) is a plain `install`. Other users of the pool during a section may be slowed
    /// that way; the engine's loop is the pool's only user while it runs.
    pub fn install_hot<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads < 2 || self.hot.swap(true, Ordering::AcqRel) {
            return self.install(f);
        }
        let release = Release { done: Arc::new(AtomicBool::new(false)), hot: self.hot.clone() };
        self.pool.install(move || {
            let me = rayon::current_thread_index();
            let (flag, pollers, started) = (release.done.clone(), self.pollers.clone(), Arc::new(AtomicUsize::new(0)));
            let up = started.clone();
            self.pool.spawn_broadcast(move |ctx| {
                // (This thread runs `f`; it finds this job while waiting inside `f`, or after.)
                if Some(ctx.index()) == me {
                    return;
                }
                pollers.fetch_add(1, Ordering::SeqCst);
                up.fetch_add(1, Ordering::Release);
                let mut idle = 0u32;
                while !flag.load(Ordering::Acquire) {
                    if let Some(rayon::Yield::Executed) = rayon::yield_now() {
                        idle = 0;
                        continue;
                    }
                    idle = idle.saturating_add(1);
                    back_off(idle);
                }
                pollers.fetch_sub(1, Ordering::SeqCst);
            });
            // Released however `f` ends (a panic included).
            let _release = release;
            // `f` starts once every other thread polls: a thread that took its poller later,
            // while waiting inside a job it had stolen from `f`, would hold that job until the
            // section ended, and `f` would wait for it forever (a hung `train_job` test).
            let others = self.threads - usize::from(me.is_some());
            let mut idle = 0u32;
            while started.load(Ordering::Acquire) < others {
                idle = idle.saturating_add(1);
                back_off(idle);
            }
            f()
        })
    }

    /// Runs `f` once on every thread of the pool (used to size thread-local scratch up front).
    pub fn broadcast(&self, f: impl Fn() + Sync) {
        self.pool.broadcast(|_| f());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::time::{Duration, Instant};

    /// Waits (up to 5 s) until no poller runs on `dev`.
    fn pollers_gone(dev: &CpuDevice) -> bool {
        let t = Instant::now();
        while dev.pollers.load(Ordering::SeqCst) > 0 {
            if t.elapsed() > Duration::from_secs(5) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn hot_install_runs_parallel_work_and_releases_its_pollers() {
        let dev = CpuDevice::new(3, None).expect("pool");
        for round in 0..3u64 {
            let sum = dev.install_hot(|| {
                // Every other thread polls before `f` starts (none can start inside its work);
                // a later round may also count a previous round's poller, not yet gone.
                let polling = dev.pollers.load(Ordering::SeqCst);
                assert!(polling == 2 || (round > 0 && polling > 2), "f started with {polling} of 2 pollers");
                (0..100_000u64).into_par_iter().map(|i| i * round).sum::<u64>()
            });
            assert_eq!(sum, round * (100_000 * 99_999 / 2));
        }
        assert!(pollers_gone(&dev), "install_hot left pollers running");
        // Nested: a plain install inside (one hot section per pool), and not hot afterwards.
        let nested = dev.install_hot(|| {
            assert!(dev.hot.load(Ordering::SeqCst));
            dev.install_hot(|| (0..1000u32).into_par_iter().sum::<u32>())
        });
        assert_eq!((nested, dev.hot.load(Ordering::SeqCst)), (499_500, false));
        // A panic inside still ends them, and the pool goes on working.
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dev.install_hot(|| {
                (0..64).into_par_iter().for_each(|i| assert!(i < 1000));
                panic!("inside");
            })
        }));
        assert!(caught.is_err());
        assert!(pollers_gone(&dev), "a panic left pollers running");
        assert!(!dev.hot.load(Ordering::SeqCst), "a panic left the pool hot");
        assert_eq!(dev.install(|| (0..10u32).into_par_iter().sum::<u32>()), 45);
    }

    #[test]
    fn hot_sections_never_run_a_poller_inside_their_own_work() {
        // A poller that starts inside a job stolen from `f` (a thread that was already looking
        // for work when the section began) would wait for the section's end while `f` waits
        // for that job: a deadlock, which a `train_job` test hit once. Many short sections,
        // each starting nested parallel work at once, called from outside the pool as the
        // engine's loop is; a watchdog turns a hang into a failure. (The race is rare: the
        // deterministic check is the poller count at `f`'s start, in the test above.)
        let dev = Arc::new(CpuDevice::new(2, None).expect("pool"));
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dev.clone();
        std::thread::spawn(move || {
            for round in 0..3000u64 {
                let s = d.install_hot(|| {
                    (0..64u64)
                        .into_par_iter()
                        .map(|i| (0..i).into_par_iter().map(|j| j ^ round).sum::<u64>())
                        .sum::<u64>()
                });
                let want: u64 = (0..64u64).map(|i| (0..i).map(|j| j ^ round).sum::<u64>()).sum();
                assert_eq!(s, want);
                if round % 7 == 0 {
                    // Let the other thread fall idle (and go to sleep) between some sections.
                    std::thread::sleep(Duration::from_micros(50 + round % 300));
                }
            }
            let _ = tx.send(());
        });
        assert!(rx.recv_timeout(Duration::from_secs(60)).is_ok(), "install_hot deadlocked (or took over 60 s)");
    }
}
