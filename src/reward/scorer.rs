//! The reward service of a run: one thread owning the [`Rule`] (and so the plug-in's process)
//! that rewards responses as the engines finish them. Generation posts each completion
//! ([`Scorer::completed`], from the device threads, right after the engine step that finished
//! it); the step's reward phase only collects ([`Scorer::take`]) what is, by then, mostly
//! scored. The queue to the thread is bounded (`[reward] batch` × 4 responses): a slow
//! plug-in holds generation back instead of buffering without limit. The thread takes what is
//! waiting, up to one batch, and scores it together.
//!
//! Owns: the scoring thread, the completion → prompt registry, the results until collected.
//! May call: `super::Rule`, the tokenizer. Must not: touch devices or block a caller for longer
//! than the bounded queue makes it wait.

use super::{Job, Outcome, Rule};
use crate::config::RewardConfig;
use crate::data::dataset::PromptItem;
use crate::engine::{Completion, FinishReason};
use crate::model::tokenizer::TextTools;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// A response's key: its request id (step << 32 | prompt index) and sample.
pub type Key = (u64, u32);

#[derive(Default)]
struct State {
    submitted: HashSet<Key>,
    done: HashMap<Key, Outcome>,
    /// The first scoring error (every later `take` reports it).
    failed: Option<String>,
    busy_s: f64,
    restarts: usize,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| anyhow!("the reward service's state was poisoned"))
    }
}

/// The reward service (see the module comment).
pub struct Scorer {
    tx: Mutex<Option<SyncSender<(Key, Job)>>>,
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    text: Option<Arc<TextTools>>,
    /// The prompts of the steps in flight, by step.
    prompts: Mutex<HashMap<u64, Arc<Vec<PromptItem>>>>,
    /// Keys for responses scored without a completion (rollout files), counting down.
    next_local: Mutex<u64>,
    plugin: bool,
}

impl Scorer {
    /// Starts the rule of `cfg` (a plug-in's process) on its own thread; `text` decodes
    /// responses (None: no tokenizer, so nothing is rewarded from completions).
    pub fn start(cfg: &RewardConfig, text: Option<Arc<TextTools>>) -> Result<Scorer> {
        let rule = Rule::start(cfg)?;
        let plugin = matches!(rule, Rule::Plugin(_));
        let (tx, rx) = sync_channel(cfg.batch.saturating_mul(4).max(1));
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), cv: Condvar::new() });
        let s2 = shared.clone();
        let batch = cfg.batch.max(1);
        let worker = std::thread::Builder::new()
            .name("reward".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(rule, rx, &s2, batch)));
                // However the thread ends, no taker waits for it: a panic (or a poisoned state)
                // becomes the service's error; after a normal end (the queue closed) nobody takes.
                let why = match r {
                    Ok(()) => "the reward service has stopped".to_string(),
                    Err(p) => format!(
                        "the reward rule panicked: {}",
                        p.downcast_ref::<String>()
                            .map(String::as_str)
                            .or(p.downcast_ref::<&str>().copied())
                            .unwrap_or("?")
                    ),
                };
                if let Ok(mut s) = s2.state.lock() {
                    s.failed.get_or_insert(why);
                }
                s2.cv.notify_all();
            })
            .context("cannot start the reward thread")?;
        Ok(Scorer {
            tx: Mutex::new(Some(tx)),
            shared,
            worker: Mutex::new(Some(worker)),
            text,
            prompts: Mutex::new(HashMap::new()),
            next_local: Mutex::new(u64::MAX),
            plugin,
        })
    }

    /// Whether a plug-in rewards (else the built-in rule).
    pub fn is_plugin(&self) -> bool {
        self.plugin
    }

    /// Makes `step`'s prompts known (before its requests are queued).
    pub fn register(&self, step: u64, prompts: Arc<Vec<PromptItem>>) -> Result<()> {
        self.prompts.lock().map_err(|_| anyhow!("the reward registry was poisoned"))?.insert(step, prompts);
        Ok(())
    }

    /// Forgets `step`'s prompts (all its responses are out).
    pub fn forget(&self, step: u64) -> Result<()> {
        self.prompts.lock().map_err(|_| anyhow!("the reward registry was poisoned"))?.remove(&step);
        Ok(())
    }

    /// Posts a finished completion for scoring (its step's prompts must be registered: an
    /// error otherwise). Without a tokenizer, or for a prompt that the built-in rule has nothing
    /// to reward against, it does nothing.
    pub fn completed(&self, c: &Completion) -> Result<()> {
        let Some(text) = &self.text else { return Ok(()) };
        let item = {
            let reg = self.prompts.lock().map_err(|_| anyhow!("the reward registry was poisoned"))?;
            let step = c.id >> 32;
            let p = reg.get(&step).with_context(|| {
                format!("reward service: a completion of step {step}, whose prompts are not registered")
            })?;
            p.get((c.id & 0xffff_ffff) as usize)
                .with_context(|| format!("reward service: completion {:#x} names no prompt of step {step}", c.id))?
                .clone()
        };
        if item.answer.is_none() && !self.plugin {
            return Ok(());
        }
        let job = Job {
            response: text.decode(&c.tokens)?,
            answer: item.answer,
            prompt: if self.plugin { Some(text.decode(&item.tokens)?) } else { None },
            meta: item.meta,
            truncated: c.finish == FinishReason::Length,
        };
        self.submit((c.id, c.sample), job)
    }

    fn submit(&self, key: Key, job: Job) -> Result<()> {
        self.shared.lock()?.submitted.insert(key);
        // Clone the sender out of the lock: a full queue blocks this caller only.
        let tx = self.tx.lock().map_err(|_| anyhow!("the reward queue was poisoned"))?.clone();
        let tx = tx.context("the reward service has stopped")?;
        if tx.send((key, job)).is_err() {
            bail!("the reward service has stopped: {}", self.failure().unwrap_or_else(|| "no reason given".into()));
        }
        Ok(())
    }

    fn failure(&self) -> Option<String> {
        self.shared.lock().ok().and_then(|s| s.failed.clone())
    }

    /// Scores `jobs` now (responses that did not come from this run's engines: a rollout file).
    pub fn score_now(&self, jobs: Vec<Job>) -> Result<Vec<Outcome>> {
        let mut keys = Vec::with_capacity(jobs.len());
        for job in jobs {
            let key = {
                let mut n = self.next_local.lock().map_err(|_| anyhow!("the reward keys were poisoned"))?;
                *n -= 1;
                (*n, 0)
            };
            self.submit(key, job)?;
            keys.push(key);
        }
        self.take(&keys)
    }

    /// The outcomes of `keys` (each posted before), waiting for those still being scored;
    /// None for a key never posted (no tokenizer, or nothing to reward against).
    pub fn take_posted(&self, keys: &[Key]) -> Result<Vec<Option<Outcome>>> {
        let mut s = self.shared.lock()?;
        loop {
            if let Some(e) = &s.failed {
                bail!("{e}");
            }
            if keys.iter().all(|k| s.done.contains_key(k) || !s.submitted.contains(k)) {
                break;
            }
            s = self.shared.cv.wait(s).map_err(|_| anyhow!("the reward service's state was poisoned"))?;
        }
        Ok(keys
            .iter()
            .map(|k| {
                s.submitted.remove(k);
                s.done.remove(k)
            })
            .collect())
    }

    fn take(&self, keys: &[Key]) -> Result<Vec<Outcome>> {
        self.take_posted(keys)?.into_iter().map(|o| o.context("a response posted for scoring has no outcome")).collect()
    }

    /// Seconds spent scoring so far and the plug-in's restarts (the step's metrics take the
    /// difference of the first between steps).
    pub fn counters(&self) -> Result<(f64, usize)> {
        let s = self.shared.lock()?;
        Ok((s.busy_s, s.restarts))
    }
}

impl Drop for Scorer {
    /// Closes the queue and joins the thread (which drops the rule: a plug-in's stdin closes
    /// and its process is reaped).
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Ok(mut w) = self.worker.lock() {
            if let Some(h) = w.take() {
                let _ = h.join();
            }
        }
    }
}

/// The scoring thread: whatever is waiting, up to `batch`, scored together, until the queue
/// closes. After an error it records it and drains the queue (so no poster blocks forever).
fn serve(mut rule: Rule, rx: Receiver<(Key, Job)>, shared: &Shared, batch: usize) {
    while let Ok(first) = rx.recv() {
        let mut work = vec![first];
        while work.len() < batch {
            match rx.try_recv() {
                Ok(j) => work.push(j),
                Err(_) => break,
            }
        }
        if shared.state.lock().map(|s| s.failed.is_some()).unwrap_or(true) {
            shared.cv.notify_all();
            continue;
        }
        let t = Instant::now();
        let (keys, jobs): (Vec<Key>, Vec<Job>) = work.into_iter().unzip();
        let res = rule.score(&jobs);
        let Ok(mut s) = shared.state.lock() else { return };
        s.busy_s += t.elapsed().as_secs_f64();
        s.restarts = rule.restarts();
        match res {
            Ok(outs) => s.done.extend(keys.into_iter().zip(outs)),
            Err(e) => s.failed = Some(format!("{e:#}")),
        }
        drop(s);
        shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(response: &str, answer: Option<&str>, truncated: bool) -> Job {
        Job { response: response.into(), answer: answer.map(String::from), truncated, ..Default::default() }
    }

    /// The built-in rule through the service: outcomes in order, with the extraction failures
    /// counted; a truncated response earns 0 even with the right answer.
    #[test]
    fn the_builtin_rule_scores_through_the_service() {
        let s = Scorer::start(&RewardConfig::default(), None).unwrap();
        assert!(!s.is_plugin());
        let out = s
            .score_now(vec![
                job("so \\boxed{\\frac12}", Some("\\frac{1}{2}"), false),
                job("so \\boxed{3}", Some("4"), false),
                job("no box here", Some("4"), false),
                job("\\boxed{4}", Some("4"), true),
                job("\\boxed{4}", None, false),
            ])
            .unwrap();
        let rewards: Vec<Option<f32>> = out.iter().map(|o| o.reward).collect();
        assert_eq!(rewards, vec![Some(1.0), Some(0.0), Some(0.0), Some(0.0), None]);
        assert!(out[2].no_answer && !out[1].no_answer);
        assert_eq!(out[0].extracted.as_deref(), Some("\\frac12"));
        let st = super::super::RewardStats::of(&out, 1, 0);
        assert_eq!((st.scored, st.no_answer, st.truncated), (4, 1, 1));
    }

    /// A key that was never posted is None, not a wait forever.
    #[test]
    fn an_unposted_response_is_none() {
        let s = Scorer::start(&RewardConfig::default(), None).unwrap();
        assert_eq!(s.take_posted(&[(7, 0)]).unwrap(), vec![None]);
    }
}
