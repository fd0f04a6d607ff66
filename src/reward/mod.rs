//! Rewards of RL runs: the built-in math rule (`data::answer`: the last `\boxed{}` against the
//! prompt's reference answer, agreeing with math-verify on the committed table) or a user's
//! plug-in command (`plugin`: one persistent subprocess speaking JSONL), behind one service
//! (`scorer`) that scores responses as the engines finish them, off the step's critical path.
//!
//! Owns: [`Rule`], [`Outcome`], [`RewardStats`] and the scoring of one batch. May call:
//! `crate::data` (the rule, prompt items), `crate::engine` (completions), `crate::model`
//! (decoding), `crate::config` ([reward]). Must not: touch devices, weights or the trainer.

pub mod plugin;
pub mod scorer;

use crate::config::RewardConfig;
use crate::data::answer::{self, Verdict};
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;

/// One response to reward.
#[derive(Clone, Debug, Default)]
pub struct Job {
    pub response: String,
    /// The prompt's reference answer, if it has one.
    pub answer: Option<String>,
    /// The prompt's text (sent to a plug-in).
    pub prompt: Option<String>,
    /// The dataset line's `meta` field (sent to a plug-in: e.g. a code task's tests).
    pub meta: Option<serde_json::Value>,
    /// Cut at the length limit: reward 0 whatever it contains (its answer is incomplete).
    pub truncated: bool,
}

/// What rewarding one response found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// None: the built-in rule and no reference answer (nothing to reward against).
    pub reward: Option<f32>,
    /// The built-in rule found no `\boxed{}` answer.
    pub no_answer: bool,
    /// The built-in rule could not decide (reward 0, counted).
    pub undecided: bool,
    /// The built-in rule: the boxed content, and both sides after normalization.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extracted: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub normalized: Option<(String, String)>,
    /// A plug-in's other numeric fields.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, f64>,
}

/// The per-step reward metrics (`reward_stats` in metrics.jsonl).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RewardStats {
    /// Responses rewarded.
    pub scored: usize,
    /// Built-in rule: responses without a `\boxed{}` answer, and answers it could not decide.
    pub no_answer: usize,
    pub undecided: usize,
    /// Responses cut at the length limit (reward 0, not sent to a plug-in).
    pub truncated: usize,
    /// Plug-in restarts during the step (the scorer's busy seconds are `time.reward_busy`).
    pub plugin_restarts: usize,
    /// Means of a plug-in's extra numeric fields over the responses that had them.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, f64>,
}

impl RewardStats {
    /// Counts `outcomes` (the step's), with `truncated` of them cut at the length limit.
    pub fn of(outcomes: &[Outcome], truncated: usize, plugin_restarts: usize) -> RewardStats {
        let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        for o in outcomes {
            for (k, v) in &o.extra {
                let e = sums.entry(k.clone()).or_default();
                e.0 += v;
                e.1 += 1;
            }
        }
        RewardStats {
            scored: outcomes.iter().filter(|o| o.reward.is_some()).count(),
            no_answer: outcomes.iter().filter(|o| o.no_answer).count(),
            undecided: outcomes.iter().filter(|o| o.undecided).count(),
            truncated,
            plugin_restarts,
            extra: sums.into_iter().map(|(k, (s, n))| (k, s / n as f64)).collect(),
        }
    }
}

/// The reward function of a run: the built-in rule or a started plug-in.
pub enum Rule {
    Builtin,
    Plugin(plugin::Plugin),
}

impl Rule {
    /// The rule `cfg` names (starting the plug-in, if any).
    pub fn start(cfg: &RewardConfig) -> Result<Rule> {
        if cfg.command.is_empty() {
            return Ok(Rule::Builtin);
        }
        let pc = plugin::PluginConfig { command: cfg.command.clone(), timeout_s: cfg.timeout_s, batch: cfg.batch };
        Ok(Rule::Plugin(plugin::Plugin::start(&pc)?))
    }

    pub fn restarts(&self) -> usize {
        match self {
            Rule::Builtin => 0,
            Rule::Plugin(p) => p.restarts(),
        }
    }

    /// Rewards `jobs`, one outcome each, in order. A truncated response gets 0 from either rule
    /// (a plug-in never sees it); the built-in rule leaves a response without a reference
    /// answer unrewarded, a plug-in is asked about every other response.
    pub fn score(&mut self, jobs: &[Job]) -> Result<Vec<Outcome>> {
        let cut = || Outcome { reward: Some(0.0), ..Default::default() };
        match self {
            Rule::Builtin => Ok(jobs
                .iter()
                .map(|j| match (&j.answer, j.truncated) {
                    (None, _) => Outcome::default(),
                    (Some(_), true) => cut(),
                    (Some(a), false) => {
                        let r = answer::judge_response(&j.response, a);
                        Outcome {
                            reward: Some(r.reward),
                            no_answer: r.verdict.is_none(),
                            undecided: r.verdict == Some(Verdict::Undecided),
                            extracted: r.extracted,
                            normalized: r.normalized,
                            extra: BTreeMap::new(),
                        }
                    }
                })
                .collect()),
            Rule::Plugin(p) => {
                let ask: Vec<plugin::Item> = jobs
                    .iter()
                    .filter(|j| !j.truncated)
                    .map(|j| plugin::Item {
                        response: j.response.clone(),
                        answer: j.answer.clone(),
                        prompt: j.prompt.clone(),
                        meta: j.meta.clone(),
                    })
                    .collect();
                let mut got = p.score(&ask)?.into_iter();
                jobs.iter()
                    .map(|j| match j.truncated {
                        true => Ok(cut()),
                        false => {
                            let s = got
                                .next()
                                .ok_or_else(|| anyhow::anyhow!("the reward plug-in answered too few lines"))?;
                            Ok(Outcome { reward: Some(s.reward), extra: s.extra, ..Default::default() })
                        }
                    })
                    .collect()
            }
        }
    }
}
