//! The explicit backward against central finite differences in f64, for every parameter tensor
//! of tiny llama (GQA, llama3 rope, attention and MLP biases), qwen2 (q/k/v bias, tied head)
//! and qwen3 (q/k norm, head_dim ≠ hidden/heads) models. Loss: Σ_i −c_i·log_softmax(z_i/T)[y_i]
//! with random coefficients c_i (the form every objective reduces to), T = 0.7.
//! Criterion: per tensor, ‖g − g_fd‖ / ‖g_fd‖ ≤ 1e-5 over the checked entries.

mod common;

use colotrain::model::config::{Arch, ModelConfig};
use colotrain::model::trainable::{TrainBatch, Trainable};
use colotrain::model::weights::param_specs;
use colotrain::rand::Stream;

fn cfg(arch: Arch) -> ModelConfig {
    common::grad_cfg(arch, 12, 20, 6)
}

fn batch() -> TrainBatch {
    common::grad_batch()
}

fn loss(m: &mut Trainable<f64>, p: &[Vec<f64>], b: &TrainBatch, coef: &[f64], t: f64) -> f64 {
    let ps: Vec<&[f64]> = p.iter().map(|v| v.as_slice()).collect();
    m.forward(&ps, b).unwrap();
    let (mut lp, mut en) = (vec![0.0; b.rows.len()], vec![0.0; b.rows.len()]);
    m.token_stats(&ps, b, t, 3, &mut lp, &mut en);
    lp.iter().zip(coef).map(|(l, c)| -c * l).sum()
}

#[test]
fn backward_matches_finite_differences_in_f64() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let cfg = cfg(arch);
        let specs = param_specs(&cfg);
        let mut rng = Stream::new(42, arch as u64);
        let mut p: Vec<Vec<f64>> = common::grad_params(&specs, &mut rng);
        let b = batch();
        let coef: Vec<f64> = (0..b.rows.len()).map(|_| rng.normal()).collect();
        let t = 0.7;
        let mut m = Trainable::<f64>::new(&cfg);
        let ps: Vec<&[f64]> = p.iter().map(|v| v.as_slice()).collect();
        m.forward(&ps, &b).unwrap();
        let mut grads: Vec<Vec<f64>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
        // Chunk 3 < 7 scored rows: the chunked loss pass is exercised across chunk boundaries.
        let l0 = m.backward(&ps, &b, &coef, t, 3, &mut grads).unwrap();
        let l1 = loss(&mut m, &p, &b, &coef, t);
        assert!((l0 - l1).abs() <= 1e-12 * l1.abs().max(1.0), "loss from backward {l0} vs forward {l1}");
        let h = 1e-5;
        for (pi, (name, _)) in specs.iter().enumerate() {
            let n = p[pi].len();
            let picks: Vec<usize> =
                if n <= 48 { (0..n).collect() } else { (0..48).map(|_| rng.below(n as u64) as usize).collect() };
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for &i in &picks {
                let orig = p[pi][i];
                p[pi][i] = orig + h;
                let lp = loss(&mut m, &p, &b, &coef, t);
                p[pi][i] = orig - h;
                let lm = loss(&mut m, &p, &b, &coef, t);
                p[pi][i] = orig;
                let fd = (lp - lm) / (2.0 * h);
                num += (grads[pi][i] - fd).powi(2);
                den += fd * fd;
            }
            let rel = num.sqrt() / den.sqrt().max(1e-30);
            assert!(den > 0.0, "{arch:?} {name}: zero finite-difference gradient (tensor unused?)");
            assert!(rel <= 1e-5, "{arch:?} {name}: relative error {rel:e}");
        }
    }
}
