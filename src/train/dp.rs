//! Data parallelism for the trainer (SPMD): every device runs the same step on the same
//! rollouts, computes the forward/backward of its contiguous, token-balanced share of each
//! minibatch, and meets the others in collectives: log-probs are gathered (every device then
//! evaluates the objective on the whole minibatch — a cheap pass — and takes its slice of the
//! coefficients), gradients are reduce-scattered, each device updates its ZeRO-1 shard of the
//! FP32 master weights and Adam moments, and the updated weights are all-gathered.
//!
//! Owns: [`Dp`] (rank, world, the collective). May call: `crate::parallel`. Must not: run models.

use super::device_coll::DeviceCollective;
use crate::engine::rollout::Rollout;
use crate::objective::triage::TriageStats;
use crate::parallel::{shard_range, Collective, InProcess};
use anyhow::Result;
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone)]
pub struct Dp {
    pub rank: usize,
    pub world: usize,
    /// Host vectors: log-probs, norms, checkpoints, and the host training path.
    pub coll: Arc<dyn Collective>,
    /// Device buffers: the gradient and the weights of trainers on GPUs (None: they stage
    /// through the host collective and train on the host).
    pub dcoll: Option<Arc<dyn DeviceCollective>>,
}

impl Dp {
    /// One device: every collective is a copy.
    pub fn single() -> Result<Dp> {
        Ok(Dp { rank: 0, world: 1, coll: Arc::new(InProcess::new(1)?), dcoll: None })
    }

    /// This device's ZeRO-1 shard of `n` parameters.
    pub fn shard(&self, n: usize) -> Range<usize> {
        shard_range(n, self.world, self.rank)
    }

    /// This device's responses of `r`: contiguous, boundaries where the cumulative token count
    /// (prompt + response) crosses k/world of the total — the same on every device.
    pub fn split(&self, rollouts: &[Rollout], r: Range<usize>) -> Range<usize> {
        split_tokens(rollouts, r, self.world, self.rank)
    }

    /// The concatenation over devices of `local` (this device's values, at `at` of `total`).
    /// Exact: the other devices contribute zeros to each position.
    pub fn allgather_v(&self, local: &[f32], at: usize, total: usize) -> Result<Vec<f32>> {
        let mut full = vec![0.0f32; total];
        full[at..at + local.len()].copy_from_slice(local);
        if self.world == 1 {
            return Ok(full);
        }
        let mut shard = vec![0.0f32; shard_range(total, self.world, self.rank).len()];
        self.coll.reduce_scatter_sum(self.rank, &full, &mut shard)?;
        self.coll.all_gather(self.rank, &shard, &mut full)?;
        Ok(full)
    }

    pub fn sum_f64(&self, x: f64) -> Result<f64> {
        if self.world == 1 {
            return Ok(x);
        }
        self.coll.all_reduce_sum_f64(self.rank, x)
    }
}

/// Device `rank`'s token-balanced contiguous share of responses `r`.
pub fn split_tokens(rollouts: &[Rollout], r: Range<usize>, world: usize, rank: usize) -> Range<usize> {
    let w = |i: usize| rollouts[i].prompt.len() + rollouts[i].response.len();
    let total: usize = r.clone().map(w).sum();
    // Device k starts at the first response whose preceding tokens reach total·k/world.
    let start_of = |k: usize| -> usize {
        if k == 0 {
            return r.start;
        }
        if k >= world {
            return r.end;
        }
        let goal = total * k / world;
        let mut acc = 0;
        for i in r.clone() {
            if acc >= goal {
                return i;
            }
            acc += w(i);
        }
        r.end
    };
    start_of(rank)..start_of(rank + 1)
}

/// Adds two minibatches' TRIAGE statistics (everything summed; the step divides the shares by
/// the number of minibatches).
pub fn sum_triage(a: TriageStats, b: &TriageStats) -> TriageStats {
    TriageStats {
        eligible_segments: a.eligible_segments + b.eligible_segments,
        gated_segments: a.gated_segments + b.gated_segments,
        gated_tokens: a.gated_tokens + b.gated_tokens,
        gated_responses: a.gated_responses + b.gated_responses,
        repair_segments: a.repair_segments + b.repair_segments,
        repair_active: a.repair_active + b.repair_active,
        lambda: a.lambda,
        mass_moved: a.mass_moved + b.mass_moved,
        repair_mass: a.repair_mass + b.repair_mass,
        b_amp: a.b_amp + b.b_amp,
        b_con: a.b_con + b.b_con,
        b_amp_base: a.b_amp_base + b.b_amp_base,
        b_con_base: a.b_con_base + b.b_con_base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_balanced_split_covers_every_response_once() {
        let rs: Vec<Rollout> = [(3, 10), (3, 1), (3, 1), (3, 20), (3, 2), (3, 2)]
            .iter()
            .map(|&(p, r)| Rollout { prompt: vec![1; p], response: vec![2; r], ..Default::default() })
            .collect();
        for world in 1..=5 {
            let parts: Vec<Range<usize>> = (0..world).map(|k| split_tokens(&rs, 1..6, world, k)).collect();
            assert_eq!(parts[0].start, 1);
            assert_eq!(parts[world - 1].end, 6);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start, "world {world}: {parts:?}");
            }
        }
        // Two devices: tokens 4 + 4 + 23 + 5 + 5 = 41; device 1 starts where 20 is reached.
        assert_eq!(split_tokens(&rs, 1..6, 2, 0), 1..4);
        assert_eq!(split_tokens(&rs, 1..6, 2, 1), 4..6);
    }
}
