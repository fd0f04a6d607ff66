//! GFLOP/s of the CPU linears of one decode step of the `bench/decode_vs_transformers.sh` model
//! (8 layers of q, k, v, o, gate, up, down, then the LM head; f32, distinct weights per layer so
//! they stream from memory as in the engine), W packed per call against W packed once
//! (`Panels`), side by side, best of 10 steps each.
//!
//! Run: cargo run --release --example linear_decode -- [BATCH] (default 32; rayon's threads:
//! every core, or RAYON_NUM_THREADS)

use colotrain::device::CpuFloats;
use colotrain::ops::linear::kernel::{linear_nt, linear_nt_panels, reserve};
use colotrain::ops::linear::Panels;
use std::time::Instant;

fn main() {
    let m: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(32);
    let (layers, hidden, vocab) = (8, 384, 32000);
    // (n, k) of q, k, v, o, gate, up, down.
    let shapes = [(384, 384), (128, 384), (128, 384), (384, 384), (1024, 384), (1024, 384), (384, 1024)];
    rayon::broadcast(|_| reserve(1024));
    let fill =
        |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + seed) % 13) as f32 * 0.01 - 0.06).collect() };
    let mut weights: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    for l in 0..layers {
        for (i, &(n, k)) in shapes.iter().enumerate() {
            weights.push((n, k, fill(n * k, 7 * l + i)));
        }
    }
    weights.push((vocab, hidden, fill(vocab * hidden, 99)));
    let panels: Vec<Panels> =
        weights.iter().map(|(n, k, w)| Panels::pack(CpuFloats::F32(w), *n, *k).expect("f32 packs")).collect();
    let x = fill(m * 1024, 3);
    let mut y = vec![0.0f32; m * vocab];
    let flops: f64 = weights.iter().map(|(n, k, _)| (2 * m * n * k) as f64).sum();
    let mut best = [f64::MAX; 2];
    for _ in 0..10 {
        for (v, b) in best.iter_mut().enumerate() {
            let t = Instant::now();
            for ((n, k, w), p) in weights.iter().zip(&panels) {
                if v == 0 {
                    linear_nt(m, *n, *k, &x, CpuFloats::F32(w), &mut y, *n, false);
                } else {
                    linear_nt_panels(m, &x, p, &mut y, *n, false);
                }
            }
            *b = b.min(t.elapsed().as_secs_f64());
        }
    }
    println!("batch {m}, {:.0} MFLOP a step ({} threads):", flops / 1e6, rayon::current_num_threads());
    for (name, t) in ["packed per call", "packed once"].iter().zip(best) {
        println!("  {name:>16}: {:.2} ms  {:.1} GFLOP/s", t * 1e3, flops / t / 1e9);
    }
    println!("  ratio: {:.2}", best[0] / best[1]);
}
