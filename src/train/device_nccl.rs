//! The NCCL implementation of [`DeviceCollective`]: one communicator per training GPU of the
//! process (`CommGroup`), the flat FP32 gradient reduce-scattered and the compute weights
//! all-gathered in place, straight on the device buffers the trainer holds, on each device's
//! communication stream. A call's NCCL work waits on an event of the compute stream recorded
//! when the call is made (the gradient is complete, the previous reads of its outputs are
//! queued), and the returned event is what the compute stream waits on before it reads the
//! result: no host synchronization anywhere, so the host can queue the next work while the
//! collective runs.
//!
//! The shards are [`shard_range`]'s, which differ by up to one value: the reduce-scatter is one
//! ncclReduce per rank's shard to that rank, the all-gather one in-place ncclBroadcast per
//! rank's shard from that rank, each in one NCCL group call. That moves what ncclReduceScatter
//! and ncclAllGather move (each rank sends (world − 1)/world of the data in the ring) without
//! padding the buffers to equal chunks; the gradient needs no staging.
//!
//! Before each NCCL call the ranks check that they agree on it (which collective, how many
//! values, which dtype) and meet at a host rendezvous: all ranks enter NCCL or none does, so a
//! rank that failed before its call aborts the group instead of leaving the others inside
//! NCCL; one that fails after it aborts the communicators (`CommGroup::abort`: on GPUs
//! ncclCommAbort, which makes the NCCL kernels the others queued return). On the simulator
//! the same calls run between simulated devices (`cuda/sim_nccl.rs`:
//! sums in rank order, bit for bit [`super::device_coll::PeerCopy`]'s); on GPUs NCCL sums in
//! its own order (ring or tree), within rounding of the simulator's.
//!
//! Owns: the group's communicators and its call ledger. May call: `CudaDevice::nccl`, the host
//! rendezvous. Must not: know about models or optimizers.

use super::device_coll::DeviceCollective;
use crate::device::cuda::{on_stream, CommGroup, CudaDevice, Event, Part, Stream};
use crate::device::{DType, Storage, Tensor};
use crate::parallel::{shard_range, Collective, InProcess};
use anyhow::{bail, Result};
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

/// (collective, values, dtype): what every rank must agree a call is.
type Call = (&'static str, usize, DType);

pub struct NcclDevice {
    comm: CommGroup,
    gate: InProcess,
    /// Calls each rank has made.
    made: Mutex<Vec<usize>>,
    /// (call number, call) of the last two calls, as the first rank to make each recorded it:
    /// no rank passes call k's rendezvous before every rank has checked in for call k, so the
    /// ranks are never more than one call apart.
    ledger: Mutex<[Option<(usize, Call)>; 2]>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn cuda_of(t: &Tensor, what: &str) -> Result<(CudaDevice, u64)> {
    match t.storage() {
        Storage::Cuda(c) => Ok((c.device().clone(), c.device_ptr() as u64)),
        Storage::Cpu(_) => bail!("NCCL collective: the {what} is in host memory"),
    }
}

impl NcclDevice {
    /// One communicator per device of `devs` (rank i on `devs[i]`).
    pub fn new(devs: &[CudaDevice]) -> Result<NcclDevice> {
        let world = devs.len();
        Ok(NcclDevice {
            comm: CommGroup::new(devs)?,
            gate: InProcess::new(world)?,
            made: Mutex::new(vec![0; world]),
            ledger: Mutex::new([None, None]),
        })
    }

    /// Checks that rank `rank`'s next call is every other rank's, then meets them: after this
    /// every rank will make the NCCL call (or the group was aborted).
    fn enter(&self, rank: usize, call: Call) -> Result<()> {
        let k = {
            let mut made = lock(&self.made);
            let k = made
                .get(rank)
                .copied()
                .ok_or_else(|| anyhow::anyhow!("NCCL collective: rank {rank} outside the group"))?;
            made[rank] += 1;
            k
        };
        let other = {
            let mut ledger = lock(&self.ledger);
            match ledger[k % 2] {
                Some((seq, c)) if seq == k => (c != call).then_some(c),
                _ => {
                    ledger[k % 2] = Some((k, call));
                    None
                }
            }
        };
        if let Some(c) = other {
            bail!(
                "NCCL collective call {k}: rank {rank} called {} of {} {} values, another rank {} of {} {} values",
                call.0,
                call.1,
                call.2.name(),
                c.0,
                c.1,
                c.2.name()
            );
        }
        self.gate.all_reduce_sum_f64(rank, 0.0).map(|_| ())
    }

    /// Queues `parts` on `dev`'s communication stream after the compute stream's work so far,
    /// and returns the event the compute stream must wait on.
    fn queue(&self, dev: &CudaDevice, rank: usize, parts: &[Part]) -> Result<Event> {
        let ready = dev.record_event()?;
        on_stream(Stream::Comm, || -> Result<Event> {
            dev.wait_event(&ready)?;
            dev.nccl(&self.comm, rank, parts)?;
            dev.record_event()
        })
    }

    /// Rank `rank`'s reduce-scatter operands for `what`, checked (an F32 gradient and its F32
    /// shard): (device, gradient address, shard address, gradient values).
    fn shard_operands(
        &self,
        what: &str,
        rank: usize,
        send: &Tensor,
        recv: &Tensor,
    ) -> Result<(CudaDevice, u64, u64, usize)> {
        let world = self.world();
        let (dev, src) = cuda_of(send, "gradient")?;
        let (_, dst) = cuda_of(recv, "shard")?;
        let (n, own) = (send.numel(), shard_range(send.numel(), world, rank).len());
        if recv.numel() != own || send.dtype() != DType::F32 || recv.dtype() != DType::F32 {
            bail!(
                "{what}: rank {rank} of {world}: an F32 gradient and its F32 shard of {own} of its {n} values expected, got a {} shard of {} values and a {} gradient",
                recv.dtype().name(),
                recv.numel(),
                send.dtype().name()
            );
        }
        Ok((dev, src, dst, n))
    }

    /// Runs `body`; an error aborts the group, so the other ranks leave the rendezvous and NCCL.
    fn guarded<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        body().inspect_err(|e| self.abort(&format!("{e:#}")))
    }

    /// Broadcasts rank `root`'s `bufs` into every other rank's, in place, as one NCCL group
    /// call (one ncclBroadcast per tensor): a split placement's lead trainer sends its compute
    /// weights straight into the generators' (`orchestrator::mailbox`). Every rank passes its
    /// own tensors of the same sizes in the same order, on one GPU, of one dtype. Queued on the
    /// communication stream after the compute stream's work so far; the compute stream must
    /// wait on the returned event before it writes (root) or reads (the others) `bufs`.
    pub fn broadcast(&self, rank: usize, root: usize, bufs: &mut [&mut Tensor]) -> Result<Event> {
        self.guarded(|| {
            let first = bufs.first().ok_or_else(|| anyhow::anyhow!("NCCL broadcast of no tensors"))?;
            let (dev, dtype) = (cuda_of(first, "broadcast tensor")?.0, first.dtype());
            let mut parts = Vec::with_capacity(bufs.len());
            for t in bufs.iter() {
                let (d, ptr) = cuda_of(t, "broadcast tensor")?;
                if d.ordinal() != dev.ordinal() || t.dtype() != dtype {
                    bail!(
                        "NCCL broadcast: rank {rank}'s tensors are on cuda:{} and cuda:{}, or {} and {}",
                        dev.ordinal(),
                        d.ordinal(),
                        dtype.name(),
                        t.dtype().name()
                    );
                }
                parts.push(Part::Broadcast { root, buf: ptr, bytes: t.numel() * dtype.size() });
            }
            if root >= self.world() {
                bail!("NCCL broadcast from rank {root} of a group of {}", self.world());
            }
            let total = bufs.iter().map(|t| t.numel()).sum();
            self.enter(rank, ("broadcast", total, dtype))?;
            self.queue(&dev, rank, &parts)
        })
    }
}

impl DeviceCollective for NcclDevice {
    fn world(&self) -> usize {
        self.comm.world()
    }

    /// NCCL reduces straight out of every rank's gradient: no staging.
    fn staging_columns(&self, _shard: usize) -> usize {
        1
    }

    /// `staging` is not used.
    fn reduce_scatter(&self, rank: usize, send: &Tensor, _staging: &mut Tensor, recv: &mut Tensor) -> Result<Event> {
        self.guarded(|| {
            let world = self.world();
            let (dev, src, dst, n) = self.shard_operands("reduce_scatter", rank, send, recv)?;
            self.enter(rank, ("reduce_scatter", n, DType::F32))?;
            let parts: Vec<Part> = (0..world)
                .map(|r| (r, shard_range(n, world, r)))
                .filter(|(_, s)| !s.is_empty())
                .map(|(root, s)| {
                    let send = src + 4 * s.start as u64;
                    // NCCL reads recvbuff on the root only.
                    Part::Reduce { root, send, recv: if root == rank { dst } else { send }, count: s.len() }
                })
                .collect();
            self.queue(&dev, rank, &parts)
        })
    }

    fn reduce_scatter_ranges(
        &self,
        rank: usize,
        send: &Tensor,
        recv: &mut Tensor,
        ranges: &[Range<usize>],
    ) -> Result<Option<Event>> {
        self.guarded(|| {
            let world = self.world();
            let (dev, src, dst, n) = self.shard_operands("reduce_scatter_ranges", rank, send, recv)?;
            if let Some(r) = ranges.iter().find(|r| r.start > r.end || r.end > n) {
                bail!("reduce_scatter_ranges: range {r:?} outside the gradient of {n} values");
            }
            let total = ranges.iter().map(|r| r.len()).sum();
            self.enter(rank, ("reduce_scatter_ranges", total, DType::F32))?;
            // Each range's part in each rank's shard, reduced to that rank.
            let mut parts = Vec::new();
            for r in ranges {
                for root in 0..world {
                    let sh = shard_range(n, world, root);
                    let (lo, hi) = (r.start.max(sh.start), r.end.min(sh.end));
                    if lo < hi {
                        let send = src + 4 * lo as u64;
                        let recv = if root == rank { dst + 4 * (lo - sh.start) as u64 } else { send };
                        parts.push(Part::Reduce { root, send, recv, count: hi - lo });
                    }
                }
            }
            self.queue(&dev, rank, &parts).map(Some)
        })
    }

    fn all_gather_in_place(&self, rank: usize, buf: &mut Tensor) -> Result<Event> {
        self.guarded(|| {
            let world = self.world();
            let (dev, base) = cuda_of(buf, "gather buffer")?;
            let (n, es) = (buf.numel(), buf.dtype().size());
            self.enter(rank, ("all_gather_in_place", n, buf.dtype()))?;
            let parts: Vec<Part> = (0..world)
                .map(|r| (r, shard_range(n, world, r)))
                .filter(|(_, s)| !s.is_empty())
                .map(|(root, s)| Part::Broadcast { root, buf: base + (s.start * es) as u64, bytes: s.len() * es })
                .collect();
            self.queue(&dev, rank, &parts)
        })
    }

    fn abort(&self, reason: &str) {
        self.gate.abort(reason);
        self.comm.abort(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::ledger::{Ledger, Path};
    use crate::device::Device;

    /// Runs `f(rank, device, group)` on `world` private simulated GPUs (ordinals from `first`),
    /// one thread each, over one NCCL group of them.
    fn on_sims<T: Send>(
        world: usize,
        first: usize,
        f: impl Fn(usize, CudaDevice, &NcclDevice) -> T + Send + Sync,
    ) -> Vec<T> {
        let devs: Vec<CudaDevice> = (0..world).map(|r| CudaDevice::sim_unshared(first + r)).collect();
        let coll = NcclDevice::new(&devs).unwrap();
        std::thread::scope(|s| {
            let (f, coll) = (&f, &coll);
            let hs: Vec<_> = devs.iter().enumerate().map(|(r, d)| s.spawn(move || f(r, d.clone(), coll))).collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// Rank r's gradient: values whose sum depends on the order of summation.
    fn grad_of(r: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + r * 13) % 29) as f32 * 0.1 + 1e-7 * (r as f32 + 1.0)).collect()
    }

    /// Bytes of op `name` on the communication stream (over NVLink), and of host transfers.
    fn comm_bytes(l: &Ledger, name: &str) -> f64 {
        l.entries()
            .filter(|(k, _)| k.2 == name)
            .inspect(|(k, _)| assert_eq!((k.1, l.kind(k.2).map(|x| x.1)), (Stream::Comm, Some(Path::Nvlink)), "{name}"))
            .map(|(_, e)| e.bytes)
            .sum()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Three ranks, uneven shards (1001 = 334 + 334 + 333 values): the reduce-scatter's shard
    /// is the host collective's sum bit for bit (ranks in order), the all-gather fills in every
    /// other rank's shard exactly, the gradient is left as it was, and the launch ledger counts
    /// NCCL's ring bytes on the communication stream with no host transfer.
    #[test]
    fn nccl_reduce_scatter_and_all_gather_equal_the_host_collective_on_three_sims() {
        let (world, n) = (3, 1001);
        let host = InProcess::new(world).unwrap();
        let out = on_sims(world, 94, |rank, dev, c| {
            let d = Device::Cuda(dev.clone());
            let g = grad_of(rank, n);
            let send = d.from_f32(DType::F32, &[n], &g).unwrap();
            let len = shard_range(n, world, rank).len();
            let mut staging = d.zeros(DType::F32, &[1, 1]).unwrap();
            let mut recv = d.from_f32(DType::F32, &[len], &vec![f32::NAN; len]).unwrap();
            dev.take_ledger();
            let e = c.reduce_scatter(rank, &send, &mut staging, &mut recv).unwrap();
            dev.wait_event(&e).unwrap();
            let l = dev.take_ledger();
            let host_copies = l.entries().filter(|(k, _)| k.2.starts_with("memcpy")).count();
            let rs = (comm_bytes(&l, "nccl reduce"), host_copies);
            let got = recv.to_f32_vec().unwrap();
            let mut want = vec![0.0f32; len];
            host.reduce_scatter_sum(rank, &g, &mut want).unwrap();
            assert_eq!(bits(&send.to_f32_vec().unwrap()), bits(&g), "rank {rank}: the gradient is read only");
            // BF16 gather: each rank's shard written, NaN elsewhere.
            let (full, mut buf) = super::super::device_coll::tests::gather_input(&d, n, world, rank);
            dev.take_ledger();
            let e = c.all_gather_in_place(rank, &mut buf).unwrap();
            dev.wait_event(&e).unwrap();
            let ag = comm_bytes(&dev.take_ledger(), "nccl broadcast");
            (got, want, buf.to_f32_vec().unwrap(), full, rs, ag)
        });
        for (rank, (got, want, gathered, full, rs, ag)) in out.into_iter().enumerate() {
            assert_eq!(bits(&got), bits(&want), "rank {rank}: the shard's sums");
            let bad = gathered.iter().zip(&full).position(|(a, b)| a != b);
            assert_eq!(bad, None, "rank {rank}: every shard in place");
            // Each rank sends (world − 1)/world of the data: 4 bytes a value reduced, 2 gathered.
            let ring = |bytes: usize| ((bytes as f64) * 2.0 / 3.0) as usize as f64;
            assert_eq!(rs, (ring(4 * n), 0), "rank {rank}: reduce-scatter NVLink bytes, copies");
            assert_eq!(ag, ring(2 * n), "rank {rank}: all-gather NVLink bytes");
        }
    }

    /// A broadcast of two BF16 tensors from rank 0 of three (a split lead's weights into its
    /// generators'): every other rank's tensors become rank 0's exactly, in place, rank 0's are
    /// left as they were, the ledger counts NCCL's ring bytes on the communication stream and
    /// no host copy; a rank that passes fewer values fails the call on every rank.
    #[test]
    fn an_nccl_broadcast_writes_the_roots_tensors_into_every_rank_in_place() {
        let sizes = [37usize, 300];
        let value = |t: usize, i: usize| ((i * 5 + t * 11) % 250) as f32 - 125.0; // exact in BF16
        let out = on_sims(3, 100, |rank, dev, c| {
            let d = Device::Cuda(dev.clone());
            let mut ts: Vec<Tensor> = sizes
                .iter()
                .enumerate()
                .map(|(t, &n)| {
                    let v: Vec<f32> = (0..n).map(|i| if rank == 0 { value(t, i) } else { f32::NAN }).collect();
                    d.from_f32(DType::BF16, &[n], &v).unwrap()
                })
                .collect();
            dev.take_ledger();
            let e = c.broadcast(rank, 0, &mut ts.iter_mut().collect::<Vec<_>>()).unwrap();
            dev.wait_event(&e).unwrap();
            let l = dev.take_ledger();
            let copies = l.entries().filter(|(k, _)| k.2.starts_with("memcpy")).count();
            (ts.iter().map(|t| t.to_f32_vec().unwrap()).collect::<Vec<_>>(), comm_bytes(&l, "nccl broadcast"), copies)
        });
        let ring = |bytes: usize| ((bytes as f64) * 2.0 / 3.0) as usize as f64;
        for (rank, (got, nvlink, copies)) in out.into_iter().enumerate() {
            for (t, v) in got.iter().enumerate() {
                let bad = v.iter().enumerate().position(|(i, &x)| x != value(t, i));
                assert_eq!(bad, None, "rank {rank} tensor {t}");
            }
            assert_eq!((nvlink, copies), (ring(2 * sizes[0]) + ring(2 * sizes[1]), 0), "rank {rank}");
        }
        let out = on_sims(2, 103, |rank, dev, c| {
            let mut t = Device::Cuda(dev).zeros(DType::BF16, &[16 - rank]).unwrap();
            c.broadcast(rank, 0, &mut [&mut t]).map(|_| ()).map_err(|e| format!("{e:#}"))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("a short rank must fail the broadcast");
            assert!(e.contains("broadcast of 15 bf16 values") || e.contains("aborted"), "rank {rank}: {e}");
        }
    }

    /// Ranks that disagree on the call fail, both, before any NCCL call; a rank that aborts
    /// wakes the other out of the rendezvous.
    #[test]
    fn disagreeing_or_aborted_ranks_fail_instead_of_calling_nccl() {
        let out = on_sims(2, 97, |rank, dev, c| {
            let d = Device::Cuda(dev);
            let n = 64 + rank; // rank 1 believes in one more value
            let send = d.from_f32(DType::F32, &[n], &grad_of(rank, n)).unwrap();
            let mut recv = d.zeros(DType::F32, &[shard_range(n, 2, rank).len()]).unwrap();
            let mut staging = d.zeros(DType::F32, &[1, 1]).unwrap();
            c.reduce_scatter(rank, &send, &mut staging, &mut recv).map(|_| ()).map_err(|e| format!("{e:#}"))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("a mismatched call must fail");
            assert!(e.contains("reduce_scatter of 65 f32 values") || e.contains("aborted"), "rank {rank}: {e}");
        }
        let out = on_sims(2, 97, |rank, dev, c| super::super::device_coll::tests::rank_1_aborts(c, rank, dev));
        let e = out[0].clone().expect_err("rank 0 must be woken with an error");
        assert!(e.contains("rank 1 failed in its backward"), "{e}");
    }

    /// The simulator holds NCCL calls to the stream-ordering rule both ways: the compute stream
    /// reading the reduce-scatter's output without waiting on its event, and an NCCL call on the
    /// communication stream reading a buffer the compute stream is still writing.
    #[test]
    fn nccl_calls_obey_the_stream_ordering_rule_on_the_simulator() {
        let n = 64;
        let dev = CudaDevice::sim_unshared(99);
        let coll = NcclDevice::new(std::slice::from_ref(&dev)).unwrap();
        let d = Device::Cuda(dev.clone());
        let send = d.from_f32(DType::F32, &[n], &grad_of(0, n)).unwrap();
        let mut staging = d.zeros(DType::F32, &[1, 1]).unwrap();
        let mut recv = d.zeros(DType::F32, &[n]).unwrap();
        // The optimizer's first read of the gradient shard is its squared norm.
        let _forgotten = coll.reduce_scatter(0, &send, &mut staging, &mut recv).unwrap();
        let e = format!("{:#}", crate::ops::optim::sum_sq(&d, &recv).expect_err("the race must be reported"));
        assert!(e.contains("stream-ordering race") && e.contains("an NCCL call on the communication stream"), "{e}");
        // With the wait, the same read is ordered and sees the sum (one rank: the gradient).
        let e = coll.reduce_scatter(0, &send, &mut staging, &mut recv).unwrap();
        dev.wait_event(&e).unwrap();
        let want: f64 = grad_of(0, n).iter().map(|&x| x as f64 * x as f64).sum();
        let got = crate::ops::optim::sum_sq(&d, &recv).unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
        // An NCCL call straight on the communication stream, after a compute-stream write of its
        // input and no event between them.
        let group = CommGroup::new(std::slice::from_ref(&dev)).unwrap();
        let mut grad = d.from_f32(DType::F32, &[n], &grad_of(0, n)).unwrap();
        grad.fill_zero().unwrap();
        let (_, p) = cuda_of(&grad, "gradient").unwrap();
        let (_, q) = cuda_of(&recv, "shard").unwrap();
        let part = Part::Reduce { root: 0, send: p, recv: q, count: n };
        let e = on_stream(Stream::Comm, || dev.nccl(&group, 0, &[part])).expect_err("the race must be reported");
        let e = format!("{e:#}");
        assert!(e.contains("stream-ordering race") && e.contains("an NCCL call"), "{e}");
    }
}
