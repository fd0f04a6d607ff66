//! Held-out evaluation (seed 000 Eq. 3's K_x): the standard engine samples responses from the
//! student; student and teacher score the same tokens; K_x is the mean of log p_θ − log p_T over
//! problem x's response tokens (samples pooled), K the mean over problems. Accuracy: the share of
//! samples whose last boxed answer is correct.

use crate::data::answer;
use crate::data::dataset::PromptItem;
use crate::engine::rollout::{self, Rollout};
use crate::engine::{Engine, Request, SamplingConfig};
use crate::model::{ModelWeights, TextTools};
use anyhow::Result;
use serde::Serialize;
use std::sync::Arc;

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct EvalResult {
    pub step: u64,
    /// K(c): mean over problems of the per-problem KL.
    pub kl: f64,
    pub accuracy: f64,
    /// K_x per problem, in held-out order.
    pub kl_per_problem: Vec<f64>,
    /// Mean correctness per problem.
    pub acc_per_problem: Vec<f64>,
    pub tokens: usize,
    /// Fingerprint of the held-out prompts and sampling (comparisons need equal ones).
    #[serde(default)]
    pub heldout: String,
    /// The student and teacher the run trained (model paths as configured).
    #[serde(default)]
    pub student: String,
    #[serde(default)]
    pub teacher: String,
}

/// Scores `rollouts`' responses with `engine` on `w` at temperature 1 (prompt log-probs).
fn score(engine: &mut Engine, w: &ModelWeights, rollouts: &[Rollout]) -> Result<Vec<Vec<f32>>> {
    let sampling = Arc::new(SamplingConfig { max_new_tokens: 0, ..Default::default() });
    for (i, r) in rollouts.iter().enumerate() {
        let mut seq = r.prompt.clone();
        seq.extend_from_slice(&r.response);
        engine.add(Request {
            id: i as u64,
            sample: 0,
            prompt: seq,
            sampling: sampling.clone(),
            prompt_logprobs: true,
        })?;
    }
    Ok(engine
        .run_to_completion(w, |_| {})?
        .into_iter()
        .map(|c| c.prompt_logprobs[rollouts[c.id as usize].prompt.len() - 1..].to_vec())
        .collect())
}

#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    step: u64,
    student: (&mut Engine, &ModelWeights),
    teacher: Option<(&mut Engine, &ModelWeights)>,
    text: Option<&TextTools>,
    prompts: &[PromptItem],
    samples: u32,
    max_new_tokens: usize,
    seed: u64,
) -> Result<EvalResult> {
    let (se, sw) = student;
    let sampling = Arc::new(SamplingConfig { temperature: 1.0, max_new_tokens, seed, ..Default::default() });
    // Held-out responses are keyed by the problem only, so every checkpoint of every run is
    // evaluated on responses drawn with the same random numbers.
    let mut rollouts = rollout::generate(se, sw, prompts, samples, &sampling, 0, 0)?;
    rollouts.retain(|r| !r.response.is_empty());
    let mut fp = format!("{samples}/{max_new_tokens}/{seed}");
    for p in prompts {
        fp.push_str(&format!("|{:?}", p.tokens));
    }
    let mut res =
        EvalResult { step, heldout: format!("{:016x}", crate::rand::fnv1a64(fp.as_bytes())), ..Default::default() };
    let mut kl_sum = vec![0.0f64; prompts.len()];
    let mut kl_n = vec![0usize; prompts.len()];
    let mut acc = vec![0.0f64; prompts.len()];
    let index: std::collections::HashMap<u64, usize> = prompts.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
    if let Some((te, tw)) = teacher {
        let ps = score(se, sw, &rollouts)?;
        let pt = score(te, tw, &rollouts)?;
        for ((r, a), b) in rollouts.iter().zip(&ps).zip(&pt) {
            let x = index[&r.prompt_id];
            for (p, t) in a.iter().zip(b) {
                kl_sum[x] += (*p - *t) as f64;
                kl_n[x] += 1;
            }
        }
    }
    for r in &rollouts {
        let x = index[&r.prompt_id];
        if let (Some(ans), Some(text)) = (&r.answer, text) {
            acc[x] += answer::reward(&text.decode(&r.response)?, ans) as f64 / samples as f64;
        }
        res.tokens += r.response.len();
    }
    res.kl_per_problem = kl_sum.iter().zip(&kl_n).map(|(s, n)| if *n > 0 { s / *n as f64 } else { 0.0 }).collect();
    res.kl = res.kl_per_problem.iter().sum::<f64>() / prompts.len().max(1) as f64;
    res.accuracy = acc.iter().sum::<f64>() / prompts.len().max(1) as f64;
    res.acc_per_problem = acc;
    Ok(res)
}
