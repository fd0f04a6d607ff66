//! CUDA graphs of one device: [`CudaDevice::capture`] records the work a closure queues on the
//! compute stream into a [`DeviceGraph`], [`CudaDevice::replay`] launches it again as one
//! driver call (a GPU: cuStreamBeginCapture / cuGraphInstantiate / cuGraphLaunch through
//! cudarc; the simulator: its recorded operation list, `sim_graph.rs`).
//!
//! A graph replays the addresses and scalars of its capture. Memory: the blocks the captured
//! work allocates (the ops' per-call scratch) and every block freed while capturing go to a
//! [`GraphPool`] — reused inside the capture in stream order, never handed to anyone else
//! while a graph that uses the pool lives (each graph keeps its pool alive), returned to the
//! cache when the last of them is dropped: the private memory pool of PyTorch's graphs, in
//! small. Graphs may share a pool when they never run at the same time: an engine's decode
//! graphs replay one after another on one compute stream, and none leaves a block in use
//! after it, so they share one (each block is only ever a temporary inside one replay). A
//! block allocated during the capture and still held after it would be written by every
//! replay while someone else owns it: the capture fails instead. Allocating fresh device
//! memory, synchronizing and host copies are refused while capturing (CUDA's thread-local
//! capture mode), so the caller runs the work eagerly just before: the cache (or the pool)
//! then holds every block size the capture asks for.
//!
//! Owns: the capture in progress, [`GraphPool`], [`DeviceGraph`]. May call: the device's
//! allocator and driver. Must not: decide what is captured (the engine does: `engine::graphs`).

use super::{alloc, driver::Graph, CudaDevice, DevBuf};
use anyhow::{anyhow, bail, Result};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// The blocks of a capture in progress (the capturing thread's allocations and frees only:
/// each device is driven by one worker thread, and other threads' blocks are none of the
/// graph's business).
pub(super) struct CapturePool {
    thread: std::thread::ThreadId,
    /// Free blocks the pool will keep: the pool's own, and those freed while capturing.
    free: Vec<(u64, usize)>,
    /// Blocks handed out during the capture and not yet freed.
    live: HashSet<u64>,
    /// Of those, the ones taken from the pool (other graphs use them as scratch).
    from_pool: HashSet<u64>,
    /// Blocks that existed before the capture and were freed during it (the captured work may
    /// read them, so they cannot become scratch).
    foreign_frees: usize,
}

/// Device blocks that belong to CUDA graphs (see the module comment); cheap to clone.
#[derive(Clone)]
pub struct GraphPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    dev: CudaDevice,
    free: Mutex<Vec<(u64, usize)>>,
    /// A block of the pool escaped a failed capture and is held outside it: the graphs that
    /// use the pool must be dropped (they would write it).
    poisoned: std::sync::atomic::AtomicBool,
}

impl PoolInner {
    fn blocks(&self) -> std::sync::MutexGuard<'_, Vec<(u64, usize)>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Stream-ordered like any freed block: work queued after the last replay may reuse
        // these blocks; the replays were queued before it.
        let blocks = std::mem::take(&mut *self.blocks());
        let mut a = self.dev.allocator();
        for (p, c) in blocks {
            a.free(p, c);
        }
    }
}

impl GraphPool {
    /// Bytes the pool holds.
    pub fn bytes(&self) -> usize {
        self.inner.blocks().iter().map(|b| b.1).sum()
    }

    /// Whether a failed capture left one of the pool's blocks held outside it (then the graphs
    /// of the pool must be dropped before any replay).
    pub fn poisoned(&self) -> bool {
        self.inner.poisoned.load(Ordering::SeqCst)
    }
}

/// A captured graph of one device; it keeps its pool's blocks alive.
pub struct DeviceGraph {
    g: Graph,
    dev: CudaDevice,
    _pool: GraphPool,
    /// What the captured launches cost (each replay adds them to the device's ledger).
    launches: super::ledger::Captured,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceGraph({})", self.dev.name())
    }
}

impl DeviceGraph {
    /// Operations recorded (the simulator; None on a GPU, where the driver keeps the graph).
    pub fn recorded_ops(&self) -> Option<usize> {
        match &self.g {
            Graph::Sim(g) => Some(g.len()),
            #[cfg(feature = "cuda")]
            Graph::Real(_) => None,
        }
    }
}

/// Ends a capture however its closure left (an error or a panic): the stream stops capturing,
/// the device allocates normally again, and the free blocks go back to the pool.
struct Capturing<'a> {
    dev: &'a CudaDevice,
    pool: &'a GraphPool,
    ended: bool,
}

impl Capturing<'_> {
    /// Ends the capture: the driver's graph (or error), the blocks still held, the blocks
    /// from before the capture freed during it, and the captured launches' costs.
    fn end(&mut self) -> (Result<Graph>, usize, usize, super::ledger::Captured) {
        self.ended = true;
        let g = self.dev.inner.driver.end_capture();
        let launches = self.dev.take_captured();
        self.dev.inner.capturing.store(false, Ordering::SeqCst);
        let Some(c) = self.dev.capture_pool().take() else { return (g, 0, 0, launches) };
        if c.live.iter().any(|p| c.from_pool.contains(p)) {
            self.pool.inner.poisoned.store(true, Ordering::SeqCst);
        }
        self.pool.inner.blocks().extend(c.free);
        (g, c.live.len(), c.foreign_frees, launches)
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.end();
        }
    }
}

impl CudaDevice {
    /// An empty pool for graphs of this device.
    pub fn graph_pool(&self) -> GraphPool {
        GraphPool {
            inner: Arc::new(PoolInner {
                dev: self.clone(),
                free: Mutex::new(Vec::new()),
                poisoned: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Records the work `f` queues on the compute stream into a graph whose temporaries come
    /// from `pool`; nothing of it runs. The calling thread must be the only one queueing work
    /// on this device meanwhile: on a GPU, another thread's work on the capturing stream would
    /// join the graph and not run (the simulator records only the capturing thread's work, so
    /// it cannot catch that; the product drives each device from one worker thread). Fails (and leaves the device usable, nothing queued)
    /// when `f` fails, when it makes a call a capture refuses, or when a block it allocated is
    /// still held at its end.
    pub fn capture(&self, pool: &GraphPool, f: impl FnOnce() -> Result<()>) -> Result<DeviceGraph> {
        if !Arc::ptr_eq(&pool.inner.dev.inner, &self.inner) {
            bail!("{}: a graph pool of {}", self.name(), pool.inner.dev.name());
        }
        if super::current_stream() != super::Stream::Compute {
            bail!("{}: CUDA graphs capture the compute stream only", self.name());
        }
        self.bind()?;
        {
            let mut c = self.capture_pool();
            if c.is_some() {
                bail!("{}: a CUDA-graph capture is already in progress", self.name());
            }
            let free = std::mem::take(&mut *pool.inner.blocks());
            *c = Some(CapturePool {
                thread: std::thread::current().id(),
                free,
                live: HashSet::new(),
                from_pool: HashSet::new(),
                foreign_frees: 0,
            });
        }
        self.take_captured();
        self.inner.capturing.store(true, Ordering::SeqCst);
        let mut guard = Capturing { dev: self, pool, ended: false };
        let run = self.inner.driver.begin_capture().and_then(|_| f());
        let (ended, live, foreign, launches) = guard.end();
        let fail = |e: anyhow::Error| Err(anyhow!("{}: CUDA-graph capture: {e:#}", self.name()));
        let g = match (run, ended) {
            (Err(e), _) | (Ok(()), Err(e)) => return fail(e),
            (Ok(()), Ok(g)) => g,
        };
        if foreign > 0 {
            return fail(anyhow!(
                "{foreign} device block(s) that existed before the capture were freed during it (the graph may \
                 read them, and they would become another graph's scratch)"
            ));
        }
        if live > 0 {
            return fail(anyhow!(
                "{live} device block(s) allocated by the captured work are still held after it (every replay would \
                 write memory someone else owns)"
            ));
        }
        Ok(DeviceGraph { g, dev: self.clone(), _pool: pool.clone(), launches })
    }

    /// Queues graph `g` (captured on this device) on the compute stream. `keys`: the cached
    /// positions its attention launches read in this replay, summed over their rows (the
    /// caller's step; the ledger counts the replayed launches with them).
    pub fn replay(&self, g: &DeviceGraph, keys: u64) -> Result<()> {
        if !Arc::ptr_eq(&g.dev.inner, &self.inner) {
            bail!("{}: replay of a graph captured on {}", self.name(), g.dev.name());
        }
        self.bind()?;
        self.inner.driver.replay(&g.g).map_err(|e| anyhow!("{}: {e:#}", self.name()))?;
        self.record_replay(&g.launches, keys);
        // COLOTRAIN_CUDA_SYNC=1: a fault inside the graph is reported at its replay.
        if self.sync_launches() {
            self.synchronize().map_err(|e| anyhow!("after a CUDA-graph replay: {e:#}"))?;
        }
        Ok(())
    }

    /// Whether the calling thread is capturing this device's compute stream.
    pub(super) fn captures_here(&self) -> bool {
        self.inner.capturing.load(Ordering::SeqCst)
            && self.capture_pool().as_ref().is_some_and(|p| p.thread == std::thread::current().id())
    }

    /// Whether a capture is in progress on this device.
    pub(super) fn capturing(&self) -> bool {
        self.inner.capturing.load(Ordering::SeqCst)
    }

    fn capture_pool(&self) -> std::sync::MutexGuard<'_, Option<CapturePool>> {
        self.inner.capture.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block for `bytes` while this thread captures: a free block of the same size class
    /// from the capture's pool, else one from the cache (counted as the capture's). None when
    /// this thread is not capturing.
    pub(super) fn capture_alloc(&self, bytes: usize, what: &str) -> Option<Result<DevBuf>> {
        if !self.inner.capturing.load(Ordering::SeqCst) {
            return None;
        }
        let mut guard = self.capture_pool();
        let pool = guard.as_mut().filter(|p| p.thread == std::thread::current().id())?;
        let class = alloc::size_class(bytes);
        // A block from the cache keeps the class the allocator gave it (up to twice this one).
        // The pool's smallest block of at most twice the class, as the allocator's rule.
        let fit =
            pool.free.iter().enumerate().filter(|(_, b)| (class..=2 * class).contains(&b.1)).min_by_key(|(_, b)| b.1);
        let (ptr, class) = match fit.map(|(i, _)| i) {
            Some(i) => {
                let (p, c) = pool.free.swap_remove(i);
                pool.from_pool.insert(p);
                (p, c)
            }
            None => match self.allocator().alloc(&self.inner.driver, bytes, what) {
                Ok(pc) => pc,
                Err(e) => return Some(Err(e)),
            },
        };
        pool.live.insert(ptr);
        Some(Ok(DevBuf { ptr, class, dev: self.clone(), region: None }))
    }

    /// Takes a block this thread frees while capturing into the capture's pool; false when
    /// this thread is not capturing.
    pub(super) fn capture_free(&self, ptr: u64, class: usize) -> bool {
        if !self.inner.capturing.load(Ordering::SeqCst) {
            return false;
        }
        let mut guard = self.capture_pool();
        let Some(pool) = guard.as_mut().filter(|p| p.thread == std::thread::current().id()) else { return false };
        if !pool.live.remove(&ptr) {
            pool.foreign_frees += 1;
        }
        pool.free.push((ptr, class));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::driver::Driver;
    use super::super::sim::{Sim, SM90A};
    use super::super::{ffi, CudaDevice};

    fn cast(dev: &CudaDevice, x: u64, y: u64, n: usize) -> anyhow::Result<()> {
        let p = ffi::ct_cast_params {
            x: x as *mut f32,
            y: y as *mut std::ffi::c_void,
            dtype: ffi::CT_DTYPE_BF16,
            n: n as i64,
            row_amax: std::ptr::null(),
            cols: 1,
        };
        dev.k_cast(p)
    }

    fn bf16s(dev: &CudaDevice, p: u64, n: usize) -> Vec<f32> {
        let mut h = vec![0u16; n];
        dev.dtoh(&mut h, p).unwrap();
        h.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect()
    }

    /// A capture records without running; a replay runs what it recorded on the buffers'
    /// current contents (an in-place update needs no new capture); the captured work's scratch
    /// block stays in the graph's pool, never handed out while a graph of the pool lives.
    #[test]
    fn a_replay_runs_the_captured_work_on_the_current_contents() {
        let dev = CudaDevice::sim_unshared(93);
        let n = 300;
        let x = dev.scratch(n * 4, "x").unwrap();
        let y = dev.scratch(n * 2, "y").unwrap();
        let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 20.0).collect();
        dev.htod(x.ptr, &a).unwrap();
        dev.memset0(y.ptr, n * 2).unwrap();
        // Warm-up: the scratch block's size class is in the cache before the capture asks for it.
        drop(dev.scratch(n * 2, "warm-up").unwrap());
        let mut tmp_ptr = 0;
        let pool = dev.graph_pool();
        let g = dev
            .capture(&pool, || {
                let t = dev.scratch(n * 2, "captured scratch")?;
                tmp_ptr = t.ptr;
                cast(&dev, x.ptr, t.ptr, n)?;
                dev.dtod(y.ptr, t.ptr, n * 2)
            })
            .unwrap();
        assert!(bf16s(&dev, y.ptr, n).iter().all(|&v| v == 0.0), "the capture ran the work");
        assert_eq!(g.recorded_ops(), Some(2));
        // The ledger: the eager copies before the capture are there, the captured launches not
        // (nothing ran); each replay below adds the cast and the copy, marked as replayed.
        let count = |l: &super::super::ledger::Ledger, op: &str| -> (u64, u64) {
            l.entries().filter(|(k, _)| k.2 == op).fold((0, 0), |a, (_, e)| (a.0 + e.launches, a.1 + e.replayed))
        };
        let before = dev.take_ledger();
        assert_eq!(count(&before, "ct_cast"), (0, 0));
        assert_eq!(count(&before, "memcpy h2d"), (1, 0));
        assert!(pool.bytes() >= n * 2);
        let other = dev.scratch(n * 2, "after the capture").unwrap();
        assert_ne!(other.ptr, tmp_ptr, "the graph's scratch block was handed out while the graph lives");
        for round in 0..2 {
            let b: Vec<f32> = a.iter().map(|v| v * (1.0 + round as f32)).collect();
            dev.htod(x.ptr, &b).unwrap();
            dev.replay(&g, 0).unwrap();
            let want: Vec<f32> = b.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            assert_eq!(bf16s(&dev, y.ptr, n), want, "replay {round}");
        }
        let l = dev.take_ledger();
        assert_eq!(count(&l, "ct_cast"), (2, 2));
        assert_eq!(count(&l, "memcpy d2d"), (2, 2));
        let cast_bytes: f64 = l.entries().filter(|(k, _)| k.2 == "ct_cast").map(|(_, e)| e.bytes).sum();
        assert_eq!(cast_bytes, 2.0 * n as f64 * 6.0, "f32 read, BF16 written, twice");
        drop(pool);
        let still = dev.scratch(n * 2, "while the graph lives").unwrap();
        assert_ne!(still.ptr, tmp_ptr, "the pool's block was handed out while a graph of it lives");
        drop(g);
        let again = dev.scratch(n * 2, "after the graph").unwrap();
        assert_eq!(again.ptr, tmp_ptr, "the last graph of a pool returns its blocks to the cache");
    }

    /// What a capture refuses fails it with the rule named, and leaves the device usable with
    /// nothing of the failed capture queued.
    #[test]
    fn a_capture_refuses_host_copies_syncs_and_escaping_blocks() {
        let dev = CudaDevice::sim_unshared(92);
        let y = dev.scratch(64, "y").unwrap();
        dev.htod(y.ptr, &[7u32; 16]).unwrap();
        // A cached block for the third case (a fresh device allocation is refused first).
        drop(dev.scratch(64, "warm-up").unwrap());
        type Case<'a> = (&'static str, Box<dyn Fn() -> anyhow::Result<()> + 'a>);
        let cases: [Case; 3] = [
            ("a host-to-device copy during CUDA-graph capture", Box::new(|| dev.htod(y.ptr, &[1u32; 16]))),
            (
                "a synchronization during CUDA-graph capture",
                Box::new(|| dev.memset0(y.ptr, 64).and_then(|_| dev.synchronize())),
            ),
            (
                "still held after it",
                Box::new(|| dev.memset0(y.ptr, 64).map(|_| std::mem::forget(dev.scratch(64, "kept").unwrap()))),
            ),
        ];
        for (want, f) in cases {
            let e = format!("{:#}", dev.capture(&dev.graph_pool(), f).unwrap_err());
            assert!(e.contains(want) && e.contains("cuda-sim:92"), "{want}: {e}");
            let mut h = [0u32; 16];
            dev.dtoh(&mut h, y.ptr).unwrap();
            assert_eq!(h, [7; 16], "{want}: work of the failed capture ran");
        }
        // A block from before the capture, freed inside it: the graph may read it, so it cannot
        // become scratch.
        let pre = std::cell::RefCell::new(Some(dev.scratch(64, "before the capture").unwrap()));
        let e = format!(
            "{:#}",
            dev.capture(&dev.graph_pool(), || {
                drop(pre.borrow_mut().take());
                Ok(())
            })
            .unwrap_err()
        );
        assert!(e.contains("existed before the capture were freed during it"), "{e}");
        // A pool block that escapes a failed capture poisons the pool (its graphs must go).
        let pool = dev.graph_pool();
        let g = dev.capture(&pool, || dev.scratch(64, "scratch").map(drop)).unwrap();
        assert!(pool.bytes() > 0 && !pool.poisoned());
        let e = format!("{:#}", dev.capture(&pool, || dev.scratch(64, "kept").map(std::mem::forget)).unwrap_err());
        assert!(e.contains("still held after it") && pool.poisoned(), "{e}");
        drop(g);
        // A panic inside the captured closure ends the capture too: the device synchronizes.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dev.capture(&dev.graph_pool(), || -> anyhow::Result<()> { panic!("a panic while capturing") })
        }));
        assert!(r.is_err());
        dev.memset0(y.ptr, 64).unwrap();
        dev.synchronize().unwrap();
    }

    #[test]
    fn a_replay_whose_buffer_was_freed_is_an_error() {
        let d = Driver::Sim(Sim::new(91, SM90A));
        let p = d.malloc(256).unwrap();
        d.begin_capture().unwrap();
        d.memset0(p, 256).unwrap();
        let g = d.end_capture().unwrap();
        d.replay(&g).unwrap();
        d.synchronize().unwrap();
        d.free(p);
        let e = format!("{:#}", d.replay(&g).unwrap_err());
        assert!(e.contains("the allocation of 256 bytes") && e.contains("freed since its capture"), "{e}");
    }
}
