//! Collectives for data-parallel training (ZeRO-1): reduce-scatter, all-gather, scalar
//! all-reduce and broadcast over N ranks, one thread per rank.
//!
//! Owns: the [`Collective`] trait, [`shard_range`] (the one definition of who owns which slice of a
//! flat buffer) and its mapping onto NCCL's equal chunks ([`padded_chunk`], [`pad_shards`],
//! [`unpad_shards`]), and [`InProcess`], the CPU implementation (shared staging slots + an
//! abortable barrier). The NCCL implementation is `super::nccl` (feature `cuda`).
//! May call: std sync primitives. Must not touch: models, tensors, devices or training state.

use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::sync::{Condvar, Mutex, RwLock};

/// A group of `world` ranks that call the same collective in the same order. Every call blocks
/// until all ranks have made it. Any error (including a mismatch between ranks) aborts the group:
/// every later call on every rank fails, so one failing rank never leaves the others hanging.
pub trait Collective: Send + Sync {
    fn world(&self) -> usize;
    /// Sum over ranks of `send` (len = total), rank r receives the sum restricted to shard r (see `shard_range`).
    fn reduce_scatter_sum(&self, rank: usize, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// Every rank contributes its shard; every rank receives the full concatenation (in rank order).
    fn all_gather(&self, rank: usize, shard: &[f32], out: &mut [f32]) -> Result<()>;
    /// [`Collective::all_gather`] of 16-bit values (BF16 weights: half the bytes of the FP32
    /// master). Rank r's shard must be `shard_range(out.len(), world, r)`. The values travel
    /// two to an f32 word through `all_gather`, which only moves bytes (no arithmetic touches
    /// them, so every bit pattern, NaNs included, arrives as sent); the word counts per rank,
    /// ⌈shard / 2⌉, are themselves a `shard_range` split, as `all_gather` requires.
    fn all_gather_u16(&self, rank: usize, shard: &[u16], out: &mut [u16]) -> Result<()> {
        let (world, total) = (self.world(), out.len());
        let own = shard_range(total, world, rank);
        if shard.len() != own.len() {
            let msg = format!(
                "all_gather_u16: rank {rank} contributed {} values for its shard of {}",
                shard.len(),
                own.len()
            );
            self.abort(&msg);
            bail!("{msg}");
        }
        let words: Vec<f32> = shard
            .chunks(2)
            .map(|p| f32::from_bits(p[0] as u32 | (p.get(1).copied().unwrap_or(0) as u32) << 16))
            .collect();
        let counts: Vec<usize> = (0..world).map(|r| shard_range(total, world, r).len().div_ceil(2)).collect();
        let mut gathered = vec![0.0f32; counts.iter().sum()];
        self.all_gather(rank, &words, &mut gathered)?;
        let mut at = 0;
        for (r, n) in counts.iter().enumerate() {
            let dst = &mut out[shard_range(total, world, r)];
            for (i, o) in dst.iter_mut().enumerate() {
                let w = gathered[at + i / 2].to_bits();
                *o = if i % 2 == 0 { w as u16 } else { (w >> 16) as u16 };
            }
            at += n;
        }
        Ok(())
    }
    /// Sum of one f64 per rank (e.g. squared gradient norms), returned to every rank.
    fn all_reduce_sum_f64(&self, rank: usize, x: f64) -> Result<f64>;
    /// Everyone gets rank `root`'s vector of f32 (resized to match).
    fn broadcast(&self, rank: usize, root: usize, buf: &mut Vec<f32>) -> Result<()>;
    /// Wakes every rank waiting in (or later entering) a collective with the error
    /// "collective aborted: <reason>". Sticky: the group is unusable afterwards. The first reason wins.
    fn abort(&self, reason: &str);
}

/// The slice of a flat buffer of `total` elements owned by `rank` out of `world`: contiguous,
/// sizes differ by at most 1, earlier ranks get the extra element. `world` must be > 0.
pub fn shard_range(total: usize, world: usize, rank: usize) -> Range<usize> {
    let world = world.max(1);
    let (base, extra) = (total / world, total % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start.min(total)..(start + len).min(total)
}

/// NCCL's reduce-scatter and all-gather give every rank an equal chunk; [`shard_range`] shards
/// differ by up to one element. The chunk that holds every shard: ⌈total / world⌉ (≥ 1).
pub fn padded_chunk(total: usize, world: usize) -> usize {
    total.div_ceil(world.max(1)).max(1)
}

/// staged (world · chunk) = rank r's shard_range of `full` at r · chunk, zeros after it.
pub fn pad_shards(full: &[f32], world: usize, chunk: usize, staged: &mut Vec<f32>) {
    staged.clear();
    staged.resize(world * chunk, 0.0);
    for r in 0..world {
        let sh = shard_range(full.len(), world, r);
        staged[r * chunk..r * chunk + sh.len()].copy_from_slice(&full[sh]);
    }
}

/// The inverse of [`pad_shards`]: full[shard_range(r)] = staged[r · chunk ..] for every rank.
pub fn unpad_shards(staged: &[f32], world: usize, chunk: usize, full: &mut [f32]) {
    let total = full.len();
    for r in 0..world {
        let sh = shard_range(total, world, r);
        let n = sh.len();
        full[sh].copy_from_slice(&staged[r * chunk..r * chunk + n]);
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Idle,
    ReduceScatter,
    AllGather,
    AllReduceF64,
    Broadcast,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Idle => "nothing",
            Op::ReduceScatter => "reduce_scatter_sum",
            Op::AllGather => "all_gather",
            Op::AllReduceF64 => "all_reduce_sum_f64",
            Op::Broadcast => "broadcast",
        }
    }
}

/// What one rank published for the current call. Written only by its rank, and only between the
/// closing barrier of the previous call and the opening barrier of this one; read by everyone
/// between the two barriers of a call.
struct Slot {
    op: Op,
    data: Vec<f32>,
    /// The receive length the rank passed (validated by every rank identically).
    out_len: usize,
    scalar: f64,
    root: usize,
}

struct Meeting {
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
}

/// In-process collective for ranks that are threads of this process (CPU devices).
///
/// Deterministic: every element is summed in rank order 0, 1, …, N−1 whatever the thread timing,
/// so results are bit-reproducible. Each rank reduces only its own shard, so reduction work is
/// split across ranks. Each call costs two barrier meetings and one copy of every rank's
/// contribution into a staging slot (the staging memory, N × the largest buffer, is kept for reuse).
pub struct InProcess {
    world: usize,
    slots: Vec<RwLock<Slot>>,
    meeting: Mutex<Meeting>,
    wake: Condvar,
}

impl InProcess {
    pub fn new(world: usize) -> Result<InProcess> {
        if world == 0 {
            bail!("a collective needs at least one rank (world = 0)");
        }
        let slots = (0..world)
            .map(|_| RwLock::new(Slot { op: Op::Idle, data: Vec::new(), out_len: 0, scalar: 0.0, root: 0 }))
            .collect();
        let meeting = Mutex::new(Meeting { arrived: 0, generation: 0, aborted: None });
        Ok(InProcess { world, slots, meeting, wake: Condvar::new() })
    }

    /// The abort reason, if the group was aborted.
    pub fn aborted(&self) -> Option<String> {
        self.meeting.lock().unwrap_or_else(|p| p.into_inner()).aborted.clone()
    }

    /// Aborts the group with `msg` and returns it as the error (for failures found by this rank).
    fn fail(&self, msg: String) -> anyhow::Error {
        self.abort(&msg);
        anyhow!(msg)
    }

    /// Blocks until all `world` ranks have arrived (or the group is aborted).
    fn meet(&self) -> Result<()> {
        // Nothing panics while holding this lock, and its data is plain counters: a poisoned lock is
        // still consistent, so it is recovered rather than reported.
        let mut m = self.meeting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &m.aborted {
            bail!("collective aborted: {reason}");
        }
        m.arrived += 1;
        if m.arrived == self.world {
            m.arrived = 0;
            m.generation = m.generation.wrapping_add(1);
            self.wake.notify_all();
            return Ok(());
        }
        let generation = m.generation;
        loop {
            m = self.wake.wait(m).unwrap_or_else(|p| p.into_inner());
            if m.generation != generation {
                return Ok(());
            }
            if let Some(reason) = &m.aborted {
                bail!("collective aborted: {reason}");
            }
        }
    }

    /// Publishes this rank's contribution, then meets everyone and validates what all ranks
    /// published. Every rank sees the same slots, so all ranks reach the same verdict.
    fn publish(&self, rank: usize, op: Op, data: &[f32], out_len: usize, scalar: f64, root: usize) -> Result<()> {
        if rank >= self.world {
            return Err(self.fail(format!("{}: rank {rank} is out of range for world {}", op.name(), self.world)));
        }
        {
            let mut s = self.slots[rank].write().map_err(|_| self.fail("a staging slot was poisoned".into()))?;
            s.op = op;
            s.data.clear();
            s.data.extend_from_slice(data);
            s.out_len = out_len;
            s.scalar = scalar;
            s.root = root;
        }
        self.meet()?;
        self.validate(op).map_err(|msg| self.fail(msg))
    }

    fn validate(&self, op: Op) -> std::result::Result<(), String> {
        let slots = self.read_all()?;
        let total: usize = match op {
            Op::AllGather => slots.iter().map(|s| s.data.len()).sum(),
            _ => slots[0].data.len(),
        };
        if let Some((r, s)) = slots.iter().enumerate().find(|(_, s)| s.op != slots[0].op) {
            return Err(format!("rank 0 called {} while rank {r} called {}", slots[0].op.name(), s.op.name()));
        }
        for (r, s) in slots.iter().enumerate() {
            match op {
                Op::ReduceScatter if s.data.len() != total => {
                    return Err(format!("reduce_scatter_sum: rank 0 sends {total} values, rank {r} {}", s.data.len()));
                }
                Op::ReduceScatter if s.out_len != shard_range(total, self.world, r).len() => {
                    let (want, world, got) = (shard_range(total, self.world, r).len(), self.world, s.out_len);
                    return Err(format!(
                        "reduce_scatter_sum: rank {r} receives into {got} values, \
                         its shard of {total} over {world} ranks has {want}"
                    ));
                }
                Op::AllGather if s.out_len != total => {
                    return Err(format!(
                        "all_gather: rank {r} gathers into {} values, the shards total {total}",
                        s.out_len
                    ));
                }
                Op::Broadcast if s.root != slots[0].root || s.root >= self.world => {
                    return Err(format!(
                        "broadcast: rank 0 names root {}, rank {r} root {} (world {})",
                        slots[0].root, s.root, self.world
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn read_all(&self) -> std::result::Result<Vec<std::sync::RwLockReadGuard<'_, Slot>>, String> {
        self.slots.iter().map(|s| s.read().map_err(|_| "a staging slot was poisoned".to_string())).collect()
    }

    /// Runs `f` on all published slots, then meets everyone so no slot is overwritten while read.
    fn consume<T>(&self, f: impl FnOnce(&[std::sync::RwLockReadGuard<'_, Slot>]) -> T) -> Result<T> {
        let out = {
            let slots = self.read_all().map_err(|msg| self.fail(msg))?;
            f(&slots)
        };
        self.meet()?;
        Ok(out)
    }

    fn check_open(&self) -> Result<()> {
        match self.aborted() {
            Some(reason) => bail!("collective aborted: {reason}"),
            None => Ok(()),
        }
    }
}

impl Collective for InProcess {
    fn world(&self) -> usize {
        self.world
    }

    fn reduce_scatter_sum(&self, rank: usize, send: &[f32], recv: &mut [f32]) -> Result<()> {
        if self.world == 1 {
            self.check_open()?;
            if rank != 0 || recv.len() != send.len() {
                let msg =
                    format!("reduce_scatter_sum: rank {rank} of 1 receives {} of {} values", recv.len(), send.len());
                return Err(self.fail(msg));
            }
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.publish(rank, Op::ReduceScatter, send, recv.len(), 0.0, 0)?;
        let range = shard_range(send.len(), self.world, rank);
        self.consume(|slots| {
            recv.copy_from_slice(&slots[0].data[range.clone()]);
            for s in &slots[1..] {
                for (o, v) in recv.iter_mut().zip(&s.data[range.clone()]) {
                    *o += *v;
                }
            }
        })
    }

    fn all_gather(&self, rank: usize, shard: &[f32], out: &mut [f32]) -> Result<()> {
        if self.world == 1 {
            self.check_open()?;
            if rank != 0 || out.len() != shard.len() {
                let msg = format!("all_gather: rank {rank} of 1 gathers {} values into {}", shard.len(), out.len());
                return Err(self.fail(msg));
            }
            out.copy_from_slice(shard);
            return Ok(());
        }
        self.publish(rank, Op::AllGather, shard, out.len(), 0.0, 0)?;
        self.consume(|slots| {
            let mut at = 0;
            for s in slots {
                out[at..at + s.data.len()].copy_from_slice(&s.data);
                at += s.data.len();
            }
        })
    }

    fn all_reduce_sum_f64(&self, rank: usize, x: f64) -> Result<f64> {
        if self.world == 1 {
            self.check_open()?;
            if rank != 0 {
                return Err(self.fail(format!("all_reduce_sum_f64: rank {rank} is out of range for world 1")));
            }
            return Ok(x);
        }
        self.publish(rank, Op::AllReduceF64, &[], 0, x, 0)?;
        self.consume(|slots| slots[1..].iter().fold(slots[0].scalar, |acc, s| acc + s.scalar))
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &mut Vec<f32>) -> Result<()> {
        if self.world == 1 {
            self.check_open()?;
            if rank != 0 || root != 0 {
                return Err(self.fail(format!("broadcast: rank {rank}, root {root} are out of range for world 1")));
            }
            return Ok(());
        }
        let data: &[f32] = if rank == root { buf } else { &[] };
        self.publish(rank, Op::Broadcast, data, 0, 0.0, root)?;
        self.consume(|slots| {
            if rank != root {
                buf.clear();
                buf.extend_from_slice(&slots[root].data);
            }
        })
    }

    fn abort(&self, reason: &str) {
        let mut m = self.meeting.lock().unwrap_or_else(|p| p.into_inner());
        if m.aborted.is_none() {
            m.aborted = Some(reason.to_string());
        }
        self.wake.notify_all();
    }
}
