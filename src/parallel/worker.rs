//! A pool of worker threads, one per device, each owning a state `S` (its model replica, …) and
//! running commands sent by the orchestrator thread.
//!
//! Owns: the worker threads, their command channels (commands to one, some or all workers, and
//! long-running ones collected later through [`Pending`]), panic capture and poisoning, core
//! pinning, and [`split_cores`]. May call: crossbeam channels, core_affinity, std threads, tracing.
//! Must not touch: models, devices or training; the state `S` is opaque here.

use super::collective::shard_range;
use anyhow::{anyhow, Context, Result};
use crossbeam::channel::{self, Receiver, Sender};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

/// A command as the worker loop sees it: `body` gets the state, or the phase of the panic that
/// poisoned it, and returns true when it panicked (the loop then poisons the worker).
struct Job<S> {
    phase: String,
    body: JobBody<S>,
}

type JobBody<S> = Box<dyn FnOnce(Access<'_, S>) -> bool + Send>;

/// The worker's state, or (when poisoned) the phase whose panic poisoned it.
type Access<'a, S> = std::result::Result<&'a mut S, &'a str>;

struct Worker<S> {
    name: String,
    tx: Option<Sender<Job<S>>>,
    handle: Option<JoinHandle<()>>,
}

type Hook = Arc<dyn Fn(&str) + Send + Sync>;

/// One OS thread per device; commands run on the worker that owns the state.
pub struct WorkerPool<S: Send + 'static> {
    workers: Vec<Worker<S>>,
    on_failure: Option<Hook>,
}

impl<S: Send + 'static> WorkerPool<S> {
    /// Spawns one thread per entry; `init(rank)` runs ON the worker thread and builds its state
    /// (so thread-local things like pinned pools are created there). `names[rank]` (e.g. "cpu:1") is used in errors.
    /// Each thread pins itself to the first core of `cores[rank]` (no pinning when it is empty).
    pub fn spawn(
        names: Vec<String>,
        cores: Vec<Vec<core_affinity::CoreId>>,
        init: impl Fn(usize) -> Result<S> + Send + Sync + 'static,
    ) -> Result<Self> {
        if names.is_empty() {
            anyhow::bail!("a worker pool needs at least one worker");
        }
        if cores.len() != names.len() {
            anyhow::bail!("worker pool: {} names but {} core lists", names.len(), cores.len());
        }
        let init = Arc::new(init);
        let (ready_tx, ready_rx) = channel::unbounded::<(usize, Result<()>)>();
        let mut pool = WorkerPool { workers: Vec::with_capacity(names.len()), on_failure: None };
        for (rank, (name, cores)) in names.into_iter().zip(cores).enumerate() {
            let (tx, rx) = channel::unbounded::<Job<S>>();
            let (init, ready_tx, label) = (Arc::clone(&init), ready_tx.clone(), name.clone());
            let handle = std::thread::Builder::new()
                .name(format!("colotrain-worker-{rank}"))
                .spawn(move || worker_main(rank, &label, &cores, &*init, &ready_tx, &rx))
                .with_context(|| format!("cannot start the thread of worker {rank} ({name})"))?;
            pool.workers.push(Worker { name, tx: Some(tx), handle: Some(handle) });
        }
        drop(ready_tx);
        let mut failures = Vec::new();
        for _ in 0..pool.workers.len() {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((rank, Err(e))) => failures.push((rank, e)),
                Err(_) => failures.push((0, anyhow!("a worker thread exited before reporting its start"))),
            }
        }
        // Dropping `pool` on failure closes the channels and joins the threads that did start.
        match summarize(failures, pool.workers.len(), "init") {
            Some(e) => Err(e),
            None => Ok(pool),
        }
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The name given to worker `rank` at spawn.
    pub fn name(&self, rank: usize) -> Option<&str> {
        self.workers.get(rank).map(|w| w.name.as_str())
    }

    /// Sets a hook called (on the calling thread) with the first failure's message as soon as any
    /// worker fails in [`run_all`](Self::run_all), before waiting for the others. Wire it to
    /// `Collective::abort` so workers blocked in a collective on the failed rank wake up.
    pub fn set_on_failure(&mut self, hook: impl Fn(&str) + Send + Sync + 'static) {
        self.on_failure = Some(Arc::new(hook));
    }

    /// Runs `f(rank, &mut state)` on every worker concurrently and returns the results in rank order.
    /// `phase` names what is running (e.g. "rollout", "train") for errors and tracing spans.
    /// When several workers fail, the lowest rank's error is returned with the count of failures.
    pub fn run_all<R: Send + 'static>(
        &self,
        phase: &str,
        f: impl Fn(usize, &mut S) -> Result<R> + Send + Sync + 'static,
    ) -> Result<Vec<R>> {
        let all: Vec<usize> = (0..self.workers.len()).collect();
        self.run_some(&all, phase, f)
    }

    /// [`run_all`](Self::run_all) on the workers `ranks` only (e.g. the trainers of a split
    /// placement); results in the order of `ranks`.
    pub fn run_some<R: Send + 'static>(
        &self,
        ranks: &[usize],
        phase: &str,
        f: impl Fn(usize, &mut S) -> Result<R> + Send + Sync + 'static,
    ) -> Result<Vec<R>> {
        let f = Arc::new(f);
        let n = ranks.len();
        let (reply_tx, reply_rx) = channel::unbounded::<(usize, Result<R>)>();
        for (slot, &rank) in ranks.iter().enumerate() {
            let f = Arc::clone(&f);
            let reply = reply_tx.clone();
            let sent = self.dispatch(
                rank,
                phase,
                move |state| f(rank, state),
                move |r| {
                    let _ = reply.send((slot, r));
                },
            );
            if let Err(e) = sent {
                let _ = reply_tx.send((slot, Err(e)));
            }
        }
        drop(reply_tx);
        let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
        let mut failures = Vec::new();
        // Every dispatched job replies exactly once; its sender is dropped unanswered only if the
        // worker thread died, which ends this loop early.
        while let Ok((slot, r)) = reply_rx.recv() {
            match r {
                Ok(v) => results[slot] = Some(v),
                Err(e) => {
                    if failures.is_empty() {
                        if let Some(hook) = &self.on_failure {
                            hook(&format!("{e:#}"));
                        }
                    }
                    failures.push((ranks[slot], e));
                }
            }
        }
        for (slot, &rank) in ranks.iter().enumerate() {
            if results[slot].is_none() && !failures.iter().any(|(k, _)| *k == rank) {
                let name = self.name(rank).unwrap_or("?");
                failures.push((rank, anyhow!("worker {rank} ({name}) exited without replying in phase '{phase}'")));
            }
        }
        if let Some(e) = summarize(failures, n, phase) {
            return Err(e);
        }
        results.into_iter().zip(ranks).map(|(r, k)| r.ok_or_else(|| anyhow!("worker {k} gave no result"))).collect()
    }

    /// Starts `f` on worker `rank` and returns at once; [`Pending::wait`] gives its result. For
    /// long-running work beside the orchestrator (the generators of a split placement). A
    /// failure calls the failure hook as soon as it is collected.
    pub fn start_on<R: Send + 'static>(
        &self,
        rank: usize,
        phase: &str,
        f: impl FnOnce(&mut S) -> Result<R> + Send + 'static,
    ) -> Result<Pending<R>> {
        let (reply_tx, reply_rx) = channel::bounded::<Result<R>>(1);
        self.dispatch(rank, phase, f, move |r| {
            let _ = reply_tx.send(r);
        })?;
        let what = format!("worker {rank} ({}) exited without replying in phase '{phase}'", self.workers[rank].name);
        Ok(Pending { rx: reply_rx, done: None, what, hook: self.on_failure.clone() })
    }

    /// Runs `f` on worker `rank` and waits for its result.
    pub fn run_on<R: Send + 'static>(
        &self,
        rank: usize,
        phase: &str,
        f: impl FnOnce(&mut S) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (reply_tx, reply_rx) = channel::bounded::<Result<R>>(1);
        self.dispatch(rank, phase, f, move |r| {
            let _ = reply_tx.send(r);
        })?;
        let name = &self.workers[rank].name;
        reply_rx.recv().map_err(|_| anyhow!("worker {rank} ({name}) exited without replying in phase '{phase}'"))?
    }

    /// Sends `f` to worker `rank`; `reply` receives its outcome (errors already name the worker).
    fn dispatch<R: Send + 'static>(
        &self,
        rank: usize,
        phase: &str,
        f: impl FnOnce(&mut S) -> Result<R> + Send + 'static,
        reply: impl FnOnce(Result<R>) + Send + 'static,
    ) -> Result<()> {
        let worker = self.workers.get(rank).ok_or_else(|| {
            anyhow!("phase '{phase}': no worker {rank} (the pool has {} workers)", self.workers.len())
        })?;
        let (name, phase_owned) = (worker.name.clone(), phase.to_string());
        let body = move |state: Access<S>| -> bool {
            let state = match state {
                Ok(s) => s,
                Err(earlier) => {
                    reply(Err(anyhow!(
                        "worker {rank} ({name}) is poisoned by an earlier panic in phase '{earlier}'; \
                         it refuses phase '{phase_owned}'"
                    )));
                    return false;
                }
            };
            let _span = tracing::info_span!("phase", name = phase_owned.as_str(), worker = rank).entered();
            // What the command does counts under its phase (the CUDA launch ledger).
            let _phase = super::phase::enter_phase(&phase_owned);
            // AssertUnwindSafe: a panic can leave `state` half-updated (weights, optimizer moments,
            // caches), so its invariants may be broken. That is sound here only because after a
            // panic the state is never used again: the worker loop marks itself poisoned and
            // answers every later command with an error; the state is only dropped.
            match catch_unwind(AssertUnwindSafe(|| f(state))) {
                Ok(r) => {
                    reply(r.with_context(|| format!("worker {rank} ({name}) failed in phase '{phase_owned}'")));
                    false
                }
                Err(payload) => {
                    let msg = panic_message(payload.as_ref());
                    reply(Err(anyhow!("worker {rank} ({name}) panicked in phase '{phase_owned}': {msg}")));
                    true
                }
            }
        };
        let job = Job { phase: phase.to_string(), body: Box::new(body) };
        let tx = worker.tx.as_ref().ok_or_else(|| anyhow!("worker {rank} ({}) is shut down", worker.name))?;
        tx.send(job).map_err(|_| {
            anyhow!("worker {rank} ({}) is gone (its thread exited); cannot run phase '{phase}'", worker.name)
        })
    }
}

/// The outcome of a command started with [`WorkerPool::start_on`].
pub struct Pending<R> {
    rx: Receiver<Result<R>>,
    /// The outcome once collected by `is_done`.
    done: Option<Result<R>>,
    what: String,
    hook: Option<Hook>,
}

impl<R> Pending<R> {
    /// Whether the command has finished, or its worker died without replying.
    pub fn is_done(&mut self) -> bool {
        if self.done.is_none() {
            self.done = match self.rx.try_recv() {
                Ok(r) => Some(r),
                Err(channel::TryRecvError::Disconnected) => Some(Err(anyhow!("{}", self.what))),
                Err(channel::TryRecvError::Empty) => None,
            };
        }
        self.done.is_some()
    }

    /// Blocks until the command finishes; its result (errors name the worker and phase).
    pub fn wait(mut self) -> Result<R> {
        let r = match self.done.take() {
            Some(r) => r,
            None => self.rx.recv().map_err(|_| anyhow!("{}", self.what)).and_then(|r| r),
        };
        if let (Err(e), Some(hook)) = (&r, &self.hook) {
            hook(&format!("{e:#}"));
        }
        r
    }
}

impl<S: Send + 'static> Drop for WorkerPool<S> {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.tx = None; // closing the channel ends the worker loop
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}

fn worker_main<S>(
    rank: usize,
    name: &str,
    cores: &[core_affinity::CoreId],
    init: &(dyn Fn(usize) -> Result<S> + Send + Sync),
    ready: &Sender<(usize, Result<()>)>,
    jobs: &Receiver<Job<S>>,
) {
    if let Some(&core) = cores.first() {
        // Best effort: a refused pin only costs locality.
        let _ = core_affinity::set_for_current(core);
    }
    // AssertUnwindSafe: nothing built by a panicking init survives it.
    let state = match catch_unwind(AssertUnwindSafe(|| init(rank))) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let _ = ready.send((rank, Err(e.context(format!("worker {rank} ({name}) failed to initialize")))));
            return;
        }
        Err(p) => {
            let msg = panic_message(p.as_ref());
            let _ = ready.send((rank, Err(anyhow!("worker {rank} ({name}) panicked while initializing: {msg}"))));
            return;
        }
    };
    let _ = ready.send((rank, Ok(())));
    let mut state = state;
    let mut poisoned: Option<String> = None;
    while let Ok(job) = jobs.recv() {
        let access = match &poisoned {
            None => Ok(&mut state),
            Some(phase) => Err(phase.as_str()),
        };
        if (job.body)(access) {
            poisoned = Some(job.phase);
        }
    }
}

/// The lowest rank's error, with the number of failures when there are several.
fn summarize(mut failures: Vec<(usize, anyhow::Error)>, n: usize, phase: &str) -> Option<anyhow::Error> {
    let count = failures.len();
    failures.sort_by_key(|(rank, _)| *rank);
    let (_, first) = failures.into_iter().next()?;
    Some(if count > 1 { first.context(format!("{count} of {n} workers failed in phase '{phase}'")) } else { first })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic payload that is not a string)".to_string()
    }
}

/// Gives each of `n_workers` a contiguous share of the machine's cores (`core_affinity::get_core_ids`);
/// empty lists when the cores cannot be listed; with fewer cores than workers, workers wrap around.
pub fn split_cores(n_workers: usize) -> Vec<Vec<core_affinity::CoreId>> {
    split_core_list(&core_affinity::get_core_ids().unwrap_or_default(), n_workers)
}

pub(super) fn split_core_list(ids: &[core_affinity::CoreId], n_workers: usize) -> Vec<Vec<core_affinity::CoreId>> {
    (0..n_workers)
        .map(|w| match ids.len() {
            0 => Vec::new(),
            len if len < n_workers => vec![ids[w % len]],
            len => ids[shard_range(len, n_workers, w)].to_vec(),
        })
        .collect()
}
