//! The fused log-softmax + gather against an f64 reference.

use super::*;

#[test]
fn topk_matches_a_full_sort_in_f64() {
    let dev = Device::cpu(2).unwrap();
    let (m, v, k) = (3, 50, 7);
    let mut rng = crate::rand::Stream::new(3, 1);
    let mut z: Vec<f32> = (0..m * v).map(|_| (rng.normal() * 3.0) as f32).collect();
    z[v + 4] = z[v + 9]; // a tie: the lower id comes first
    let logits = dev.from_f32(crate::device::DType::F32, &[m, v], &z).unwrap();
    let temps = [1.0f32, 0.7, 0.0];
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    topk_logprobs(&dev, &logits, &temps, k, &mut ids, &mut lps).unwrap();
    for i in 0..m {
        let t = if temps[i] > 0.0 { temps[i] as f64 } else { 1.0 };
        let row: Vec<f64> = z[i * v..(i + 1) * v].iter().map(|&x| x as f64 / t).collect();
        let mx = row.iter().cloned().fold(f64::MIN, f64::max);
        let lse = mx + row.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
        for j in 0..k {
            assert_eq!(ids[i * k + j] as usize, order[j], "row {i} rank {j}");
            let want = row[order[j]] - lse;
            // f32 log-probs vs f64: |Δ| ≤ 1e-5 + 1e-6·|ref|.
            assert!((lps[i * k + j] as f64 - want).abs() <= 1e-5 + 1e-6 * want.abs());
        }
    }
    assert!(topk_logprobs(&dev, &logits, &temps, 0, &mut ids, &mut lps).is_err());
}
