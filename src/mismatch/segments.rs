//! Direction-aware mismatch statistics of seed 004 §3 (Eqs. 9–11) and App. B.4 (Eqs. 44–51):
//! the amplifying regions A⁻ = {A_i < 0, δ < 0} and A⁺ = {A_i > 0, δ > 0}, ρ_asym with raw |A|
//! or |A|/n weights (App. B.6), and segment tail statistics over diagnostic segments of W valid
//! tokens (segment k of a response holds its valid positions with ⌊t/W⌋ = k; empty segments
//! omitted; the last shorter one kept; never across responses).
//!
//! Inputs: one [`Response`] per sampled response: its advantage A_i and the per-token gap
//! δ_t = log π_learner − log π_sampler with a validity mask.

/// One response's tokens (valid positions only carry meaning).
#[derive(Clone, Debug)]
pub struct Response<'a> {
    pub advantage: f64,
    pub delta: &'a [f64],
    pub valid: &'a [bool],
}

impl Response<'_> {
    fn n_valid(&self) -> usize {
        self.valid.iter().filter(|v| **v).count()
    }
}

/// Numerator and denominator weights of ρ (sums over A⁻ and A⁺), so windows can pool them
/// before dividing (the paper pools, it does not average ratios).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RhoParts {
    pub minus: f64,
    pub plus: f64,
}

impl RhoParts {
    pub fn add(&mut self, o: RhoParts) {
        self.minus += o.minus;
        self.plus += o.plus;
    }
    /// ρ = w(A⁻)/w(A⁺) (the common total cancels); None when A⁺ carries no weight.
    pub fn ratio(&self) -> Option<f64> {
        (self.plus > 0.0).then(|| self.minus / self.plus)
    }
}

/// Eq. 10 with q = |A_i| (`length_normalized = false`) or q = |A_i|/n_i (App. B.6).
pub fn rho_parts(responses: &[Response], length_normalized: bool) -> RhoParts {
    let mut p = RhoParts::default();
    for r in responses {
        let n = r.n_valid();
        if n == 0 || r.advantage == 0.0 {
            continue;
        }
        let q = if length_normalized { r.advantage.abs() / n as f64 } else { r.advantage.abs() };
        for (d, v) in r.delta.iter().zip(r.valid) {
            if !v {
                continue;
            }
            if r.advantage < 0.0 && *d < 0.0 {
                p.minus += q;
            } else if r.advantage > 0.0 && *d > 0.0 {
                p.plus += q;
            }
        }
    }
    p
}

/// The diagnostic segments of a response: (segment index k, valid positions).
pub fn segments(valid: &[bool], w: usize) -> Vec<(usize, Vec<usize>)> {
    assert!(w > 0, "segment length W must be positive");
    let mut out = Vec::new();
    for k in 0..valid.len().div_ceil(w) {
        let pos: Vec<usize> = (k * w..((k + 1) * w).min(valid.len())).filter(|&t| valid[t]).collect();
        if !pos.is_empty() {
            out.push((k, pos));
        }
    }
    out
}

/// Segment tail statistics (Eqs. 48–51) over the segments of A_i < 0 responses, pooled.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TailStats {
    /// Eq. 48: share of eligible tokens with δ < τ.
    pub r_amp: f64,
    /// Eq. 49: share of tail tokens in the top 5% of segments by tail fraction.
    pub c_tok: Option<f64>,
    /// Eq. 50: share of tail-heavy segments (tail fraction > 0.1).
    pub h_seg: f64,
    /// Eq. 51: P(next segment heavy | this heavy) / P(next segment heavy) over adjacent pairs.
    pub p_adj: Option<f64>,
    pub segments: usize,
    pub tokens: usize,
}

pub fn tail_stats(responses: &[Response], w: usize, tau: f64) -> TailStats {
    // (response, k, tail count, size)
    let mut segs: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (i, r) in responses.iter().enumerate() {
        if !(r.advantage < 0.0) {
            continue;
        }
        for (k, pos) in segments(r.valid, w) {
            let tail = pos.iter().filter(|&&t| r.delta[t] < tau).count();
            segs.push((i, k, tail, pos.len()));
        }
    }
    let mut s = TailStats { segments: segs.len(), ..Default::default() };
    if segs.is_empty() {
        return s;
    }
    let tokens: usize = segs.iter().map(|x| x.3).sum();
    let tails: usize = segs.iter().map(|x| x.2).sum();
    s.tokens = tokens;
    s.r_amp = tails as f64 / tokens as f64;
    let heavy = |x: &(usize, usize, usize, usize)| x.2 as f64 / x.3 as f64 > 0.1;
    s.h_seg = segs.iter().filter(|x| heavy(x)).count() as f64 / segs.len() as f64;
    // Top 5% by tail fraction, ties by tail count, then response and segment ids ascending.
    let mut order: Vec<&(usize, usize, usize, usize)> = segs.iter().collect();
    order.sort_by(|a, b| {
        let (fa, fb) = (a.2 as f64 / a.3 as f64, b.2 as f64 / b.3 as f64);
        fb.total_cmp(&fa).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1))
    });
    let n_top = (0.05 * segs.len() as f64).ceil() as usize;
    if tails > 0 {
        s.c_tok = Some(order[..n_top].iter().map(|x| x.2).sum::<usize>() as f64 / tails as f64);
    }
    // Adjacent pairs: segments k and k+1 of the same response, both nonempty.
    let (mut pairs, mut cur_heavy, mut both, mut next_heavy) = (0usize, 0usize, 0usize, 0usize);
    for a in &segs {
        if let Some(b) = segs.iter().find(|b| b.0 == a.0 && b.1 == a.1 + 1) {
            pairs += 1;
            let (ha, hb) = (heavy(a), heavy(b));
            cur_heavy += ha as usize;
            next_heavy += hb as usize;
            both += (ha && hb) as usize;
        }
    }
    if cur_heavy > 0 && next_heavy > 0 {
        s.p_adj = Some((both as f64 / cur_heavy as f64) / (next_heavy as f64 / pairs as f64));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rho_asym_by_hand() {
        // Response 1: A = −2, δ = [−1, +1, −0.5] (2 tokens in A⁻); response 2: A = +1, δ = [+1, −1]
        // (1 token in A⁺); response 3: A = 0 (no weight).
        let (d1, d2, d3) = ([-1.0, 1.0, -0.5], [1.0, -1.0], [-3.0]);
        let rs = [
            Response { advantage: -2.0, delta: &d1, valid: &[true; 3] },
            Response { advantage: 1.0, delta: &d2, valid: &[true; 2] },
            Response { advantage: 0.0, delta: &d3, valid: &[true] },
        ];
        let raw = rho_parts(&rs, false);
        assert_eq!(raw, RhoParts { minus: 4.0, plus: 1.0 });
        assert_eq!(raw.ratio(), Some(4.0));
        // |A|/n: response 1 weight 2/3 per token, response 2 weight 1/2.
        let ln = rho_parts(&rs, true);
        assert!((ln.minus - 4.0 / 3.0).abs() < 1e-12 && (ln.plus - 0.5).abs() < 1e-12);
    }

    #[test]
    fn segments_keep_positions_and_the_short_tail() {
        let valid = [true, true, false, true, true, false, false, false, true];
        let s = segments(&valid, 3);
        // positions 0..3 → {0,1}; 3..6 → {3,4}; 6..9 → {8}; no reindexing around masked ones.
        assert_eq!(s, vec![(0, vec![0, 1]), (1, vec![3, 4]), (2, vec![8])]);
        let valid = [false, false, true];
        assert_eq!(segments(&valid, 2), vec![(1, vec![2])]);
    }

    #[test]
    fn tail_statistics_by_hand() {
        // One A<0 response, W = 2, τ = −1: segments {0,1}: δ −2, 0 (1 tail, f = 0.5, heavy),
        // {2,3}: −3, −4 (2 tails, heavy), {4}: 0 (0 tails). An A>0 response is ignored.
        let d = [-2.0, 0.0, -3.0, -4.0, 0.0];
        let v = [true; 5];
        let pos = [-5.0, -5.0];
        let vp = [true; 2];
        let rs =
            [Response { advantage: -1.0, delta: &d, valid: &v }, Response { advantage: 1.0, delta: &pos, valid: &vp }];
        let s = tail_stats(&rs, 2, -1.0);
        assert_eq!((s.segments, s.tokens), (3, 5));
        assert!((s.r_amp - 3.0 / 5.0).abs() < 1e-12);
        assert!((s.h_seg - 2.0 / 3.0).abs() < 1e-12);
        // Top 5% of 3 segments = 1 segment: the one with f = 1 (2 of the 3 tail tokens).
        assert!((s.c_tok.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        // Pairs (0,1): heavy→heavy; (1,2): heavy→light. P(next heavy | heavy) = 1/2,
        // P(next heavy) = 1/2 → P_adj = 1.
        assert!((s.p_adj.unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(tail_stats(&rs[1..], 2, -1.0).segments, 0);
    }
}
