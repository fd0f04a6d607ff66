//! The CPU kernel behind `ops::linear` (y = x · Wᵀ for an nn.Linear weight W (N, K)).
//!
//! Every output element is one sequential fused multiply-add chain over K, from 0:
//! `acc = fma(x[i][p], w[j][p], acc)` for p = 0, 1, …, K−1. Vector lanes never split K; they
//! run across rows of x or across rows of W instead, so no horizontal sums are needed:
//! - each block of 16 weight rows is widened to f32 and packed into a panel, (K, 16), while the
//!   next block is prefetched (row-major W read 16 rows at a time is 16 streams, which alias in
//!   L1 when a row is 4 KiB); or, for weights that do not change, the panels were packed once
//!   (`panels::Panels`, [`linear_nt_panels`]) and are read as one stream;
//! - a group of 9–16 rows of x (AVX-512) is transposed, (K, 16), once per 192-row chunk, and an
//!   instruction multiplies one weight, broadcast, with a column of 16 rows (AVX2: 8 rows);
//! - a group of ≤ 8 rows (AVX-512) instead multiplies one x value, broadcast, with a panel row of
//!   16 weights, all of them against one panel per register tile: no idle lanes at batch 1;
//! - several linears of one input (q/k/v, gate/up) run as one call, [`linear_many`]: one
//!   transpose of x, one parallel region, and each block's bias added by the task that computed
//!   it, while the block is in cache;
//! - an output written once and read once later (the LM head's logits) can skip the caches:
//!   [`Job::streamed`] (non-temporal stores, the same bits).
//!
//! Two properties the decoding engine relies on:
//! - **Batch invariance**: a lane's arithmetic does not depend on its neighbours, the vector
//!   width or the tiling (FMA rounds once, lane by lane), so a row's result is bit-identical
//!   whatever else is in the batch, where it sits, and whether the CPU has AVX-512, AVX2 or
//!   neither (the portable path runs the same chain with `f32::mul_add`). Logits therefore do
//!   not depend on batch composition, and samples are reproducible across batch sizes.
//! - **No allocation in steady state**: the transposed x, widened BF16/F16/FP8/NVFP4 weight rows
//!   and the panels live in thread-local scratch that [`reserve`] grows once. (The `gemm`
//!   crate, used for the large training GEMMs in `gemm`, allocates on every call.)
//!
//! Owns: that scratch. May call: rayon, `CpuFloats` decoding, `prefetch`. Must not touch: devices,
//! tensors.

use super::gemm::SendPtr;
use super::panels::Panels;
use crate::device::CpuFloats;
use crate::ops::isa::Isa;
use crate::ops::prefetch::Prefetch;
use rayon::prelude::*;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};

/// Row lanes per group of the transposed x block (one AVX-512 register of f32), and weight
/// rows per packed panel.
pub(super) const G: usize = 16;
/// Rows of x per task (a multiple of G).
const MB: usize = 12 * G;
/// Weight rows packed (and kept in cache across the row groups) at a time (a multiple of G);
/// also how far ahead the next rows are prefetched (one panel ahead, into L2, measured best on
/// the 2-core Zen 4 VM among 1, 2 and 4 panels and L1/L2/L3 hints).
const NB: usize = G;
// Pre-packed weights are read one panel per block.
const _: () = assert!(NB == G);

thread_local! {
    /// The call's x transposed, MB rows at a time: (MB / G groups, K, G); each thread has its own.
    static XT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// NB weight rows widened to f32, row-major (BF16/F16/FP8/NVFP4 weights only).
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// NB weight rows packed: (NB / G panels, K, G).
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The call (a [`CALLS`] number) whose x `XT` holds.
    static XT_CALL: Cell<u64> = const { Cell::new(u64::MAX) };
}

/// Numbers each chunk of each linear call (tags the transposed x in `XT`).
static CALLS: AtomicU64 = AtomicU64::new(0);
/// Largest transposed x (bytes) that each thread makes for itself; a larger one is made once,
/// in parallel, and shared (each thread's own copy of a 192 × 11008 chunk would be 8 MiB).
const PRIVATE_XT_BYTES: usize = 256 << 10;

/// The first `n` values of `s`, grown (once) when it is shorter.
fn scratch(s: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if s.len() < n {
        s.resize(n, 0.0);
    }
    &mut s[..n]
}

/// Grows this thread's scratch for linears with reduction dimension up to `max_k`.
pub fn reserve(max_k: usize) {
    XT.with(|s| _ = scratch(&mut s.borrow_mut(), MB * max_k));
    ROWS.with(|s| _ = scratch(&mut s.borrow_mut(), NB * max_k));
    PANELS.with(|s| _ = scratch(&mut s.borrow_mut(), NB * max_k));
}

/// y[i·ldy + j] (+)= Σ_p x[i·k + p] · w[j·k + p] for i < m, j < n (the sum: one FMA chain over
/// p = 0..k from 0; `accumulate` adds it to y).
pub fn linear_nt(m: usize, n: usize, k: usize, x: &[f32], w: CpuFloats, y: &mut [f32], ldy: usize, accumulate: bool) {
    linear_isa(Isa::detect(), m, k, x, &mut [Job::rows(w, n, y, ldy, accumulate)])
}

/// [`linear_nt`] with W given as [`Panels`] (packed once): the same bits, no per-call packing.
pub fn linear_nt_panels(m: usize, x: &[f32], w: &Panels, y: &mut [f32], ldy: usize, accumulate: bool) {
    linear_isa(Isa::detect(), m, w.dims().1, x, &mut [Job::panels(w, y, ldy, accumulate)])
}

/// Several linears of one input x (m, k), each with its own weight and output, in one
/// parallel region with x transposed once (q/k/v, gate/up). Every output has the bits that
/// [`linear_nt`] (then `+ bias`, rounded once more) gives it alone. At most [`MAX_JOBS`].
pub fn linear_many(m: usize, k: usize, x: &[f32], jobs: &mut [Job]) {
    linear_isa(Isa::detect(), m, k, x, jobs)
}

/// The most linears one [`linear_many`] call runs.
pub const MAX_JOBS: usize = 4;

/// One linear of a [`linear_many`] call: its weight (N, K) and output y (m rows of stride ldy).
pub struct Job<'a> {
    w: Src<'a>,
    n: usize,
    y: &'a mut [f32],
    ldy: usize,
    accumulate: bool,
    /// (N) added to each output row after the sum (and after `accumulate`'s addition).
    bias: Option<&'a [f32]>,
    /// Write y around the caches (see [`Job::streamed`]).
    stream: bool,
}

impl<'a> Job<'a> {
    /// W row-major (n, k), packed block by block as the call goes.
    pub fn rows(w: CpuFloats<'a>, n: usize, y: &'a mut [f32], ldy: usize, accumulate: bool) -> Job<'a> {
        Job { w: Src::Rows(w), n, y, ldy, accumulate, bias: None, stream: false }
    }

    /// W packed once.
    pub fn panels(w: &'a Panels, y: &'a mut [f32], ldy: usize, accumulate: bool) -> Job<'a> {
        Job { w: Src::Panels(w), n: w.dims().0, y, ldy, accumulate, bias: None, stream: false }
    }

    /// y[i][j] = (the linear's value) + bias[j]: the bits of adding the bias afterwards.
    pub fn with_bias(self, bias: Option<&'a [f32]>) -> Job<'a> {
        Job { bias, ..self }
    }

    /// The same bits, with y's rows written by non-temporal stores wherever a full tile's 16
    /// columns start on a cache line (AVX-512, batch ≥ 9, no accumulate, no bias): for an
    /// output written once, read once later, and too large to stay in cache (the LM head's
    /// logits), so that no line of it is read from memory before it is overwritten. Batch-32
    /// decode on the 2-core Zen 4 VM: the LM head 535 → 508 ms a run.
    pub fn streamed(self) -> Job<'a> {
        Job { stream: true, ..self }
    }
}

/// How a register tile writes its sums into y.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Out {
    Set,
    Add,
    /// Set, around the caches where the tile can (see [`Job::streamed`]).
    Stream,
}

impl Out {
    fn adds(self) -> bool {
        self == Out::Add
    }
}

/// Where a call's weight panels come from.
#[derive(Clone, Copy)]
enum Src<'a> {
    /// The row-major weight, packed block by block as the call goes.
    Rows(CpuFloats<'a>),
    /// Packed before the call.
    Panels(&'a Panels),
}

/// [`linear_many`] on a given instruction set (tests check that they all agree bit for bit).
fn linear_isa(isa: Isa, m: usize, k: usize, x: &[f32], jobs: &mut [Job]) {
    assert!(jobs.len() <= MAX_JOBS, "linear: {} linears in one call (at most {MAX_JOBS})", jobs.len());
    if m == 0 {
        return;
    }
    let extent = |a: usize, b: usize| a.checked_mul(b).expect("linear: size overflows usize");
    assert!(x.len() >= extent(m, k), "linear: x too short");
    for j in jobs.iter_mut() {
        if j.n == 0 {
            continue;
        }
        match j.w {
            Src::Rows(w) => assert!(w.len() >= extent(j.n, k), "linear: w too short"),
            Src::Panels(p) => assert_eq!(p.dims(), (j.n, k), "linear: panels of another shape"),
        }
        assert!(j.y.len() >= extent(m - 1, j.ldy) + j.n, "linear: y too short");
        // Rows of y must not overlap: tasks split y by column, each writing its columns of every row.
        assert!(m == 1 || j.ldy >= j.n, "linear: row stride {} < {} columns", j.ldy, j.n);
        if let Some(b) = j.bias {
            assert!(b.len() >= j.n, "linear: bias too short");
        }
        if k == 0 {
            for i in 0..m {
                let row = &mut j.y[i * j.ldy..i * j.ldy + j.n];
                if !j.accumulate {
                    row.fill(0.0);
                }
                if let Some(b) = j.bias {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        }
    }
    if k == 0 {
        return;
    }
    // MB rows at a time: bounds the transposed copy; W is packed again for every chunk, which
    // costs little next to the 192 rows of FMAs per weight it serves.
    for i0 in (0..m).step_by(MB) {
        let mc = MB.min(m - i0);
        chunk(isa, mc, i0, k, &x[i0 * k..(i0 + mc) * k], jobs);
    }
}

/// [`linear_isa`] for the m ≤ MB rows from row i0 of every output.
fn chunk(isa: Isa, m: usize, i0: usize, k: usize, x: &[f32], jobs: &mut [Job]) {
    debug_assert!(m <= MB);
    let threads = rayon::current_num_threads().max(1);
    // Weight rows per task: about eight tasks per thread over all the jobs' panels, whole
    // panels; a task stays within one job. Work stealing balances them: with two per thread a
    // thread that started late left the other idle at the end (batch-32 decode: 6 of 6
    // alternating runs faster with four, eight a little faster still; batch 1 and 8 unchanged).
    let panels: usize = jobs.iter().map(|j| j.n.div_ceil(G)).sum();
    let nt = panels.div_ceil(threads * 8).max(1) * G;
    // Tasks t in first[j]..first[j + 1] belong to job j.
    let mut first = [0usize; MAX_JOBS + 1];
    let mut yp = [SendPtr(std::ptr::null_mut::<f32>()); MAX_JOBS];
    for (i, j) in jobs.iter_mut().enumerate() {
        first[i + 1] = first[i] + j.n.div_ceil(nt);
        if j.n > 0 {
            yp[i] = SendPtr(j.y[i0 * j.ldy..].as_mut_ptr());
        }
    }
    let n_tasks = first[jobs.len()];
    let jobs = &*jobs;
    // (With AVX-512 a single group of ≤ 8 rows reads x row-major; see `block`.)
    let transposed = !(isa == Isa::Avx512 && m <= 8);
    let need = m.div_ceil(G) * G * k;
    let run = |t: usize, xt: &[f32]| {
        let ji = first[1..=jobs.len()].partition_point(|&f| f <= t);
        let j0 = (t - first[ji]) * nt;
        // SAFETY: tasks partition each job's columns (see `task`).
        unsafe { task(isa, m, k, x, xt, &jobs[ji], yp[ji], j0, nt.min(jobs[ji].n - j0)) }
    };
    if !transposed {
        return (0..n_tasks).into_par_iter().for_each(|t| run(t, &[]));
    }
    if need * 4 > PRIVATE_XT_BYTES {
        // A large x (the prefill's chunks) is transposed once, its row groups in parallel, into
        // the calling thread's scratch, which every task then reads.
        let shared = |xt: &mut [f32]| {
            xt.par_chunks_exact_mut(G * k).enumerate().for_each(|(g, dst)| transpose_group(isa, x, m, k, g, dst));
            let xt = &*xt;
            (0..n_tasks).into_par_iter().for_each(|t| run(t, xt));
        };
        return XT.with(|cell| match cell.try_borrow_mut() {
            Ok(mut xt) => {
                XT_CALL.set(u64::MAX);
                shared(scratch(&mut xt, need))
            }
            // This thread is inside another linear's shared transpose (rayon ran this call's
            // job while that call waited for its tasks): this call gets its own buffer.
            Err(_) => shared(&mut vec![0.0; need]),
        });
    }
    // A small x (decode) is transposed by each thread into its own scratch before its first
    // task of this call (the tag says which call's x it holds). One transpose on the calling
    // thread had the others wait, and its copy, written by one core, was then read by all:
    // 6.7 µs of each 80 µs q/k/v call at batch 32 (19 µs at K = 1024), measured.
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    (0..n_tasks).into_par_iter().for_each(|t| {
        XT.with(|cell| match cell.try_borrow_mut() {
            Ok(mut xt) => {
                let xt = scratch(&mut xt, need);
                if XT_CALL.get() != call {
                    XT_CALL.set(u64::MAX);
                    transpose(isa, &x[..m * k], m, k, xt);
                    XT_CALL.set(call);
                }
                run(t, xt)
            }
            // (Only inside another linear's shared transpose, as above.)
            Err(_) => {
                let mut xt = vec![0.0; need];
                transpose(isa, &x[..m * k], m, k, &mut xt);
                run(t, &xt)
            }
        })
    });
}

/// Columns j0..j0 + nj of `job`'s output, m rows from `y` (the row i0 of the chunk): block by
/// block, packed (or read pre-packed) and computed while the next block is prefetched.
///
/// # Safety
/// No other task writes these columns of these rows (tasks partition each job's columns; jobs
/// have distinct outputs, borrowed mutably); `linear_isa` checked the extents.
#[allow(clippy::too_many_arguments)]
unsafe fn task(isa: Isa, m: usize, k: usize, x: &[f32], xt: &[f32], job: &Job, y: SendPtr<f32>, j0: usize, nj: usize) {
    let (w, ldy) = (job.w, job.ldy);
    let out = match (job.accumulate, job.stream && job.bias.is_none()) {
        (true, _) => Out::Add,
        (false, true) => Out::Stream,
        (false, false) => Out::Set,
    };
    // Non-temporal stores are weakly ordered: they reach memory before this task's end is
    // seen by another thread (rayon's latch), whatever way the task ends.
    struct Fence;
    impl Drop for Fence {
        fn drop(&mut self) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: SSE is part of x86-64; a store fence has no other effect.
            unsafe {
                std::arch::x86_64::_mm_sfence()
            }
        }
    }
    let _fence = (out == Out::Stream).then_some(Fence);
    PANELS.with(|pn| {
        let mut pn = pn.borrow_mut();
        let mut jb = j0;
        while jb < j0 + nj {
            let nbj = NB.min(j0 + nj - jb);
            // While this block is packed and computed, the next NB rows (this task's or the next
            // one's) are prefetched: packing is most of the time at batch 1, the FMA loop at
            // large batches.
            let (panels, ahead): (&[f32], &[u8]) = match w {
                Src::Rows(w) => {
                    let panels = scratch(&mut pn, nbj.div_ceil(G) * G * k);
                    let ahead = w.bytes((jb + NB) * k, NB * k);
                    let pf = Prefetch::lines(ahead, 0, ahead.len().div_ceil(64));
                    match w {
                        CpuFloats::F32(wd) => pack(isa, &wd[jb * k..(jb + nbj) * k], nbj, k, panels, pf),
                        _ => ROWS.with(|r| {
                            let mut r = r.borrow_mut();
                            let rows = scratch(&mut r, nbj * k);
                            w.read_into(jb * k, rows);
                            pack(isa, rows, nbj, k, panels, pf);
                        }),
                    }
                    (panels, ahead)
                }
                // (NB = G: a block is one panel.)
                Src::Panels(p) => (p.panel(jb / G, &mut pn), p.bytes(jb / G + 1)),
            };
            // SAFETY: as this function's (sub-blocks partition the task's columns).
            unsafe {
                let y = y.get().add(jb);
                block(isa, m, nbj, k, x, xt, panels, ahead, y, ldy, out);
                if let Some(b) = job.bias {
                    add_bias(m, &b[jb..jb + nbj], y, ldy);
                }
            }
            jb += nbj;
        }
    })
}

/// y[i·ldy + j] += b[j] for i < m, j < b.len() (while the block is still in cache).
///
/// # Safety
/// As [`block`] for m × b.len().
unsafe fn add_bias(m: usize, b: &[f32], y: *mut f32, ldy: usize) {
    for i in 0..m {
        let row = std::slice::from_raw_parts_mut(y.add(i * ldy), b.len());
        row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
}

/// xt (groups, k, G) ← the rows of x (rows, k); lanes past the last row are zero.
fn transpose(isa: Isa, x: &[f32], rows: usize, k: usize, xt: &mut [f32]) {
    for (g, dst) in xt.chunks_exact_mut(G * k).enumerate() {
        transpose_group(isa, x, rows, k, g, dst);
    }
}

/// Group g of [`transpose`], dst (k, G) (with AVX-512, 16 × 16 blocks transposed in registers).
fn transpose_group(isa: Isa, x: &[f32], rows: usize, k: usize, g: usize, dst: &mut [f32]) {
    let live = G.min(rows - g * G);
    let src = &x[g * G * k..(g * G + live) * k];
    let mut p0 = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F is present (isa); src holds live rows of k, dst (k, G).
        unsafe { avx512::transpose_group(src, live, k, dst) };
        p0 = k / G * G;
    }
    if live < G {
        dst[p0 * G..].fill(0.0);
    }
    for l in 0..live {
        for p in p0..k {
            dst[p * G + l] = src[l * k + p];
        }
    }
}

/// dst (panels, k, G) ← w (n, k) row-major: dst[q][p][c] = w[q·G + c][p] (columns of a last,
/// partial panel are left as they were: the column tile loads them with the rest of the panel
/// row, but no kernel stores a result computed from them).
fn pack(isa: Isa, w: &[f32], n: usize, k: usize, dst: &mut [f32], pf: Prefetch) {
    for (q, d) in dst.chunks_exact_mut(G * k).enumerate() {
        let cols = G.min(n - q * G);
        let src = &w[q * G * k..(q * G + cols) * k];
        let mut p0 = 0;
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable && cols == G {
            // SAFETY: AVX2 is present (isa), src holds G rows of k and d (k, G).
            unsafe { avx2::pack_panel(src, k, d, pf) };
            p0 = k / 8 * 8;
        }
        for c in 0..cols {
            for p in p0..k {
                d[p * G + c] = src[c * k + p];
            }
        }
    }
}

/// y (m, n; row stride ldy) (+)= the rows of xt (transposed, zero-padded) · Wᵀ, W packed in
/// panels.
///
/// # Safety
/// y must be valid for writes at i·ldy + j for i < m, j < n and not accessed concurrently
/// there; xt must hold m.div_ceil(G) groups of (k, G) (except with AVX-512 and m ≤ 8) and w
/// n.div_ceil(G) panels of (k, G).
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    xt: &[f32],
    w: &[f32],
    ahead: &[u8],
    y: *mut f32,
    ldy: usize,
    out: Out,
) {
    // (AVX-512 with ≤ 8 rows reads x, not xt, which is then empty.)
    let xt_read = !(isa == Isa::Avx512 && m <= 8);
    assert!(x.len() >= m * k && (!xt_read || xt.len() >= m.div_ceil(G) * G * k) && w.len() >= n.div_ceil(G) * G * k);
    for g in 0..m.div_ceil(G) {
        let rows = G.min(m - g * G);
        let (xg, yg) = (xt.as_ptr().add(g * G * k), y.add(g * G * ldy));
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && rows <= 8 {
            // Few rows: lanes over the 16 columns of a panel instead (no idle lanes), x
            // broadcast from its row-major rows; all ≤ 8 rows × one panel per register tile.
            for q in 0..n.div_ceil(G) {
                let pf = if g == 0 { Prefetch::lines(ahead, q * k, k) } else { Prefetch::NONE };
                let (xr, wq, yq) = (x.as_ptr().add(g * G * k), w.as_ptr().add(q * G * k), yg.add(q * G));
                avx512::col_dispatch(rows, G.min(n - q * G), k, xr, wq, pf, yq, ldy, out.adds());
            }
            continue;
        }
        for q in 0..n.div_ceil(G) {
            let c = G.min(n - q * G);
            let (wq, yq) = (w.as_ptr().add(q * G * k), yg.add(q * G));
            // Cache lines q·k.. of `ahead`, one per step p, during the first row group only.
            let pf = if g == 0 { Prefetch::lines(ahead, q * k, k) } else { Prefetch::NONE };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // (rows > 8: smaller groups took the branch above.)
                Isa::Avx512 => avx512::tile16_dispatch(c, rows, k, xg, wq, pf, yq, ldy, out),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    // 8 lanes × 8 columns at a time (16 ymm registers).
                    for h in 0..rows.div_ceil(8) {
                        for c0 in (0..c).step_by(8) {
                            let (x8, y8) = (xg.add(8 * h), yq.add(8 * h * ldy + c0));
                            avx2::tile8_dispatch(
                                8.min(c - c0),
                                8.min(rows - 8 * h),
                                k,
                                x8,
                                wq.add(c0),
                                pf,
                                y8,
                                ldy,
                                out,
                            );
                        }
                    }
                }
                _ => portable::tile(rows, c, k, xg, wq, yq, ldy, out.adds()),
            }
        }
    }
}

/// Writes lane l < rows of column c of `t` to y[l·ldy + c].
///
/// # Safety
/// As [`block`], for rows × C.
#[inline(always)]
unsafe fn store<const C: usize, const L: usize>(
    t: &[[f32; L]; C],
    rows: usize,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    for (c, col) in t.iter().enumerate() {
        for (l, v) in col.iter().enumerate().take(rows) {
            let o = y.add(l * ldy + c);
            *o = if accumulate { *o + *v } else { *v };
        }
    }
}

/// Expands to a match over the tile width, calling `$f::<C> $args`.
macro_rules! by_width {
    ($c:expr, $f:ident, $args:tt, [$($n:literal)*]) => {
        match $c {
            $($n => $f::<$n> $args,)*
            _ => unreachable!("tile width"),
        }
    };
}

/// A register tile: C columns of a panel × the lanes of one x column,
/// `acc[c] = fma(x[.., p], broadcast w[p][c], acc[c])` for p = 0..k, then stored.
macro_rules! tile_fn {
    ($name:ident, $feat:literal, $vec:ty, $lanes:literal, $zero:ident, $load:ident, $set1:ident, $fma:ident, $storeu:ident, $wide:expr) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name<const C: usize>(
            rows: usize,
            k: usize,
            xg: *const f32,
            w: *const f32,
            pf: super::Prefetch,
            y: *mut f32,
            ldy: usize,
            a: super::Out,
        ) {
            let mut acc: [$vec; C] = [$zero(); C];
            for p in 0..k {
                pf.line(p);
                let xv = $load(xg.add(p * G));
                let wp = w.add(p * G);
                for (c, r) in acc.iter_mut().enumerate() {
                    *r = $fma(xv, $set1(*wp.add(c)), *r);
                }
            }
            if $wide(&acc, rows, y, ldy, a) {
                return;
            }
            let mut t = [[0.0f32; $lanes]; C];
            for (c, r) in acc.iter().enumerate() {
                $storeu(t[c].as_mut_ptr(), *r);
            }
            super::store(&t, rows, y, ldy, a.adds());
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Out, Prefetch, G};
    use std::arch::x86_64::*;

    tile_fn!(
        tile16,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps,
        store_rows
    );

    /// A full tile (C = 16 columns) is written row by row, one vector per row of y, after a
    /// 16 × 16 transpose in registers: 64 shuffles instead of 256 scalar stores (the stores
    /// were ~12% of the tile's time at K = 384). Returns false (nothing written) for C < 16.
    ///
    /// # Safety
    /// As [`super::block`] for `rows` ≤ 16 rows × C columns; AVX-512F.
    #[inline(always)]
    unsafe fn store_rows<const C: usize>(acc: &[__m512; C], rows: usize, y: *mut f32, ldy: usize, a: Out) -> bool {
        let Ok(cols) = <&[__m512; 16]>::try_from(&acc[..]) else { return false };
        for (l, v) in transpose16(cols).iter().enumerate().take(rows) {
            let o = y.add(l * ldy);
            match a {
                Out::Add => _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *v)),
                // (A whole cache line: no read of it first. `task` fences.)
                Out::Stream if o as usize % 64 == 0 => _mm512_stream_ps(o, *v),
                Out::Set | Out::Stream => _mm512_storeu_ps(o, *v),
            }
        }
        true
    }

    /// dst[p·16 + l] = src[l·k + p] for l < live (0 for l ≥ live), p < k / 16 · 16.
    ///
    /// # Safety
    /// AVX-512F; src holds live ≤ 16 rows of k values and dst k · 16.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose_group(src: &[f32], live: usize, k: usize, dst: &mut [f32]) {
        assert!(live <= G && src.len() >= live * k && dst.len() >= G * k);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for p0 in (0..k / G * G).step_by(G) {
            // (Loops, not array::from_fn: a closure does not inherit this function's target
            // features, and its intrinsics would stay out-of-line calls.)
            let mut v = [_mm512_setzero_ps(); 16];
            if live == G {
                // A constant trip count keeps v in registers (a runtime one spilled it to the
                // stack, zeroed, every block).
                for (l, r) in v.iter_mut().enumerate() {
                    *r = _mm512_loadu_ps(s.add(l * k + p0));
                }
                for (i, r) in transpose16(&v).iter().enumerate() {
                    _mm512_storeu_ps(d.add((p0 + i) * G), *r);
                }
                continue;
            }
            for (l, r) in v.iter_mut().enumerate().take(live) {
                *r = _mm512_loadu_ps(s.add(l * k + p0));
            }
            for (i, r) in transpose16(&v).iter().enumerate() {
                _mm512_storeu_ps(d.add((p0 + i) * G), *r);
            }
        }
    }

    /// w[j][i] = v[i][j] for 16 vectors of 16 lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn transpose16(v: &[__m512; 16]) -> [__m512; 16] {
        // Pairs of vectors interleaved (within 128-bit lanes), then pairs of pairs: u[4b + e]
        // holds, in 128-bit lane q, v[4b..4b + 4][4q + e]. (Loops, not closures: see above.)
        let mut t = [_mm512_setzero_ps(); 16];
        for i in (0..16).step_by(2) {
            t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
            t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for b in 0..4 {
            for h in 0..2 {
                let (x, y) = (_mm512_castps_pd(t[4 * b + h]), _mm512_castps_pd(t[4 * b + 2 + h]));
                u[4 * b + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
                u[4 * b + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
            }
        }
        // Then a 4 × 4 transpose of 128-bit lanes for each e: w[4q + e] lane b = u[4b + e] lane q.
        let mut w = [_mm512_setzero_ps(); 16];
        for e in 0..4 {
            let s0 = _mm512_shuffle_f32x4::<0x44>(u[e], u[4 + e]);
            let s1 = _mm512_shuffle_f32x4::<0xEE>(u[e], u[4 + e]);
            let s2 = _mm512_shuffle_f32x4::<0x44>(u[8 + e], u[12 + e]);
            let s3 = _mm512_shuffle_f32x4::<0xEE>(u[8 + e], u[12 + e]);
            w[e] = _mm512_shuffle_f32x4::<0x88>(s0, s2);
            w[4 + e] = _mm512_shuffle_f32x4::<0xDD>(s0, s2);
            w[8 + e] = _mm512_shuffle_f32x4::<0x88>(s1, s3);
            w[12 + e] = _mm512_shuffle_f32x4::<0xDD>(s1, s3);
        }
        w
    }

    #[cfg(test)]
    #[test]
    fn transpose16_transposes() {
        if !crate::ops::isa::Isa::available().contains(&crate::ops::isa::Isa::Avx512) {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512F detected above; every load reads 16 of the 256 values.
        let w = unsafe { transpose16(&std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(16 * i)))) };
        for (j, r) in w.iter().enumerate() {
            let mut row = [0.0f32; 16];
            // SAFETY: as above; row holds 16 values.
            unsafe { _mm512_storeu_ps(row.as_mut_ptr(), *r) };
            let want: Vec<f32> = (0..16).map(|i| m[16 * i + j]).collect();
            assert_eq!(row.to_vec(), want, "row {j}");
        }
    }

    /// R rows of x (row-major, stride k) × one panel, lanes over its 16 columns:
    /// acc[r] = fma(broadcast x[r][p], panel row p, acc[r]) for p = 0..k; the columns from
    /// `ncols` on (a last, partial panel) are not stored.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn col_tile<const R: usize>(
        ncols: usize,
        k: usize,
        x: *const f32,
        w: *const f32,
        pf: Prefetch,
        y: *mut f32,
        ldy: usize,
        a: bool,
    ) {
        let mut acc = [_mm512_setzero_ps(); R];
        for p in 0..k {
            pf.line(p);
            let wv = _mm512_loadu_ps(w.add(p * G));
            for (r, ar) in acc.iter_mut().enumerate() {
                *ar = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(r * k + p)), wv, *ar);
            }
        }
        let mut t = [0.0f32; 16];
        for (r, ar) in acc.iter().enumerate() {
            _mm512_storeu_ps(t.as_mut_ptr(), *ar);
            for (l, v) in t.iter().enumerate().take(ncols) {
                let o = y.add(r * ldy + l);
                *o = if a { *o + *v } else { *v };
            }
        }
    }

    /// # Safety
    /// As [`super::block`] for `r` ≤ 8 rows and one panel holding `cols` ≤ 16 columns; the CPU
    /// has AVX-512F.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn col_dispatch(
        r: usize,
        cols: usize,
        k: usize,
        x: *const f32,
        w: *const f32,
        pf: Prefetch,
        y: *mut f32,
        ldy: usize,
        a: bool,
    ) {
        by_width!(r, col_tile, (cols, k, x, w, pf, y, ldy, a), [1 2 3 4 5 6 7 8])
    }

    /// # Safety
    /// As [`super::block`] for one row group and one panel of `c` ≤ 16 columns; AVX-512F.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile16_dispatch(
        c: usize,
        rows: usize,
        k: usize,
        xg: *const f32,
        w: *const f32,
        pf: Prefetch,
        y: *mut f32,
        ldy: usize,
        a: Out,
    ) {
        by_width!(c, tile16, (rows, k, xg, w, pf, y, ldy, a), [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16])
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

mod portable {
    use super::G;

    /// The same FMA chain per element as the SIMD paths, in plain Rust.
    ///
    /// # Safety
    /// As [`super::block`] for one row group and one panel of `c` columns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        rows: usize,
        c: usize,
        k: usize,
        xg: *const f32,
        w: *const f32,
        y: *mut f32,
        ldy: usize,
        accumulate: bool,
    ) {
        for l in 0..rows {
            for j in 0..c {
                let mut s = 0.0f32;
                for p in 0..k {
                    s = (*xg.add(p * G + l)).mul_add(*w.add(p * G + j), s);
                }
                let o = y.add(l * ldy + j);
                *o = if accumulate { *o + s } else { s };
            }
        }
    }
}

#[cfg(test)]
mod tests;
