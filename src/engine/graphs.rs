//! CUDA graphs for decode: a step whose every row is one sequence's next token runs the
//! model's forward and LM head as one graph replay, captured per batch-size bucket (1, 2, 4, 8,
//! then multiples of 8 up to min(max_seqs, max_tokens_per_step, logits_rows)). The batch is
//! padded to its bucket with rows that decode token 0 at position 0 of a reserved KV block
//! (their keys and values go there, their logits are never read), so every launch of the step
//! has the bucket's shapes. Sampling stays outside the graph (it copies to the host).
//!
//! Why an in-place resync needs no new capture: a graph replays the addresses and scalars of
//! its capture, and nothing a decode step reads moves. The weights are updated in place (the
//! engine reads the caller's tensors, which a resync writes into), the activation buffers are
//! the engine's for its lifetime, the KV cache too, also when the memory plan frees it for the
//! train phase (`Engine::release_cache`: on CUDA its memory is unmapped and mapped again at the
//! same addresses, `device::cuda::vmm`; a cache committed elsewhere, as on the CPU, would drop
//! the graphs, and each bucket would capture again), and the per-step inputs (ids,
//! positions, slots; of the block tables, the entries that changed) are copied into the same
//! buffers before each replay. What
//! a capture freezes besides addresses are host scalars: the quantized engines' tensor scales
//! (the GEMMs' alpha), their activation formats and the FP8 cache scales. Each graph is keyed
//! by a fingerprint of every weight address and every such scalar; a step whose fingerprint
//! has no graph runs eagerly and is captured right after (the eager run leaves every block
//! size the capture asks for in the allocator's cache: a capture may not allocate device
//! memory). So a BF16 engine's resync replays its graphs, a quantized engine's new scales are
//! captured again, and a stale engine (its view rotates over `staleness + 1` weight copies)
//! keeps one graph per copy: a bucket keeps its `graph_versions` most recent graphs (4, or
//! staleness + 1 for a stale rollout engine). A bucket whose
//! capture fails [`MAX_FAILURES`] times in a row stays eager, with a warning naming why. All
//! of an engine's graphs share one pool of device blocks (they replay one at a time).
//!
//! Owns: [`DecodeGraphs`] (the graphs, their fingerprints, counters). May call: the engine's
//! buffers and model, `CudaDevice::capture`/`replay`. Must not: change what a step computes —
//! the padded eager step and the replay run the same launches.

use super::Engine;
use crate::device::cuda::{CudaDevice, DeviceGraph, GraphPool};
use crate::device::Device;
use crate::model::quant_state::QLayer;
use crate::model::ModelWeights;
use crate::ops::quantize::ActQuant;
use anyhow::Result;
use std::hash::{Hash, Hasher};

/// Captures of one bucket that fail in a row before it stays eager.
const MAX_FAILURES: u32 = 3;

/// What the decode graphs did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (a bucket's first, and again for each new fingerprint).
    pub captures: u64,
    /// Decode steps run as a replay.
    pub replays: u64,
    /// Decode steps run eagerly at a bucket's size (before each capture, and buckets left eager).
    pub eager: u64,
    /// Captures that failed.
    pub failures: u64,
    /// Bytes of the graphs' shared pool.
    pub pool_bytes: usize,
}

struct Bucket {
    size: usize,
    /// (fingerprint, graph), the most recently used last.
    graphs: Vec<(u64, DeviceGraph)>,
    /// Failed captures in a row.
    failures: u32,
}

pub(super) struct DecodeGraphs {
    buckets: Vec<Bucket>,
    /// The KV block the padding rows write.
    pad_block: u32,
    /// The blocks every graph's temporaries use (made at the first capture).
    pool: Option<GraphPool>,
    /// Graphs a bucket keeps (one per fingerprint, the most recently used).
    keep: usize,
    /// False: pad and run eagerly, never capture (`EngineConfig::graph_capture`).
    capture: bool,
    pub stats: GraphStats,
}

/// 1, 2, 4, 8, 16, 24, … up to `max` (and `max` itself).
fn bucket_sizes(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [1, 2, 4].into_iter().filter(|&b| b < max).collect();
    v.extend((1..).map(|i| 8 * i).take_while(|&b| b < max));
    v.push(max);
    v
}

impl DecodeGraphs {
    /// Graphs for batches of up to `max_rows` sequences, padding into `pad_block`, `keep` per
    /// bucket; `capture` false: padded eager steps only.
    pub fn new(max_rows: usize, pad_block: u32, keep: usize, capture: bool) -> DecodeGraphs {
        let buckets = bucket_sizes(max_rows.max(1))
            .into_iter()
            .map(|size| Bucket { size, graphs: Vec::new(), failures: 0 })
            .collect();
        DecodeGraphs { buckets, pad_block, pool: None, keep, capture, stats: GraphStats::default() }
    }

    /// The index of the smallest bucket that holds `n` rows.
    fn bucket_of(&self, n: usize) -> Option<usize> {
        self.buckets.iter().position(|b| b.size >= n)
    }

    /// Drops every graph (the buffers they read moved); the pool and the counters stay.
    pub fn forget(&mut self) {
        for b in &mut self.buckets {
            b.graphs.clear();
        }
    }

    /// The counters, with the bytes the shared pool holds now.
    pub fn stats(&self) -> GraphStats {
        GraphStats { pool_bytes: self.pool.as_ref().map(|p| p.bytes()).unwrap_or(0), ..self.stats }
    }
}

fn hash_act(a: &ActQuant, h: &mut impl Hasher) {
    match *a {
        ActQuant::None => 0u8.hash(h),
        ActQuant::Fp8 { scale } => (1u8, scale.to_bits()).hash(h),
        ActQuant::Nvfp4 { global, opts } => (2u8, global.to_bits(), opts.rht, opts.stochastic).hash(h),
    }
}

/// Every address and host scalar a captured decode step depends on, hashed.
fn fingerprint(w: &ModelWeights, q: Option<&[QLayer]>, e: &Engine) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let _ = w.for_each(|_, t| {
        (t.data_ptr(), t.numel(), t.dtype().name()).hash(&mut h);
        Ok(())
    });
    for l in q.unwrap_or(&[]) {
        for t in l.w.iter().flatten() {
            (t.codes.data_ptr(), t.block_scales.data_ptr(), t.scale.to_bits(), t.opts.rht, t.opts.stochastic)
                .hash(&mut h);
            // What the GEMM reads in the codes' place where it keeps it (`QTensor::decoded`,
            // `swizzled`).
            for kept in [&t.decoded, &t.swizzled] {
                kept.as_ref().map(|k| k.data_ptr()).hash(&mut h);
            }
        }
        for a in &l.act {
            hash_act(a, &mut h);
        }
    }
    for c in &e.cache.layers {
        (c.k.data_ptr(), c.v.data_ptr(), c.k_scale.to_bits(), c.v_scale.to_bits()).hash(&mut h);
    }
    h.finish()
}

impl Engine {
    /// The bucket a planned step replays in, when it is a pure decode step on a CUDA device
    /// with graphs on: every row samples one sequence's next token, in plan order.
    pub(super) fn graph_bucket(&self, planned: usize) -> Option<usize> {
        let g = self.graphs.as_ref()?;
        if !matches!(self.dev, Device::Cuda(_)) || self.bufs.observe.is_some() {
            return None;
        }
        let rows = &self.st.rows;
        let decode = rows.len() == planned
            && rows.iter().enumerate().all(|(i, r)| r.0 as usize == i && matches!(r.1, super::RowUse::Sample { .. }))
            && self.st.ids.len() == planned;
        if !decode {
            return None;
        }
        g.bucket_of(planned)
    }

    /// Pads the staged batch of decode rows to bucket `bi`'s size and runs the forward and the
    /// LM head over it: a replay, or eagerly and then captured (see the module comment).
    pub(super) fn decode_step_graph(&mut self, w: &ModelWeights, q: Option<&[QLayer]>, bi: usize) -> Result<()> {
        let Device::Cuda(d) = self.dev.clone() else { anyhow::bail!("decode graphs need a CUDA device") };
        let Some(mut g) = self.graphs.take() else { anyhow::bail!("decode graphs are off") };
        let r = self.decode_step_graph_with(&d, &mut g, w, q, bi);
        self.graphs = Some(g);
        r
    }

    fn decode_step_graph_with(
        &mut self,
        d: &CudaDevice,
        g: &mut DecodeGraphs,
        w: &ModelWeights,
        q: Option<&[QLayer]>,
        bi: usize,
    ) -> Result<()> {
        let size = g.buckets[bi].size;
        let bs = self.cache.block_size;
        let st = &mut self.st;
        let n = st.ids.len();
        for _ in n..size {
            st.ids.push(0);
            st.positions.push(0);
            st.slots.push(g.pad_block * bs as u32);
            st.q_start.push(st.q_start.last().copied().unwrap_or(0) + 1);
            st.ctx_len.push(1);
            st.tables.push(g.pad_block);
            st.table_off.push(st.tables.len() as u32);
        }
        st.sel.clear();
        st.sel.extend(0..size as u32);
        self.upload_batch(size, size)?;
        self.bufs.sel.write_u32(&self.st.sel)?;
        let fp = fingerprint(w, q, self);
        let b = &mut g.buckets[bi];
        if let Some(i) = b.graphs.iter().position(|x| x.0 == fp) {
            let hit = b.graphs.remove(i);
            d.replay(&hit.1, self.bufs.meta.attended)?;
            b.graphs.push(hit);
            g.stats.replays += 1;
            return Ok(());
        }
        self.model.forward(&self.dev, w, q, &mut self.bufs, &mut self.cache.layers)?;
        self.model.logits(&self.dev, w, &mut self.bufs, size)?;
        g.stats.eager += 1;
        if !g.capture || b.failures >= MAX_FAILURES {
            return Ok(());
        }
        let pool = g.pool.get_or_insert_with(|| d.graph_pool()).clone();
        let (model, bufs, cache) = (&self.model, &mut self.bufs, &mut self.cache.layers);
        let captured = d.capture(&pool, || {
            model.forward(&self.dev, w, q, bufs, cache)?;
            model.logits(&self.dev, w, bufs, size)
        });
        match captured {
            Ok(graph) => {
                g.stats.captures += 1;
                b.failures = 0;
                if b.graphs.len() >= g.keep {
                    b.graphs.remove(0);
                }
                b.graphs.push((fp, graph));
            }
            Err(e) => {
                g.stats.failures += 1;
                b.failures += 1;
                if b.failures == MAX_FAILURES {
                    tracing::warn!("decode steps of {size} sequences stay eager: {e:#}");
                }
                if pool.poisoned() {
                    // A block of the shared pool escaped the failed capture: the other graphs
                    // would write it under its new holder. They and the pool go; the next
                    // steps capture afresh.
                    tracing::warn!("decode graphs dropped: {e:#}");
                    g.buckets.iter_mut().for_each(|b| b.graphs.clear());
                    g.pool = None;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_batch_with_the_smallest_fitting_size() {
        assert_eq!(bucket_sizes(1), vec![1]);
        assert_eq!(bucket_sizes(6), vec![1, 2, 4, 6]);
        assert_eq!(bucket_sizes(20), vec![1, 2, 4, 8, 16, 20]);
        assert_eq!(bucket_sizes(32), vec![1, 2, 4, 8, 16, 24, 32]);
        let g = DecodeGraphs::new(20, 0, 4, true);
        for n in 1..=20 {
            let b = g.buckets[g.bucket_of(n).unwrap()].size;
            assert!(b >= n && (n <= 8 && b < 2 * n || b - n < 8), "{n} rows in a bucket of {b}");
        }
        assert!(g.bucket_of(21).is_none());
    }
}
