//! CUDA graphs for decode: a step whose every row is one sequence's next token runs the
//! model's forward and LM head as one graph replay, captured per batch-size bucket (1, 2, 4, 8,
//! then multiples of 8 up to what the buffers hold). The batch is padded to its bucket with
//! rows that decode token 0 at position 0 of a reserved KV block (their keys and values go
//! there, their logits are never read), so every launch of the step has the bucket's shapes.
//! Sampling stays outside the graph (it copies to the host).
//!
//! Why a resync needs no new capture: a graph replays the addresses and scalars of its
//! capture, and nothing a decode step reads moves. The weights are updated in place (the
//! engine reads the caller's tensors, which a resync writes into), the KV cache and the
//! activation buffers are the engine's for its lifetime, and the per-step inputs (ids,
//! positions, slots, block tables) are copied into the same buffers before each replay. What
//! a capture freezes besides addresses are host scalars: the quantized engines' tensor scales
//! (the GEMMs' alpha) and the FP8 cache scales. Each bucket's graph is keyed by a fingerprint
//! of every weight address and every such scalar; a resync that changes a scale (a quantized
//! engine's requantization) is captured again, a BF16 engine's never is. The first step of a
//! bucket runs eagerly (a warm-up: the allocator's cache then holds every block size the
//! capture asks for, since a capture may not allocate fresh device memory); a capture that
//! fails leaves that bucket eager after three tries, with a warning naming why.
//!
//! Owns: [`DecodeGraphs`] (the graphs, their fingerprints, counters). May call: the engine's
//! buffers and model, `CudaDevice::capture`/`replay`. Must not: change what a step computes —
//! the padded eager step and the replay run the same launches.

use super::Engine;
use crate::device::cuda::DeviceGraph;
use crate::device::Device;
use crate::model::quant_state::QLayer;
use crate::model::ModelWeights;
use anyhow::Result;
use std::hash::{Hash, Hasher};

/// Tries at capturing one bucket before it stays eager.
const MAX_FAILURES: u32 = 3;

/// What the decode graphs did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (a bucket's first, and again after a fingerprint changed).
    pub captures: u64,
    /// Decode steps run as a replay.
    pub replays: u64,
    /// Decode steps run eagerly at a bucket's size (warm-ups, and buckets left eager).
    pub eager: u64,
    /// Captures that failed.
    pub failures: u64,
    /// Bytes the live graphs hold in their private pools.
    pub pool_bytes: usize,
}

struct Bucket {
    size: usize,
    /// The bucket ran once eagerly since its graph was last dropped.
    warm: bool,
    graph: Option<(u64, DeviceGraph)>,
    failures: u32,
}

pub(super) struct DecodeGraphs {
    buckets: Vec<Bucket>,
    /// The KV block the padding rows write.
    pad_block: u32,
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
    /// Graphs for batches of up to `max_rows` sequences, padding into `pad_block`.
    pub fn new(max_rows: usize, pad_block: u32) -> DecodeGraphs {
        let buckets = bucket_sizes(max_rows.max(1))
            .into_iter()
            .map(|size| Bucket { size, warm: false, graph: None, failures: 0 })
            .collect();
        DecodeGraphs { buckets, pad_block, stats: GraphStats::default() }
    }

    /// The index of the smallest bucket that holds `n` rows.
    fn bucket_of(&self, n: usize) -> Option<usize> {
        self.buckets.iter().position(|b| b.size >= n)
    }

    /// The counters, with the bytes the graphs' private pools hold now.
    pub fn stats(&self) -> GraphStats {
        let pool_bytes = self.buckets.iter().filter_map(|b| b.graph.as_ref()).map(|g| g.1.pool_bytes()).sum();
        GraphStats { pool_bytes, ..self.stats }
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
            (t.codes.data_ptr(), t.block_scales.data_ptr(), t.scale.to_bits()).hash(&mut h);
        }
        for a in &l.act {
            format!("{a:?}").hash(&mut h);
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

    /// Pads the staged batch of `n` decode rows to bucket `bi`'s size and runs the forward and
    /// the LM head over it: a replay, a capture and replay, or eagerly (see the module comment).
    pub(super) fn decode_step_graph(&mut self, w: &ModelWeights, q: Option<&[QLayer]>, bi: usize) -> Result<()> {
        let Device::Cuda(d) = self.dev.clone() else { anyhow::bail!("decode graphs need a CUDA device") };
        let Some(mut g) = self.graphs.take() else { anyhow::bail!("decode graphs are off") };
        let r = self.decode_step_graph_with(&d, &mut g, w, q, bi);
        self.graphs = Some(g);
        r
    }

    fn decode_step_graph_with(
        &mut self,
        d: &crate::device::cuda::CudaDevice,
        g: &mut DecodeGraphs,
        w: &ModelWeights,
        q: Option<&[QLayer]>,
        bi: usize,
    ) -> Result<()> {
        let size = g.buckets[bi].size;
        let (bs, maxb) = (self.cache.block_size, self.bufs.meta.max_blocks);
        let st = &mut self.st;
        let n = st.ids.len();
        for _ in n..size {
            st.ids.push(0);
            st.positions.push(0);
            st.slots.push(g.pad_block * bs as u32);
            st.q_start.push(st.q_start.last().copied().unwrap_or(0) + 1);
            st.ctx_len.push(1);
            st.tables.push(g.pad_block);
            st.tables.resize(st.tables.len() + maxb - 1, 0);
        }
        st.sel.clear();
        st.sel.extend(0..size as u32);
        self.upload_batch(size, size)?;
        self.bufs.sel.write_u32(&self.st.sel)?;
        let fp = fingerprint(w, q, self);
        let b = &mut g.buckets[bi];
        if b.graph.as_ref().is_some_and(|x| x.0 != fp) {
            // Its pool goes back to the cache before the new capture asks for blocks.
            b.graph = None;
            b.warm = false;
        }
        if b.graph.is_none() && b.warm && b.failures < MAX_FAILURES {
            let (model, bufs, cache) = (&self.model, &mut self.bufs, &mut self.cache.layers);
            let captured = d.capture(|| {
                model.forward(&self.dev, w, q, bufs, cache)?;
                model.logits(&self.dev, w, bufs, size)
            });
            match captured {
                Ok(graph) => {
                    g.stats.captures += 1;
                    b.graph = Some((fp, graph));
                }
                Err(e) => {
                    g.stats.failures += 1;
                    b.failures += 1;
                    b.warm = false;
                    if b.failures == MAX_FAILURES {
                        tracing::warn!("decode steps of {size} sequences stay eager: {e:#}");
                    }
                }
            }
        }
        match &b.graph {
            Some((_, graph)) => {
                d.replay(graph)?;
                g.stats.replays += 1;
            }
            None => {
                self.model.forward(&self.dev, w, q, &mut self.bufs, &mut self.cache.layers)?;
                self.model.logits(&self.dev, w, &mut self.bufs, size)?;
                b.warm = true;
                g.stats.eager += 1;
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
        let g = DecodeGraphs::new(20, 0);
        for n in 1..=20 {
            let b = g.buckets[g.bucket_of(n).unwrap()].size;
            assert!(b >= n && (n <= 8 && b < 2 * n || b - n < 8), "{n} rows in a bucket of {b}");
        }
        assert!(g.bucket_of(21).is_none());
    }
}
