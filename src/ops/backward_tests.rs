//! The layers' backward ops on every device (CPU, cuda-sim) against the f64 twins of their
//! rooms' `grad.rs` on the same values: RMSNorm (forward with the saved 1/rms, backward with
//! the weight gradient; a row wider than a block, and the per-head shape), RoPE, SwiGLU, the
//! embedding (repeated ids, a padding id) and the bias gradient. Tolerance |a − ref| ≤ atol +
//! rtol·|ref| with atol = rtol = 1e-5 (f32 arithmetic against f64; CUDA sums the RMSNorm rows
//! in another order and evaluates exp with its own expf).

use super::{elementwise, linear, norm, rope};
use crate::device::{DType, Device, Tensor};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = crate::rand::Stream::new(seed, 9);
    (0..n).map(|_| s.normal() as f32).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn close(dev: &Device, what: &str, got: &Tensor, want: &[f64]) {
    let got = got.to_f32_vec().unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - r).abs() <= 1e-5 + 1e-5 * r.abs(), "{} {what}[{i}]: {g} vs {r}", dev.name());
    }
}

fn backward_ops(dev: &Device) {
    let t = |shape: &[usize], v: &[f32]| dev.from_f32(DType::F32, shape, v).unwrap();
    // RMSNorm: 7 rows of 300 (wider than the kernel's 256 threads), then 12 heads' rows of 24,
    // then 70 such rows (dw summed in 3 chunks of 32 rows, `ops::reduction_chunk_rows`).
    for (m, c) in [(7usize, 300usize), (12, 24), (70, 24)] {
        let (xs, ws, dys, dx0, dw0) = (data(m * c, 1), data(c, 2), data(m * c, 3), data(m * c, 4), data(c, 5));
        let (x, w, dy) = (t(&[m, c], &xs), t(&[c], &ws), t(&[m, c], &dys));
        let (mut y, mut rstd) = (t(&[m, c], &vec![f32::NAN; m * c]), t(&[m], &vec![f32::NAN; m]));
        norm::rmsnorm_train(dev, &x, &w, 1e-6, &mut y, &mut rstd, m).unwrap();
        let (mut y64, mut r64) = (vec![0.0; m * c], vec![0.0; m]);
        norm::grad::fwd(m, c, &f64s(&xs), &f64s(&ws), 1e-6, &mut y64, &mut r64);
        close(dev, "rmsnorm y", &y, &y64);
        close(dev, "rmsnorm rstd", &rstd, &r64);
        for acc in [false, true] {
            let (mut dx, mut dw) = (t(&[m, c], &dx0), t(&[c], &dw0));
            norm::rmsnorm_bwd(dev, &dy, &x, &w, &rstd, &mut dx, acc, &mut dw, m).unwrap();
            let (mut dx64, mut dw64) = (f64s(&dx0), f64s(&dw0));
            let rs = f64s(&rstd.to_f32_vec().unwrap());
            norm::grad::bwd(m, c, &f64s(&dys), &f64s(&xs), &f64s(&ws), &rs, &mut dx64, acc, &mut dw64);
            close(dev, &format!("rmsnorm dx (accumulate {acc})"), &dx, &dx64);
            close(dev, &format!("rmsnorm dw (accumulate {acc})"), &dw, &dw64);
        }
    }
    // RoPE backward: 5 rows of 3 heads of 16.
    let (m, heads, d) = (5usize, 3usize, 16usize);
    let (xs, cs, ss) = (data(m * heads * d, 6), data(m * d / 2, 7), data(m * d / 2, 8));
    let mut x = t(&[m, heads * d], &xs);
    rope::rope_bwd(dev, &mut x, &t(&[m, d / 2], &cs), &t(&[m, d / 2], &ss), m, heads).unwrap();
    let mut x64 = f64s(&xs);
    rope::grad::bwd(m, heads, d, &mut x64, &f64s(&cs), &f64s(&ss));
    close(dev, "rope backward", &x, &x64);
    // SwiGLU backward over 1000 values.
    let n = 1000;
    let (das, gs, us) = (data(n, 10), data(n, 11), data(n, 12));
    let (mut dg, mut du) = (t(&[n], &vec![f32::NAN; n]), t(&[n], &vec![f32::NAN; n]));
    elementwise::swiglu_bwd(dev, &t(&[n], &das), &t(&[n], &gs), &t(&[n], &us), &mut dg, &mut du).unwrap();
    let (mut dg64, mut du64) = (vec![0.0; n], vec![0.0; n]);
    elementwise::grad::swiglu_bwd(&f64s(&das), &f64s(&gs), &f64s(&us), &mut dg64, &mut du64);
    close(dev, "swiglu dg", &dg, &dg64);
    close(dev, "swiglu du", &du, &du64);
    // Embedding backward: 9 tokens over a vocabulary of 6, ids repeated, id 0 the padding.
    let (v, c) = (6usize, 33usize);
    let ids = vec![3u32, 1, 3, 0, 5, 3, 1, 0, 2];
    let (dxs, t0) = (data(ids.len() * c, 13), data(v * c, 14));
    let idt = dev.upload(Tensor::from_u32_host(&[ids.len()], ids.clone()).unwrap()).unwrap();
    let mut dt = t(&[v, c], &t0);
    elementwise::embed_bwd(dev, &idt, &t(&[ids.len(), c], &dxs), &mut dt, ids.len(), Some(0)).unwrap();
    let mut dt64 = f64s(&t0);
    elementwise::grad::embed_bwd(c, &ids, &f64s(&dxs), &mut dt64, Some(0));
    close(dev, "embedding backward", &dt, &dt64);
    // Bias gradient: column sums of 37 rows of 45.
    let (m, n) = (37usize, 45usize);
    let (dys, b0) = (data(m * n, 15), data(n, 16));
    let mut db = t(&[n], &b0);
    linear::bias_grad(dev, &t(&[m, n], &dys), &mut db, m).unwrap();
    let mut db64 = f64s(&b0);
    linear::grad::bias_grad(m, n, &f64s(&dys), &mut db64);
    close(dev, "bias gradient", &db, &db64);
}

test_device!(backward_ops, backward_ops_cpu, backward_ops_sim, backward_ops_cuda);

#[test]
fn the_ordered_backward_kernels_equal_the_cpu_bit_for_bit() {
    // RoPE, the bias gradient and the embedding backward add in the CPU's order.
    let (cpu, sim) = (Device::cpu(1).unwrap(), Device::parse("cuda-sim:0").unwrap());
    let run = |dev: &Device| {
        let t = |shape: &[usize], v: &[f32]| dev.from_f32(DType::F32, shape, v).unwrap();
        let mut x = t(&[4, 32], &data(128, 20));
        rope::rope_bwd(dev, &mut x, &t(&[4, 8], &data(32, 21)), &t(&[4, 8], &data(32, 22)), 4, 2).unwrap();
        let mut db = t(&[40], &data(40, 23));
        linear::bias_grad(dev, &t(&[300, 40], &data(12000, 24)), &mut db, 300).unwrap();
        let ids = vec![2u32, 2, 2, 1, 2, 0, 1];
        let h = Tensor::from_u32_host(&[7], ids).unwrap();
        let idt = dev.upload(h).unwrap();
        let mut dt = t(&[3, 16], &data(48, 25));
        elementwise::embed_bwd(dev, &idt, &t(&[7, 16], &data(112, 26)), &mut dt, 7, None).unwrap();
        [x, db, dt].map(|t| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>())
    };
    let (a, b) = (run(&cpu), run(&sim));
    for (what, (x, y)) in ["rope backward", "bias gradient", "embedding backward"].iter().zip(a.iter().zip(&b)) {
        assert_eq!(x, y, "{what}");
    }
}

/// The column sums (RMSNorm's dw, the bias gradient) follow `ops::reduction_chunk_rows` on the
/// CPU and on the GPU: the same bits whether the rows fit one chunk (20: added onto the total
/// in order), fill 41 chunks of 32 rows, or 1,000 chunks of 40 rows (40,000 rows of 8: a
/// per-head norm's shape, where the chunks grow past 32 rows).
#[test]
fn the_column_sums_are_the_same_bits_on_the_cpu_and_the_gpu() {
    assert_eq!([20, 1300, 40_000].map(crate::ops::reduction_chunk_rows), [32, 32, 40]);
    let (cpu, sim) = (Device::cpu(2).unwrap(), Device::parse("cuda-sim:0").unwrap());
    for (m, c) in [(20usize, 40usize), (1300, 40), (40_000, 8)] {
        let run = |dev: &Device| {
            let t = |shape: &[usize], v: &[f32]| dev.from_f32(DType::F32, shape, v).unwrap();
            let (x, dy) = (t(&[m, c], &data(m * c, 30)), t(&[m, c], &data(m * c, 31)));
            let rstd: Vec<f32> = data(m, 32).iter().map(|v| 0.5 + v.abs()).collect();
            let (mut dx, mut dw) = (t(&[m, c], &vec![0.0; m * c]), t(&[c], &data(c, 33)));
            norm::rmsnorm_bwd(dev, &dy, &x, &t(&[c], &data(c, 34)), &t(&[m], &rstd), &mut dx, false, &mut dw, m)
                .unwrap();
            let mut db = t(&[c], &data(c, 35));
            linear::bias_grad(dev, &dy, &mut db, m).unwrap();
            [dw, db].map(|t| t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>())
        };
        let (a, b) = (run(&cpu), run(&sim));
        assert_eq!(a[0], b[0], "rmsnorm dw of {m} rows");
        assert_eq!(a[1], b[1], "bias gradient of {m} rows");
    }
}

/// Training attention on every device against the f64 twin: GQA ratios 1, 3 and 7 at head_dim
/// 24, 64 and 128, packed sequences of 5, 1, 130 (across a 128-key tile), 0 and 9 tokens.
/// Tolerance 2e-5 + 1e-4·|ref| (f32 dot products and softmax sums against f64).
fn attention_train(dev: &Device) {
    use super::attention::grad::{self as agrad, Shape};
    use super::attention::train::{self, Packed};
    let cu: Vec<u32> = vec![0, 5, 6, 136, 136, 145];
    let t = 145usize;
    let cu_t = dev.upload(Tensor::from_u32_host(&[cu.len()], cu.clone()).unwrap()).unwrap();
    let cus: Vec<usize> = cu.iter().map(|&x| x as usize).collect();
    for (h, hkv, d) in [(2usize, 2usize, 24usize), (6, 2, 64), (7, 1, 128)] {
        let s = Shape { heads: h, kv_heads: hkv, head_dim: d };
        let (qs, ks, vs, dos) =
            (data(t * h * d, 40), data(t * hkv * d, 41), data(t * hkv * d, 42), data(t * h * d, 43));
        let f = |shape: &[usize], v: &[f32]| dev.from_f32(DType::F32, shape, v).unwrap();
        let (q, k, v, dout) = (f(&[t, h * d], &qs), f(&[t, hkv * d], &ks), f(&[t, hkv * d], &vs), f(&[t, h * d], &dos));
        let x = Packed { q: &q, k: &k, v: &v, cu: &cu_t, offsets: &cus };
        let (mut out, mut lse) = (f(&[t, h * d], &vec![f32::NAN; t * h * d]), f(&[t, h], &vec![f32::NAN; t * h]));
        train::fwd(dev, &s, &x, &mut out, &mut lse).unwrap();
        let (mut o64, mut l64) = (vec![0.0; t * h * d], vec![0.0; t * h]);
        agrad::fwd(&s, &cus, &f64s(&qs), &f64s(&ks), &f64s(&vs), &mut o64, &mut l64);
        let what = format!("h{h}/kv{hkv} d{d}");
        let close2 = |a: &Tensor, r: &[f64], name: &str| {
            let g = a.to_f32_vec().unwrap();
            for (i, (&x, &y)) in g.iter().zip(r).enumerate() {
                assert!((x as f64 - y).abs() <= 2e-5 + 1e-4 * y.abs(), "{} {what} {name}[{i}]: {x} vs {y}", dev.name());
            }
        };
        close2(&out, &o64, "out");
        close2(&lse, &l64, "lse");
        let (mut dq, mut dk, mut dv) = (
            f(&[t, h * d], &vec![f32::NAN; t * h * d]),
            f(&[t, hkv * d], &vec![f32::NAN; t * hkv * d]),
            f(&[t, hkv * d], &vec![f32::NAN; t * hkv * d]),
        );
        train::bwd(dev, &s, &x, &out, &lse, &dout, &mut dq, &mut dk, &mut dv).unwrap();
        let (mut dq64, mut dk64, mut dv64) = (vec![0.0; t * h * d], vec![0.0; t * hkv * d], vec![0.0; t * hkv * d]);
        agrad::bwd(
            &s,
            &cus,
            &f64s(&qs),
            &f64s(&ks),
            &f64s(&vs),
            &o64,
            &l64,
            &f64s(&dos),
            &mut dq64,
            &mut dk64,
            &mut dv64,
        );
        close2(&dq, &dq64, "dq");
        close2(&dk, &dk64, "dk");
        close2(&dv, &dv64, "dv");
    }
}

test_device!(attention_train, attention_train_cpu, attention_train_sim, attention_train_cuda);

/// The backward's tolerance, |Δ| ≤ BWD_TOL·(1 + |ref|): P and dS rounded to BF16 before their
/// products, sums over up to 130 rows; the worst seen on these inputs is 8e-3 (dv, d128).
const BWD_TOL: f64 = 2e-2;

/// The tensor-core forward (ct_attn_fwd_tc) against the f64 twin on the BF16-rounded q, k, v:
/// what is left is the BF16 rounding of the probabilities before P·V and the FP32 sums, so
/// out within 5e-3 + 5e-3·|ref| and lse (from the unrounded FP32 probabilities) within 1e-4 +
/// 1e-4·|ref|. GQA ratios 1, 3, 7 at head_dim 16, 64, 128; the packed sequences (5, 1, 130, 0,
/// 9 tokens) put several sequences in one 64-row block and cross key tiles. On a CUDA device
/// the result also differs from the CUDA-core forward's (the rounding is there: the tensor-core
/// kernel ran). Then the tensor-core backward (dq, dk, dv from the f64 forward's out and lse)
/// against the f64 twin within BWD_TOL.
fn attention_tensor_cores(dev: &Device) {
    use super::attention::grad::{self as agrad, Shape};
    use super::attention::train::{self, Packed};
    let cu: Vec<u32> = vec![0, 5, 6, 136, 136, 145];
    let t = 145usize;
    let cu_t = dev.upload(Tensor::from_u32_host(&[cu.len()], cu.clone()).unwrap()).unwrap();
    let cus: Vec<usize> = cu.iter().map(|&x| x as usize).collect();
    let bf = |v: Vec<f32>| v.into_iter().map(|x| crate::device::bf16_rne(x).to_f32()).collect::<Vec<f32>>();
    for (h, hkv, d) in [(2usize, 2usize, 16usize), (6, 2, 64), (7, 1, 128)] {
        let s = Shape { heads: h, kv_heads: hkv, head_dim: d };
        assert!(train::tensor_cores_fit(&s));
        let (qs, ks, vs) = (bf(data(t * h * d, 50)), bf(data(t * hkv * d, 51)), bf(data(t * hkv * d, 52)));
        let f = |shape: &[usize], v: &[f32]| dev.from_f32(DType::F32, shape, v).unwrap();
        let (q, k, v) = (f(&[t, h * d], &qs), f(&[t, hkv * d], &ks), f(&[t, hkv * d], &vs));
        let x = Packed { q: &q, k: &k, v: &v, cu: &cu_t, offsets: &cus };
        let (mut out, mut lse) = (f(&[t, h * d], &vec![f32::NAN; t * h * d]), f(&[t, h], &vec![f32::NAN; t * h]));
        train::fwd_tensor_cores(dev, &s, &x, &mut out, &mut lse).unwrap();
        let (mut o64, mut l64) = (vec![0.0; t * h * d], vec![0.0; t * h]);
        agrad::fwd(&s, &cus, &f64s(&qs), &f64s(&ks), &f64s(&vs), &mut o64, &mut l64);
        let what = format!("{} tensor cores h{h}/kv{hkv} d{d}", dev.name());
        for (name, a, r, tol) in [("out", &out, &o64, 5e-3), ("lse", &lse, &l64, 1e-4)] {
            for (i, (&x, &y)) in a.to_f32_vec().unwrap().iter().zip(r).enumerate() {
                assert!((x as f64 - y).abs() <= tol + tol * y.abs(), "{what} {name}[{i}]: {x} vs {y}");
            }
        }
        if !dev.is_cpu() {
            let (mut o2, mut l2) = (f(&[t, h * d], &vec![0.0; t * h * d]), f(&[t, h], &vec![0.0; t * h]));
            train::fwd(dev, &s, &x, &mut o2, &mut l2).unwrap();
            let (a, b) = (out.to_f32_vec().unwrap(), o2.to_f32_vec().unwrap());
            assert!(a.iter().zip(&b).any(|(x, y)| x != y), "{what}: identical to the CUDA-core forward");
        }
        // The backward from the f64 forward's out and lse (so only the backward's own rounding
        // is measured), against the f64 twin.
        let dos = bf(data(t * h * d, 53));
        let (o64f, l64f): (Vec<f32>, Vec<f32>) =
            (o64.iter().map(|&x| x as f32).collect(), l64.iter().map(|&x| x as f32).collect());
        let (o_t, l_t, dout) = (f(&[t, h * d], &o64f), f(&[t, h], &l64f), f(&[t, h * d], &dos));
        let nan = |n: usize, w: usize| f(&[t, w], &vec![f32::NAN; n]);
        let (mut dq, mut dk, mut dv) = (nan(t * h * d, h * d), nan(t * hkv * d, hkv * d), nan(t * hkv * d, hkv * d));
        train::bwd_tensor_cores(dev, &s, &x, &o_t, &l_t, &dout, &mut dq, &mut dk, &mut dv).unwrap();
        let (mut dq64, mut dk64, mut dv64) = (vec![0.0; t * h * d], vec![0.0; t * hkv * d], vec![0.0; t * hkv * d]);
        agrad::bwd(
            &s,
            &cus,
            &f64s(&qs),
            &f64s(&ks),
            &f64s(&vs),
            &f64s(&o64f),
            &f64s(&l64f),
            &f64s(&dos),
            &mut dq64,
            &mut dk64,
            &mut dv64,
        );
        for (name, a, r) in [("dq", &dq, &dq64), ("dk", &dk, &dk64), ("dv", &dv, &dv64)] {
            let g = a.to_f32_vec().unwrap();
            let worst =
                g.iter().zip(r.iter()).map(|(&x, &y)| (x as f64 - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max);
            eprintln!("{what} {name}: worst |Δ|/(1+|ref|) {worst:.2e}");
            for (i, (&x, &y)) in g.iter().zip(r.iter()).enumerate() {
                assert!((x as f64 - y).abs() <= BWD_TOL * (1.0 + y.abs()), "{what} {name}[{i}]: {x} vs {y}");
            }
        }
    }
    let s = Shape { heads: 2, kv_heads: 2, head_dim: 24 };
    assert!(!train::tensor_cores_fit(&s), "head_dim 24 stays on the CUDA cores");
}

test_device!(
    attention_tensor_cores,
    attention_tensor_cores_cpu,
    attention_tensor_cores_sim,
    attention_tensor_cores_cuda
);

/// At the 4B's shapes the weight gradients' column sums fill an H200 in the launch ledger
/// (`ledger.rs`: a grid of fewer blocks than SMs gets their share of the bandwidth): RMSNorm
/// over 32,768 rows of 2,560, the per-head norm over 1,048,576 rows of 128 and a bias gradient
/// of each shape take at most 1.2 × their bytes at full bandwidth, both passes together. (One
/// thread per column over every row ran on 20 and on 1 of the 132 SMs: 6.6 × and 132 ×.)
#[test]
fn the_column_sums_fill_the_gpu_at_a_models_shapes() {
    let gpu = crate::device::CudaDevice::sim_dry(7, Some("sm_90a")).unwrap();
    let dev = Device::Cuda(gpu.clone());
    for (m, c) in [(32_768usize, 2_560usize), (1 << 20, 128)] {
        let z = |shape: &[usize]| dev.zeros(DType::F32, shape).unwrap();
        let (x, dy, w, rstd) = (z(&[m, c]), z(&[m, c]), z(&[c]), z(&[m]));
        let (mut dx, mut dw, mut db) = (z(&[m, c]), z(&[c]), z(&[c]));
        gpu.take_ledger();
        norm::rmsnorm_bwd(&dev, &dy, &x, &w, &rstd, &mut dx, false, &mut dw, m).unwrap();
        linear::bias_grad(&dev, &dy, &mut db, m).unwrap();
        let l = gpu.take_ledger();
        let sums: Vec<_> = l.entries().filter(|(k, _)| ["ct_rmsnorm_dw", "ct_col_sum"].contains(&k.2)).collect();
        assert_eq!(sums.iter().map(|(_, e)| e.launches).sum::<u64>(), 4, "{m} rows: two passes each");
        let (secs, bytes) = sums.iter().fold((0.0, 0.0), |(s, b), (_, e)| (s + e.seconds[0], b + e.bytes));
        assert!(bytes > 8.0 * (m * c) as f64, "{m} rows: {bytes} bytes");
        assert!(secs <= 1.2 * bytes / 4.8e12, "{m} rows of {c}: {secs} s for {bytes} bytes");
    }
}
