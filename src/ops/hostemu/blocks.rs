//! Tests that need no GPU: the block-level kernels of csrc/kernels run under the host emulation
//! of csrc/hostemu (blocks.cpp, with the real launch shapes; the threads of a block are fibers,
//! so __syncthreads, warp shuffles and shared memory, poisoned for every block, are exercised)
//! and are compared with their CPU twins:
//!   - ct_sample + ct_sample_topk against `ops::sample::sample_row`: greedy, untruncated, top-k,
//!     top-p and both, logits with many exact ties, vocabularies below and above CT_TOPK_CAP,
//!     rows the kernel must leave to the host;
//!   - ct_log_softmax_gather against `row_log_normalizer`;
//!   - ct_paged_attention and ct_prefill_attention against `ops::attention::paged_attention`
//!     (f32, BF16 and FP8 caches, GQA, prefill and decode rows, several sequences, several row
//!     and key tiles);
//!   - ct_rmsnorm (with the residual add) against `ops::norm::add_rmsnorm`;
//!   - ct_exp_f32 against `ops::vecmath::exp_f32`, bit for bit.
//!
//! Host libm and CUDA's expf / logf may differ by an ulp and the emulation contracts nothing into
//! FMAs, so this checks arithmetic, indexing and synchronization, not the GPU: the device check
//! does that on hardware. Skipped (with a message) when no C++ compiler is found.

use super::{compile, f32s, read};
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
            let exe = compile("blocks.cpp", &dir);
            assert!(
                exe.is_some() || std::env::var_os("CI").is_none(),
                "CI needs a C++ compiler for the host emulation"
            );
            exe
        })
        .clone()?;
    let dir = std::env::temp_dir().join(format!("colotrain-hostemu-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    Some((exe, dir))
}

fn run(exe: &Path, mode: &str, dir: &Path) {
    let out = Command::new(exe).arg(mode).arg(dir).output().expect("run the host emulation");
    assert!(
        out.status.success(),
        "host emulation {mode} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
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

/// |a − b| ≤ atol + rtol·|ref| per element (a NaN or infinite reference needs the same), naming
/// the first violation.
fn close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let ok = if b.is_nan() {
            a.is_nan()
        } else if b.is_infinite() {
            a == b
        } else {
            (a - b).abs() <= atol + rtol * b.abs()
        };
        assert!(ok, "{what}[{i}]: kernel {a}, CPU {b} (atol {atol}, rtol {rtol})");
    }
}

/// How many tokens the CPU's top-k / top-p keeps: its weights (exp_f32(z/T − max)) summed in
/// f64 in sorted order, by a plain full sort (the test's own reference for which rows must be
/// left to the host).
fn kept_count(z: &[f32], p: &SampleParams) -> usize {
    use crate::ops::vecmath::{exp_f32, scaled_max};
    let mut idx: Vec<usize> = (0..z.len()).collect();
    idx.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    let mx = scaled_max(z, p.temperature);
    let w: Vec<f64> = idx.iter().map(|&i| exp_f32(z[i] / p.temperature - mx) as f64).collect();
    let truncate_k = p.top_k > 0 && (p.top_k as usize) < z.len();
    let k = if truncate_k { p.top_k as usize } else { z.len() };
    let total = if truncate_k { w[..k].iter().sum::<f64>() } else { row_log_normalizer(z, p.temperature).1.exp() };
    let goal = p.top_p as f64 * total;
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
    // Logit kinds: peaked (std 4), flat (std 0.3), quarter steps (many exact ties), 70% masked
    // to −inf, all equal, and a row with a NaN and a +inf.
    let mut s = crate::rand::Stream::new(seed, 3);
    let mut z = Vec::new();
    let mut params = Vec::new();
    for (c, &(temperature, top_k, top_p)) in configs.iter().enumerate() {
        // The special kinds (3..6) only for greedy, untruncated, top-1, top-k, top-p and both.
        let kinds = if [0, 1, 3, 5, 8, 11].contains(&c) { 6 } else { 3 };
        for kind in 0..kinds {
            for i in 0..vocab {
                let g = s.normal() as f32;
                z.push(match kind {
                    0 => 4.0 * g,
                    1 => 0.3 * g,
                    2 => (g * 4.0).round() * 0.25,
                    3 if s.uniform() < 0.7 && i != 2 => f32::NEG_INFINITY,
                    3 => 2.0 * g,
                    4 => 1.5,
                    _ if i == 5 => f32::NAN,
                    _ if i == 9 => f32::INFINITY,
                    _ => g,
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
    let kp: Vec<ffi::ct_sample_row> = params.iter().map(|p| crate::ops::sample::sample_row_params(p, vocab)).collect();
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
    assert!(kernel_truncated >= 30, "only {kernel_truncated} truncated rows were drawn by ct_sample_topk");
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
fn sampling_kernels_match_the_cpu_twin_below_the_warp_width() {
    check_sampling(20, 3);
}

#[test]
fn sampling_kernels_match_the_cpu_twin_above_the_candidate_cap() {
    check_sampling(3001, 2);
}

/// Both attention kernels over caches of `dtype` (code of colotrain_kernels.h) against the CPU
/// twin: `heads` query heads over `hkv` KV heads of dimension `d`, cache blocks of `bs` with
/// shuffled block tables, sequences that prefill with and without history and decode.
fn check_attention(dtype: i32, heads: usize, hkv: usize, d: usize, bs: usize) {
    use crate::device::{CpuStorage, DType, Device, Storage, Tensor};
    use crate::ops::attention::{paged_attention, AttnMeta};
    let Some((exe, dir)) = setup(&format!("attention-{dtype}-{heads}-{hkv}-{d}-{bs}")) else { return };
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
    // The launch shapes kernels.rs computes.
    let groups = heads / hkv;
    let (pf_grid, pf_smem) = crate::device::cuda::kernels::prefill_launch(rows, seqs.len(), groups, d);
    dims.extend(le(
        &[crate::device::cuda::kernels::paged_attention_smem(groups, d), pf_grid, pf_smem].map(|x| x as i32),
        i32::to_le_bytes,
    ));
    put(&dir, "dims.bin", dims);
    put(&dir, "q.bin", le(&q, f32::to_le_bytes));
    put(&dir, "k_cache.bin", kb);
    put(&dir, "v_cache.bin", vb);
    put(&dir, "block_tables.bin", le(&tables, u32::to_le_bytes));
    put(&dir, "q_start.bin", le(&q_start, u32::to_le_bytes));
    put(&dir, "ctx_len.bin", le(&ctx, u32::to_le_bytes));
    run(&exe, "attention", &dir);

    let attended = crate::ops::attention::attended_keys(&q_start, &ctx);
    let meta = AttnMeta {
        num_seqs: seqs.len(),
        num_tokens: rows,
        block_size: bs,
        max_blocks,
        q_start: Tensor::from_u32_host(&[seqs.len() + 1], q_start).expect("q_start"),
        ctx_len: Tensor::from_u32_host(&[seqs.len()], ctx).expect("ctx"),
        block_tables: Tensor::from_u32_host(&[seqs.len(), max_blocks], tables).expect("tables"),
        slot_mapping: Tensor::from_u32_host(&[rows], vec![0; rows]).expect("slots"),
        attended,
        packed: Default::default(),
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

// GQA with 3 query heads per KV head, head_dim 40 (not a multiple of the warp), 4-token blocks:
// 21 rows per prefill tile, so the 50-row prefill spans three tiles and two key tiles.
#[test]
fn attention_kernels_match_the_cpu_twin_f32_cache() {
    check_attention(ffi::CT_DTYPE_F32, 6, 2, 40, 4);
}

#[test]
fn attention_kernels_match_the_cpu_twin_bf16_cache() {
    check_attention(ffi::CT_DTYPE_BF16, 6, 2, 40, 4);
}

#[test]
fn attention_kernels_match_the_cpu_twin_fp8_cache() {
    check_attention(ffi::CT_DTYPE_U8, 6, 2, 40, 4);
}

// The other launch shapes: 8 heads per KV head at head_dim 128 (8 rows per tile); head_dim 256
// without GQA (32 query vectors, 32 rows per tile); 48 heads per KV head (one row per tile).
#[test]
fn attention_kernels_match_the_cpu_twin_at_other_shapes() {
    check_attention(ffi::CT_DTYPE_F32, 8, 1, 128, 16);
    check_attention(ffi::CT_DTYPE_F32, 4, 4, 256, 8);
    check_attention(ffi::CT_DTYPE_BF16, 48, 1, 64, 16);
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
    assert_eq!(super::bits(&f32s(&read(&dir, "x_out.bin"))), super::bits(xt.f32s().expect("x")), "residual stream");
    close(&f32s(&read(&dir, "y.bin")), yt.f32s().expect("y"), 1e-6, 2e-6, "rmsnorm output");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_kernels_exp_is_the_cpus_bit_for_bit() {
    let Some((exe, dir)) = setup("exp") else { return };
    let mut s = crate::rand::Stream::new(8, 8);
    let mut x: Vec<f32> = (0..100_000).map(|_| (-110.0 + 200.0 * s.uniform()) as f32).collect();
    x.extend((0..20_000).map(|_| (-2.0 * s.uniform()) as f32));
    let edges = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        88.72283,
        88.722_84,
        -104.0,
        -103.9,
        -87.34,
        f32::MIN_POSITIVE,
    ];
    x.extend(edges);
    put(&dir, "x.bin", le(&x, f32::to_le_bytes));
    run(&exe, "exp", &dir);
    let y = f32s(&read(&dir, "y.bin"));
    assert_eq!(y.len(), x.len());
    for (i, (&a, &xi)) in y.iter().zip(&x).enumerate() {
        let want = crate::ops::vecmath::exp_f32(xi);
        assert!(
            a.to_bits() == want.to_bits() || (a.is_nan() && want.is_nan()),
            "exp({xi}) [{i}]: kernel {a:e}, CPU {want:e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
