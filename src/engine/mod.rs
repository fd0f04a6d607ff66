//! The decoding engine: continuous batching over a paged KV cache, prefill and decode in one
//! flat batch per step, Philox sampling, stop conditions, and prompt scoring (log-probs of
//! given tokens) through the same path; the rollout engines' weights (`rollout_weights`:
//! quantized, noisy or stale views of the trainer's store) and rollouts (`rollout`: what a
//! training step learns from).
//!
//! Owns: [`Engine`] (cache, scheduler, activation buffers, per-step host staging vectors that
//! are reused, so steady-state decoding allocates nothing), rollouts. May call: `crate::model`,
//! `crate::ops`, `crate::quant`, `crate::data` (prompts of rollouts). Must not: own weights — every step reads the caller's [`ModelWeights`], which
//! is what lets a trainer and an engine share one weight store without copies.

mod config;
mod graphs;
pub mod kv_cache;
pub mod rollout;
pub mod rollout_weights;
mod scheduler;
mod tables;

use crate::device::{DType, Device};
use crate::model::{ForwardBuffers, ModelConfig, ModelWeights, TextTools, Transformer};
use crate::ops::{
    logprob,
    sample::{self, SampleParams},
};
use anyhow::{bail, Result};
pub use config::{EngineConfig, SCORE_ROWS};
pub use graphs::GraphStats;
use kv_cache::KvCache;
use scheduler::{Planned, Scheduler};
use std::sync::Arc;

/// The weights an engine step reads: the dense store (the trainer's own tensors for a standard
/// engine) and, for low-precision engines, the quantized linears and KV scales.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub w: &'a ModelWeights,
    pub q: Option<&'a [crate::model::QLayer]>,
}

impl<'a> From<&'a ModelWeights> for View<'a> {
    fn from(w: &'a ModelWeights) -> View<'a> {
        View { w, q: None }
    }
}

/// How to draw a response.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub seed: u64,
    /// Also return the k most likely tokens' log-probs at each sampled position (score
    /// centering's target); 0: none.
    pub topk_logprobs: u32,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 128,
            stop: Vec::new(),
            ignore_eos: false,
            seed: 0,
            topk_logprobs: 0,
        }
    }
}

impl SamplingConfig {
    pub fn validate(&self) -> Result<()> {
        SampleParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: 0,
            request: 0,
            sample: 0,
            position: 0,
        }
        .validate()
    }
}

/// One sequence to run: a prompt to continue (`max_new_tokens` > 0) and/or to score.
#[derive(Clone, Debug)]
pub struct Request {
    /// Request id: part of the sampling key, so the same (seed, id, sample) always draws the
    /// same response from the same weights.
    pub id: u64,
    pub sample: u32,
    pub prompt: Vec<u32>,
    pub sampling: Arc<SamplingConfig>,
    /// Also return log p(prompt[t+1] | prompt[..=t]) for every prompt position.
    pub prompt_logprobs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// max_new_tokens or the model's maximum length.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Completion {
    pub id: u64,
    pub sample: u32,
    pub prompt_len: usize,
    /// The response's token ids.
    pub tokens: Vec<u32>,
    /// The engine's log-prob of each response token (see `crate::ops::sample`).
    pub logprobs: Vec<f32>,
    /// With `prompt_logprobs`: prompt_len − 1 values.
    pub prompt_logprobs: Vec<f32>,
    /// With `sampling.topk_logprobs = k`: per response token, the k most likely ids and their
    /// log-probs at the sampling temperature (tokens·k each; see `ops::logprob::topk_logprobs`).
    pub topk_ids: Vec<u32>,
    pub topk_logprobs: Vec<f32>,
    /// The weight version (see [`Engine::set_version`]) each response token was sampled with.
    pub versions: Vec<u32>,
    pub finish: FinishReason,
    /// Index into `stop` of the stop string that ended the response, if any.
    pub stop_string: Option<usize>,
}

/// What a step's logit row is for.
#[derive(Clone, Copy)]
enum RowUse {
    /// Score the next prompt token at `pos + 1` of running[seq].
    Score { seq: usize, pos: usize },
    /// Draw the next token of running[seq].
    Sample { seq: usize },
}

/// Host staging vectors, cleared and refilled each step (capacity kept).
#[derive(Default)]
struct Staging {
    ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    q_start: Vec<u32>,
    ctx_len: Vec<u32>,
    /// The rows' blocks, back to back; row r is `tables[table_off[r]..table_off[r + 1]]`.
    tables: Vec<u32>,
    table_off: Vec<u32>,
    rows: Vec<(u32, RowUse)>,
    chunk: Vec<(u32, RowUse)>,
    plan: Vec<Planned>,
    sel: Vec<u32>,
    targets: Vec<u32>,
    params: Vec<SampleParams>,
    tokens: Vec<u32>,
    lps: Vec<f32>,
    lp_host: Vec<f32>,
    topk_temps: Vec<f32>,
    topk_ids: Vec<u32>,
    topk_lps: Vec<f32>,
}

pub struct Engine {
    dev: Device,
    model: Transformer,
    pub cache: KvCache,
    bufs: ForwardBuffers,
    sched: Scheduler,
    st: Staging,
    /// What the device's block tables hold (each step writes only what changed).
    tables: tables::BlockTables,
    targets: crate::device::Tensor, // (score_rows) u32
    lp_out: crate::device::Tensor,  // (score_rows) f32
    /// Rows of a scoring chunk and of a sampling chunk (`score_rows`, `logits_rows`).
    chunk_rows: [usize; 2],
    max_model_len: usize,
    text: Option<Arc<TextTools>>,
    /// Weight version stamped on sampled tokens.
    version: u32,
    /// Tokens processed (prefill + decode) and drawn since creation.
    pub stats: EngineStats,
    /// CUDA graphs of the decode steps (None: off, or not a CUDA device).
    graphs: Option<graphs::DecodeGraphs>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub tokens_forwarded: u64,
    pub tokens_generated: u64,
    pub preemptions: u64,
}

/// Whether an engine writes its GEMM inputs in BF16 ([`ForwardBuffers::new`]'s room for them).
fn bf16_operands(ec: &EngineConfig, cuda: bool, weights_dtype: DType) -> bool {
    ec.bf16_operands && cuda && weights_dtype == DType::BF16
}

impl Engine {
    /// The bytes of the forward's activation buffers an engine of `ec` over `cfg` in
    /// `weights_dtype` allocates (on a CUDA device when `cuda`), before it exists: what
    /// [`Engine::buffer_bytes`] will report (the device's memory plan counts them; the step's
    /// metadata, a few MB, apart).
    pub fn plan_buffer_bytes(cfg: &ModelConfig, weights_dtype: DType, ec: &EngineConfig, cuda: bool) -> usize {
        let rows = ec.logits_rows.max(ec.score_rows);
        ForwardBuffers::plan_bytes(cfg, ec.max_tokens_per_step, rows, bf16_operands(ec, cuda, weights_dtype))
    }

    /// The bytes of the forward's activation buffers (the KV cache apart).
    pub fn buffer_bytes(&self) -> usize {
        self.bufs.size_bytes()
    }

    /// The tokenizer the engine decodes stop strings with (shared).
    pub fn text(&self) -> Option<Arc<TextTools>> {
        self.text.clone()
    }

    pub fn new(
        dev: &Device,
        cfg: &ModelConfig,
        weights_dtype: DType,
        ec: &EngineConfig,
        text: Option<Arc<TextTools>>,
    ) -> Result<Engine> {
        if ec.max_seqs == 0 || ec.max_tokens_per_step == 0 || ec.logits_rows == 0 || ec.score_rows == 0 {
            bail!("engine: max_seqs, max_tokens_per_step, logits_rows and score_rows must be positive");
        }
        let kv_dtypes = ec.kv_dtypes(cfg, weights_dtype);
        let max_model_len = ec.max_model_len.unwrap_or(cfg.max_position_embeddings);
        let block_bytes = KvCache::block_bytes_layers(cfg, ec.block_size, &kv_dtypes);
        let max_blocks_per_seq = max_model_len.div_ceil(ec.block_size);
        let useful = ec.max_seqs * max_blocks_per_seq;
        let num_blocks =
            ec.kv_blocks.unwrap_or_else(|| (ec.kv_cache_bytes / block_bytes.max(1)).clamp(1, useful.max(1)));
        // CUDA graphs pad decode batches into one more block, out of the sequences' reach.
        let graphs_on = ec.cuda_graphs && matches!(dev, Device::Cuda(_));
        let mut cache = KvCache::with_layers(dev, cfg, ec.block_size, num_blocks + graphs_on as usize, &kv_dtypes)?;
        let graph_rows = ec.max_seqs.min(ec.max_tokens_per_step).min(ec.logits_rows);
        let graphs = graphs_on
            .then(|| cache.reserve_block())
            .flatten()
            .map(|b| graphs::DecodeGraphs::new(graph_rows, b, ec.graph_versions.max(1), ec.graph_capture));
        let max_model_len = max_model_len.min(cache.capacity_tokens());
        let max_blocks = max_model_len.div_ceil(ec.block_size);
        let bufs = ForwardBuffers::new(
            dev,
            cfg,
            ec.max_tokens_per_step,
            ec.logits_rows.max(ec.score_rows),
            ec.max_seqs,
            max_blocks,
            ec.block_size,
            bf16_operands(ec, !dev.is_cpu(), weights_dtype),
        )?;
        crate::ops::reserve_scratch(
            dev,
            crate::ops::ScratchSizes {
                max_k: cfg.hidden_size.max(cfg.intermediate_size).max(cfg.q_dim()),
                attn_groups: cfg.num_heads / cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                vocab: cfg.vocab_size,
            },
        );
        Ok(Engine {
            dev: dev.clone(),
            model: Transformer::new(dev, cfg.clone())?,
            cache,
            bufs,
            sched: Scheduler::new(ec.max_seqs, ec.max_tokens_per_step, ec.block_size),
            st: Staging {
                // Full capacity up front: a decode step whose sequence gets a block allocates nothing.
                tables: Vec::with_capacity(ec.max_seqs * max_blocks),
                table_off: Vec::with_capacity(ec.max_seqs + 1),
                ..Staging::default()
            },
            tables: tables::BlockTables::new(ec.max_seqs, max_blocks),
            targets: dev.zeros(DType::U32, &[ec.score_rows])?,
            lp_out: dev.zeros(DType::F32, &[ec.score_rows])?,
            chunk_rows: [ec.score_rows, ec.logits_rows],
            max_model_len,
            text,
            version: 0,
            stats: EngineStats::default(),
            graphs,
        })
    }

    /// Starts (Some) or stops (None, returning what was recorded) calibration: the forward then
    /// records the max magnitude of every linear input and of the keys and values.
    pub fn set_observer(
        &mut self,
        obs: Option<crate::model::calib::Calibration>,
    ) -> Option<crate::model::calib::Calibration> {
        std::mem::replace(&mut self.bufs.observe, obs)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// Longest prompt + response the engine accepts.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Queues a request. Fails (without queuing) on an empty prompt, an out-of-vocabulary token,
    /// or a length the cache cannot hold.
    pub fn add(&mut self, req: Request) -> Result<()> {
        req.sampling.validate()?;
        if req.prompt.is_empty() {
            bail!("request {}: empty prompt", req.id);
        }
        let v = self.model.cfg.vocab_size as u32;
        if let Some(t) = req.prompt.iter().find(|&&t| t >= v) {
            bail!("request {}: token id {t} is outside the vocabulary (size {v})", req.id);
        }
        let total = req.prompt.len() + req.sampling.max_new_tokens;
        if req.prompt.len() > self.max_model_len
            || (req.sampling.max_new_tokens > 0 && req.prompt.len() >= self.max_model_len)
        {
            bail!(
                "request {}: prompt of {} tokens does not fit the engine's maximum length {} (prompt + {} new tokens = {total})",
                req.id,
                req.prompt.len(),
                self.max_model_len,
                req.sampling.max_new_tokens
            );
        }
        if !req.sampling.stop.is_empty() && self.text.is_none() {
            bail!("request {}: stop strings need a tokenizer", req.id);
        }
        self.sched.add(req);
        Ok(())
    }

    pub fn has_work(&self) -> bool {
        !self.sched.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.sched.running.len()
    }

    /// The weight version stamped on every token sampled from now on.
    pub fn set_version(&mut self, v: u64) {
        self.version = v as u32;
    }

    /// Sequences added and not finished (waiting or running).
    pub fn num_unfinished(&self) -> usize {
        self.sched.running.len() + self.sched.waiting.len()
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Frees the KV cache's memory for another phase (the trainer's); the bytes freed. Only an
    /// idle engine can: a sequence in flight would lose its keys. Steps with work fail until
    /// [`Engine::commit_cache`]. The decode graphs stay: the cache's addresses are part of
    /// their fingerprint, and on CUDA the cache comes back where it was (one virtual-memory
    /// reservation), so they replay.
    pub fn release_cache(&mut self) -> Result<usize> {
        if self.has_work() {
            bail!(
                "engine: {} sequence(s) in flight; the KV cache is released only between decoding phases",
                self.num_unfinished()
            );
        }
        self.cache.release_memory(&self.dev)
    }

    /// Allocates the KV cache again after [`Engine::release_cache`] (nothing when resident). A
    /// cache that came back at other addresses drops the decode graphs, which read the old
    /// ones: each bucket captures again at its next step.
    pub fn commit_cache(&mut self) -> Result<()> {
        if self.cache.commit_memory(&self.dev)? {
            if let Some(g) = self.graphs.as_mut() {
                g.forget();
            }
        }
        Ok(())
    }

    /// Runs one engine step with `w` and returns the sequences that finished in it.
    ///
    /// Steps run inside the device's thread pool (see [`Engine::run_to_completion`] and
    /// `Device::install`) allocate nothing once every running sequence is admitted.
    pub fn step<'a>(&mut self, w: impl Into<View<'a>>) -> Result<Vec<Completion>> {
        let mut plan = std::mem::take(&mut self.st.plan);
        let r = self.step_with(w.into(), &mut plan);
        self.st.plan = plan;
        r
    }

    fn step_with(&mut self, v: View<'_>, plan: &mut Vec<Planned>) -> Result<Vec<Completion>> {
        let w = v.w;
        if let Some(q) = v.q {
            // FP8 cache scales follow the engine's quantized view.
            for (c, l) in self.cache.layers.iter_mut().zip(q) {
                c.k_scale = l.k_scale;
                c.v_scale = l.v_scale;
            }
        }
        if !self.cache.is_resident() && self.has_work() {
            bail!("engine: the KV cache is released (the train phase holds its memory); commit it before decoding");
        }
        self.sched.schedule(&mut self.cache, plan)?;
        let plan = &plan[..];
        self.stats.preemptions = self.sched.preemptions;
        if plan.is_empty() {
            if self.sched.is_empty() {
                return Ok(Vec::new());
            }
            bail!("engine: nothing could be scheduled (cache of {} blocks all in use)", self.cache.num_blocks);
        }
        self.build_batch(plan)?;
        let m = self.st.ids.len();
        let bucket = self.graph_bucket(plan.len());
        match bucket {
            Some(bi) => self.decode_step_graph(w, v.q, bi)?,
            None => {
                self.upload_batch(plan.len(), m)?;
                self.model.forward(&self.dev, w, v.q, &mut self.bufs, &mut self.cache.layers)?;
            }
        }
        self.stats.steps += 1;
        self.stats.tokens_forwarded += m as u64;
        for p in plan {
            self.sched.running[p.index].computed = p.start + p.n;
        }
        if bucket.is_some() {
            // The graph computed every row's logits: sample them (one chunk, rows 0..m).
            let rows = std::mem::take(&mut self.st.rows);
            let r = self.sample_chunk(&rows);
            self.st.rows = rows;
            r?;
        } else {
            self.run_rows(w)?;
        }
        let done = self.collect_finished();
        if !self.has_work() {
            // The next batch's tables are uploaded whole: what a step uploads depends on its
            // own decoding phase only (a resumed run's ledger equals the uninterrupted one's).
            self.tables.forget();
        }
        Ok(done)
    }

    /// Copies the staged batch into the forward's input buffers: `seqs` sequences, `tokens` rows.
    fn upload_batch(&mut self, seqs: usize, tokens: usize) -> Result<()> {
        self.bufs.ids.write_u32(&self.st.ids)?;
        self.bufs.positions.write_u32(&self.st.positions)?;
        self.bufs.meta.slot_mapping.write_u32(&self.st.slots)?;
        self.bufs.meta.q_start.write_u32(&self.st.q_start)?;
        self.bufs.meta.ctx_len.write_u32(&self.st.ctx_len)?;
        self.tables.upload(&mut self.bufs.meta.block_tables, &self.st.tables, &self.st.table_off)?;
        self.bufs.meta.num_seqs = seqs;
        self.bufs.meta.num_tokens = tokens;
        self.bufs.meta.attended = crate::ops::attention::attended_keys(&self.st.q_start, &self.st.ctx_len);
        crate::ops::attention::plan_packed(&mut self.bufs.meta, &self.st.q_start, &self.st.ctx_len)?;
        Ok(())
    }

    /// What the decode graphs did (all zero when they are off).
    pub fn graph_stats(&self) -> graphs::GraphStats {
        self.graphs.as_ref().map(|g| g.stats()).unwrap_or_default()
    }

    /// Fills the staging vectors for `plan`.
    fn build_batch(&mut self, plan: &[Planned]) -> Result<()> {
        let st = &mut self.st;
        let bs = self.cache.block_size;
        st.ids.clear();
        st.positions.clear();
        st.slots.clear();
        st.q_start.clear();
        st.ctx_len.clear();
        st.tables.clear();
        st.table_off.clear();
        st.table_off.push(0);
        st.rows.clear();
        st.q_start.push(0);
        for p in plan {
            let s = &self.sched.running[p.index];
            let row0 = st.ids.len() as u32;
            for pos in p.start..p.start + p.n {
                st.ids.push(s.tokens[pos]);
                st.positions.push(pos as u32);
                st.slots.push(s.blocks[pos / bs] * bs as u32 + (pos % bs) as u32);
                if s.req.prompt_logprobs && pos + 1 < s.prompt_len() {
                    st.rows.push((row0 + (pos - p.start) as u32, RowUse::Score { seq: p.index, pos }));
                }
            }
            if p.start + p.n == s.tokens.len() && s.generated() < s.req.sampling.max_new_tokens {
                st.rows.push((row0 + p.n as u32 - 1, RowUse::Sample { seq: p.index }));
            }
            st.q_start.push(st.ids.len() as u32);
            st.ctx_len.push((p.start + p.n) as u32);
            st.tables.extend_from_slice(&s.blocks);
            st.table_off.push(st.tables.len() as u32);
        }
        Ok(())
    }

    /// Computes the logits of the step's scored and sampled rows, chunk by chunk: score rows
    /// first (chunks of `score_rows`), then sample rows (of `logits_rows`), so that each chunk
    /// is of one kind.
    fn run_rows(&mut self, w: &ModelWeights) -> Result<()> {
        let rows = std::mem::take(&mut self.st.rows);
        let mut chunk = std::mem::take(&mut self.st.chunk);
        for (scoring, cap) in [(true, self.chunk_rows[0]), (false, self.chunk_rows[1])] {
            let mut it = rows.iter().filter(|r| matches!(r.1, RowUse::Score { .. }) == scoring).peekable();
            while let Some(first) = it.peek() {
                // A chunk holds rows of one kind and, when scoring, of one temperature.
                let t0 = self.row_temperature(first.1);
                chunk.clear();
                while let Some(r) = it.peek() {
                    if chunk.len() == cap || self.row_temperature(r.1) != t0 {
                        break;
                    }
                    chunk.push(**r);
                    it.next();
                }
                self.st.sel.clear();
                self.st.sel.extend(chunk.iter().map(|x| x.0));
                self.bufs.sel.write_u32(&self.st.sel)?;
                self.model.logits(&self.dev, w, &mut self.bufs, chunk.len())?;
                if scoring {
                    self.score_chunk(&chunk)?;
                } else {
                    self.sample_chunk(&chunk)?;
                }
            }
        }
        self.st.rows = rows;
        self.st.chunk = chunk;
        Ok(())
    }

    /// Scoring uses the request's temperature, log_softmax(z / T) (T = 0 scores at 1).
    fn row_temperature(&self, u: RowUse) -> f32 {
        match u {
            RowUse::Score { seq, .. } => {
                let t = self.sched.running[seq].req.sampling.temperature;
                if t > 0.0 {
                    t
                } else {
                    1.0
                }
            }
            RowUse::Sample { .. } => 1.0,
        }
    }

    fn score_chunk(&mut self, chunk: &[(u32, RowUse)]) -> Result<()> {
        self.st.targets.clear();
        for (_, u) in chunk {
            if let RowUse::Score { seq, pos } = *u {
                self.st.targets.push(self.sched.running[seq].tokens[pos + 1]);
            }
        }
        self.targets.write_u32(&self.st.targets)?;
        let temp = self.row_temperature(chunk[0].1);
        logprob::log_softmax_gather(&self.dev, &self.bufs.logits, &self.targets, temp, &mut self.lp_out, chunk.len())?;
        self.st.lp_host.resize(chunk.len(), 0.0);
        self.lp_out.read_f32_into(&mut self.st.lp_host)?;
        for (i, (_, u)) in chunk.iter().enumerate() {
            if let RowUse::Score { seq, pos } = *u {
                let s = &mut self.sched.running[seq];
                debug_assert_eq!(s.prompt_logprobs.len(), pos);
                s.prompt_logprobs.push(self.st.lp_host[i]);
            }
        }
        Ok(())
    }

    fn sample_chunk(&mut self, chunk: &[(u32, RowUse)]) -> Result<()> {
        let st = &mut self.st;
        st.params.clear();
        for (_, u) in chunk {
            if let RowUse::Sample { seq } = *u {
                let s = &self.sched.running[seq];
                let c = &s.req.sampling;
                st.params.push(SampleParams {
                    temperature: c.temperature,
                    top_k: c.top_k,
                    top_p: c.top_p,
                    seed: c.seed,
                    request: s.req.id,
                    sample: s.req.sample,
                    position: s.tokens.len() as u32,
                });
            }
        }
        let r = chunk.len();
        st.tokens.resize(r, 0);
        st.lps.resize(r, 0.0);
        sample::sample(&self.dev, &self.bufs.logits, &st.params, &mut st.tokens, &mut st.lps)?;
        // Top-k log-probs for the requests that asked (k = the largest asked in this chunk).
        let k = chunk
            .iter()
            .map(|(_, u)| match *u {
                RowUse::Sample { seq } => self.sched.running[seq].req.sampling.topk_logprobs as usize,
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        if k > 0 {
            st.topk_temps.clear();
            st.topk_temps.extend(st.params.iter().map(|p| p.temperature));
            logprob::topk_logprobs(
                &self.dev,
                &self.bufs.logits,
                &st.topk_temps,
                k,
                &mut st.topk_ids,
                &mut st.topk_lps,
            )?;
        }
        for (i, (_, u)) in chunk.iter().enumerate() {
            if let RowUse::Sample { seq } = *u {
                let s = &mut self.sched.running[seq];
                s.tokens.push(st.tokens[i]);
                s.logprobs.push(st.lps[i]);
                s.versions.push(self.version);
                let kk = s.req.sampling.topk_logprobs as usize;
                if kk > 0 {
                    s.topk_ids.extend_from_slice(&st.topk_ids[i * k..i * k + kk]);
                    s.topk_lps.extend_from_slice(&st.topk_lps[i * k..i * k + kk]);
                }
            }
        }
        self.stats.tokens_generated += r as u64;
        Ok(())
    }

    /// Removes finished sequences from the running set, frees their blocks, returns them.
    fn collect_finished(&mut self) -> Vec<Completion> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.sched.running.len() {
            let s = &self.sched.running[i];
            if let Some((finish, stop_string)) = self.finished(s) {
                let mut s = self.sched.running.remove(i);
                self.cache.release(&mut s.blocks);
                let prompt_len = s.prompt_len();
                let mut tokens = s.tokens;
                let response = tokens.split_off(prompt_len);
                done.push(Completion {
                    id: s.req.id,
                    sample: s.req.sample,
                    prompt_len,
                    tokens: response,
                    logprobs: s.logprobs,
                    prompt_logprobs: s.prompt_logprobs,
                    topk_ids: s.topk_ids,
                    topk_logprobs: s.topk_lps,
                    versions: s.versions,
                    finish,
                    stop_string,
                });
            } else {
                i += 1;
            }
        }
        done
    }

    /// Whether `s` is done, and why.
    fn finished(&self, s: &scheduler::Seq) -> Option<(FinishReason, Option<usize>)> {
        let c = &s.req.sampling;
        let g = s.generated();
        if g == 0 {
            // Scoring only: done once every prompt token is computed.
            return (c.max_new_tokens == 0 && s.computed == s.tokens.len()).then_some((FinishReason::Length, None));
        }
        if s.computed + 1 != s.tokens.len() {
            // Recomputing after a preemption.
            return None;
        }
        let last = *s.tokens.last().expect("generated > 0");
        if !c.ignore_eos && self.eos_ids().contains(&last) {
            return Some((FinishReason::Stop, None));
        }
        if !c.stop.is_empty() {
            if let Some(k) = self.stop_hit(&s.tokens[s.prompt_len()..], &c.stop) {
                return Some((FinishReason::Stop, Some(k)));
            }
        }
        if g >= c.max_new_tokens || s.tokens.len() >= self.max_model_len {
            return Some((FinishReason::Length, None));
        }
        None
    }

    fn eos_ids(&self) -> &[u32] {
        match &self.text {
            Some(t) => &t.eos_ids,
            None => &self.model.cfg.eos_token_ids,
        }
    }

    /// Index of a stop string that ends the decoded tail of `response`, checking only a window
    /// of recent tokens (long enough for the longest stop string).
    fn stop_hit(&self, response: &[u32], stop: &[String]) -> Option<usize> {
        let text = self.text.as_ref()?;
        let longest = stop.iter().map(|s| s.len()).max().unwrap_or(0);
        let window = (longest + 8).min(response.len());
        let tail = text.decode(&response[response.len() - window..]).ok()?;
        stop.iter().position(|s| !s.is_empty() && tail.contains(s.as_str()))
    }

    /// Runs every queued request to completion; `on_done` sees each completion as it finishes.
    /// The loop runs inside the device's thread pool, so ops do not hop threads per call.
    pub fn run_to_completion<'a>(
        &mut self,
        w: impl Into<View<'a>>,
        mut on_done: impl FnMut(&Completion) + Send,
    ) -> Result<Vec<Completion>> {
        let w: View<'a> = w.into();
        let dev = self.dev.clone();
        let mut out = dev.install_hot(|| -> Result<Vec<Completion>> {
            let mut out = Vec::new();
            while self.has_work() {
                for c in self.step(w)? {
                    on_done(&c);
                    out.push(c);
                }
            }
            Ok(out)
        })?;
        out.sort_by_key(|c| (c.id, c.sample));
        Ok(out)
    }
}

/// Cuts `text` at the first occurrence of any stop string (the stop string is not kept).
pub fn truncate_at_stop(text: &str, stop: &[String]) -> String {
    let cut = stop.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min();
    match cut {
        Some(i) => text[..i].to_string(),
        None => text.to_string(),
    }
}
