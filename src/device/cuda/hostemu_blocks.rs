//! Tests that need no GPU: the block-level kernels of csrc/kernels run under the host emulation
//! of csrc/hostemu (blocks.cpp, with the real launch shapes; the threads of a block are fibers,
//! so __syncthreads, warp shuffles and shared memory are exercised) and are compared with their
//! CPU twins:
//!   - ct_sample + ct_sample_topk against `ops::sample::sample_row`: greedy, untruncated, top-k,
//!     top-p and both, logits with many exact ties, vocabularies below and above CT_TOPK_CAP,
//!     rows the kernel must leave to the host;
//!   - ct_log_softmax_gather against `row_log_normalizer`;
//!   - ct_paged_attention and ct_prefill_attention against `ops::attention::paged_attention`
//!     (f32, BF16 and FP8 caches, GQA, prefill and decode rows, several sequences, several row
//!     and key tiles);
//!   - ct_rmsnorm (with the residual add) against `ops::norm::add_rmsnorm`.
//!
//! Host libm and CUDA's expf / logf may differ by an ulp and the emulation contracts nothing into
//! FMAs, so this checks arithmetic, indexing and synchronization, not the GPU: the device check
//! does that on hardware. Skipped (with a message) when no C++ compiler is found.

use super::hostemu::{compile, f32s, read};
use crate::device::cuda::ffi;
use crate::ops::logprob::row_log_normalizer;
use crate::ops::sample::{sample_row, SampleParams};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The blocks.cpp program, compiled once per test process, and a fresh folder for one test.
fn setup(test: &str) -> Option<(PathBuf, PathBuf)> {
    static EXE: OnceLock<Option<PathBuf>> = OnceLock::new();
    let exe = EXE
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("colotrain-hostemu-blocks-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            compile("blocks.cpp", &dir)
        })
        .clone()?;
    let dir = std::env::temp_dir().join(format!("colotrain-hostemu-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    Some((exe, dir))
}

fn run(exe: &Path, mode: &str, dir: &Path) {
    let out = Command::new(exe).arg(mode).arg(dir).output().expect("run the host emulation");
    assert!(out.status.success(), "host emulation {mode} failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn put(dir: &Path, name: &str, bytes: Vec<u8>) {
    std::fs::write(dir.join(name), bytes).unwrap_or_else(|e| panic!("write {name}: {e}"));
}

fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// |a − b| ≤ atol + rtol·|ref|, per element, naming the first violation.
fn close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= atol + rtol * b.abs(), "{what}[{i}]: kernel {a}, CPU {b} (atol {atol}, rtol {rtol})");
    }
}

/// How many tokens the CPU's top-k / top-p keeps, by brute force in f64 (the test's own
/// reference for which rows must be left to the host).
fn kept_count(z: &[f32], p: &SampleParams) -> usize {
    let mut idx: Vec<usize> = (0..z.len()).collect();
    idx.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    let mx = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64 / p.temperature as f64));
    let w: Vec<f64> = idx.iter().map(|&i| (z[i] as f64 / p.temperature as f64 - mx).exp()).collect();
    let k = if p.top_k > 0 { (p.top_k as usize).min(z.len()) } else { z.len() };
    let goal = p.top_p as f64 * w[..k].iter().sum::<f64>();
    let mut acc = 0.0;
    for (j, wi) in w[..k].iter().enumerate() {
        acc += wi;
        if acc >= goal {
            return j + 1;
        }
    }
    k
}

fn check_sampling(vocab: usize, seed: u64) {
    let Some((exe, dir)) = setup(&format!("sample-{vocab}")) else { return };
    let cap = ffi::CT_TOPK_CAP as usize;
    // (temperature, top_k, top_p): greedy, whole distribution, top-k (1, small, at and above the
    // cap, at least the vocabulary), top-p (short and long prefixes), both.
    let configs: [(f32, u32, f32); 14] = [
        (0.0, 0, 1.0),
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.0, 1, 1.0),
        (1.0, 7, 1.0),
        (0.8, 50, 1.0),
        (1.0, cap as u32, 1.0),
        (1.0, cap as u32 + 1, 1.0),
        (1.0, 0, 0.9),
        (0.6, 0, 0.3),
        (1.0, 0, 0.999),
        (1.0, 50, 0.9),
        (1.3, 7, 0.5),
        (1.0, vocab as u32, 0.9),
    ];
    // Logit kinds: peaked (std 4), flat (std 0.3), and quarter steps (many exact ties).
    let mut s = crate::rand::Stream::new(seed, 3);
    let mut z = Vec::new();
    let mut params = Vec::new();
    for (c, &(temperature, top_k, top_p)) in configs.iter().enumerate() {
        for kind in 0..3 {
            for _ in 0..vocab {
                let g = s.normal() as f32;
                z.push(match kind {
                    0 => 4.0 * g,
                    1 => 0.3 * g,
                    _ => (g * 4.0).round() * 0.25,
                });
            }
            let r = params.len() as u64;
            params.push(SampleParams {
                temperature,
                top_k,
                top_p,
                seed: seed ^ 0x5eed,
                request: 1000 + r,
                sample: kind,
                position: 17 + c as u32,
            });
        }
    }
    let rows = params.len();
    let targets: Vec<u32> = (0..rows).map(|i| (i * 7919 % vocab) as u32).collect();
    let score_t = 0.9f32;
    let mut dims = le(&[rows as i32, vocab as i32], i32::to_le_bytes);
    dims.extend(score_t.to_le_bytes());
    put(&dir, "dims.bin", dims);
    put(&dir, "logits.bin", le(&z, f32::to_le_bytes));
    let kp: Vec<ffi::ct_sample_row> = params.iter().map(|p| super::ops::sample_row_params(p, vocab)).collect();
    let mut pb = Vec::new();
    for r in &kp {
        pb.extend(r.seed.to_le_bytes());
        pb.extend(r.request.to_le_bytes());
        pb.extend(r.temperature.to_le_bytes());
        pb.extend(r.sample.to_le_bytes());
        pb.extend(r.position.to_le_bytes());
        pb.extend(r.truncated.to_le_bytes());
        pb.extend(r.top_k.to_le_bytes());
        pb.extend(r.top_p.to_le_bytes());
    }
    assert_eq!(pb.len(), rows * std::mem::size_of::<ffi::ct_sample_row>(), "ct_sample_row has no padding");
    put(&dir, "params.bin", pb);
    put(&dir, "targets.bin", le(&targets, u32::to_le_bytes));
    run(&exe, "sample", &dir);

    let (tokens, lps) = (u32s(&read(&dir, "tokens.bin")), f32s(&read(&dir, "logprobs.bin")));
    let (host, scores) = (u32s(&read(&dir, "host_rows.bin")), f32s(&read(&dir, "scores.bin")));
    let (mut kernel_truncated, mut left) = (0, 0);
    for (i, p) in params.iter().enumerate() {
        let row = &z[i * vocab..(i + 1) * vocab];
        let what = format!("vocab {vocab} row {i} {p:?}");
        if kp[i].truncated == 0 {
            assert_eq!(host[i], 7, "{what}: ct_sample_topk touched an untruncated row");
        } else {
            let k_over = p.top_k as usize > cap && (p.top_k as usize) < vocab;
            let must_leave = k_over || kept_count(row, p) > cap;
            assert_eq!(host[i], must_leave as u32, "{what}: left to the host (kept {})", kept_count(row, p));
            if must_leave {
                assert_eq!(tokens[i], 0xDEAD_BEEF, "{what}: a row left to the host was written");
                left += 1;
                continue;
            }
            kernel_truncated += 1;
        }
        let (t, l) = sample_row(row, p);
        assert_eq!(tokens[i], t, "{what}: token");
        // Log-probs: f64 sums in another order, then rounded to f32.
        close(&lps[i..i + 1], &[l], 1e-6, 1e-6, &format!("{what}: log-prob"));
    }
    assert!(kernel_truncated >= 20, "only {kernel_truncated} truncated rows were drawn by ct_sample_topk");
    assert!(vocab <= cap || left >= 3, "a vocabulary above the cap must leave the top_k > cap rows to the host");
    let want: Vec<f32> = (0..rows)
        .map(|i| {
            let row = &z[i * vocab..(i + 1) * vocab];
            let (mx, lse) = row_log_normalizer(row, score_t);
            ((row[targets[i] as usize] / score_t - mx) as f64 - lse) as f32
        })
        .collect();
    close(&scores, &want, 1e-6, 1e-6, &format!("log_softmax_gather, vocab {vocab}"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sampling_kernels_match_the_cpu_twin_below_the_candidate_cap() {
    check_sampling(700, 1);
}

#[test]
fn sampling_kernels_match_the_cpu_twin_above_the_candidate_cap() {
    check_sampling(3001, 2);
}

/// Paged attention over caches of `dtype` (code of colotrain_kernels.h) against the CPU twin:
/// GQA (3 query heads per KV head), head_dim 40 (not a multiple of the warp), block size 4 with
/// shuffled block tables, and sequences that prefill with and without history and decode.
fn check_attention(dtype: i32) {
    use crate::device::{CpuStorage, DType, Device, Storage, Tensor};
    use crate::ops::attention::{paged_attention, AttnMeta};
    let Some((exe, dir)) = setup(&format!("attention-{dtype}")) else { return };
    let (heads, hkv, d, bs) = (6usize, 2usize, 40usize, 4usize);
    // (rows this step, context): prefill with and without history, decode, and a prefill of
    // three row tiles of the flash-style kernel (21 rows each here) over two key tiles.
    let seqs: [(u32, u32); 5] = [(5, 9), (1, 37), (1, 1), (12, 12), (50, 60)];
    let max_blocks = seqs.iter().map(|s| (s.1 as usize).div_ceil(bs)).max().unwrap_or(1);
    let used: usize = seqs.iter().map(|s| (s.1 as usize).div_ceil(bs)).sum();
    let nb = used + 3;
    // Block tables: a shuffled assignment of distinct blocks; unused entries point past the cache.
    let mut s = crate::rand::Stream::new(9, dtype as u64);
    let mut perm: Vec<u32> = (0..nb as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, s.below(i as u64 + 1) as usize);
    }
    let mut tables = vec![u32::MAX; seqs.len() * max_blocks];
    let mut next = 0;
    for (si, sq) in seqs.iter().enumerate() {
        for b in 0..(sq.1 as usize).div_ceil(bs) {
            tables[si * max_blocks + b] = perm[next];
            next += 1;
        }
    }
    let n_cache = nb * hkv * bs * d;
    let (k_scale, v_scale) = (0.011f32, 0.013f32);
    let mut vals = |scale: f32| -> (Tensor, Vec<u8>) {
        let v: Vec<f32> = (0..n_cache).map(|_| s.normal() as f32).collect();
        let shape = [nb, hkv, bs, d];
        match dtype {
            ffi::CT_DTYPE_F32 => {
                (Tensor::from_f32_host(DType::F32, &shape, &v).expect("cache"), le(&v, f32::to_le_bytes))
            }
            ffi::CT_DTYPE_BF16 => {
                let t = Tensor::from_f32_host(DType::BF16, &shape, &v).expect("cache");
                let bytes = match t.cpu().expect("host") {
                    CpuStorage::BF16(b) => b.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
                    _ => unreachable!("a BF16 tensor"),
                };
                (t, bytes)
            }
            _ => {
                let codes: Vec<u8> = v.iter().map(|&x| crate::quant::fp8::E4M3.encode(x / scale)).collect();
                (Tensor::from_storage(&shape, Storage::Cpu(CpuStorage::U8(codes.clone()))), codes)
            }
        }
    };
    // FP8 caches: codes of N(0, 1) / scale, decoded as e4m3 · scale.
    let (kc, kb) = vals(k_scale);
    let (vc, vb) = vals(v_scale);
    let mut q_start = vec![0u32];
    for sq in &seqs {
        q_start.push(q_start.last().copied().unwrap_or(0) + sq.0);
    }
    let rows = *q_start.last().unwrap_or(&0) as usize;
    let q: Vec<f32> = (0..rows * heads * d).map(|_| s.normal() as f32).collect();
    let ctx: Vec<u32> = seqs.iter().map(|s| s.1).collect();
    let sm = 1.0 / (d as f32).sqrt();
    let (ks, vs) = if dtype == ffi::CT_DTYPE_U8 { (k_scale, v_scale) } else { (1.0, 1.0) };
    let mut dims = le(&[heads, hkv, d, bs, nb, seqs.len(), max_blocks, rows].map(|x| x as i32), i32::to_le_bytes);
    dims.extend(dtype.to_le_bytes());
    dims.extend(le(&[sm, ks, vs], f32::to_le_bytes));
    put(&dir, "dims.bin", dims);
    put(&dir, "q.bin", le(&q, f32::to_le_bytes));
    put(&dir, "k_cache.bin", kb);
    put(&dir, "v_cache.bin", vb);
    put(&dir, "block_tables.bin", le(&tables, u32::to_le_bytes));
    put(&dir, "q_start.bin", le(&q_start, u32::to_le_bytes));
    put(&dir, "ctx_len.bin", le(&ctx, u32::to_le_bytes));
    run(&exe, "attention", &dir);

    let meta = AttnMeta {
        num_seqs: seqs.len(),
        num_tokens: rows,
        block_size: bs,
        max_blocks,
        q_start: Tensor::from_u32_host(&[seqs.len() + 1], q_start).expect("q_start"),
        ctx_len: Tensor::from_u32_host(&[seqs.len()], ctx).expect("ctx"),
        block_tables: Tensor::from_u32_host(&[seqs.len(), max_blocks], tables).expect("tables"),
        slot_mapping: Tensor::from_u32_host(&[rows], vec![0; rows]).expect("slots"),
    };
    let cpu = Device::cpu(1).expect("cpu");
    let qt = Tensor::from_f32_host(DType::F32, &[rows, heads * d], &q).expect("q");
    let mut out = Tensor::cpu_zeros(DType::F32, &[rows, heads * d]);
    paged_attention(&cpu, &qt, &kc, &vc, ks, vs, &meta, &mut out, heads).expect("CPU attention");
    assert_eq!(u32s(&read(&dir, "err.bin"))[0], 0, "the kernel reported an error");
    // Online softmax over tiles of 32 keys (CPU: 16) and warp-reduced dot products: rounding.
    close(
        &f32s(&read(&dir, "out.bin")),
        out.f32s().expect("out"),
        1e-5,
        1e-4,
        &format!("paged attention, cache dtype {dtype}"),
    );
    close(
        &f32s(&read(&dir, "out_prefill.bin")),
        out.f32s().expect("out"),
        1e-5,
        1e-4,
        &format!("prefill attention, cache dtype {dtype}"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn paged_attention_matches_the_cpu_twin_f32_cache() {
    check_attention(ffi::CT_DTYPE_F32);
}

#[test]
fn paged_attention_matches_the_cpu_twin_bf16_cache() {
    check_attention(ffi::CT_DTYPE_BF16);
}

#[test]
fn paged_attention_matches_the_cpu_twin_fp8_cache() {
    check_attention(ffi::CT_DTYPE_U8);
}

#[test]
fn rmsnorm_with_residual_matches_the_cpu_twin() {
    use crate::device::{DType, Device, Tensor};
    let Some((exe, dir)) = setup("rmsnorm") else { return };
    let (rows, cols, eps) = (5usize, 1000usize, 1e-6f32);
    let mut s = crate::rand::Stream::new(4, 4);
    let mut g = |n: usize, sc: f32| -> Vec<f32> { (0..n).map(|_| sc * s.normal() as f32).collect() };
    let (x, r, w) = (g(rows * cols, 2.0), g(rows * cols, 0.5), g(cols, 1.0));
    let mut dims = le(&[rows as i32, cols as i32], i32::to_le_bytes);
    dims.extend(eps.to_le_bytes());
    put(&dir, "dims.bin", dims);
    put(&dir, "x.bin", le(&x, f32::to_le_bytes));
    put(&dir, "r.bin", le(&r, f32::to_le_bytes));
    put(&dir, "w.bin", le(&w, f32::to_le_bytes));
    run(&exe, "rmsnorm", &dir);
    let cpu = Device::cpu(1).expect("cpu");
    let mut xt = Tensor::from_f32_host(DType::F32, &[rows, cols], &x).expect("x");
    let rt = Tensor::from_f32_host(DType::F32, &[rows, cols], &r).expect("r");
    let wt = Tensor::from_f32_host(DType::F32, &[cols], &w).expect("w");
    let mut yt = Tensor::cpu_zeros(DType::F32, &[rows, cols]);
    crate::ops::norm::add_rmsnorm(&cpu, &mut xt, &rt, &wt, eps, &mut yt, rows).expect("CPU rmsnorm");
    // The residual sum is one f32 add: exact. The sum of squares is a block reduction (the CPU
    // sums in order): rstd, hence y, agree to a few ulps.
    assert_eq!(
        super::hostemu::bits(&f32s(&read(&dir, "x_out.bin"))),
        super::hostemu::bits(xt.f32s().expect("x")),
        "residual stream"
    );
    close(&f32s(&read(&dir, "y.bin")), yt.f32s().expect("y"), 1e-6, 2e-6, "rmsnorm output");
    let _ = std::fs::remove_dir_all(&dir);
}
