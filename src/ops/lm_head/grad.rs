//! The LM head and the loss, chunk by chunk, never holding more than `chunk × V` logits:
//! - [`stats`]: logp_t = log_softmax(z_t/T)[y_t] and the entropy of softmax(z_t/T), z_t = h_t·Whᵀ;
//! - [`grad`]: the fused loss pass. Given one coefficient c_t per token (from an objective), it
//!   recomputes each chunk's logits and backpropagates dz_t = −c_t·(e_{y_t} − softmax(z_t/T))/T,
//!   the gradient of −c_t·logp_t: dh_t += dz_t·Wh, dWh += dzᵀ·h.
//!
//! Rows are given as indices into h (only response positions are scored).

use crate::ops::linear::grad as matmul;
use crate::ops::real::Real;
use rayon::prelude::*;

/// Rows of one chunk gathered into scratch: hc (n, C).
fn gather<T: Real>(rows: &[u32], c: usize, h: &[T], hc: &mut [T]) {
    for (i, &r) in rows.iter().enumerate() {
        hc[i * c..(i + 1) * c].copy_from_slice(&h[r as usize * c..(r as usize + 1) * c]);
    }
}

/// Per-row (max, log Σ exp(z/T − max)) of z (n, V), in place turning z into z/T.
fn normalize<T: Real>(n: usize, v: usize, z: &mut [T], inv_t: T, lse: &mut [T]) {
    z[..n * v].par_chunks_mut(v).zip(lse[..n].par_iter_mut()).for_each(|(row, l)| {
        let mut mx = T::neg_infinity();
        for x in row.iter_mut() {
            *x *= inv_t;
            mx = mx.max(*x);
        }
        let s: T = row.iter().map(|&x| (x - mx).fexp()).sum();
        *l = mx + s.ln();
    });
}

pub struct Scratch<T> {
    hc: Vec<T>,
    z: Vec<T>,
    lse: Vec<T>,
    dhc: Vec<T>,
}

impl<T: Real> Scratch<T> {
    pub fn new(chunk: usize, c: usize, v: usize) -> Scratch<T> {
        Scratch {
            hc: vec![T::zero(); chunk * c],
            z: vec![T::zero(); chunk * v],
            lse: vec![T::zero(); chunk],
            dhc: vec![T::zero(); chunk * c],
        }
    }
    /// Bytes held: the bound on the loss pass's memory, independent of the number of tokens.
    pub fn size_bytes(&self) -> usize {
        (self.hc.len() + self.z.len() + self.lse.len() + self.dhc.len()) * std::mem::size_of::<T>()
    }
    pub fn chunk(&self) -> usize {
        self.lse.len()
    }
}

/// logp[i], entropy[i] of rows[i] with target targets[i].
#[allow(clippy::too_many_arguments)]
pub fn stats<T: Real>(
    c: usize,
    v: usize,
    rows: &[u32],
    targets: &[u32],
    h: &[T],
    wh: &[T],
    temperature: T,
    s: &mut Scratch<T>,
    logp: &mut [T],
    entropy: &mut [T],
) {
    let chunk = s.chunk();
    let inv_t = T::one() / temperature;
    for (ci, (rs, ts)) in rows.chunks(chunk).zip(targets.chunks(chunk)).enumerate() {
        let n = rs.len();
        gather(rs, c, h, &mut s.hc);
        matmul::nt(n, v, c, &s.hc, wh, &mut s.z, false);
        normalize(n, v, &mut s.z, inv_t, &mut s.lse);
        let base = ci * chunk;
        let (lp, en) = (&mut logp[base..base + n], &mut entropy[base..base + n]);
        lp.par_iter_mut().zip(en.par_iter_mut()).enumerate().for_each(|(i, (lp, en))| {
            let row = &s.z[i * v..(i + 1) * v];
            let l = s.lse[i];
            *lp = row[ts[i] as usize] - l;
            // H = −Σ p log p = lse − Σ p·(z/T)
            let ez: T = row.iter().map(|&x| (x - l).fexp() * x).sum();
            *en = l - ez;
        });
    }
}

/// Score centering's target per scored row (seed 000 App. B.1): the engine's k most likely
/// tokens `ids` (M·k) and their normalized probabilities `probs` (M·k, each row sums to 1).
/// The score ∇log p(y) becomes ∇log p(y) − Σ_v q̃_v ∇log p(v): in logits, (e_y − q̃)/T.
pub struct Center<'a> {
    pub k: usize,
    pub ids: &'a [u32],
    pub probs: &'a [f32],
}

/// The fused loss pass: dh[rows] += dz·Wh, dwh += dzᵀ·h for dz_i = −coef_i (e_{y_i} − p_i)/T.
/// Returns Σ_i −coef_i·logp_i (the surrogate loss value at these weights).
#[allow(clippy::too_many_arguments)]
pub fn grad<T: Real>(
    c: usize,
    v: usize,
    rows: &[u32],
    targets: &[u32],
    coef: &[T],
    h: &[T],
    wh: &[T],
    temperature: T,
    s: &mut Scratch<T>,
    dh: &mut [T],
    dwh: &mut [T],
) -> T {
    grad_centered(c, v, rows, targets, coef, None, h, wh, temperature, s, dh, dwh)
}

/// [`grad`], or with `center` the centered score: dz_i = −coef_i (e_{y_i} − q̃_i)/T and the
/// surrogate −coef_i·(logp_i − Σ_v q̃_iv·logp_iv).
#[allow(clippy::too_many_arguments)]
pub fn grad_centered<T: Real>(
    c: usize,
    v: usize,
    rows: &[u32],
    targets: &[u32],
    coef: &[T],
    center: Option<&Center>,
    h: &[T],
    wh: &[T],
    temperature: T,
    s: &mut Scratch<T>,
    dh: &mut [T],
    dwh: &mut [T],
) -> T {
    let chunk = s.chunk();
    let inv_t = T::one() / temperature;
    let mut loss = T::zero();
    for (ci, (rs, ts)) in rows.chunks(chunk).zip(targets.chunks(chunk)).enumerate() {
        let n = rs.len();
        let cs = &coef[ci * chunk..ci * chunk + n];
        gather(rs, c, h, &mut s.hc);
        matmul::nt(n, v, c, &s.hc, wh, &mut s.z, false);
        normalize(n, v, &mut s.z, inv_t, &mut s.lse);
        for i in 0..n {
            loss -= cs[i] * (s.z[i * v + ts[i] as usize] - s.lse[i]);
            if let Some(ct) = center {
                let at = (ci * chunk + i) * ct.k;
                for (&id, &q) in ct.ids[at..at + ct.k].iter().zip(&ct.probs[at..at + ct.k]) {
                    loss += cs[i] * T::from_f64(q as f64) * (s.z[i * v + id as usize] - s.lse[i]);
                }
            }
        }
        s.z[..n * v].par_chunks_mut(v).enumerate().for_each(|(i, row)| {
            let l = s.lse[i];
            let k = cs[i] * inv_t;
            match center {
                None => {
                    for x in row.iter_mut() {
                        *x = k * (*x - l).fexp();
                    }
                }
                Some(ct) => {
                    row.fill(T::zero());
                    let at = (ci * chunk + i) * ct.k;
                    for (&id, &q) in ct.ids[at..at + ct.k].iter().zip(&ct.probs[at..at + ct.k]) {
                        row[id as usize] += k * T::from_f64(q as f64);
                    }
                }
            }
            row[ts[i] as usize] -= k;
        });
        matmul::tn(n, v, c, &s.z, &s.hc, dwh, true);
        matmul::nn(n, v, c, &s.z, wh, &mut s.dhc, false);
        for (i, &r) in rs.iter().enumerate() {
            let dst = &mut dh[r as usize * c..(r as usize + 1) * c];
            for (a, b) in dst.iter_mut().zip(&s.dhc[i * c..(i + 1) * c]) {
                *a += *b;
            }
        }
    }
    loss
}
