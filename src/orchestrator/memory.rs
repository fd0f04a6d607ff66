//! The KV part of a device's memory plan: how many blocks its engines' caches get, and whether
//! they are released for the train phase (`rollout.kv_release`). Colocated, a device decodes
//! and trains in turn: while it decodes, the trainer's activation arenas are empty; while it
//! trains, the KV caches are. Holding both at once moves no memory at a switch, so that is
//! the default; where the budget cannot hold both, the caches are freed before the train phase
//! and allocated again after it (`Replica::train`), and the plan's peak is the larger phase.
//! (Caches sized from what is left count as not held when they cannot hold one response.)
//!
//!   decode phase = resident + KV caches,   train phase = resident + activations,
//!   resident     = weights + trainer state + teacher + engine buffers + snapshot.
//!
//! Only the synchronous colocated schedule can release: the asynchronous one keeps sequences
//! in flight across updates, and a split placement's devices never switch.
//!
//! In that schedule, where the rollout engine is another than the standard one (a quantized,
//! noisy or stale recipe), the two engines' caches also take turns (`Need::turns`): the
//! standard engine decodes only to calibrate and to evaluate, between steps, while the rollout
//! engine's cache is released; so the larger of the two counts. Every engine keeps the same
//! capacity in tokens: where their blocks are the same size (BF16 KV, as the shipped NVFP4
//! recipe keeps it) the rollout engine gets the room both had shared; an FP8 KV cache holds
//! those tokens in part of it.
//!
//! Owns: the arithmetic, and the plan's refusals. May call: the config. Must not: allocate.

use crate::config::KvRelease;
use anyhow::{bail, Result};

/// What a device holds besides its KV caches, and what its caches may take.
#[derive(Clone)]
pub struct Need {
    /// Bytes before the KV caches: weights, the trainer's state and activations where it
    /// trains here, the teacher's weights, the engine buffers, the published snapshot.
    pub used: usize,
    /// The part of `used` only the train phase touches: the trainer's activation arenas.
    pub activations: usize,
    /// The device's budget (None: a CPU device without `run.memory_budget_mb`), and where it
    /// comes from ("run.memory_budget_mb" or "the device's memory").
    pub budget: Option<usize>,
    pub budget_source: &'static str,
    /// Per engine on the device: (bytes of one KV block, blocks its sequences can use); the
    /// standard engine first, then the rollout engine where it is another, then the teacher's.
    pub engines: Vec<(usize, usize)>,
    /// The first two engines' caches take turns (one resident at a time): the larger counts.
    pub turns: bool,
    /// `rollout.kv_cache_mb` in bytes (each engine's cache); 0: from what is left.
    pub kv_cache_bytes: usize,
    /// Blocks each engine adds for the decode graphs' padding rows (0 or 1).
    pub graph_pad: usize,
    /// Blocks one response of `rollout.max_new_tokens` takes: caches sized from what is left
    /// that hold fewer are freed for training under `auto` (so they take the activations' room).
    pub min_blocks: usize,
    pub policy: KvRelease,
    /// Why the caches cannot be released on this device (None: they can).
    pub no_release: Option<&'static str>,
}

/// The plan's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSizing {
    /// Blocks of every engine's cache when sized from what is left (None: `kv_cache_bytes`).
    pub blocks: Option<usize>,
    /// The caches are freed for each train phase.
    pub release: bool,
}

/// Bytes of every engine's KV cache: `blocks` each (sized from what is left), or with None
/// `kv_cache_bytes` each, capped at what its sequences can use as `Engine::new` caps it; the
/// graphs' padding block included.
pub fn kv_bytes(n: &Need, blocks: Option<usize>) -> usize {
    let each = |b: usize, useful: usize| blocks.unwrap_or((n.kv_cache_bytes / b.max(1)).clamp(1, useful.max(1)));
    resident(n, |&(b, useful)| (each(b, useful) + n.graph_pad) * b)
}

/// The sum of `f` over the engines whose caches are resident at once: with `turns`, the larger
/// of the first two and the rest.
fn resident(n: &Need, f: impl Fn(&(usize, usize)) -> usize) -> usize {
    let v: Vec<usize> = n.engines.iter().map(f).collect();
    match (n.turns, v.as_slice()) {
        (true, [a, b, rest @ ..]) => *a.max(b) + rest.iter().sum::<usize>(),
        _ => v.iter().sum(),
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Sizes the caches of `n`; `who` names the device ("device 0 (cuda:0)"), `parts` the bytes
/// of `used` in words. Refuses a plan that fits in neither way, naming what to change.
pub fn size(n: &Need, who: &str, parts: &str) -> Result<KvSizing> {
    let allowed = n.no_release.is_none();
    if n.policy == KvRelease::Always {
        if let Some(why) = n.no_release {
            bail!("{who}: rollout.kv_release = \"always\" needs the synchronous colocated schedule: {why}");
        }
    }
    let act = n.activations.min(n.used);
    let Some(budget) = n.budget else {
        return Ok(KvSizing { blocks: None, release: n.policy == KvRelease::Always });
    };
    let hint = |fits_released: bool| -> String {
        if !fits_released || act == 0 {
            return String::new();
        }
        match (n.policy, n.no_release) {
            (_, Some(why)) => format!(" (freeing the caches for the train phase would fit, but {why})"),
            (KvRelease::Never, None) => {
                "; or let the caches be freed for the train phase (rollout.kv_release = \"auto\")".into()
            }
            _ => String::new(),
        }
    };
    if n.kv_cache_bytes == 0 {
        // A tenth of the budget stays free for what the plan does not itemize: the activation
        // arenas' growth, the allocator's size classes, the step's metadata. Every engine gets
        // the same capacity in tokens, and one block more each for the graphs.
        let reserve = budget / 10;
        let per_block = resident(n, |e| e.0).max(1);
        let blocks_over =
            |base: usize| budget.saturating_sub(base + reserve).saturating_sub(n.graph_pad * per_block) / per_block;
        let release = match n.policy {
            KvRelease::Always => true,
            KvRelease::Never => false,
            KvRelease::Auto => allowed && act > 0 && blocks_over(n.used) < n.min_blocks.max(1),
        };
        if release && n.used + reserve > budget {
            bail!(
                "the plan does not fit {who}: its train phase alone needs {parts} + a tenth kept free = {:.0} MiB of a {:.0} MiB budget, even with the KV caches freed; lower objective.micro_batch_tokens, use a smaller teacher, or add devices",
                mib(n.used + reserve),
                mib(budget)
            );
        }
        let base = if release { n.used - act } else { n.used };
        let blocks = blocks_over(base);
        if blocks == 0 {
            let freed = if release { " - activations (the caches are freed for training)" } else { "" };
            bail!(
                "the plan does not fit {who}: {parts}{freed} + a tenth kept free = {:.0} MiB of a {:.0} MiB budget leave no room for one KV block ({:.2} MiB); raise run.memory_budget_mb, use a smaller teacher or fewer engine copies (staleness, noise), or add devices{}",
                mib(base + reserve),
                mib(budget),
                mib(per_block),
                hint(!release && blocks_over(n.used - act) > 0)
            );
        }
        return Ok(KvSizing { blocks: Some(blocks), release });
    }
    // Fixed caches: each engine takes kv_cache_bytes (capped at what its sequences can use, as
    // `Engine::new` caps it), checked before anything is allocated.
    let kv = kv_bytes(n, None);
    let release = match n.policy {
        KvRelease::Always => true,
        KvRelease::Never => false,
        KvRelease::Auto => allowed && act > 0 && n.used + kv > budget,
    };
    if release && n.used > budget {
        bail!(
            "the plan does not fit {who}: its train phase alone needs {parts} = {:.0} MiB of a {:.0} MiB budget ({}), even with the KV caches freed; lower objective.micro_batch_tokens, use a smaller teacher, or add devices",
            mib(n.used),
            mib(budget),
            n.budget_source
        );
    }
    let peak = if release { n.used.max(n.used - act + kv) } else { n.used + kv };
    if peak > budget {
        bail!(
            "the plan does not fit {who}: {parts} + KV caches {:.0} MiB ({} engine(s), rollout.kv_cache_mb = {} each) = {:.0} MiB{}, over its {:.0} MiB budget ({}); lower rollout.kv_cache_mb, or set it to 0 to size the caches from what is left{}",
            mib(kv),
            n.engines.len(),
            n.kv_cache_bytes >> 20,
            mib(n.used + kv),
            if release { format!(" (a peak of {:.0} MiB with the caches freed for training)", mib(peak)) } else { String::new() },
            mib(budget),
            n.budget_source,
            hint(!release && n.used.max(n.used - act + kv) <= budget)
        );
    }
    Ok(KvSizing { blocks: None, release })
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: usize = 1 << 20;

    /// 100 MiB before the caches, 30 of them activations, one engine of 1 MiB blocks.
    fn need(budget: usize, kv_mb: usize, policy: KvRelease) -> Need {
        Need {
            used: 100 * M,
            activations: 30 * M,
            budget: Some(budget),
            budget_source: "run.memory_budget_mb",
            engines: vec![(M, 1000)],
            turns: false,
            kv_cache_bytes: kv_mb * M,
            graph_pad: 0,
            min_blocks: 1,
            policy,
            no_release: None,
        }
    }

    fn err(n: &Need) -> String {
        format!("{:#}", size(n, "device 0 (test)", "parts").unwrap_err())
    }

    #[test]
    fn fixed_caches_are_freed_for_training_only_when_both_do_not_fit() {
        // 100 + 40 > 120, but decoding needs 110 and training 100.
        let got = size(&need(120 * M, 40, KvRelease::Auto), "d", "p").unwrap();
        assert_eq!(got, KvSizing { blocks: None, release: true });
        // Both fit: nothing moves at a switch.
        assert!(!size(&need(140 * M, 40, KvRelease::Auto), "d", "p").unwrap().release);
        assert!(size(&need(140 * M, 40, KvRelease::Always), "d", "p").unwrap().release);
        // Never: refused, naming the knob that would let it run.
        let e = err(&need(120 * M, 40, KvRelease::Never));
        assert!(
            e.contains("the plan does not fit device 0 (test)") && e.contains("rollout.kv_release = \"auto\""),
            "{e}"
        );
        // Decoding alone (110 MiB) over the budget: refused with the peak.
        let e = err(&need(105 * M, 40, KvRelease::Auto));
        assert!(e.contains("a peak of 110 MiB with the caches freed"), "{e}");
        // Training alone (100 MiB) over it: refused, pointing at the activations.
        let e = err(&need(95 * M, 40, KvRelease::Always));
        assert!(e.contains("its train phase alone needs parts = 100 MiB") && e.contains("micro_batch_tokens"), "{e}");
        // The asynchronous schedule cannot free them: refused, saying why.
        let mut n = need(120 * M, 40, KvRelease::Auto);
        n.no_release = Some("the asynchronous schedule keeps sequences in flight across updates");
        let e = err(&n);
        assert!(e.contains("would fit, but the asynchronous schedule keeps sequences in flight"), "{e}");
        n.policy = KvRelease::Always;
        assert!(err(&n).contains("needs the synchronous colocated schedule"), "{}", err(&n));
        // Without activations (a trainer on the host) freeing gains nothing: refused.
        let mut n = need(120 * M, 40, KvRelease::Auto);
        n.activations = 0;
        assert!(err(&n).contains("KV caches 40 MiB"), "{}", err(&n));
        // The graphs' padding block counts: 41 blocks of 1 MiB.
        let mut n = need(140 * M, 40, KvRelease::Auto);
        n.graph_pad = 1;
        assert!(size(&n, "d", "p").unwrap().release, "100 + 41 > 140");
    }

    #[test]
    fn caches_sized_from_what_is_left_take_the_activations_room_only_when_none_is_left() {
        // 120 MiB: 100 + a tenth (12) leave 8 blocks, so nothing is freed.
        assert_eq!(
            size(&need(120 * M, 0, KvRelease::Auto), "d", "p").unwrap(),
            KvSizing { blocks: Some(8), release: false }
        );
        // 112 MiB: 100 + 11.2 leave no block; freeing the 30 MiB of activations leaves 30.
        assert_eq!(
            size(&need(112 * M, 0, KvRelease::Auto), "d", "p").unwrap(),
            KvSizing { blocks: Some(30), release: true }
        );
        // Room for 8 blocks, but one response needs 10: freed, as if none were left.
        let mut n = need(120 * M, 0, KvRelease::Auto);
        n.min_blocks = 10;
        assert_eq!(size(&n, "d", "p").unwrap(), KvSizing { blocks: Some(38), release: true });
        // Always: the caches take the activations' room even where a block was left.
        assert_eq!(
            size(&need(120 * M, 0, KvRelease::Always), "d", "p").unwrap(),
            KvSizing { blocks: Some(38), release: true }
        );
        // Half a MiB of activations, 111.5 MiB: training fits (100 + 11.15), and freeing the
        // activations leaves 0.85 MiB, no block.
        let mut n = need(111 * M + M / 2, 0, KvRelease::Always);
        n.activations = M / 2;
        let e = err(&n);
        assert!(
            e.contains("parts - activations (the caches are freed for training) + a tenth kept free = 111 MiB"),
            "{e}"
        );
        let e = err(&need(112 * M, 0, KvRelease::Never));
        assert!(e.contains("leave no room for one KV block") && e.contains("rollout.kv_release = \"auto\""), "{e}");
        // 110 MiB: training alone (100 + 11) does not fit.
        let e = err(&need(110 * M, 0, KvRelease::Auto));
        assert!(e.contains("its train phase alone needs parts + a tenth kept free = 111 MiB"), "{e}");
    }

    #[test]
    fn engines_taking_turns_count_the_larger_cache_once() {
        // Standard engine 2 MiB blocks, rollout engine (FP8 KV) 1 MiB, teacher 1 MiB; 160 MiB:
        // 100 + 16 kept free leave 44 MiB.
        let mut n = need(160 * M, 0, KvRelease::Never);
        n.engines = vec![(2 * M, 1000), (M, 1000), (M, 1000)];
        // Side by side: 4 MiB a block of capacity, 11 blocks each.
        assert_eq!(size(&n, "d", "p").unwrap().blocks, Some(11));
        assert_eq!(kv_bytes(&n, Some(11)), 44 * M);
        // Taking turns: 2 + 1 MiB a block, 14 blocks each; the rollout engine's 14 MiB lie in
        // the standard engine's 28 when it is released.
        n.turns = true;
        assert_eq!(size(&n, "d", "p").unwrap().blocks, Some(14));
        assert_eq!(kv_bytes(&n, Some(14)), (28 + 14) * M);
        // With the graphs' padding block: (2 + 1) MiB of it per block of capacity.
        n.graph_pad = 1;
        assert_eq!(size(&n, "d", "p").unwrap().blocks, Some(13));
        assert_eq!(kv_bytes(&n, Some(13)), (28 + 14) * M);
        // Fixed caches of 10 MiB each: 5 blocks of the standard engine's, 10 of the others'.
        let mut n = need(200 * M, 10, KvRelease::Never);
        n.engines = vec![(2 * M, 1000), (M, 1000), (M, 1000)];
        assert_eq!(kv_bytes(&n, None), 30 * M);
        n.turns = true;
        assert_eq!(kv_bytes(&n, None), 20 * M);
        // One engine alone: nothing to take turns with.
        n.engines.truncate(1);
        assert_eq!(kv_bytes(&n, None), 10 * M);
    }
}
