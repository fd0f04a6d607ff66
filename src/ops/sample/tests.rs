//! Sampling against f64 references and its own invariants.

use super::*;

/// Expected probabilities after temperature, top-k and top-p, computed in f64 by brute force.
fn expected(z: &[f32], t: f64, k: usize, p: f64) -> Vec<f64> {
    let s: Vec<f64> = z.iter().map(|&x| x as f64 / t).collect();
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap().then(a.cmp(&b)));
    let k = if k == 0 { s.len() } else { k };
    let w: Vec<f64> = s.iter().map(|x| x.exp()).collect();
    let tot: f64 = idx[..k].iter().map(|&i| w[i]).sum();
    let (mut acc, mut kept) = (0.0, 0);
    for &i in &idx[..k] {
        acc += w[i];
        kept += 1;
        if acc >= p * tot {
            break;
        }
    }
    let ks: f64 = idx[..kept].iter().map(|&i| w[i]).sum();
    let mut out = vec![0.0; s.len()];
    for &i in &idx[..kept] {
        out[i] = w[i] / ks;
    }
    out
}

#[test]
fn empirical_frequencies_match_the_truncated_distribution() {
    let z = [1.0f32, 2.5, -0.5, 2.5, 0.0, 1.7, -2.0, 3.0];
    let n = 40_000u32;
    for (t, k, p) in [(1.0f32, 0u32, 1.0f32), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.6), (1.0, 4, 0.9), (0.7, 1, 1.0)]
    {
        let want = expected(&z, t as f64, k as usize, p as f64);
        let mut count = vec![0u32; z.len()];
        for pos in 0..n {
            let sp = SampleParams { temperature: t, top_k: k, top_p: p, seed: 9, request: 1, sample: 0, position: pos };
            let (tok, lp) = sample_row(&z, &sp);
            count[tok as usize] += 1;
            assert!(want[tok as usize] > 0.0, "drew token {tok} outside the kept set");
            assert!((lp as f64 - want[tok as usize].ln()).abs() < 1e-5, "logprob {lp} vs {}", want[tok as usize].ln());
        }
        for (i, &c) in count.iter().enumerate() {
            let (f, q) = (c as f64 / n as f64, want[i]);
            let sd = (q * (1.0 - q) / n as f64).sqrt();
            assert!((f - q).abs() <= 5.0 * sd + 1e-12, "T={t} k={k} p={p} token {i}: freq {f} vs {q}");
        }
    }
}

#[test]
fn greedy_takes_the_first_maximum_and_reports_its_log_softmax() {
    let z = [0.5f32, 2.0, 2.0, -1.0];
    let sp = SampleParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, request: 0, sample: 0, position: 0 };
    let (t, lp) = sample_row(&z, &sp);
    assert_eq!(t, 1);
    let lse = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    assert!((lp as f64 - (2.0 - lse)).abs() < 1e-6);
}

#[test]
fn greedy_is_the_first_maximum_of_the_plain_scan_on_edge_rows() {
    let scan = |z: &[f32]| {
        let mut best = 0usize;
        for (i, &x) in z.iter().enumerate() {
            if x > z[best] {
                best = i;
            }
        }
        best as u32
    };
    let nan = f32::NAN;
    let rows: [&[f32]; 8] = [
        &[0.5, 2.0, 2.0, -1.0],
        &[nan, 3.0, 1.0],
        &[1.0, nan, 3.0, 3.0],
        &[-0.0, 0.0, -1.0],
        &[0.0, -0.0, -1.0],
        &[f32::NEG_INFINITY; 5],
        &[-3.0, f32::INFINITY, 1.0, f32::INFINITY],
        &[nan, nan],
    ];
    let sp = SampleParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, request: 0, sample: 0, position: 0 };
    for z in rows {
        assert_eq!(sample_row(z, &sp).0, scan(z), "{z:?}");
    }
    let mut s = crate::rand::Stream::new(12, 1);
    for _ in 0..50 {
        let z: Vec<f32> = (0..1000).map(|_| (s.normal() * 2.0).round() as f32).collect();
        assert_eq!(sample_row(&z, &sp).0, scan(&z));
    }
}

#[test]
fn same_key_same_token_different_key_varies() {
    let z: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let sp = |pos, sample| SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.95,
        seed: 4,
        request: 2,
        sample,
        position: pos,
    };
    assert_eq!(sample_row(&z, &sp(3, 0)), sample_row(&z, &sp(3, 0)));
    let draws: std::collections::HashSet<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 0)).0).collect();
    assert!(draws.len() > 10);
    let other: Vec<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 1)).0).collect();
    let base: Vec<u32> = (0..40).map(|p| sample_row(&z, &sp(p, 0)).0).collect();
    assert_ne!(other, base);
}
