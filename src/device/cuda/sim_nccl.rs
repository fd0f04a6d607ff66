//! NCCL between simulated devices: what `cuda/nccl.rs` queues on a simulated GPU. A call runs
//! when it is queued, at the point its stream has reached: the device first runs everything
//! queued before it, each operation checked against the other stream's pending work (so a
//! collective that reads a buffer the compute stream is still writing, with no event between
//! them, is a stream-ordering race as it is for any other operation), then the call hands its
//! inputs to the group and waits for every rank's, and queues its outputs as one operation on
//! the same stream (so the compute stream reading them before waiting on an event recorded
//! after the call is a race too). Sums are F32 in rank order starting from +0.0, the order of
//! `ct_col_sum`: bit for bit the in-process collective's.
//!
//! The caller (`train::device_nccl`) lets a rank queue a call only after every rank has agreed
//! to make it (a host rendezvous), so waiting for the other ranks' inputs here cannot wait on
//! work the waiting thread itself would have to do. Ranks that make different calls fail, all
//! of them, naming the difference; an abort wakes them.
//!
//! Owns: [`SimGroup`]. May call: the parent `sim`'s state and queue. Must not: be reached
//! except through `CudaDevice::nccl`.

use super::super::nccl::Part;
use super::{check_range, Op, Sim};
use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a rank waits for the others' inputs before it gives up (they agreed to call).
const PATIENCE: Duration = Duration::from_secs(300);

/// The simulated communicators of a group: the calls in flight, by sequence number.
pub struct SimGroup {
    world: usize,
    state: Mutex<GroupState>,
    cv: Condvar,
}

#[derive(Default)]
struct GroupState {
    calls: BTreeMap<u64, Call>,
    /// Calls each rank has made.
    made: Vec<u64>,
    aborted: Option<String>,
}

/// One call of every rank: what the first rank to arrive said it is, and each rank's inputs.
struct Call {
    shape: Vec<Shape>,
    inputs: Vec<Option<Vec<Vec<u8>>>>,
    done: usize,
}

/// A part as every rank must agree on it: (reduce?, root, bytes).
type Shape = (bool, usize, usize);

fn shape(p: &Part) -> Shape {
    (matches!(p, Part::Reduce { .. }), p.root(), p.bytes())
}

impl SimGroup {
    pub fn new(world: usize) -> SimGroup {
        SimGroup {
            world,
            state: Mutex::new(GroupState { made: vec![0; world], ..Default::default() }),
            cv: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn abort(&self, reason: &str) {
        self.state().aborted.get_or_insert_with(|| reason.to_string());
        self.cv.notify_all();
    }

    /// Hands rank `rank`'s inputs of its next call to the group and returns, once every rank
    /// has handed in its own, what this rank receives: per part, the bytes to write (None:
    /// nothing for this rank).
    fn exchange(&self, rank: usize, parts: &[Part], inputs: Vec<Vec<u8>>) -> Result<Vec<Option<Vec<u8>>>> {
        let mut st = self.state();
        if let Some(r) = &st.aborted {
            bail!("NCCL group aborted: {r}");
        }
        let k = st.made[rank];
        st.made[rank] += 1;
        let world = self.world;
        let mine: Vec<Shape> = parts.iter().map(shape).collect();
        let call =
            st.calls.entry(k).or_insert_with(|| Call { shape: mine.clone(), inputs: vec![None; world], done: 0 });
        if call.shape != mine {
            let msg = format!(
                "NCCL call {k}: rank {rank} calls {} (reduce?, root, bytes), another rank {}",
                describe(&mine),
                describe(&call.shape)
            );
            drop(st);
            self.abort(&msg);
            bail!(msg);
        }
        call.inputs[rank] = Some(inputs);
        self.cv.notify_all();
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(r) = &st.aborted {
                bail!("NCCL group aborted: {r}");
            }
            let call = st.calls.get(&k).ok_or_else(|| anyhow!("NCCL call {k} vanished"))?;
            if call.inputs.iter().all(|i| i.is_some()) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..world).filter(|&r| call.inputs[r].is_none()).collect();
                let msg = format!("NCCL call {k}: ranks {missing:?} never made it ({} s)", PATIENCE.as_secs());
                drop(st);
                self.abort(&msg);
                bail!(msg);
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        let call = st.calls.get_mut(&k).ok_or_else(|| anyhow!("NCCL call {k} vanished"))?;
        let input = |r: usize, i: usize| call.inputs[r].as_ref().map(|v| v[i].as_slice()).unwrap_or(&[]);
        let out = parts
            .iter()
            .enumerate()
            .map(|(i, p)| match *p {
                Part::Reduce { root, count, .. } if root == rank => {
                    let mut acc = vec![0.0f32; count];
                    for r in 0..world {
                        for (a, x) in acc.iter_mut().zip(input(r, i).chunks_exact(4)) {
                            *a += f32::from_ne_bytes([x[0], x[1], x[2], x[3]]);
                        }
                    }
                    Some(acc.iter().flat_map(|a| a.to_ne_bytes()).collect())
                }
                Part::Broadcast { root, .. } if root != rank => Some(input(root, i).to_vec()),
                _ => None,
            })
            .collect();
        call.done += 1;
        if call.done == world {
            st.calls.remove(&k);
        }
        Ok(out)
    }
}

fn describe(s: &[Shape]) -> String {
    format!("{} parts {s:?}", s.len())
}

impl Sim {
    /// Runs NCCL call `parts` of rank `rank` of `g` (see the module comment).
    pub fn nccl(&self, g: &SimGroup, rank: usize, parts: &[Part]) -> Result<()> {
        let name = self.name();
        let mut st = self.state();
        st.refuse_in_capture(&name, "an NCCL call")?;
        // What the call reads (every rank's inputs) and writes (the root's sums, the others'
        // broadcast buffers), each range inside one live allocation of this device.
        let (mut reads, mut writes) = (Vec::new(), Vec::new());
        for p in parts {
            match *p {
                Part::Reduce { root, send, recv, count } => {
                    check_range(&st, send, 4 * count, "NCCL reduce input").map_err(|e| anyhow!("{name}: {e}"))?;
                    reads.push(send);
                    if root == rank {
                        check_range(&st, recv, 4 * count, "NCCL reduce output").map_err(|e| anyhow!("{name}: {e}"))?;
                        writes.push(recv);
                    }
                }
                Part::Broadcast { root, buf, bytes } => {
                    check_range(&st, buf, bytes, "NCCL broadcast buffer").map_err(|e| anyhow!("{name}: {e}"))?;
                    if root == rank {
                        reads.push(buf)
                    } else {
                        writes.push(buf)
                    }
                }
            }
        }
        let all: Vec<u64> = reads.iter().chain(&writes).copied().collect();
        st.push(Op::Nccl { writes: Vec::new() }, &all);
        self.run_queues(&mut st)?;
        // The queue is empty: the inputs hold what the stream had computed by the call.
        let inputs: Vec<Vec<u8>> = parts
            .iter()
            .map(|p| match *p {
                _ if self.dry => Vec::new(),
                Part::Reduce { send, count, .. } => read(send, 4 * count),
                Part::Broadcast { root, buf, bytes } if root == rank => read(buf, bytes),
                Part::Broadcast { .. } => Vec::new(),
            })
            .collect();
        drop(st);
        let got = g.exchange(rank, parts, inputs)?;
        let mut out = Vec::new();
        for (p, data) in parts.iter().zip(got) {
            let dst = match *p {
                Part::Reduce { recv, .. } => recv,
                Part::Broadcast { buf, .. } => buf,
            };
            if let Some(d) = data.filter(|d| !d.is_empty()) {
                out.push((dst, d));
            }
        }
        self.state().push(Op::Nccl { writes: out }, &writes);
        Ok(())
    }
}

/// `bytes` of simulated device memory at `ptr`.
fn read(ptr: u64, bytes: usize) -> Vec<u8> {
    // SAFETY: the range was checked against a live allocation of this device, whose address is
    // a host address of at least `bytes` bytes, and the device's queue has run: nothing writes it.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) }.to_vec()
}
