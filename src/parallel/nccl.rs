//! The NCCL implementation of [`Collective`] (feature `cuda`): one communicator per GPU of this
//! process (ncclCommInitAll), each rank's calls on its own stream of its device's primary
//! context.
//!
//! The trainer's vectors live on the host, so every call does three things: it stages the rank's
//! data to its GPU (padded to NCCL's equal chunks, see `collective::pad_shards`), runs the NCCL
//! collective, and copies the result back. That makes it the choice once the GPUs are linked by
//! NVLink and the vectors are large. While training runs on the host, `InProcess` needs no
//! copies, which is why `train` uses NCCL only when asked (`COLOTRAIN_COLLECTIVE=nccl`).
//!
//! Guarantees the in-process collective gives, kept here:
//! - **Mismatched calls fail instead of hanging or corrupting.** A ledger records each call's
//!   (operation, length) by sequence number; a rank whose k-th call differs from another
//!   rank's aborts the group. NCCL itself would wait forever or mix buffers.
//! - **All ranks enter NCCL, or none.** Each rank validates and stages its data, then meets the
//!   others at a host gate (an `InProcess` rendezvous) before the NCCL call. A rank that fails
//!   before the gate aborts the group, and the others leave the gate with an error instead of
//!   waiting inside NCCL for it. Any error of any call aborts the group, as the trait promises.
//! - **Abort wakes everyone.** After the NCCL call a rank waits for its stream by polling an
//!   event and the abort flag, not by blocking in the driver, so `abort` wakes ranks stuck
//!   behind a dead peer. The communicators are aborted (ncclCommAbort) when the group is
//!   dropped, which also stops NCCL kernels still waiting on the GPU.
//!
//! Sums run in NCCL's order (ring or tree), not rank order: results agree with `InProcess` to
//! rounding, not bit for bit, beyond 2 ranks. Not yet run on a GPU (no multi-GPU machine here).
//! The test at the bottom runs where ≥ 2 GPUs and libnccl are present and is skipped elsewhere.
//!
//! Owns: the communicators, per-rank streams and staging buffers. May call: cudarc (driver,
//! nccl). Must not touch: models, tensors, training state, the `CudaDevice` allocator.

use super::collective::{pad_shards, padded_chunk, shard_range, unpad_shards, Collective, InProcess};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nr, sys as ns};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    ReduceScatter,
    AllGather,
    AllReduceF64,
    Broadcast,
}

/// One rank's communicator, stream and device staging buffers (grown, never shrunk).
struct Rank {
    comm: ns::ncclComm_t,
    stream: Arc<CudaStream>,
    send: CudaSlice<f32>,
    recv: CudaSlice<f32>,
    scalar: CudaSlice<f64>,
    len: CudaSlice<u64>,
    staged: Vec<f32>,
    /// Calls this rank has made (its index into the ledger).
    calls: usize,
}

// SAFETY: `comm` is NCCL's communicator handle; NCCL allows a communicator to be used from any
// thread provided calls on it do not overlap, and every use goes through the Mutex<Rank> that owns
// it. The other fields are Send.
unsafe impl Send for Rank {}

pub struct Nccl {
    ranks: Vec<Mutex<Rank>>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    /// (call number, operation, length) of the last two calls, as the first rank to make each
    /// recorded it. Two slots suffice: no rank passes call k's gate before every rank has
    /// checked in for call k, so the ranks are never more than one call apart.
    ledger: Mutex<[Option<(usize, Op, usize)>; 2]>,
    /// The host rendezvous before every NCCL call: all ranks have validated and staged their
    /// data, or none enters NCCL (a rank that failed aborts it, which wakes the others).
    gate: InProcess,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these leaves plain data (handles, counters): recover it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Nccl {
    /// One rank per CUDA device ordinal, rank i on `ordinals[i]`.
    pub fn new(ordinals: &[usize]) -> Result<Nccl> {
        if ordinals.is_empty() {
            bail!("an NCCL group needs at least one GPU");
        }
        // SAFETY: only tries to dlopen the library.
        if !unsafe { ns::is_culib_present() } {
            bail!("NCCL requested (COLOTRAIN_COLLECTIVE=nccl) but libnccl.so could not be loaded: install NCCL or put it on LD_LIBRARY_PATH");
        }
        let n = ordinals.len();
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms: Vec<ns::ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for n handles and `devs` holds n device ordinals.
        unsafe { nr::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr()) }
            .map_err(|e| anyhow!("ncclCommInitAll over GPUs {ordinals:?}: {e:?}"))?;
        let mut ranks = Vec::with_capacity(n);
        for (r, &o) in ordinals.iter().enumerate() {
            let made = (|| -> Result<Rank> {
                let ctx = CudaContext::new(o).map_err(|e| anyhow!("{e}"))?;
                let stream = ctx.new_stream().map_err(|e| anyhow!("{e}"))?;
                let f = |s: &Arc<CudaStream>| s.alloc_zeros::<f32>(1).map_err(|e| anyhow!("{e}"));
                let (send, recv) = (f(&stream)?, f(&stream)?);
                let scalar = stream.alloc_zeros::<f64>(1).map_err(|e| anyhow!("{e}"))?;
                let len = stream.alloc_zeros::<u64>(1).map_err(|e| anyhow!("{e}"))?;
                Ok(Rank { comm: comms[r], stream, send, recv, scalar, len, staged: Vec::new(), calls: 0 })
            })();
            match made {
                Ok(rank) => ranks.push(Mutex::new(rank)),
                Err(e) => {
                    for &c in &comms {
                        // SAFETY: each handle came from ncclCommInitAll and is not used again.
                        let _ = unsafe { nr::comm_destroy(c) };
                    }
                    return Err(e.context(format!("NCCL rank {r} on cuda:{o}")));
                }
            }
        }
        Ok(Nccl {
            ranks,
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            ledger: Mutex::new([None, None]),
            gate: InProcess::new(n)?,
        })
    }

    fn aborted_error(&self) -> anyhow::Error {
        anyhow!("collective aborted: {}", lock(&self.reason).clone().unwrap_or_default())
    }

    fn fail(&self, msg: String) -> anyhow::Error {
        self.abort(&msg);
        anyhow!(msg)
    }

    /// Takes rank `rank`'s state after checking the group is alive and that this call matches
    /// the other ranks' call of the same sequence number.
    fn enter(&self, rank: usize, op: Op, len: usize) -> Result<MutexGuard<'_, Rank>> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        let m = self
            .ranks
            .get(rank)
            .ok_or_else(|| anyhow!("rank {rank} outside the NCCL group of {}", self.ranks.len()))?;
        let mut st = lock(m);
        let k = st.calls;
        st.calls += 1;
        let mismatch = {
            let mut ledger = lock(&self.ledger);
            match ledger[k % 2] {
                Some((seq, o, l)) if seq == k => ((o, l) != (op, len)).then_some((o, l)),
                _ => {
                    ledger[k % 2] = Some((k, op, len));
                    None
                }
            }
        };
        if let Some((o, l)) = mismatch {
            return Err(self.fail(format!(
                "collective mismatch at call {k}: rank {rank} called {op:?} of {len} values, another rank {o:?} of {l}"
            )));
        }
        st.stream.context().bind_to_thread().map_err(|e| anyhow!("rank {rank}: {e}"))?;
        Ok(st)
    }

    /// Waits for everything queued on `st`'s stream, polling so that an abort is noticed.
    fn wait(&self, st: &Rank) -> Result<()> {
        let ev = st.stream.record_event(None).map_err(|e| anyhow!("{e}"))?;
        let mut nap = Duration::from_micros(20);
        loop {
            if ev.try_is_complete().map_err(|e| anyhow!("{e}"))? {
                return Ok(());
            }
            if self.aborted.load(Ordering::Acquire) {
                return Err(self.aborted_error());
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Blocks until every rank is ready to enter the NCCL call (or the group is aborted).
    fn rendezvous(&self, rank: usize) -> Result<()> {
        self.gate.all_reduce_sum_f64(rank, 0.0).map(|_| ()).map_err(|_| self.aborted_error())
    }

    /// Runs one collective's body; any error aborts the group (the trait's contract), so no
    /// peer is left waiting in NCCL or at the gate.
    fn guarded<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let out = body();
        if let Err(e) = &out {
            self.abort(&format!("{e:#}"));
        }
        out
    }
}

fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    s: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    n: usize,
) -> Result<()> {
    if buf.len() < n {
        *buf = s.alloc_zeros::<T>(n).map_err(|e| anyhow!("NCCL staging buffer of {n} values: {e}"))?;
    }
    Ok(())
}

impl Collective for Nccl {
    fn world(&self) -> usize {
        self.ranks.len()
    }

    fn reduce_scatter_sum(&self, rank: usize, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.guarded(|| {
            let world = self.world();
            let mut st = self.enter(rank, Op::ReduceScatter, send.len())?;
            let sh = shard_range(send.len(), world, rank);
            if recv.len() != sh.len() {
                bail!(
                    "reduce_scatter_sum: rank {rank} passed {} receive values for its shard of {}",
                    recv.len(),
                    sh.len()
                );
            }
            let c = padded_chunk(send.len(), world);
            let r = &mut *st;
            pad_shards(send, world, c, &mut r.staged);
            ensure(&r.stream, &mut r.send, world * c)?;
            ensure(&r.stream, &mut r.recv, c)?;
            r.stream.memcpy_htod(&r.staged[..], &mut r.send.slice_mut(..world * c)).map_err(|e| anyhow!("{e}"))?;
            self.rendezvous(rank)?;
            {
                let (sp, _gs) = r.send.device_ptr(&r.stream);
                let (rp, _gr) = r.recv.device_ptr_mut(&r.stream);
                // SAFETY: send holds world·c f32 and recv c f32 on this rank's GPU; the stream is
                // this rank's and its context is current; the guards outlive the call.
                unsafe {
                    nr::reduce_scatter(
                        sp as _,
                        rp as _,
                        c,
                        ns::ncclDataType_t::ncclFloat32,
                        ns::ncclRedOp_t::ncclSum,
                        r.comm,
                        cu(&r.stream),
                    )
                }
                .map_err(|e| anyhow!("ncclReduceScatter: {e:?}"))?;
            }
            self.wait(r)?;
            r.stream.memcpy_dtoh(&r.recv.slice(..sh.len()), recv).map_err(|e| anyhow!("{e}"))?;
            Ok(())
        })
    }

    fn all_gather(&self, rank: usize, shard: &[f32], out: &mut [f32]) -> Result<()> {
        self.guarded(|| {
            let world = self.world();
            let mut st = self.enter(rank, Op::AllGather, out.len())?;
            let sh = shard_range(out.len(), world, rank);
            if shard.len() != sh.len() {
                bail!("all_gather: rank {rank} contributed {} values for its shard of {}", shard.len(), sh.len());
            }
            let c = padded_chunk(out.len(), world);
            let r = &mut *st;
            r.staged.clear();
            r.staged.extend_from_slice(shard);
            r.staged.resize(c, 0.0);
            ensure(&r.stream, &mut r.send, c)?;
            ensure(&r.stream, &mut r.recv, world * c)?;
            r.stream.memcpy_htod(&r.staged[..], &mut r.send.slice_mut(..c)).map_err(|e| anyhow!("{e}"))?;
            self.rendezvous(rank)?;
            {
                let (sp, _gs) = r.send.device_ptr(&r.stream);
                let (rp, _gr) = r.recv.device_ptr_mut(&r.stream);
                // SAFETY: send holds c and recv world·c f32 on this rank's GPU (see reduce_scatter_sum).
                unsafe { nr::all_gather(sp as _, rp as _, c, ns::ncclDataType_t::ncclFloat32, r.comm, cu(&r.stream)) }
                    .map_err(|e| anyhow!("ncclAllGather: {e:?}"))?;
            }
            self.wait(r)?;
            r.staged.resize(world * c, 0.0);
            r.stream.memcpy_dtoh(&r.recv.slice(..world * c), &mut r.staged[..]).map_err(|e| anyhow!("{e}"))?;
            unpad_shards(&r.staged, world, c, out);
            Ok(())
        })
    }

    fn all_reduce_sum_f64(&self, rank: usize, x: f64) -> Result<f64> {
        self.guarded(|| {
            let mut st = self.enter(rank, Op::AllReduceF64, 1)?;
            let r = &mut *st;
            r.stream.memcpy_htod(&[x][..], &mut r.scalar).map_err(|e| anyhow!("{e}"))?;
            self.rendezvous(rank)?;
            {
                let (p, _g) = r.scalar.device_ptr_mut(&r.stream);
                // SAFETY: in-place all-reduce of one f64 on this rank's GPU.
                unsafe {
                    nr::all_reduce(
                        p as _,
                        p as _,
                        1,
                        ns::ncclDataType_t::ncclFloat64,
                        ns::ncclRedOp_t::ncclSum,
                        r.comm,
                        cu(&r.stream),
                    )
                }
                .map_err(|e| anyhow!("ncclAllReduce: {e:?}"))?;
            }
            self.wait(r)?;
            let mut out = [0.0f64];
            r.stream.memcpy_dtoh(&r.scalar, &mut out[..]).map_err(|e| anyhow!("{e}"))?;
            Ok(out[0])
        })
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &mut Vec<f32>) -> Result<()> {
        self.guarded(|| {
            let world = self.world();
            if root >= world {
                bail!("broadcast from rank {root} in a group of {world}");
            }
            let mut st = self.enter(rank, Op::Broadcast, root)?;
            let r = &mut *st;
            // The length first, so every rank can size its buffer.
            r.stream.memcpy_htod(&[buf.len() as u64][..], &mut r.len).map_err(|e| anyhow!("{e}"))?;
            self.rendezvous(rank)?;
            {
                let (lp, _g) = r.len.device_ptr_mut(&r.stream);
                // SAFETY: in-place broadcast of one u64 on this rank's GPU.
                unsafe {
                    nr::broadcast(
                        lp as _,
                        lp as _,
                        1,
                        ns::ncclDataType_t::ncclUint64,
                        root as i32,
                        r.comm,
                        cu(&r.stream),
                    )
                }
                .map_err(|e| anyhow!("ncclBroadcast (length): {e:?}"))?;
            }
            self.wait(r)?;
            let mut n = [0u64];
            r.stream.memcpy_dtoh(&r.len, &mut n[..]).map_err(|e| anyhow!("{e}"))?;
            let n = usize::try_from(n[0]).context("broadcast length")?;
            buf.resize(n, 0.0);
            if n == 0 {
                return Ok(()); // every rank read the same n
            }
            ensure(&r.stream, &mut r.send, n)?;
            if rank == root {
                r.stream.memcpy_htod(&buf[..], &mut r.send.slice_mut(..n)).map_err(|e| anyhow!("{e}"))?;
            }
            self.rendezvous(rank)?;
            {
                let (p, _g) = r.send.device_ptr_mut(&r.stream);
                // SAFETY: in-place broadcast of n f32 (send holds at least n) on this rank's GPU.
                unsafe {
                    nr::broadcast(
                        p as _,
                        p as _,
                        n,
                        ns::ncclDataType_t::ncclFloat32,
                        root as i32,
                        r.comm,
                        cu(&r.stream),
                    )
                }
                .map_err(|e| anyhow!("ncclBroadcast: {e:?}"))?;
            }
            self.wait(r)?;
            r.stream.memcpy_dtoh(&r.send.slice(..n), &mut buf[..]).map_err(|e| anyhow!("{e}"))?;
            Ok(())
        })
    }

    fn abort(&self, reason: &str) {
        {
            let mut why = lock(&self.reason);
            if why.is_none() {
                *why = Some(reason.to_string());
            }
        }
        self.aborted.store(true, Ordering::Release);
        self.gate.abort(reason);
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        let aborted = self.aborted.load(Ordering::Acquire);
        // Destroying a communicator may wait for its peers (newer NCCL): destroy all of them in
        // one group. An aborted group may have NCCL kernels waiting for a dead peer: abort
        // stops them, where destroy would wait for them.
        let grouped = !aborted && nr::group_start().is_ok();
        for m in &self.ranks {
            let r = lock(m);
            let _ = r.stream.context().bind_to_thread();
            // SAFETY: the handle came from ncclCommInitAll and nothing uses it after this.
            let _ = unsafe {
                if aborted {
                    nr::comm_abort(r.comm)
                } else {
                    nr::comm_destroy(r.comm)
                }
            };
        }
        if grouped {
            let _ = nr::group_end();
        }
    }
}

fn cu(s: &CudaStream) -> ns::cudaStream_t {
    s.cu_stream() as ns::cudaStream_t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::InProcess;

    /// What one rank got from each collective: (reduce-scatter, all-gather, all-reduce, broadcast) per round.
    type Got = Vec<(Vec<f32>, Vec<f32>, f64, Vec<f32>)>;

    /// Runs f(rank) on 2 threads, failing (not hanging) after 60 s.
    fn on_two<T: Send + 'static>(f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let (tx, rx) = std::sync::mpsc::channel();
        for rank in 0..2 {
            let (f, tx) = (f.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tx.send((rank, f(rank)));
            });
        }
        let mut got: Vec<(usize, T)> =
            (0..2).map(|_| rx.recv_timeout(Duration::from_secs(60)).expect("a rank hung or panicked")).collect();
        got.sort_by_key(|g| g.0);
        got.into_iter().map(|g| g.1).collect()
    }

    /// Every collective against `InProcess` on 2 GPUs, over rounds of growing and shrinking
    /// sizes (a total below the world size, an empty broadcast, both roots): a sum of two values
    /// is exact in either order, so the results must be identical. Then a mismatched call must
    /// fail on both ranks, not hang. Skipped without 2 GPUs and libnccl.
    #[test]
    fn nccl_matches_in_process_on_two_gpus() {
        // SAFETY: only try to dlopen the libraries.
        let present = unsafe { cudarc::driver::sys::is_culib_present() && ns::is_culib_present() };
        let gpus = if present {
            std::panic::catch_unwind(CudaContext::device_count).ok().and_then(|r| r.ok()).unwrap_or(0)
        } else {
            0
        };
        if gpus < 2 {
            eprintln!("skipped: needs 2 GPUs and libnccl (found {gpus} GPUs, libraries present: {present})");
            return;
        }
        let nccl: Arc<dyn Collective> = Arc::new(Nccl::new(&[0, 1]).expect("NCCL group"));
        let inproc: Arc<dyn Collective> = Arc::new(InProcess::new(2).expect("group"));
        let run = |c: Arc<dyn Collective>| -> Vec<Got> {
            on_two(move |rank| {
                let mut rounds = Vec::new();
                for (total, root, blen) in [(1001usize, 1usize, 3usize), (1, 0, 0), (40_000, 0, 5000), (7, 1, 1)] {
                    let send: Vec<f32> = (0..total).map(|i| (i * (rank + 3)) as f32 * 0.37).collect();
                    let mut rs = vec![0.0; shard_range(total, 2, rank).len()];
                    c.reduce_scatter_sum(rank, &send, &mut rs).expect("reduce_scatter");
                    let mut ag = vec![0.0; total];
                    c.all_gather(rank, &rs, &mut ag).expect("all_gather");
                    let s = c.all_reduce_sum_f64(rank, 1.5 + rank as f64).expect("all_reduce");
                    let mut b: Vec<f32> =
                        if rank == root { (0..blen).map(|i| i as f32 - 2.5).collect() } else { vec![9.0; 4] };
                    c.broadcast(rank, root, &mut b).expect("broadcast");
                    rounds.push((rs, ag, s, b));
                }
                rounds
            })
        };
        let (a, b) = (run(nccl.clone()), run(inproc));
        assert_eq!(a, b, "NCCL and in-process results");
        // Same operation, different lengths: the ledger catches it before NCCL is entered.
        let errs = on_two(move |rank| {
            let total = 10 + rank;
            let mut out = vec![0.0; total];
            nccl.all_gather(rank, &vec![1.0; shard_range(total, 2, rank).len()], &mut out).is_err()
        });
        assert_eq!(errs, vec![true, true]);
    }
}
