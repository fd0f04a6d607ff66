//! What the devices of an asynchronous or split run share besides the collectives: the
//! [`Board`] of completions that generators post to and trainers take from, and the
//! [`GenLink`] of a split placement (request queue, board, weight mailbox, stop flag, busy
//! counters).
//!
//! How a split placement's generators receive each version: on GPUs (simulated or not) by an
//! NCCL broadcast from the lead trainer's compute weights straight into each generator's, in
//! place (one group of the lead and the generators, `train::device_nccl`). The lead posts a
//! round and enters the broadcast; each generator joins it between two engine steps, so the
//! lead waits at most one engine step of the slowest generator (and no generator misses a
//! version: the next round is posted only after every generator joined this one). Nothing is
//! copied twice and the lead holds no snapshot. With COLOTRAIN_DEVICE_COLLECTIVE=peer, or on
//! the host, the lead publishes a snapshot instead (a copy of its compute weights on its GPU,
//! or its FP32 master) and each generator pulls the newest one when it likes.
//!
//! Owns: [`Board`], [`GenLink`], the published [`Snapshot`], the broadcast rounds. May call:
//! the trainer (to publish and to load weights), the broadcast group, the engine's completion
//! type, the reward scorer, the tests' fault. Must not: run an engine step or a training step.

use crate::engine::rollout::WorkQueue;
use crate::engine::Completion;
use crate::reward::scorer::Scorer;
use crate::train::device_nccl::NcclDevice;
use crate::train::trainer::Trainer;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// A completion on the board, with the teacher's log-probs at its response tokens when its
/// generator scored it (split placement).
pub type Posted = (Completion, Option<Vec<f32>>);

/// Completions posted by every device, grouped by prompt request; counts complete groups
/// (all `samples` responses of a prompt done).
pub struct Board {
    samples: usize,
    groups: Mutex<BTreeMap<u64, Vec<Posted>>>,
    complete: AtomicUsize,
    /// Signalled when a group completes (the split placement's trainer waits on it).
    ready: Condvar,
}

impl Board {
    pub fn new(samples: usize) -> Board {
        Board {
            samples: samples.max(1),
            groups: Default::default(),
            complete: Default::default(),
            ready: Condvar::new(),
        }
    }

    pub fn complete(&self) -> usize {
        self.complete.load(Ordering::SeqCst)
    }

    fn lock(&self) -> Result<MutexGuard<'_, BTreeMap<u64, Vec<Posted>>>> {
        self.groups.lock().map_err(|_| anyhow::anyhow!("the rollout board was poisoned by a failed device"))
    }

    pub fn post(&self, c: Completion, teacher: Option<Vec<f32>>) -> Result<()> {
        let mut g = self.lock()?;
        let e = g.entry(c.id).or_default();
        e.push((c, teacher));
        if e.len() == self.samples {
            self.complete.fetch_add(1, Ordering::SeqCst);
            self.ready.notify_all();
        }
        Ok(())
    }

    /// Waits until the board holds at least `n` complete groups or `timeout` passes; whether it
    /// does.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Result<bool> {
        let g = self.lock()?;
        let (_g, _) = self
            .ready
            .wait_timeout_while(g, timeout, |_| self.complete() < n)
            .map_err(|_| anyhow::anyhow!("the rollout board was poisoned by a failed device"))?;
        Ok(self.complete() >= n)
    }

    /// Removes and returns up to `n` complete groups, oldest request first, each in sample order.
    pub fn take(&self, n: usize) -> Result<Vec<Posted>> {
        let mut g = self.lock()?;
        let ids: Vec<u64> = g.iter().filter(|(_, v)| v.len() == self.samples).map(|(k, _)| *k).take(n).collect();
        let mut out = Vec::new();
        for id in ids {
            if let Some(mut v) = g.remove(&id) {
                v.sort_by_key(|c| c.0.sample);
                out.extend(v);
                self.complete.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Ok(out)
    }
}

/// What the orchestrator shares with the generators of a split placement: the request queue,
/// the board they post to, the newest published weights, a stop flag and each generator's busy
/// time.
pub struct GenLink {
    pub queue: Arc<WorkQueue>,
    pub board: Arc<Board>,
    /// (version, the weights) last published by the trainers.
    published: Mutex<Option<(u64, Snapshot)>>,
    pub stop: AtomicBool,
    /// Nanoseconds each generator spent in engine steps and teacher scoring (indexed by
    /// generator slot).
    pub busy_ns: Vec<AtomicU64>,
    /// Generators also teacher-score what they generate (at this temperature), off the
    /// trainers' path, as the paper's separate teacher devices do (seed 000 Figure 10).
    pub teacher_temperature: Option<f32>,
    /// The run's reward service: generators post each completion as it finishes.
    pub scorer: Arc<Scorer>,
    /// GPUs: the lead trainer (rank 0) and generator `slot` (rank 1 + slot) in one NCCL group
    /// that each version is broadcast over (None: the snapshot mailbox).
    bcast: Option<Arc<NcclDevice>>,
    /// The broadcast rounds the lead posted, and the version of the last one.
    posted: Mutex<(u64, u64)>,
    /// Tests: a generator that fails as it is about to join a broadcast round.
    fault: Option<super::fault::Fault>,
}

impl GenLink {
    pub fn new(
        samples: usize,
        generators: usize,
        teacher_temperature: Option<f32>,
        scorer: Arc<Scorer>,
        bcast: Option<Arc<NcclDevice>>,
        fault: Option<super::fault::Fault>,
    ) -> GenLink {
        GenLink {
            bcast,
            fault: fault.filter(|f| f.phase == "broadcast"),
            posted: Mutex::new((0, 0)),
            teacher_temperature,
            scorer,
            queue: queue(Vec::new()),
            board: Arc::new(Board::new(samples)),
            published: Mutex::new(None),
            stop: AtomicBool::new(false),
            busy_ns: (0..generators).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn mailbox(&self) -> Result<std::sync::MutexGuard<'_, Option<(u64, Snapshot)>>> {
        self.published.lock().map_err(|_| anyhow::anyhow!("the weight mailbox was poisoned"))
    }

    /// (broadcast rounds posted, the version of the last one).
    fn rounds(&self) -> Result<MutexGuard<'_, (u64, u64)>> {
        self.posted.lock().map_err(|_| anyhow::anyhow!("the broadcast rounds were poisoned"))
    }

    /// Whether a broadcast round is posted that a generator that joined `rounds` did not join.
    pub fn unjoined(&self, rounds: u64) -> bool {
        self.bcast.is_some() && self.posted.lock().map_or(true, |p| p.0 > rounds)
    }

    /// Wakes the lead or a generator waiting in a broadcast round (a device failed).
    pub fn abort(&self, reason: &str) {
        if let Some(g) = &self.bcast {
            crate::train::device_coll::DeviceCollective::abort(g.as_ref(), reason);
        }
    }

    /// Publishes `trainer`'s weights (the lead trainer's, after an update) as the generators'
    /// next. Over the broadcast group: posts a round and broadcasts the compute weights; this
    /// returns once every generator joined (their copies then run on the GPUs' communication
    /// streams, which the compute streams wait for). Otherwise a trainer on a GPU copies its
    /// compute weights into the snapshot buffer on its own device (allocated at the first
    /// publication, rewritten in place after) under the mailbox's lock, so no generator reads
    /// it half written; on the host the FP32 master is shared.
    pub fn publish(&self, trainer: &mut Trainer) -> Result<()> {
        let v = trainer.version;
        if let Some(g) = &self.bcast {
            // The lead's optimizer writes these weights next.
            return broadcast_weights(g, 0, trainer, || {
                let mut p = self.rounds()?;
                *p = (p.0 + 1, v);
                Ok(())
            });
        }
        let mut p = self.mailbox()?;
        if trainer.on_device() {
            if !matches!(p.as_ref(), Some((_, Snapshot::Device(_)))) {
                *p = Some((0, Snapshot::Device(trainer.snapshot_buffer()?)));
            }
            if let Some((version, Snapshot::Device(buf))) = p.as_mut() {
                // A failed copy leaves the previous version published: its number is set after.
                trainer.snapshot_into(buf)?;
                *version = v;
            }
        } else {
            *p = Some((v, Snapshot::Host(Arc::new(trainer.full_weights()?))));
        }
        Ok(())
    }

    /// Generator `slot` takes in the published weights: over the broadcast group, joins the
    /// lead's round if one is posted that it has not joined (`rounds`: those it joined);
    /// otherwise the mailbox's when they are newer than `have`, in place into its compute
    /// weights, from the trainer's GPU device to device (under the mailbox's lock) or from the
    /// host. The version taken, if any.
    pub(super) fn load_newer(
        &self,
        slot: usize,
        have: u64,
        rounds: &mut u64,
        trainer: &mut Trainer,
    ) -> Result<Option<u64>> {
        if let Some(g) = &self.bcast {
            let (posted, v) = *self.rounds()?;
            if posted <= *rounds {
                return Ok(None);
            }
            // Generator `slot` is device `slot` (the first devices generate).
            super::fault::Fault::check(self.fault, "broadcast", *rounds + 1, slot)?;
            // The generator's engine reads these weights next.
            broadcast_weights(g, 1 + slot, trainer, || Ok(()))?;
            *rounds += 1;
            trainer.version = v;
            return Ok(Some(v));
        }
        let p = self.mailbox()?;
        match p.as_ref() {
            Some((v, snap)) if *v > have => {
                match snap {
                    Snapshot::Device(t) => trainer.load_weights_from(t, *v)?,
                    Snapshot::Host(master) => trainer.load_weights(master, *v)?,
                }
                Ok(Some(*v))
            }
            _ => Ok(None),
        }
    }
}

/// One broadcast round of `trainer`'s compute weights as rank `rank` (0: the lead, which
/// sends), in parameter order; its compute stream then waits for the round. `before` runs once
/// the weights are checked, before the group call (the lead posts the round there: from then
/// on the generators wait in it, and only the broadcast, which aborts the group if it fails,
/// lets them go).
fn broadcast_weights(
    g: &NcclDevice,
    rank: usize,
    trainer: &mut Trainer,
    before: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let mut ts = trainer.weights.tensors_mut();
    let dev = match ts.first().map(|t| t.storage()) {
        Some(crate::device::Storage::Cuda(c)) => c.device().clone(),
        _ => bail!("a weight broadcast needs compute weights on a GPU (rank {rank} of the publishing group)"),
    };
    before()?;
    let done = g.broadcast(rank, 0, &mut ts)?;
    dev.wait_event(&done)
}

/// Published weights: on the lead trainer's GPU (the whole model, flat in the compute weights'
/// dtype), or the FP32 master on the host.
enum Snapshot {
    Device(crate::device::Tensor),
    Host(Arc<Vec<f32>>),
}

/// The shared queue of `reqs`.
pub fn queue(reqs: Vec<crate::engine::Request>) -> Arc<WorkQueue> {
    Arc::new(Mutex::new(reqs.into()))
}
