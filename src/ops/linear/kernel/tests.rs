//! Tests of the CPU linear kernel: each instruction set against the documented FMA chain and an f64
//! reference, batch invariance, strided and accumulated output, the transposes, and weights
//! packed once (`panels`) against packing per call, bit for bit.

use super::*;
use half::bf16;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 0);
    (0..n).map(|_| s.normal() as f32).collect()
}

const SHAPES: [(usize, usize, usize); 12] = [
    (1, 1, 1),
    (5, 7, 9),
    (3, 4, 8),
    (200, 37, 70),
    (7, 130, 33),
    (2, 300, 64),
    (17, 29, 5),
    (9, 16, 12),
    (20, 40, 21),
    (33, 70, 16),
    (4, 3, 0),
    // A first chunk (192 rows) whose transposed x is over PRIVATE_XT_BYTES: shared.
    (200, 37, 400),
];

#[test]
fn matches_f64_reference_on_ragged_shapes() {
    // |y − Σ x·w (f64)| ≤ 4e-5·√k + 1e-5·|ref| (f32 inputs ~N(0,1), sequential f32 FMA chain).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for &(m, n, k) in &SHAPES {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        for isa in Isa::available() {
            let mut y = vec![f32::NAN; m * n];
            pool.install(|| linear_isa(isa, m, k, &x, &mut [Job::rows(CpuFloats::F32(&w), n, &mut y, n, false)]));
            for i in 0..m {
                for j in 0..n {
                    let r: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                    assert!(
                        (y[i * n + j] as f64 - r).abs() <= tol + 1e-5 * r.abs(),
                        "{isa:?} ({m},{n},{k}) [{i},{j}]: {} vs {r}",
                        y[i * n + j]
                    );
                }
            }
        }
    }
}

#[test]
fn every_isa_computes_the_documented_fma_chain_bitwise() {
    // The spec, written out here: acc = fma(x[i][p], w[j][p], acc) for p = 0..k, from 0.
    for &(m, n, k) in &SHAPES {
        let x = data(m * k, 7);
        let w = data(n * k, 8);
        let mut spec = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                spec[i * n + j] = (0..k).fold(0.0f32, |a, p| x[i * k + p].mul_add(w[j * k + p], a));
            }
        }
        for isa in Isa::available() {
            let mut y = vec![f32::NAN; m * n];
            linear_isa(isa, m, k, &x, &mut [Job::rows(CpuFloats::F32(&w), n, &mut y, n, false)]);
            let bad = y.iter().zip(&spec).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad, None, "{isa:?} ({m},{n},{k}) differs from the FMA chain");
        }
    }
}

#[test]
fn rows_are_batch_invariant_bitwise() {
    // At k = 400 the 250-row call's first chunk shares one transposed x (over
    // PRIVATE_XT_BYTES) while the smaller calls transpose per thread.
    const _: () = assert!(192 * 400 * 4 > PRIVATE_XT_BYTES && 64 * 400 * 4 <= PRIVATE_XT_BYTES);
    let n = 77;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for k in [45, 400] {
        let w = data(n * k, 3);
        let xs = data(250 * k, 4);
        let mut all = vec![0.0; 250 * n];
        pool.install(|| linear_nt(250, n, k, &xs, CpuFloats::F32(&w), &mut all, n, false));
        for (start, len) in [(0, 1), (13, 1), (10, 7), (49, 1), (4, 40), (190, 60), (3, 9)] {
            let mut part = vec![0.0; len * n];
            pool.install(|| linear_nt(len, n, k, &xs[start * k..], CpuFloats::F32(&w), &mut part, n, false));
            assert_eq!(part, all[start * n..(start + len) * n].to_vec(), "k {k}, rows {start}..+{len}");
        }
    }
}

#[test]
fn strided_output_and_accumulate() {
    // ldy > n leaves the gap untouched; accumulate adds the same sum once more.
    for (m, n, k, ldy) in [(11, 21, 30, 25), (35, 48, 19, 53)] {
        let x = data(m * k, 9);
        let w = data(n * k, 10);
        let mut y = vec![-7.0f32; m * ldy];
        linear_nt(m, n, k, &x, CpuFloats::F32(&w), &mut y, ldy, false);
        let first = y.clone();
        linear_nt(m, n, k, &x, CpuFloats::F32(&w), &mut y, ldy, true);
        for i in 0..m {
            for j in 0..ldy {
                let (a, b) = (first[i * ldy + j], y[i * ldy + j]);
                if j < n {
                    assert_eq!(b, a + a, "[{i},{j}]");
                } else {
                    assert_eq!((a, b), (-7.0, -7.0), "gap [{i},{j}] was written");
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "row stride")]
fn overlapping_output_rows_are_refused() {
    // ldy < n with two rows would let two tasks write the same element.
    let (x, w) = (data(2 * 4, 12), data(8 * 4, 13));
    let mut y = vec![0.0f32; 16];
    linear_nt(2, 8, 4, &x, CpuFloats::F32(&w), &mut y, 4, false);
}

#[test]
fn empty_reduction_writes_zeros_even_with_a_zero_stride() {
    let mut y = vec![5.0f32; 3];
    linear_nt(1, 3, 0, &[], CpuFloats::F32(&[]), &mut y, 0, false);
    assert_eq!(y, vec![0.0; 3]);
    let mut y = vec![5.0f32; 7];
    linear_nt(2, 3, 0, &[], CpuFloats::F32(&[]), &mut y, 4, true);
    assert_eq!(y, vec![5.0; 7], "accumulate adds nothing");
}

#[test]
fn transposes_agree_on_every_isa() {
    // The scalar loop, written out, against what `transpose` does on each instruction set.
    for rows in [1usize, 5, 16, 17, 33] {
        for k in [1usize, 15, 16, 17, 40, 64] {
            let x = data(rows * k, 16);
            let mut want = vec![0.0f32; rows.div_ceil(G) * G * k];
            for i in 0..rows {
                for p in 0..k {
                    want[(i / G) * G * k + p * G + i % G] = x[i * k + p];
                }
            }
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; want.len()];
                transpose(isa, &x, rows, k, &mut got);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{isa:?} rows {rows} k {k}"
                );
            }
        }
    }
}

#[test]
fn prepacked_panels_give_the_row_major_bits() {
    // Every shape, instruction set and stored dtype; strided output and accumulate too.
    for &(m, n, k) in &SHAPES {
        let x = data(m * k, 14);
        let wf = data(n * k, 15);
        let wb: Vec<bf16> = wf.iter().map(|v| bf16::from_f32(*v)).collect();
        let wh: Vec<half::f16> = wf.iter().map(|v| half::f16::from_f32(*v)).collect();
        for w in [CpuFloats::F32(&wf), CpuFloats::BF16(&wb), CpuFloats::F16(&wh)] {
            let p = Panels::pack(w, n, k).expect("float weights pack");
            assert_eq!(p.dims(), (n, k));
            for isa in Isa::available() {
                let ldy = n + 3;
                let (mut a, mut b) = (vec![0.5f32; m * ldy], vec![0.5f32; m * ldy]);
                for acc in [false, true] {
                    linear_isa(isa, m, k, &x, &mut [Job::rows(w, n, &mut a, ldy, acc)]);
                    linear_isa(isa, m, k, &x, &mut [Job::panels(&p, &mut b, ldy, acc)]);
                    let bad = a.iter().zip(&b).position(|(u, v)| u.to_bits() != v.to_bits());
                    assert_eq!(bad, None, "{isa:?} ({m},{n},{k}) accumulate {acc}");
                }
            }
        }
    }
    let codes = vec![0u8; 64];
    assert!(Panels::pack(CpuFloats::Fp8 { codes: &codes, scale: 1.0 }, 4, 16).is_none(), "FP8 codes stay row-major");
}

#[test]
fn bf16_weights_equal_widened_f32() {
    let (m, n, k) = (9, 70, 40);
    let x = data(m * k, 5);
    let wb: Vec<bf16> = data(n * k, 6).into_iter().map(bf16::from_f32).collect();
    let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
    let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
    linear_nt(m, n, k, &x, CpuFloats::BF16(&wb), &mut a, n, false);
    linear_nt(m, n, k, &x, CpuFloats::F32(&wf), &mut b, n, false);
    assert_eq!(a, b);
}

#[test]
fn many_linears_in_one_call_equal_each_alone_plus_bias() {
    // q/k/v-like: one x, three weights (row-major f32, packed once, row-major BF16), strided and
    // accumulated outputs, biases; each output must equal its own `linear_nt` followed by
    // y += bias, bit for bit, on every ISA and for every row count (ragged groups, > MB rows).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let k = 40;
    let dims = [(37usize, 40usize), (16, 19), (5, 5)]; // (n, ldy)
    for m in [1, 7, 9, 16, 33, 200] {
        let x = data(m * k, 21);
        let ws: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, &(n, _))| data(n * k, 30 + i as u64)).collect();
        let wb: Vec<bf16> = ws[2].iter().map(|&v| bf16::from_f32(v)).collect();
        let bias: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, &(n, _))| data(n, 40 + i as u64)).collect();
        let p1 = Panels::pack(CpuFloats::F32(&ws[1]), dims[1].0, k).unwrap();
        let init: Vec<Vec<f32>> = dims.iter().enumerate().map(|(i, &(_, ldy))| data(m * ldy, 50 + i as u64)).collect();
        // Reference: one call each, then the bias added afterwards.
        let mut want = init.clone();
        let srcs = [CpuFloats::F32(&ws[0]), CpuFloats::F32(&ws[1]), CpuFloats::BF16(&wb)];
        let acc = [false, true, false];
        for (i, &(n, ldy)) in dims.iter().enumerate() {
            pool.install(|| linear_nt(m, n, k, &x, srcs[i], &mut want[i], ldy, acc[i]));
            for r in 0..m {
                for j in 0..n {
                    want[i][r * ldy + j] += bias[i][j];
                }
            }
        }
        for isa in Isa::available() {
            let mut got = init.clone();
            let [g0, g1, g2] = &mut got[..] else { unreachable!() };
            let mut jobs = [
                Job::rows(srcs[0], dims[0].0, g0, dims[0].1, acc[0]).with_bias(Some(&bias[0])),
                Job::panels(&p1, g1, dims[1].1, acc[1]).with_bias(Some(&bias[1])),
                Job::rows(srcs[2], dims[2].0, g2, dims[2].1, acc[2]).with_bias(Some(&bias[2])),
            ];
            pool.install(|| linear_isa(isa, m, k, &x, &mut jobs));
            for i in 0..3 {
                let same = got[i].iter().zip(&want[i]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?} m={m}: output {i} differs from its own call + bias");
            }
        }
    }
}

#[test]
fn empty_reduction_with_bias_gives_the_bias() {
    // k = 0: the sum is 0, so y = bias (or y + bias when accumulating).
    let (b, mut y) = ([1.5f32, -2.0, 0.25], vec![10.0f32; 6]);
    linear_many(2, 0, &[], &mut [Job::rows(CpuFloats::F32(&[]), 3, &mut y, 3, true).with_bias(Some(&b))]);
    assert_eq!(y, [11.5, 8.0, 10.25, 11.5, 8.0, 10.25]);
    linear_many(2, 0, &[], &mut [Job::rows(CpuFloats::F32(&[]), 3, &mut y, 3, false).with_bias(Some(&b))]);
    assert_eq!(y, [1.5, -2.0, 0.25, 1.5, -2.0, 0.25]);
}

#[test]
fn streamed_output_has_the_plain_bits() {
    // Rows of y on cache lines (a 64-byte aligned start, a stride of 32 floats), so that
    // AVX-512's full tiles take the non-temporal stores; ragged shapes take the plain ones.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for &(m, n, k) in &[(32, 64, 40), (33, 70, 16), (17, 29, 5), (200, 37, 400), (9, 16, 12)] {
        let (x, w) = (data(m * k, 21), data(n * k, 22));
        let p = Panels::pack(CpuFloats::F32(&w), n, k).unwrap();
        let ldy = n.next_multiple_of(32);
        for isa in Isa::available() {
            let mut plain = vec![f32::NAN; m * ldy];
            let mut buf = vec![f32::NAN; m * ldy + 16];
            let off = buf.as_ptr().align_offset(64);
            let streamed = &mut buf[off..off + m * ldy];
            pool.install(|| {
                linear_isa(isa, m, k, &x, &mut [Job::panels(&p, &mut plain, ldy, false)]);
                linear_isa(isa, m, k, &x, &mut [Job::panels(&p, streamed, ldy, false).streamed()]);
            });
            for i in 0..m {
                let (a, b) = (&plain[i * ldy..i * ldy + n], &streamed[i * ldy..i * ldy + n]);
                assert!(a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} ({m},{n},{k}) row {i}");
                assert!(
                    streamed[i * ldy + n..(i + 1) * ldy].iter().all(|v| v.is_nan()),
                    "{isa:?}: wrote past column {n}"
                );
            }
        }
    }
}
