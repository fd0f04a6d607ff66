//! The caching device allocator of one CUDA device: blocks are rounded to a size class (512 B
//! steps up to 1 MiB, 2 MiB steps above), freed blocks go to a free list per class and are
//! handed out again without a driver call: a request takes the smallest cached block of at
//! most twice its class. (Exact classes only made the cache grow every step, by about a
//! quarter of what the tiny job uses, as sequence lengths and so activation sizes changed:
//! each new length was a new class, and the old blocks were never taken again.) Blocks are reused in the compute stream's order: a
//! block freed while kernels still read it is only reused by work queued after them. The
//! communication stream uses only long-lived blocks (the collectives' buffers, allocated with
//! the trainer's state), so no block moves between streams while either has work on it. A memory budget caps what the process holds; over budget, the cached blocks are
//! returned to the driver first, and then the request fails with an error naming it.
//! Not yet run on a GPU.

use anyhow::{bail, Result};
use std::collections::BTreeMap;

const SMALL: usize = 1 << 20;
const SMALL_STEP: usize = 512;
const LARGE_STEP: usize = 2 << 20;

/// The size class of a request (at least one step, so zero-sized tensors get a real address).
pub(super) fn size_class(bytes: usize) -> usize {
    let b = bytes.max(1);
    if b <= SMALL {
        b.div_ceil(SMALL_STEP) * SMALL_STEP
    } else {
        b.div_ceil(LARGE_STEP) * LARGE_STEP
    }
}

#[derive(Debug, Default)]
pub(super) struct Allocator {
    free: BTreeMap<usize, Vec<u64>>,
    /// Bytes handed out (by class), cached in free lists, and the largest in_use + cached seen.
    pub in_use: usize,
    pub cached: usize,
    pub peak: usize,
    pub budget: usize,
}

/// What the allocator needs from the driver (the device implements it; tests can fake it).
pub(super) trait Driver {
    fn malloc(&self, bytes: usize) -> Result<u64>;
    fn free(&self, ptr: u64);
    /// Waits until no queued work can still touch freed blocks.
    fn quiesce(&self) -> Result<()>;
}

fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl Allocator {
    pub fn new(budget: usize) -> Allocator {
        Allocator { budget, ..Default::default() }
    }

    /// A block of at least `bytes` bytes; returns (pointer, class). `what` names the request
    /// in errors.
    pub fn alloc(&mut self, drv: &dyn Driver, bytes: usize, what: &str) -> Result<(u64, usize)> {
        let class = size_class(bytes);
        // The smallest cached block of at most twice the class (the block keeps its class).
        let fit = self.free.range_mut(class..=2 * class).find_map(|(&c, v)| v.pop().map(|p| (p, c)));
        if let Some((p, c)) = fit {
            self.cached -= c;
            self.in_use += c;
            return Ok((p, c));
        }
        self.make_room(drv, class, what)?;
        let p = match drv.malloc(class) {
            Ok(p) => p,
            Err(_) if self.cached > 0 => {
                self.release(drv)?;
                drv.malloc(class)
                    .map_err(|e| anyhow::anyhow!("{what}: device allocation of {bytes} bytes failed: {e}"))?
            }
            Err(e) => bail!("{what}: device allocation of {bytes} bytes failed: {e}"),
        };
        self.in_use += class;
        self.peak = self.peak.max(self.in_use + self.cached);
        Ok((p, class))
    }

    /// Counts `bytes` mapped into a reservation outside the pools (`vmm.rs`) as in use, under
    /// the same budget: over it, the cached blocks go back to the driver first.
    pub fn map(&mut self, drv: &dyn Driver, bytes: usize, what: &str) -> Result<()> {
        self.make_room(drv, bytes, what)?;
        self.in_use += bytes;
        self.peak = self.peak.max(self.in_use + self.cached);
        Ok(())
    }

    /// Checks that `bytes` more fit the budget, giving the cached blocks back to the driver
    /// first when only they stand in the way; `what` names the request in the error.
    fn make_room(&mut self, drv: &dyn Driver, bytes: usize, what: &str) -> Result<()> {
        if self.in_use + self.cached + bytes > self.budget {
            self.release(drv)?;
        }
        if self.in_use + bytes > self.budget {
            bail!(
                "CUDA memory budget exceeded: {what} needs {bytes} bytes ({:.1} MiB); the budget is {:.1} MiB and \
                 {:.1} MiB are in use (set COLOTRAIN_CUDA_BUDGET_MB to change the budget)",
                mib(bytes),
                mib(self.budget),
                mib(self.in_use)
            );
        }
        Ok(())
    }

    /// The mapping of `bytes` counted by [`Allocator::map`] is gone.
    pub fn unmap(&mut self, bytes: usize) {
        self.in_use = self.in_use.saturating_sub(bytes);
    }

    /// Returns a block to its free list.
    pub fn free(&mut self, ptr: u64, class: usize) {
        self.free.entry(class).or_default().push(ptr);
        self.in_use = self.in_use.saturating_sub(class);
        self.cached += class;
    }

    /// Gives every cached block back to the driver (after the stream drained).
    pub fn release(&mut self, drv: &dyn Driver) -> Result<()> {
        if self.cached == 0 {
            return Ok(());
        }
        drv.quiesce()?;
        for (_, ptrs) in std::mem::take(&mut self.free) {
            for p in ptrs {
                drv.free(p);
            }
        }
        self.cached = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct Fake {
        next: RefCell<u64>,
        live: RefCell<Vec<u64>>,
        quiesced: RefCell<usize>,
    }
    impl Driver for Fake {
        fn malloc(&self, bytes: usize) -> Result<u64> {
            let mut n = self.next.borrow_mut();
            *n += bytes as u64;
            self.live.borrow_mut().push(*n);
            Ok(*n)
        }
        fn free(&self, ptr: u64) {
            self.live.borrow_mut().retain(|&p| p != ptr);
        }
        fn quiesce(&self) -> Result<()> {
            *self.quiesced.borrow_mut() += 1;
            Ok(())
        }
    }

    #[test]
    fn classes_reuse_and_budget() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        let drv = Fake::default();
        let mut a = Allocator::new(8 << 20);
        let (p, c) = a.alloc(&drv, 1000, "x").unwrap();
        a.free(p, c);
        let (q, _) = a.alloc(&drv, 900, "y").unwrap();
        assert_eq!(p, q, "a freed block of the same class is reused");
        let (big, bc) = a.alloc(&drv, 5 << 20, "big").unwrap();
        a.free(big, bc);
        // 6 MiB cached + 1 KiB in use: a 2 MiB request (the cached block is over twice its
        // class) releases the cache, then fits.
        let (_, _) = a.alloc(&drv, 2 << 20, "after release").unwrap();
        assert_eq!(*drv.quiesced.borrow(), 1);
        let e = a.alloc(&drv, 6 << 20, "model.layers.0.mlp.up_proj.weight").unwrap_err().to_string();
        assert!(e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("budget"), "{e}");
    }

    #[test]
    fn a_request_takes_the_smallest_cached_block_up_to_twice_its_class() {
        let drv = Fake::default();
        let mut a = Allocator::new(64 << 20);
        let blocks: Vec<_> = [6 << 20, 10 << 20, 3000].iter().map(|&b| a.alloc(&drv, b, "x").unwrap()).collect();
        for &(p, c) in &blocks {
            a.free(p, c);
        }
        let (cached, mallocs) = (a.cached, drv.live.borrow().len());
        // 4 MiB: the 6 MiB block (the smallest of at most 8 MiB), which keeps its class.
        assert_eq!(a.alloc(&drv, 4 << 20, "y").unwrap(), blocks[0]);
        // 5 MiB (class 6 MiB): the 10 MiB block, within twice the class.
        assert_eq!(a.alloc(&drv, 5 << 20, "y").unwrap(), blocks[1]);
        assert_eq!((a.cached, a.in_use), (cached - (16 << 20), (16 << 20)), "counted at the blocks' classes");
        assert_eq!(drv.live.borrow().len(), mallocs, "no driver call");
        // 1000 B (class 1 KiB): the 3000 B block (class 3 KiB) is over twice that: a new block.
        let (p, c) = a.alloc(&drv, 1000, "z").unwrap();
        assert!(p != blocks[2].0 && c == 1024 && drv.live.borrow().len() == mallocs + 1);
    }
}
