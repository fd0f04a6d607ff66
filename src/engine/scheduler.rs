//! Continuous batching: which sequences run in the next step and how many of their tokens.
//!
//! Policy (vLLM-style, one token budget per step): running sequences that are decoding get one
//! token each (a new cache block when they cross a block boundary; if none is free the youngest
//! running sequence is preempted: its blocks are freed and it is recomputed later, which gives
//! identical samples because sampling is keyed by position); then partially prefilled sequences
//! continue; then waiting requests are admitted in arrival order while a sequence slot, budget
//! and blocks remain. Owns: the sequence states. May call: `KvCache` allocation.

use super::kv_cache::KvCache;
use super::Request;
use anyhow::{bail, Result};
use std::collections::VecDeque;

pub(crate) struct Seq {
    pub req: Request,
    /// Prompt followed by the response so far.
    pub tokens: Vec<u32>,
    /// Tokens whose keys/values are in the cache.
    pub computed: usize,
    pub blocks: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub prompt_logprobs: Vec<f32>,
    /// Weight version of each generated token (asynchronous schedules).
    pub versions: Vec<u32>,
    /// Top-k ids and log-probs per generated token (when the request asks for them).
    pub topk_ids: Vec<u32>,
    pub topk_lps: Vec<f32>,
    /// Arrival order (preemption takes the youngest).
    pub order: u64,
}

impl Seq {
    pub fn prompt_len(&self) -> usize {
        self.req.prompt.len()
    }
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

/// One scheduled sequence: run tokens[start..start + n] of running[index].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Planned {
    pub index: usize,
    pub start: usize,
    pub n: usize,
}

pub(crate) struct Scheduler {
    pub waiting: VecDeque<Seq>,
    pub running: Vec<Seq>,
    pub max_seqs: usize,
    pub max_tokens: usize,
    block_size: usize,
    next_order: u64,
    pub preemptions: u64,
}

impl Scheduler {
    pub fn new(max_seqs: usize, max_tokens: usize, block_size: usize) -> Scheduler {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_seqs,
            max_tokens,
            block_size,
            next_order: 0,
            preemptions: 0,
        }
    }

    pub fn add(&mut self, req: Request) {
        // Reserve the whole response up front: decoding appends without reallocating.
        let max_new = req.sampling.max_new_tokens;
        let mut tokens = Vec::with_capacity(req.prompt.len() + max_new);
        tokens.extend_from_slice(&req.prompt);
        let order = self.next_order;
        self.next_order += 1;
        let prompt_logprobs = Vec::with_capacity(if req.prompt_logprobs { req.prompt.len() } else { 0 });
        let topk = max_new * req.sampling.topk_logprobs as usize;
        let blocks = Vec::with_capacity((req.prompt.len() + max_new).div_ceil(self.block_size) + 1);
        self.waiting.push_back(Seq {
            req,
            tokens,
            computed: 0,
            blocks,
            logprobs: Vec::with_capacity(max_new),
            prompt_logprobs,
            versions: Vec::with_capacity(max_new),
            topk_ids: Vec::with_capacity(topk),
            topk_lps: Vec::with_capacity(topk),
            order,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn grow(cache: &mut KvCache, seq: &mut Seq, upto_tokens: usize) -> bool {
        let need = upto_tokens.div_ceil(cache.block_size);
        while seq.blocks.len() < need {
            match cache.alloc() {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Moves running[i] back to the front of the waiting queue, freeing its blocks; it will be
    /// recomputed from its prompt and the tokens it already drew.
    fn preempt(&mut self, cache: &mut KvCache, i: usize) {
        let mut s = self.running.remove(i);
        cache.release(&mut s.blocks);
        s.computed = 0;
        s.prompt_logprobs.clear();
        self.preemptions += 1;
        self.waiting.push_front(s);
    }

    /// Plans the next step into `plan` (cleared first; its capacity is reused). Leaves it
    /// empty when there is nothing to run.
    pub fn schedule(&mut self, cache: &mut KvCache, plan: &mut Vec<Planned>) -> Result<()> {
        let mut budget = self.max_tokens;
        plan.clear();
        // 1. Running sequences, oldest first.
        self.running.sort_by_key(|s| s.order);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, len) = (self.running[i].computed, self.running[i].tokens.len());
            let n = (len - computed).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            // Out of blocks: preempt the youngest running sequence (the last one, as running is
            // sorted by arrival). Planned entries all have smaller indices, so they stay valid.
            let mut preempted_self = false;
            while !Self::grow(cache, &mut self.running[i], computed + n) {
                let last = self.running.len() - 1;
                if last == i {
                    if i == 0 {
                        bail!(
                            "the KV cache ({} tokens) cannot hold one sequence of {} tokens; give the engine more cache memory or lower max_new_tokens",
                            cache.capacity_tokens(),
                            computed + n
                        );
                    }
                    self.preempt(cache, i);
                    preempted_self = true;
                    break;
                }
                self.preempt(cache, last);
            }
            if preempted_self {
                return Ok(());
            }
            plan.push(Planned { index: i, start: computed, n });
            budget -= n;
            i += 1;
        }
        // 2. Admit waiting sequences.
        while budget > 0 && self.running.len() < self.max_seqs {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let n = (s.tokens.len() - s.computed).min(budget);
            let upto = s.computed + n;
            if !Self::grow(cache, &mut s, upto) {
                cache.release(&mut s.blocks);
                self.waiting.push_front(s);
                break;
            }
            plan.push(Planned { index: self.running.len(), start: s.computed, n });
            budget -= n;
            self.running.push(s);
        }
        Ok(())
    }
}
