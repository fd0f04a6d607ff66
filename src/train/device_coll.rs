//! Collectives over device memory, for data-parallel training with the trainer's state on the
//! GPUs (ZeRO-1 in `train::device_state`): the flat FP32 gradient reduce-scattered, the
//! compute weights all-gathered in place, on each device's communication stream and ordered
//! against its compute stream by events. Nothing goes through host memory: the copies are
//! device to device (over NVLink where the GPUs have it, peer to peer over PCIe otherwise).
//!
//! [`PeerCopy`] is the in-process implementation: every rank copies the pieces it needs
//! straight out of the other devices' buffers (`CudaDevice::peer_copy`: cuMemcpyPeerAsync on
//! GPUs, a checked copy between simulated devices), then sums them on its own device in rank
//! order with `ct_col_sum` (so the sums are the host collective's, bit for bit). The ranks
//! meet at host barriers (an [`InProcess`] rendezvous, so an abort wakes them): before the
//! copies (every rank has synchronized its own writes) and after them (no rank changes a
//! buffer another is still reading). The reduce-scatter stages its pieces a bounded number of
//! values at a time (the caller's staging; summing each piece before the next is copied), so
//! it does not hold the gradient's size again; the last piece's sum runs after the second
//! barrier on the communication stream; the returned [`Event`] is the point the compute stream must wait on
//! before it reads the result — the rule the simulator checks (a read without the wait is a
//! "stream-ordering race" error). NCCL does the same work without the host barriers and
//! synchronizations (`train::device_nccl`, the default); this one stays for GPUs without NCCL
//! (COLOTRAIN_DEVICE_COLLECTIVE=peer).
//!
//! Owns: the rendezvous and the per-call exchange of device addresses. May call: the CUDA
//! device layer, `ops::linear::sum_rows_in_order` (the column sum). Must not: know about models or
//! optimizers.

use crate::device::cuda::{on_stream, CudaDevice, Event, Stream};
use crate::device::{DType, Storage, Tensor};
use crate::parallel::{shard_range, Collective, InProcess};
use anyhow::{anyhow, bail, Result};
use std::sync::Mutex;

/// A group of ranks, one per device, that call the same collective in the same order.
pub trait DeviceCollective: Send + Sync {
    fn world(&self) -> usize;
    /// The columns of the staging `reduce_scatter` takes for a shard of `shard` values: how
    /// many of them it sums at a time (at least 1).
    fn staging_columns(&self, shard: usize) -> usize;
    /// Σ over ranks of `send` (F32, n values on this rank's device); this rank's shard
    /// (`shard_range(n, world, rank)`) lands in `recv`. `staging` (F32, world × c, any c ≥ 1)
    /// holds the pieces of c values of the shard at a time while they are summed, ranks in
    /// order (the sums' bits do not depend on c). Queued on the communication stream: read
    /// `recv` only after the compute stream waited on the returned event.
    fn reduce_scatter(&self, rank: usize, send: &Tensor, staging: &mut Tensor, recv: &mut Tensor) -> Result<Event>;
    /// One bucket of `reduce_scatter`, started while the backward goes on: Σ over ranks of
    /// `send`'s values in `ranges` (final on every rank), each rank's part of them landing in
    /// its `recv` (its shard of `send`) at the same offsets. Queued on the communication stream
    /// after the compute stream's work so far; every rank calls with the same ranges in the same
    /// order, and the buckets of one update cover every value once. The event after it orders
    /// it (and the buckets before it) for the compute stream. None: this collective reduces
    /// whole gradients only.
    fn reduce_scatter_ranges(
        &self,
        _rank: usize,
        _send: &Tensor,
        _recv: &mut Tensor,
        _ranges: &[std::ops::Range<usize>],
    ) -> Result<Option<Event>> {
        Ok(None)
    }
    /// `buf` (n values of any dtype on this rank's device) holds this rank's shard at
    /// `shard_range(n, world, rank)`; afterwards it holds every rank's. The compute stream
    /// must wait on the returned event before it reads `buf`.
    fn all_gather_in_place(&self, rank: usize, buf: &mut Tensor) -> Result<Event>;
    /// Wakes every rank in (or later entering) a collective with an error.
    fn abort(&self, reason: &str);
}

/// The in-process collective over device buffers (see the module comment).
pub struct PeerCopy {
    world: usize,
    gate: InProcess,
    /// Each rank's offer for the call in progress.
    slots: Mutex<Vec<Option<Offer>>>,
}

/// What a rank brings to a call: its device, the address of its buffer, and what it believes
/// the call is (checked against every other rank's before any copy).
#[derive(Clone)]
struct Offer {
    dev: CudaDevice,
    ptr: u64,
    call: (&'static str, usize, DType),
}

fn cuda_of(t: &Tensor, what: &str) -> Result<(CudaDevice, u64)> {
    match t.storage() {
        Storage::Cuda(c) => Ok((c.device().clone(), c.device_ptr() as u64)),
        Storage::Cpu(_) => bail!("device collective: the {what} is in host memory"),
    }
}

impl PeerCopy {
    pub fn new(world: usize) -> Result<PeerCopy> {
        Ok(PeerCopy { world, gate: InProcess::new(world)?, slots: Mutex::new(vec![None; world]) })
    }

    fn barrier(&self, rank: usize) -> Result<()> {
        self.gate.all_reduce_sum_f64(rank, 0.0).map(|_| ())
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Option<Offer>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes this rank's buffer after its device has finished writing it, and returns
    /// every rank's (device, address) once all have. Ranks that disagree on the call (which
    /// collective, how many values, which dtype) fail, every one of them, before any copy:
    /// a peer copy sized by one rank's belief would read past another's buffer.
    fn exchange(
        &self,
        rank: usize,
        dev: &CudaDevice,
        ptr: u64,
        call: (&'static str, usize, DType),
    ) -> Result<Vec<(CudaDevice, u64)>> {
        dev.synchronize()?;
        self.slots()[rank] = Some(Offer { dev: dev.clone(), ptr, call });
        self.barrier(rank)?;
        let slots = self.slots().clone();
        let mut out = Vec::with_capacity(slots.len());
        let first = slots.first().and_then(|o| o.as_ref()).map(|o| o.call);
        for (r, o) in slots.into_iter().enumerate() {
            let o = o.ok_or_else(|| anyhow!("device collective: rank {r} published no buffer"))?;
            if Some(o.call) != first {
                let (a, b) = (first.unwrap_or(call), o.call);
                bail!(
                    "device collective: rank 0 called {} of {} {} values, rank {r} {} of {} {} values",
                    a.0,
                    a.1,
                    a.2.name(),
                    b.0,
                    b.1,
                    b.2.name()
                );
            }
            out.push((o.dev, o.ptr));
        }
        Ok(out)
    }

    /// Runs `body`; an error aborts the group, so the other ranks leave their barriers.
    fn guarded<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        body().inspect_err(|e| self.gate.abort(&format!("{e:#}")))
    }
}

/// Values of the shard whose pieces `PeerCopy` stages at a time: 64 MiB a rank (512 MiB at 8
/// GPUs), where the whole shard's pieces took the full gradient's size again (30 GB for a 7B
/// model on each GPU). The sums' bits do not depend on it.
const STAGING_PIECE: usize = 1 << 24;

impl DeviceCollective for PeerCopy {
    fn world(&self) -> usize {
        self.world
    }

    fn staging_columns(&self, shard: usize) -> usize {
        shard.clamp(1, STAGING_PIECE)
    }

    fn reduce_scatter(&self, rank: usize, send: &Tensor, staging: &mut Tensor, recv: &mut Tensor) -> Result<Event> {
        self.guarded(|| {
            let (dev, src) = cuda_of(send, "gradient")?;
            let n = send.numel();
            let own = shard_range(n, self.world, rank);
            let len = own.len();
            let c = staging.numel() / self.world;
            if recv.numel() != len || c == 0 || staging.numel() != self.world * c {
                bail!(
                    "reduce_scatter: rank {rank} of {} receives {} values for its shard of {len}, through staging of {} (expected a multiple of {} above 0)",
                    self.world,
                    recv.numel(),
                    staging.numel(),
                    self.world
                );
            }
            for (t, what) in [(send, "gradient"), (&*staging, "staging"), (&*recv, "shard")] {
                if t.dtype() != DType::F32 {
                    bail!("reduce_scatter: the {what} is {}, expected F32", t.dtype().name());
                }
            }
            let (_, stage) = cuda_of(staging, "staging")?;
            let ranks = self.exchange(rank, &dev, src, ("reduce_scatter", n, DType::F32))?;
            // Piece by piece of w ≤ c values: row p of the staging (world, w) takes rank p's
            // values of them, and their column sums land in the shard. One stream, so a
            // piece's copies wait for the previous piece's sum to have read the staging.
            let sum = |start: usize, w: usize, recv: &mut Tensor| -> Result<()> {
                let rows = staging.view(0, &[self.world, w])?;
                crate::ops::linear::sum_rows_in_order(&dev, &rows, &mut recv.view(start, &[w])?, self.world)
            };
            let pieces: Vec<(usize, usize)> = (0..len).step_by(c).map(|s| (s, c.min(len - s))).collect();
            on_stream(Stream::Comm, || -> Result<()> {
                recv.fill_zero()?;
                for (i, &(start, w)) in pieces.iter().enumerate() {
                    for (p, (peer, base)) in ranks.iter().enumerate() {
                        let (dst, from) = (stage + (p * w * 4) as u64, base + ((own.start + start) * 4) as u64);
                        if p == rank {
                            dev.dtod(dst, from, w * 4)?;
                        } else {
                            dev.peer_copy(dst, peer, from, w * 4)?;
                        }
                    }
                    if i + 1 < pieces.len() {
                        sum(start, w, recv)?;
                    }
                }
                Ok(())
            })?;
            // The copies have read every peer's gradient before anyone moves on; the last
            // piece's sum is queued after (as a collective's work is, the event orders it).
            dev.synchronize()?;
            self.barrier(rank)?;
            on_stream(Stream::Comm, || -> Result<Event> {
                if let Some(&(start, w)) = pieces.last() {
                    sum(start, w, recv)?;
                }
                dev.record_event()
            })
        })
    }

    fn all_gather_in_place(&self, rank: usize, buf: &mut Tensor) -> Result<Event> {
        self.guarded(|| {
            let (dev, base) = cuda_of(buf, "gather buffer")?;
            let (n, es) = (buf.numel(), buf.dtype().size());
            let ranks = self.exchange(rank, &dev, base, ("all_gather_in_place", n, buf.dtype()))?;
            on_stream(Stream::Comm, || -> Result<()> {
                for (p, (peer, pbase)) in ranks.iter().enumerate().filter(|(p, _)| *p != rank) {
                    let r = shard_range(n, self.world, p);
                    dev.peer_copy(base + (r.start * es) as u64, peer, pbase + (r.start * es) as u64, r.len() * es)?;
                }
                Ok(())
            })?;
            dev.synchronize()?;
            self.barrier(rank)?;
            on_stream(Stream::Comm, || dev.record_event())
        })
    }

    fn abort(&self, reason: &str) {
        self.gate.abort(reason);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::device::Device;
    use std::sync::Arc;

    /// An all-gather's values (exact in BF16) and rank `rank`'s BF16 buffer of `n`: its shard
    /// of them, NaN elsewhere (what the gather must fill in).
    pub(in crate::train) fn gather_input(d: &Device, n: usize, world: usize, rank: usize) -> (Vec<f32>, Tensor) {
        let full: Vec<f32> = (0..n).map(|i| (i % 200) as f32 - 100.0).collect();
        let mine = shard_range(n, world, rank);
        let mut init = vec![f32::NAN; n];
        init[mine.clone()].copy_from_slice(&full[mine]);
        let buf = d.from_f32(DType::BF16, &[n], &init).unwrap();
        (full, buf)
    }

    /// Rank 1 aborts `c`; rank 0 enters an all-gather and must be woken with the reason (the
    /// abort test of every device collective).
    pub(in crate::train) fn rank_1_aborts(
        c: &dyn DeviceCollective,
        rank: usize,
        dev: CudaDevice,
    ) -> Result<(), String> {
        if rank == 1 {
            c.abort("rank 1 failed in its backward");
            return Ok(());
        }
        let mut buf = Device::Cuda(dev).zeros(DType::F32, &[8]).unwrap();
        c.all_gather_in_place(0, &mut buf).map(|_| ()).map_err(|e| format!("{e:#}"))
    }

    /// The tests here take turns on simulated GPUs 1 and 2, which no other lib test opens:
    /// the race test's error discards its device's queue.
    static TURN: Mutex<()> = Mutex::new(());

    /// Runs `f(rank, device)` on simulated GPUs 1 and 2, one thread each.
    fn on_two_sims<T: Send + 'static>(f: impl Fn(usize, CudaDevice) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let hs: Vec<_> = [1usize, 2]
            .iter()
            .enumerate()
            .map(|(r, &o)| {
                let f = f.clone();
                std::thread::spawn(move || f(r, CudaDevice::sim(o).expect("a simulated GPU")))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    /// Rank r's gradient: values that are not exact in a different summation order.
    fn grad_of(r: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + r * 13) % 29) as f32 * 0.1 + 1e-7 * (r as f32 + 1.0)).collect()
    }

    /// (bytes, launches) of the ledger's peer copies on the communication stream (NVLink).
    fn peer_bytes(l: &crate::device::cuda::ledger::Ledger) -> (f64, u64) {
        use crate::device::cuda::{ledger::Path, Stream};
        l.entries()
            .filter(|(k, _)| k.1 == Stream::Comm && k.2 == "memcpy peer")
            .inspect(|(k, _)| assert_eq!(l.kind(k.2).map(|x| x.1), Some(Path::Nvlink)))
            .fold((0.0, 0), |a, (_, e)| (a.0 + e.bytes, a.1 + e.launches))
    }

    #[test]
    fn reduce_scatter_and_all_gather_equal_the_host_collective_on_two_sims() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let (world, n) = (2, 1001);
        let coll = Arc::new(PeerCopy::new(world).unwrap());
        let host = Arc::new(InProcess::new(world).unwrap());
        let (c, h) = (coll.clone(), host.clone());
        let out = on_two_sims(move |rank, dev| {
            let d = Device::Cuda(dev.clone());
            let g = grad_of(rank, n);
            let send = d.from_f32(DType::F32, &[n], &g).unwrap();
            let len = shard_range(n, world, rank).len();
            let mut staging = d.zeros(DType::F32, &[world, len]).unwrap();
            let mut recv = d.zeros(DType::F32, &[len]).unwrap();
            dev.take_ledger();
            let e = c.reduce_scatter(rank, &send, &mut staging, &mut recv).unwrap();
            dev.wait_event(&e).unwrap();
            let rs = peer_bytes(&dev.take_ledger());
            let got = recv.to_f32_vec().unwrap();
            // Through a staging of 7 columns: 72 pieces (the last of 4 or 5 values), one peer
            // copy each, the same sums.
            let mut small = d.zeros(DType::F32, &[world, 7]).unwrap();
            let mut pieces = d.zeros(DType::F32, &[len]).unwrap();
            let e = c.reduce_scatter(rank, &send, &mut small, &mut pieces).unwrap();
            dev.wait_event(&e).unwrap();
            assert_eq!(peer_bytes(&dev.take_ledger()), (len as f64 * 4.0, len.div_ceil(7) as u64), "rank {rank}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pieces.to_f32_vec().unwrap()), bits(&got), "rank {rank}: pieces of 7");
            let mut want = vec![0.0f32; len];
            h.reduce_scatter_sum(rank, &g, &mut want).unwrap();
            // BF16 gather: each rank's shard written, the others' pieces copied in.
            let (full, mut buf) = gather_input(&d, n, world, rank);
            dev.take_ledger();
            let e = c.all_gather_in_place(rank, &mut buf).unwrap();
            dev.wait_event(&e).unwrap();
            let ag = peer_bytes(&dev.take_ledger());
            // The launch ledger: each collective's peer copies on the communication stream, over
            // NVLink, of the bytes the rank pulls from its peer (its shard's other piece in f32;
            // the peer's shard in BF16).
            let other = n - len;
            assert_eq!(rs, (len as f64 * 4.0, 1), "rank {rank}: reduce-scatter (NVLink bytes, launches)");
            assert_eq!(ag, (other as f64 * 2.0, 1), "rank {rank}: all-gather (NVLink bytes, launches)");
            (got, want, buf.to_f32_vec().unwrap(), full)
        });
        for (rank, (got, want, gathered, full)) in out.into_iter().enumerate() {
            // The same sums in the same order (501 and 500 values: uneven shards): bit for bit.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "rank {rank}");
            let bad = gathered.iter().zip(&full).position(|(a, b)| a != b);
            assert_eq!(bad, None, "rank {rank}: every shard in place");
        }
    }

    /// Ranks that disagree on the call fail, both of them, naming the rank; a rank that aborts
    /// wakes the other out of the rendezvous.
    #[test]
    fn disagreeing_or_aborted_ranks_fail_instead_of_copying_or_hanging() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let coll = Arc::new(PeerCopy::new(2).unwrap());
        let c = coll.clone();
        let out = on_two_sims(move |rank, dev| {
            let d = Device::Cuda(dev.clone());
            // Rank 1 believes in one more value than rank 0.
            let n = 64 + rank;
            let send = d.from_f32(DType::F32, &[n], &grad_of(rank, n)).unwrap();
            let len = shard_range(n, 2, rank).len();
            let mut staging = d.zeros(DType::F32, &[2, len]).unwrap();
            let mut recv = d.zeros(DType::F32, &[len]).unwrap();
            c.reduce_scatter(rank, &send, &mut staging, &mut recv).map(|_| ()).map_err(|e| format!("{e:#}"))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("a mismatched call must fail");
            assert!(e.contains("rank 1 reduce_scatter of 65 f32 values") || e.contains("aborted"), "rank {rank}: {e}");
        }
        let coll = Arc::new(PeerCopy::new(2).unwrap());
        let c = coll.clone();
        let out = on_two_sims(move |rank, dev| rank_1_aborts(c.as_ref(), rank, dev));
        let e = out[0].clone().expect_err("rank 0 must be woken with an error");
        assert!(e.contains("rank 1 failed in its backward"), "{e}");
    }

    /// The simulator catches the mistake the event exists for: the compute stream reading the
    /// reduce-scatter's output without waiting on its event. One rank (the copies and the
    /// column sum on the communication stream are the same code).
    #[test]
    fn reading_the_shard_without_the_event_is_a_stream_ordering_race() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let n = 64;
        let coll = PeerCopy::new(1).unwrap();
        let dev = CudaDevice::sim(2).unwrap();
        let d = Device::Cuda(dev.clone());
        let send = d.from_f32(DType::F32, &[n], &grad_of(0, n)).unwrap();
        let mut staging = d.zeros(DType::F32, &[1, n]).unwrap();
        let mut recv = d.zeros(DType::F32, &[n]).unwrap();
        // The optimizer's first read of the gradient shard is its squared norm.
        let _forgotten = coll.reduce_scatter(0, &send, &mut staging, &mut recv).unwrap();
        let e = format!("{:#}", crate::ops::optim::sum_sq(&d, &recv).expect_err("the race must be reported"));
        assert!(e.contains("stream-ordering race"), "{e}");
        assert!(e.contains("on the communication stream") && e.contains("compute stream"), "{e}");
        // With the wait, the same read is ordered and sees the sum.
        let e = coll.reduce_scatter(0, &send, &mut staging, &mut recv).unwrap();
        dev.wait_event(&e).unwrap();
        let want: f64 = grad_of(0, n).iter().map(|&x| x as f64 * x as f64).sum();
        let got = crate::ops::optim::sum_sq(&d, &recv).unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    }
}
