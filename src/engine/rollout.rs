//! Rollouts: what a training step learns from. Produced by the engine on the current weights
//! (the engine reads the trainer's weight store directly), or read from a JSONL file of
//! precomputed rollouts; then scored by the teacher (log p_T at the sampled tokens only).
//!
//! Owns: [`Rollout`], the work queue that devices generate from. May call: the engine, `data`'s
//! prompts. Must not: train (the trainer consumes rollouts; `mismatch::admit` makes them too).

use crate::data::dataset::PromptItem;
use crate::engine::{Completion, Engine, FinishReason, Request, SamplingConfig, View};
use crate::model::ModelWeights;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The engine's k most likely tokens at each response position and their log-probs (score
/// centering's target): `ids` and `logprobs` hold response_len·k values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopK {
    pub k: usize,
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rollout {
    pub prompt_id: u64,
    pub sample: u32,
    /// Responses to the same prompt share a group (GRPO).
    pub group: u64,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// log q(y_t) of the engine that sampled the response.
    pub sampler_logprobs: Vec<f32>,
    pub teacher_logprobs: Option<Vec<f32>>,
    /// With score centering: the sampler's top-k at each response token.
    pub sampler_topk: Option<TopK>,
    pub reward: Option<f32>,
    /// Reference answer of the prompt, when known.
    pub answer: Option<String>,
    /// The response hit the token limit.
    pub truncated: bool,
    /// Weight version the response was sampled with (its first token's, under an asynchronous
    /// schedule).
    pub version: u64,
    /// Asynchronous schedules: the weight version of each response token (a generation
    /// interrupted by an update resumes under the new weights); empty: all `version`.
    pub token_versions: Vec<u32>,
}

/// Requests not yet started, shared by every device's engine: a device takes the next one
/// whenever its engine has room, so long responses do not leave the other devices idle.
pub type WorkQueue = std::sync::Mutex<std::collections::VecDeque<Request>>;

/// The rollout requests of one step: `samples` responses to each prompt. Sampling keys are
/// (seed, request = step·2³² + prompt index, sample): the tokens do not depend on which device
/// draws them.
pub fn requests(prompts: &[PromptItem], samples: u32, sampling: &Arc<SamplingConfig>, step: u64) -> Vec<Request> {
    let mut out = Vec::with_capacity(prompts.len() * samples as usize);
    for (i, p) in prompts.iter().enumerate() {
        for s in 0..samples {
            out.push(Request {
                id: (step << 32) | i as u64,
                sample: s,
                prompt: p.tokens.clone(),
                sampling: sampling.clone(),
                prompt_logprobs: false,
            });
        }
    }
    out
}

/// Runs `engine` on `w`, pulling requests from `queue` while it holds fewer than `inflight`
/// unfinished sequences, until the queue is empty and the engine idle. Completions in the order
/// they finished.
pub fn run_queue<'a>(
    engine: &mut Engine,
    w: impl Into<View<'a>>,
    queue: &WorkQueue,
    inflight: usize,
) -> Result<Vec<Completion>> {
    run_queue_with(engine, w, queue, inflight, &mut |_| Ok(()))
}

/// [`run_queue`], calling `on_done` with each completion as soon as the engine step that
/// finished it returns (the reward service scores it while generation goes on).
pub fn run_queue_with<'a>(
    engine: &mut Engine,
    w: impl Into<View<'a>>,
    queue: &WorkQueue,
    inflight: usize,
    on_done: &mut (dyn FnMut(&Completion) -> Result<()> + Send),
) -> Result<Vec<Completion>> {
    let w: View<'a> = w.into();
    let dev = engine.device().clone();
    dev.install(|| -> Result<Vec<Completion>> {
        let mut out = Vec::new();
        loop {
            top_up(engine, queue, inflight)?;
            if !engine.has_work() {
                return Ok(out);
            }
            for c in engine.step(w)? {
                on_done(&c)?;
                out.push(c);
            }
        }
    })
}

/// Adds requests from the shared `queue` until `engine` has `inflight` unfinished sequences or
/// the queue is empty (an idle device takes the next unstarted request).
pub fn top_up(engine: &mut Engine, queue: &WorkQueue, inflight: usize) -> Result<()> {
    while engine.num_unfinished() < inflight.max(1) {
        let next =
            queue.lock().map_err(|_| anyhow::anyhow!("the rollout queue was poisoned by a failed device"))?.pop_front();
        match next {
            Some(r) => engine.add(r)?,
            None => break,
        }
    }
    Ok(())
}

/// The rollout of a completion of [`requests`] for `prompts`.
pub fn from_completion(c: Completion, prompts: &[PromptItem], version: u64) -> Rollout {
    let i = (c.id & 0xffff_ffff) as usize;
    Rollout {
        prompt_id: prompts[i].id,
        sample: c.sample,
        group: prompts[i].id,
        prompt: prompts[i].tokens.clone(),
        truncated: c.finish == FinishReason::Length,
        sampler_topk: (!c.topk_ids.is_empty()).then(|| TopK {
            k: c.topk_ids.len() / c.tokens.len().max(1),
            ids: c.topk_ids,
            logprobs: c.topk_logprobs,
        }),
        response: c.tokens,
        sampler_logprobs: c.logprobs,
        teacher_logprobs: None,
        reward: None,
        answer: prompts[i].answer.clone(),
        version: c.versions.first().map(|&v| v as u64).unwrap_or(version),
        token_versions: c.versions,
    }
}

/// Samples `samples` responses to each prompt with `engine` on weights `w` (one device).
#[allow(clippy::too_many_arguments)]
pub fn generate<'a>(
    engine: &mut Engine,
    w: impl Into<View<'a>>,
    prompts: &[PromptItem],
    samples: u32,
    sampling: &Arc<SamplingConfig>,
    step: u64,
    version: u64,
) -> Result<Vec<Rollout>> {
    let queue: WorkQueue = std::sync::Mutex::new(requests(prompts, samples, sampling, step).into());
    let mut done = run_queue(engine, w, &queue, usize::MAX)?;
    done.sort_by_key(|c| (c.id, c.sample));
    Ok(done.into_iter().map(|c| from_completion(c, prompts, version)).collect())
}

/// Teacher-scoring requests for the rollouts that lack teacher log-probs (request id = the
/// rollout's index); rollouts with empty responses get empty teacher log-probs at once.
pub fn teacher_requests(rollouts: &mut [Rollout], temperature: f32) -> Vec<Request> {
    let sampling = Arc::new(SamplingConfig { temperature, max_new_tokens: 0, ..Default::default() });
    let mut out = Vec::new();
    for (i, r) in rollouts.iter_mut().enumerate() {
        if r.response.is_empty() {
            r.teacher_logprobs.get_or_insert_with(Vec::new);
        }
        if r.teacher_logprobs.is_some() {
            continue;
        }
        let mut seq = r.prompt.clone();
        seq.extend_from_slice(&r.response);
        out.push(Request { id: i as u64, sample: 0, prompt: seq, sampling: sampling.clone(), prompt_logprobs: true });
    }
    out
}

/// Stores the teacher's scores (completions of [`teacher_requests`]) into the rollouts.
pub fn store_teacher(rollouts: &mut [Rollout], done: Vec<Completion>) {
    for c in done {
        let r = &mut rollouts[c.id as usize];
        r.teacher_logprobs = Some(c.prompt_logprobs[r.prompt.len() - 1..].to_vec());
    }
}

/// The teacher's log-probs at the response tokens of `done` (completions of prompts
/// `prompts[i]`), scored at `temperature` on one device (a split placement's generator).
pub fn score_completions(
    engine: &mut Engine,
    w: &ModelWeights,
    prompts: &[&[u32]],
    done: &[Completion],
    temperature: f32,
) -> Result<Vec<Vec<f32>>> {
    let sampling = Arc::new(SamplingConfig { temperature, max_new_tokens: 0, ..Default::default() });
    let mut reqs = Vec::new();
    for (i, (c, p)) in done.iter().zip(prompts).enumerate() {
        if p.len() != c.prompt_len {
            bail!(
                "teacher scoring: completion {} has a prompt of {} tokens, its request {}",
                c.id,
                c.prompt_len,
                p.len()
            );
        }
        if !c.tokens.is_empty() {
            let mut seq = p.to_vec();
            seq.extend_from_slice(&c.tokens);
            reqs.push(Request {
                id: i as u64,
                sample: 0,
                prompt: seq,
                sampling: sampling.clone(),
                prompt_logprobs: true,
            });
        }
    }
    let queue: WorkQueue = std::sync::Mutex::new(reqs.into());
    let mut out = vec![Vec::new(); done.len()];
    for c in run_queue(engine, w, &queue, usize::MAX)? {
        let i = c.id as usize;
        out[i] = c.prompt_logprobs[done[i].prompt_len - 1..].to_vec();
    }
    Ok(out)
}

/// Fills `teacher_logprobs` of every rollout that lacks them: the teacher engine scores
/// prompt + response at `temperature` and keeps only the response positions (one device).
pub fn score_teacher(engine: &mut Engine, w: &ModelWeights, rollouts: &mut [Rollout], temperature: f32) -> Result<()> {
    let queue: WorkQueue = std::sync::Mutex::new(teacher_requests(rollouts, temperature).into());
    let done = run_queue(engine, w, &queue, usize::MAX)?;
    store_teacher(rollouts, done);
    debug_assert!(rollouts.iter().all(|r| r.teacher_logprobs.is_some()));
    Ok(())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a, 64-bit: `h` carried on over `bytes`.
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h = (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a (64-bit) of the responses, in (prompt id, sample) order: per response its prompt
/// id, sample index, length and tokens, little-endian. Equal for the same samples whatever the
/// order the devices finished them in.
pub fn digest(rollouts: &[Rollout]) -> String {
    let mut order: Vec<&Rollout> = rollouts.iter().collect();
    order.sort_by_key(|r| (r.prompt_id, r.sample));
    let mut h = FNV_OFFSET;
    let mut eat = |bytes: &[u8]| h = fnv1a(h, bytes);
    for r in order {
        eat(&r.prompt_id.to_le_bytes());
        eat(&r.sample.to_le_bytes());
        eat(&(r.response.len() as u64).to_le_bytes());
        for t in &r.response {
            eat(&t.to_le_bytes());
        }
    }
    format!("{h:016x}")
}

fn floats(v: Option<&Value>, key: &str, ctx: &dyn Fn() -> String) -> Result<Option<Vec<f32>>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let arr = v.as_array().with_context(|| format!("{}: '{key}' must be a list of numbers", ctx()))?;
    let mut out = Vec::with_capacity(arr.len());
    for (i, x) in arr.iter().enumerate() {
        let f = x.as_f64().with_context(|| format!("{}: {key}[{i}] = {x} is not a number", ctx()))?;
        if !f.is_finite() {
            bail!("{}: {key}[{i}] = {f} is not finite", ctx());
        }
        out.push(f as f32);
    }
    Ok(Some(out))
}

/// Optional `sampler_topk_ids` / `sampler_topk_logprobs`: one list of k values per response token.
fn read_topk(v: &Value, n: usize, vocab: usize, ctx: &dyn Fn() -> String) -> Result<Option<TopK>> {
    let (ids, lps) = match (v.get("sampler_topk_ids"), v.get("sampler_topk_logprobs")) {
        (None | Some(Value::Null), None | Some(Value::Null)) => return Ok(None),
        (Some(i), Some(l)) => (i, l),
        _ => bail!("{}: 'sampler_topk_ids' and 'sampler_topk_logprobs' come together", ctx()),
    };
    let rows = |x: &Value, key: &str| -> Result<Vec<Value>> {
        let a =
            x.as_array().with_context(|| format!("{}: '{key}' must be a list (one list per response token)", ctx()))?;
        if a.len() != n {
            bail!("{}: '{key}' has {} entries for {n} response tokens", ctx(), a.len());
        }
        Ok(a.clone())
    };
    let (ir, lr) = (rows(ids, "sampler_topk_ids")?, rows(lps, "sampler_topk_logprobs")?);
    let mut t = TopK::default();
    for (j, (i, l)) in ir.iter().zip(&lr).enumerate() {
        let ids = crate::data::prompts::parse_tokens(i, vocab, &|| format!("{} ('sampler_topk_ids'[{j}])", ctx()))?;
        let lps = floats(Some(l), &format!("sampler_topk_logprobs[{j}]"), ctx)?.unwrap_or_default();
        if j == 0 {
            t.k = ids.len();
        }
        if ids.is_empty() || ids.len() != t.k || lps.len() != t.k {
            bail!(
                "{}: token {j} has {} top-k ids and {} log-probs; every token needs the same k >= 1 of each",
                ctx(),
                ids.len(),
                lps.len()
            );
        }
        t.ids.extend(ids);
        t.logprobs.extend(lps);
    }
    Ok(Some(t))
}

/// Reads a rollout file: one JSON object per line with `prompt_tokens`, `response_tokens`,
/// `sampler_logprobs` and optional `group`, `reward`, `teacher_logprobs`, `answer`,
/// `sampler_topk_ids` + `sampler_topk_logprobs`. Errors name
/// the file, the line and the field.
pub fn read_file(path: &Path, vocab: usize) -> Result<Vec<Rollout>> {
    let lines = crate::util::read_jsonl(path)?;
    if lines.is_empty() {
        bail!("{}: no rollouts (the file is empty)", path.display());
    }
    let mut out = Vec::with_capacity(lines.len());
    for (idx, (line, v)) in lines.iter().enumerate() {
        let ctx = || format!("{}:{line}", path.display());
        if !v.is_object() {
            bail!("{}: expected a JSON object", ctx());
        }
        let toks = |key: &str| -> Result<Vec<u32>> {
            let f = v.get(key).with_context(|| format!("{}: missing field '{key}'", ctx()))?;
            crate::data::prompts::parse_tokens(f, vocab, &|| format!("{} ('{key}')", ctx()))
        };
        let prompt = toks("prompt_tokens")?;
        let response = toks("response_tokens")?;
        if prompt.is_empty() {
            bail!("{}: 'prompt_tokens' is empty", ctx());
        }
        let sampler = floats(v.get("sampler_logprobs"), "sampler_logprobs", &ctx)?
            .with_context(|| format!("{}: missing field 'sampler_logprobs'", ctx()))?;
        if sampler.len() != response.len() {
            bail!("{}: 'sampler_logprobs' has {} values for {} response tokens", ctx(), sampler.len(), response.len());
        }
        let teacher = floats(v.get("teacher_logprobs"), "teacher_logprobs", &ctx)?;
        if let Some(t) = &teacher {
            if t.len() != response.len() {
                bail!("{}: 'teacher_logprobs' has {} values for {} response tokens", ctx(), t.len(), response.len());
            }
        }
        let group = match v.get("group") {
            None | Some(Value::Null) => idx as u64,
            Some(g) => g.as_u64().with_context(|| format!("{}: 'group' must be a non-negative integer", ctx()))?,
        };
        let reward = match v.get("reward") {
            None | Some(Value::Null) => None,
            Some(r) => {
                let f = r.as_f64().with_context(|| format!("{}: 'reward' must be a number", ctx()))?;
                if !f.is_finite() {
                    bail!("{}: 'reward' = {f} is not finite", ctx());
                }
                Some(f as f32)
            }
        };
        let sampler_topk = read_topk(v, response.len(), vocab, &ctx)?;
        let answer = v.get("answer").and_then(|a| a.as_str()).map(str::to_string);
        out.push(Rollout {
            prompt_id: idx as u64,
            sample: 0,
            group,
            prompt,
            response,
            sampler_logprobs: sampler,
            teacher_logprobs: teacher,
            sampler_topk,
            reward,
            answer,
            truncated: false,
            version: 0,
            token_versions: Vec::new(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rollout(prompt_id: u64, sample: u32, response: Vec<u32>) -> Rollout {
        Rollout { prompt_id, sample, response, ..Default::default() }
    }

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference (isthe.com/chongo/tech/comp/fnv): FNV-1a 64 of "", "a", "foobar".
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn digest_ignores_arrival_order_and_sees_every_token() {
        let a = vec![rollout(1, 0, vec![5, 6, 7]), rollout(0, 1, vec![9]), rollout(0, 0, vec![])];
        let d = digest(&a);
        assert_eq!(d.len(), 16);
        let mut b = a.clone();
        b.reverse();
        assert_eq!(digest(&b), d, "order of completion");
        b[2].response[2] = 8; // (1, 0): [5, 6, 8]
        assert_ne!(digest(&b), d, "one token changed");
        // Moving a token across a response boundary changes it too (lengths are hashed).
        let c = vec![rollout(1, 0, vec![5, 6]), rollout(0, 1, vec![7, 9]), rollout(0, 0, vec![])];
        assert_ne!(digest(&c), d);
    }
}
