//! The built-in tiny task: two-digit additions written `37+48=` and answered `\boxed{85}`.
//! Problem p ∈ [0, 8100) is a = 10 + p / 90, b = 10 + p % 90. A fixed tenth of the problems
//! (by hash) is held out and never drawn for training; draws are Philox-keyed by (seed, step,
//! index), so a run's data does not depend on anything but its seed.

use crate::rand::{fnv1a64, Stream};

pub const NUM_PROBLEMS: u64 = 8100;

#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub a: u32,
    pub b: u32,
}

impl Problem {
    pub fn from_id(p: u64) -> Problem {
        Problem { a: 10 + (p / 90) as u32, b: 10 + (p % 90) as u32 }
    }
    pub fn prompt(&self) -> String {
        format!("{}+{}=", self.a, self.b)
    }
    pub fn answer(&self) -> String {
        (self.a + self.b).to_string()
    }
    /// The reference response (without the end-of-sequence token).
    pub fn response(&self) -> String {
        format!("\\boxed{{{}}}", self.a + self.b)
    }
}

pub fn is_heldout(p: u64) -> bool {
    fnv1a64(&p.to_le_bytes()) % 10 == 0
}

/// `n` training problems for `step` (never held-out ones).
pub fn train_problems(seed: u64, step: u64, n: usize) -> Vec<Problem> {
    let mut s = Stream::new(seed, 0x4152_4954_0000_0000 ^ step);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let p = s.below(NUM_PROBLEMS);
        if !is_heldout(p) {
            out.push(Problem::from_id(p));
        }
    }
    out
}

/// The first `n` held-out problems in a fixed order (independent of the run's seed).
pub fn heldout_problems(n: usize) -> Vec<Problem> {
    let mut s = Stream::new(0x4845_4c44, 0);
    let mut seen = std::collections::HashSet::new();
    let pool = (0..NUM_PROBLEMS).filter(|&p| is_heldout(p)).count();
    // n may be usize::MAX ("all of them", a data.heldout file's rule).
    let mut out = Vec::with_capacity(n.min(pool));
    while out.len() < n.min(pool) {
        let p = s.below(NUM_PROBLEMS);
        if is_heldout(p) && seen.insert(p) {
            out.push(Problem::from_id(p));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_disjoint_and_deterministic() {
        let h = heldout_problems(100);
        assert_eq!(h.len(), 100);
        assert_eq!(h, heldout_problems(100));
        let ids: std::collections::HashSet<u64> = h.iter().map(|p| ((p.a - 10) * 90 + p.b - 10) as u64).collect();
        for step in 0..50 {
            for p in train_problems(3, step, 16) {
                assert!(!ids.contains(&(((p.a - 10) * 90 + p.b - 10) as u64)));
            }
        }
        assert_eq!(train_problems(3, 7, 8), train_problems(3, 7, 8));
        assert_ne!(train_problems(3, 7, 8), train_problems(3, 8, 8));
        let p = Problem { a: 37, b: 48 };
        assert_eq!((p.prompt().as_str(), p.response().as_str(), p.answer().as_str()), ("37+48=", "\\boxed{85}", "85"));
    }

    /// "All of them" (usize::MAX, what a data.heldout of builtin:arith asks for) is the whole
    /// held-out pool: a tenth of the 90 × 90 two-digit problems, each once.
    #[test]
    fn all_heldout_problems_is_the_pool() {
        let all = heldout_problems(usize::MAX);
        let pool = (0..NUM_PROBLEMS).filter(|&p| is_heldout(p)).count();
        assert_eq!(all.len(), pool);
        assert!(pool > 600 && pool < 1000, "{pool}");
        assert_eq!(all[..100], heldout_problems(100)[..]);
    }
}
