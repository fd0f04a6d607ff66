//! Paged attention against a dense f64 reference, on every cache dtype and paging.

use super::cpu::dot;
use crate::device::{DType, Device, Tensor};

#[test]
fn dot_is_the_documented_order_and_near_f64() {
    let mut s = crate::rand::Stream::new(11, 0);
    for n in [0usize, 1, 15, 16, 17, 31, 64, 100, 128, 257] {
        let a: Vec<f32> = (0..n).map(|_| s.normal() as f32).collect();
        let b: Vec<f32> = (0..n).map(|_| s.normal() as f32).collect();
        let got = dot(&a, &b);
        // The intrinsic versions give the same bits.
        #[cfg(target_arch = "x86_64")]
        for isa in crate::ops::isa::Isa::available() {
            // SAFETY: `available` lists only detected instruction sets.
            let v = match isa {
                crate::ops::isa::Isa::Avx512 => {
                    let mut out = [0.0f32; 1];
                    unsafe { super::cpu::x86::dots512(&a, &b, &[0; super::KCHUNK], 1, &mut out) };
                    out[0]
                }
                crate::ops::isa::Isa::Avx2 => unsafe { super::cpu::x86::dot256(&a, &b) },
                crate::ops::isa::Isa::Portable => dot(&a, &b),
            };
            assert_eq!(v.to_bits(), got.to_bits(), "{isa:?}, n = {n}");
        }
        // The order, spelled out: lane sums, then lanes l and l + 8, + 4, + 2, + 1, then the tail.
        let full = n / 16 * 16;
        let mut lane = [0.0f32; 16];
        for i in 0..full {
            lane[i % 16] += a[i] * b[i];
        }
        let h8: Vec<f32> = (0..8).map(|l| lane[l] + lane[l + 8]).collect();
        let h4: Vec<f32> = (0..4).map(|l| h8[l] + h8[l + 4]).collect();
        let h2: Vec<f32> = (0..2).map(|l| h4[l] + h4[l + 2]).collect();
        let mut want = h2[0] + h2[1];
        for i in full..n {
            want += a[i] * b[i];
        }
        assert_eq!(got.to_bits(), want.to_bits(), "n = {n}");
        // |dot − Σ a·b (f64)| ≤ 1e-6 + 1e-5·Σ|a·b|.
        let r: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let mag: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
        assert!((got as f64 - r).abs() <= 1e-6 + 1e-5 * mag, "n = {n}: {got} vs {r}");
    }
}

#[test]
fn sixteen_keys_at_once_are_sixteen_dots_bitwise() {
    if !crate::ops::isa::Isa::available().contains(&crate::ops::isa::Isa::Avx512) {
        eprintln!("skipped: no AVX-512 on this CPU");
        return;
    }
    let mut s = crate::rand::Stream::new(12, 0);
    for d in [0usize, 1, 15, 16, 17, 40, 64, 100, 128] {
        // Keys at scattered offsets of one buffer (as cache slots are), some overlapping.
        let base: Vec<f32> = (0..40 * d.max(1) + 7).map(|_| s.normal() as f32).collect();
        let q: Vec<f32> = (0..d).map(|_| s.normal() as f32).collect();
        let koff: [usize; super::KCHUNK] = std::array::from_fn(|j| (j * 37 * d.max(1) / 16 + j) % (39 * d.max(1)));
        for n in [1usize, 5, 16] {
            let mut got = [f32::NAN; 16];
            // SAFETY: AVX-512 detected above; every row koff[j]..+d lies inside `base`.
            unsafe { super::cpu::x86::dots512(&q, &base, &koff, n, &mut got[..n]) };
            for j in 0..n {
                let want = dot(&q, &base[koff[j]..koff[j] + d]);
                assert_eq!(got[j].to_bits(), want.to_bits(), "d {d} n {n} key {j}");
            }
            assert!(got[n..].iter().all(|x| x.is_nan()), "wrote past n");
        }
    }
}

#[test]
fn register_blocked_value_sums_equal_key_by_key_bitwise() {
    use crate::ops::isa::Isa;
    let mut s = crate::rand::Stream::new(13, 0);
    for d in [1usize, 8, 15, 16, 40, 64, 72, 128, 200] {
        let base: Vec<f32> = (0..20 * d + 3).map(|_| s.normal() as f32).collect();
        let voff: [usize; super::KCHUNK] = std::array::from_fn(|j| (j * 5 * d / 4 + 3) % (18 * d));
        for n in [1usize, 7, 16] {
            let p: Vec<f32> = (0..n).map(|_| s.normal().abs() as f32).collect();
            let start: Vec<f32> = (0..d).map(|_| s.normal() as f32).collect();
            let mut want = start.clone();
            super::cpu::pv(&mut want, &p, &voff, &base);
            for isa in Isa::available() {
                let mut got = start.clone();
                match isa {
                    // SAFETY: `available` lists only detected instruction sets; rows lie in `base`.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { super::cpu::x86::pv512(&mut got, &p, &voff, &base) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { super::cpu::x86::pv256(&mut got, &p, &voff, &base) },
                    _ => super::cpu::pv(&mut got, &p, &voff, &base),
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa:?} d {d} n {n}");
            }
            // And the spec, written out: per element, key by key.
            for i in 0..d {
                let mut a = start[i];
                for j in 0..n {
                    a += p[j] * base[voff[j] + i];
                }
                assert_eq!(a.to_bits(), want[i].to_bits());
            }
        }
    }
}

/// The keys the rows of a batch attend (`attended_keys`, the ledger's attention cost): a
/// decode row attends its whole context, a prefill chunk of q rows ending at position c − 1
/// attends c − q + 1, …, c positions, and inconsistent metadata (ctx < q) counts nothing.
#[test]
fn attended_keys_follow_the_causal_rows() {
    // One decode row at 10 cached positions: 10 keys.
    assert_eq!(super::attended_keys(&[0, 1], &[10]), 10);
    // A chunk of 3 rows that ends the context at 7: 5 + 6 + 7.
    assert_eq!(super::attended_keys(&[0, 3], &[7]), 18);
    // Both in one batch, and a padding row (context 1) of a graph bucket.
    assert_eq!(super::attended_keys(&[0, 1, 4, 5], &[10, 7, 1]), 10 + 18 + 1);
    // A whole prompt of 4 tokens from scratch: 1 + 2 + 3 + 4.
    assert_eq!(super::attended_keys(&[0, 4], &[4]), 10);
    assert_eq!(super::attended_keys(&[0, 5], &[2]), 0);
}

/// The metadata of one step on `dev`: sequences of (query rows, context after the step), each
/// with `maxb` blocks of `bs` slots listed in `tables` (sequence by sequence).
fn step_meta(dev: &Device, seqs: &[(u32, u32)], bs: usize, maxb: usize, tables: &[u32]) -> super::AttnMeta {
    let up = |shape: &[usize], v: Vec<u32>| {
        let h = Tensor::from_u32_host(shape, v).expect("host tensor");
        if dev.is_cpu() {
            h
        } else {
            dev.upload(h).expect("upload")
        }
    };
    let mut q_start = vec![0u32];
    for (q, _) in seqs {
        q_start.push(q_start[q_start.len() - 1] + q);
    }
    let tokens = q_start[seqs.len()] as usize;
    let ctx: Vec<u32> = seqs.iter().map(|x| x.1).collect();
    super::AttnMeta {
        num_seqs: seqs.len(),
        num_tokens: tokens,
        block_size: bs,
        max_blocks: maxb,
        q_start: up(&[seqs.len() + 1], q_start.clone()),
        ctx_len: up(&[seqs.len()], ctx.clone()),
        block_tables: up(&[seqs.len(), maxb], tables.to_vec()),
        slot_mapping: up(&[tokens], vec![0; tokens]),
        attended: super::attended_keys(&q_start, &ctx),
        packed: Default::default(),
    }
}

/// A prefill step over a BF16 cache on the simulated GPU runs ct_prefill_attention_tc (the
/// tensor cores) and equals the CPU twin to BF16 rounding. The step mixes a chunk that
/// continues a sequence (70 rows at positions 80..149: three key tiles of 64 and several
/// query tiles), a decode row at position 89, and two whole sequences (40 and 23 rows), over
/// blocks scattered through the cache; group sizes 3, 8, 7 and 1, head dimensions 16 and 32
/// (the kernel's generic body) and 64 and 128 (its unrolled ones). The tensor cores round q
/// and the probabilities to BF16 (the cache's keys and values are BF16 already): an output
/// value, a probability-weighted mean of values of magnitude ~1, moves by about 2⁻⁸;
/// |gpu − cpu| ≤ 1e-2 + 1e-2·|cpu|.
#[test]
fn bf16_prefill_on_the_tensor_cores_sim() {
    // A device of its own: the test reads its launch ledger, which other tests would add to.
    let cd = crate::device::cuda::CudaDevice::sim_unshared_arch(78, "sm_90a");
    let sim = Device::Cuda(cd.clone());
    let cpu = Device::cpu(1).expect("cpu");
    let (bs, seqs) = (16usize, [(70u32, 150u32), (1, 90), (40, 40), (23, 23)]);
    let maxb = 150usize.div_ceil(bs);
    let nb = seqs.len() * maxb + 3;
    let mut s = crate::rand::Stream::new(21, 0);
    // Every sequence's blocks, drawn without replacement from the cache's.
    let mut perm: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        perm.swap(i, s.below(i as u64 + 1) as usize);
    }
    let tables = perm[..seqs.len() * maxb].to_vec();
    let mut q_start = vec![0u32];
    for (q, _) in &seqs {
        q_start.push(q_start[q_start.len() - 1] + q);
    }
    let tokens = q_start[seqs.len()] as usize;
    let (mc, mg) = (step_meta(&cpu, &seqs, bs, maxb, &tables), step_meta(&sim, &seqs, bs, maxb, &tables));
    for (hkv, heads, d) in [(2usize, 6usize, 16usize), (1, 8, 64), (2, 14, 128), (4, 4, 32)] {
        let what = format!("h{heads}/kv{hkv} d{d}");
        let mut rnd = |n: usize| (0..n).map(|_| s.normal() as f32).collect::<Vec<f32>>();
        let shape = [nb, hkv, bs, d];
        let (qh, kh, vh) = (rnd(tokens * heads * d), rnd(nb * hkv * bs * d), rnd(nb * hkv * bs * d));
        let q = Tensor::from_f32_host(DType::F32, &[tokens, heads * d], &qh).expect("q");
        let kc = Tensor::from_f32_host(DType::BF16, &shape, &kh).expect("keys");
        let vc = Tensor::from_f32_host(DType::BF16, &shape, &vh).expect("values");
        let mut want = Tensor::cpu_zeros(DType::F32, &[tokens, heads * d]);
        super::paged_attention(&cpu, &q, &kc, &vc, 1.0, 1.0, &mc, &mut want, heads).expect("cpu attention");
        let (qg, kg, vg) = (
            sim.upload(q.try_clone().expect("q")).expect("q up"),
            sim.upload(kc.try_clone().expect("k")).expect("k up"),
            sim.upload(vc.try_clone().expect("v")).expect("v up"),
        );
        let mut out = sim.zeros(DType::F32, &[tokens, heads * d]).expect("out");
        cd.take_ledger();
        super::paged_attention(&sim, &qg, &kg, &vg, 1.0, 1.0, &mg, &mut out, heads).expect("gpu attention");
        let ran: Vec<&str> = crate::device::cuda::ledger::rows(&cd.take_ledger()).into_iter().map(|r| r.op).collect();
        assert_eq!(ran, ["ct_prefill_attention_tc"], "{what}");
        let (got, want) = (out.to_f32_vec().expect("read"), want.to_f32_vec().expect("read"));
        let mut worst = 0.0f64;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let (a, b) = (*a as f64, *b as f64);
            let excess = (a - b).abs() - (1e-2 + 1e-2 * b.abs());
            assert!(excess <= 0.0, "{what}: element {i} (row {}): {a} vs {b}", i / (heads * d));
            worst = worst.max((a - b).abs());
        }
        assert!(worst > 0.0, "{what}: the tensor cores round q and the probabilities: some difference is expected");
        println!("{what}: max |gpu − cpu| {worst:e}");
    }
}

/// Every attention kernel that may feed a BF16 o_proj stores a BF16 output as the rounding
/// `ct_cast` (round to nearest even) applies to its own f32 output: the engine's decode
/// (ct_paged_attention), prefill on the CUDA cores (ct_prefill_attention, f32 and FP8 caches)
/// and on the tensor cores (ct_prefill_attention_tc), and the training forward
/// (ct_attn_fwd, ct_attn_fwd_tc; the engine's packed prefill). Bit for bit against the host's
/// own BF16 rounding of the f32 output; each route checked to run the kernel it names.
#[test]
fn bf16_outputs_are_the_f32_outputs_rounded_sim() {
    use super::grad::Shape;
    use super::train::{self, Packed};
    use crate::device::{CpuStorage, Storage};
    // A device of its own: the test reads its launch ledger.
    let cd = crate::device::cuda::CudaDevice::sim_unshared_arch(111, "sm_90a");
    let sim = Device::Cuda(cd.clone());
    let (bs, maxb, heads, hkv, d) = (16usize, 6usize, 6usize, 2usize, 32usize);
    let mut s = crate::rand::Stream::new(5, 0);
    let mut rnd = |n: usize| (0..n).map(|_| s.normal() as f32).collect::<Vec<f32>>();
    let rounded = |v: &[f32]| Tensor::from_f32_host(DType::BF16, &[v.len()], v).and_then(|t| t.to_f32_vec());
    let check = |what: &str, f32s: Vec<f32>, bf16s: Vec<f32>, ran: Vec<&str>, want: &str| {
        assert_eq!(ran, [want], "{what}");
        let r = rounded(&f32s).expect("host rounding");
        assert!(f32s.iter().all(|x| x.is_finite()), "{what}: finite outputs");
        let bad = r.iter().zip(&bf16s).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(bad.is_none(), "{what}: element {bad:?}: {:?} vs {:?}", bad.map(|i| r[i]), bad.map(|i| bf16s[i]));
    };
    let nb = 3 * maxb;
    let tables: Vec<u32> = (0..nb as u32).rev().collect();
    // (cache dtype, sequences (rows, context), the kernel): decode rows; a prefill step of
    // whole and continuing sequences on the CUDA cores (f32 and FP8 caches) and on the tensor
    // cores (BF16 cache).
    let decode = [(1u32, 40u32), (1, 9), (1, 77)];
    let prefill = [(30u32, 70u32), (21, 21), (12, 12)];
    let routes = [
        (DType::F32, &decode, "ct_paged_attention"),
        (DType::F32, &prefill, "ct_prefill_attention"),
        (DType::U8, &prefill, "ct_prefill_attention"),
        (DType::BF16, &prefill, "ct_prefill_attention_tc"),
    ];
    for (cache, seqs, kernel) in routes {
        let m = step_meta(&sim, seqs, bs, maxb, &tables);
        let t = m.num_tokens;
        let shape = [nb, hkv, bs, d];
        let q = sim.from_f32(DType::F32, &[t, heads * d], &rnd(t * heads * d)).expect("q");
        let kv = |v: Vec<f32>| match cache {
            DType::U8 => {
                let codes = v.iter().map(|&x| crate::formats::fp8::encode_e4m3_fast(x / 0.5)).collect();
                let host = Tensor::from_storage(&shape, Storage::Cpu(CpuStorage::U8(codes)));
                sim.upload(host).expect("upload")
            }
            dt => sim.from_f32(dt, &shape, &v).expect("cache"),
        };
        let (kc, vc) = (kv(rnd(nb * hkv * bs * d)), kv(rnd(nb * hkv * bs * d)));
        let run = |dt: DType| {
            let mut out = sim.zeros(dt, &[t, heads * d]).expect("out");
            cd.take_ledger();
            super::paged_attention(&sim, &q, &kc, &vc, 0.5, 0.5, &m, &mut out, heads).expect("attention");
            let ran = crate::device::cuda::ledger::rows(&cd.take_ledger()).into_iter().map(|r| r.op).collect();
            (out.to_f32_vec().expect("read"), ran)
        };
        let ((f, _), (b, ran)) = (run(DType::F32), run(DType::BF16));
        check(&format!("{} cache, {kernel}", cache.name()), f, b, ran, kernel);
    }
    // The training forward over three packed sequences, on the CUDA cores and the tensor cores.
    let offsets = [0usize, 19, 20, 53];
    let t = offsets[3];
    let cu = sim.upload(Tensor::from_u32_host(&[4], offsets.iter().map(|&o| o as u32).collect()).expect("cu"));
    let cu = cu.expect("cu up");
    let up = |n: usize, v: Vec<f32>| sim.from_f32(DType::F32, &[t, n], &v).expect("upload");
    let (q, k, v) = (up(heads * d, rnd(t * heads * d)), up(hkv * d, rnd(t * hkv * d)), up(hkv * d, rnd(t * hkv * d)));
    let x = Packed { q: &q, k: &k, v: &v, cu: &cu, offsets: &offsets };
    let sh = Shape { heads, kv_heads: hkv, head_dim: d };
    for (tc, kernel) in [(false, "ct_attn_fwd"), (true, "ct_attn_fwd_tc")] {
        let run = |dt: DType| {
            let (mut out, mut lse) =
                (sim.zeros(dt, &[t, heads * d]).expect("o"), sim.zeros(DType::F32, &[t, heads]).expect("lse"));
            cd.take_ledger();
            match tc {
                true => train::fwd_tensor_cores(&sim, &sh, &x, &mut out, &mut lse).expect("forward"),
                false => train::fwd(&sim, &sh, &x, &mut out, &mut lse).expect("forward"),
            }
            let ran = crate::device::cuda::ledger::rows(&cd.take_ledger()).into_iter().map(|r| r.op).collect();
            (out.to_f32_vec().expect("read"), ran)
        };
        let ((f, _), (b, ran)) = (run(DType::F32), run(DType::BF16));
        check(kernel, f, b, ran, kernel);
    }
}

/// A decode step of few rows splits each row's keys over blocks (split-K: 3 rows × 2 KV heads
/// are 6 blocks on 132 SMs) and merges the parts (ct_attention_merge), equal to the CPU twin,
/// which does not split, within f32 rounding: |gpu − cpu| ≤ 1e-5 + 1e-4·|cpu|. Rows of 700, 37
/// (the third split of it holds no key) and 300 keys through 48-block tables (768 keys: 3
/// splits), f32 and FP8 caches, f32 and BF16 outputs (the BF16 one the f32 one rounded).
#[test]
fn a_few_decode_rows_split_their_keys_and_merge_sim() {
    // A device of its own: the test reads its launch ledger.
    let cd = crate::device::cuda::CudaDevice::sim_unshared_arch(117, "sm_90a");
    let (sim, cpu) = (Device::Cuda(cd.clone()), Device::cpu(1).expect("cpu"));
    let (bs, maxb, heads, hkv, d) = (16usize, 48usize, 6usize, 2usize, 32usize);
    let seqs = [(1u32, 700u32), (1, 37), (1, 300)];
    assert_eq!(cd.decode_splits(seqs.len(), hkv, maxb * bs), 3);
    let nb = seqs.len() * maxb;
    let tables: Vec<u32> = (0..nb as u32).map(|i| (i * 7 + 3) % nb as u32).collect();
    let (mc, mg) = (step_meta(&cpu, &seqs, bs, maxb, &tables), step_meta(&sim, &seqs, bs, maxb, &tables));
    let mut s = crate::rand::Stream::new(8, 0);
    let mut rnd = |n: usize| (0..n).map(|_| s.normal() as f32).collect::<Vec<f32>>();
    let shape = [nb, hkv, bs, d];
    let q = Tensor::from_f32_host(DType::F32, &[3, heads * d], &rnd(3 * heads * d)).expect("q");
    for (cache, scale) in [(DType::F32, 1.0f32), (DType::U8, 0.5)] {
        let kv = |v: Vec<f32>| match cache {
            DType::U8 => {
                let codes = v.iter().map(|&x| crate::formats::fp8::encode_e4m3_fast(x / scale)).collect();
                Tensor::from_storage(&shape, crate::device::Storage::Cpu(crate::device::CpuStorage::U8(codes)))
            }
            dt => Tensor::from_f32_host(dt, &shape, &v).expect("cache"),
        };
        let (kc, vc) = (kv(rnd(nb * hkv * bs * d)), kv(rnd(nb * hkv * bs * d)));
        let mut want = Tensor::cpu_zeros(DType::F32, &[3, heads * d]);
        super::paged_attention(&cpu, &q, &kc, &vc, scale, scale, &mc, &mut want, heads).expect("cpu attention");
        let up = |t: &Tensor| sim.upload(t.try_clone().expect("clone")).expect("upload");
        let (qg, kg, vg) = (up(&q), up(&kc), up(&vc));
        let run = |dt: DType| {
            let mut out = sim.zeros(dt, &[3, heads * d]).expect("out");
            cd.take_ledger();
            super::paged_attention(&sim, &qg, &kg, &vg, scale, scale, &mg, &mut out, heads).expect("gpu attention");
            let ran: Vec<&str> =
                crate::device::cuda::ledger::rows(&cd.take_ledger()).into_iter().map(|r| r.op).collect();
            (out.to_f32_vec().expect("read"), ran)
        };
        let ((got, ran), (got16, _)) = (run(DType::F32), run(DType::BF16));
        let mut ran = ran;
        ran.sort_unstable();
        assert_eq!(ran, ["ct_attention_merge", "ct_paged_attention"], "{} cache", cache.name());
        for (i, (a, b)) in got.iter().zip(&want.to_f32_vec().expect("read")).enumerate() {
            let (a, b) = (*a as f64, *b as f64);
            assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{} cache: element {i}: {a} vs {b}", cache.name());
        }
        let rounded = Tensor::from_f32_host(DType::BF16, &[got.len()], &got).and_then(|t| t.to_f32_vec());
        let same = rounded.expect("rounding").iter().zip(&got16).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{} cache: the BF16 output is the f32 output rounded", cache.name());
    }
}

/// A layer's attention inputs in one launch (`qk_rope_kv`: ct_qk_rope_kv) on the simulated GPU:
/// with Qwen3's per-head norms (F32 and BF16 weights) and without, into a BF16 and an FP8
/// cache, q, k and both caches have the bits of the five launches it replaces
/// (`head_rmsnorm` ×2, `rope` ×2, `kv_write`), and q and k equal the CPU twin's to f32
/// rounding (the norm's parallel sum of squares), |gpu − cpu| ≤ 1e-5 + 1e-5·|cpu|. Five tokens
/// at scattered slots, 6 query heads over 2 KV heads of 64.
#[test]
fn a_layers_attention_inputs_take_one_launch_sim() {
    let cd = crate::device::cuda::CudaDevice::sim_unshared_arch(128, "sm_90a");
    let (sim, cpu) = (Device::Cuda(cd.clone()), Device::cpu(1).expect("cpu"));
    let (t, heads, hkv, d, bs, nb) = (5usize, 6usize, 2usize, 64usize, 16usize, 4usize);
    let mut s = crate::rand::Stream::new(21, 0);
    let mut rnd = |n: usize, std: f64| (0..n).map(|_| (s.normal() * std) as f32).collect::<Vec<f32>>();
    let (qs, ks, vs) = (rnd(t * heads * d, 1.0), rnd(t * hkv * d, 1.0), rnd(t * hkv * d, 1.0));
    let angles = rnd(t * d / 2, 3.0);
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let (qn, kn) = (rnd(d, 0.3), rnd(d, 0.3));
    let slots = vec![3u32, 17, 40, 41, 60];
    let meta = |dev: &Device| {
        let mut m = step_meta(dev, &[(5, 5)], bs, nb, &[0, 1, 2, 3]);
        let h = Tensor::from_u32_host(&[t], slots.clone()).expect("slots");
        m.slot_mapping = if dev.is_cpu() { h } else { dev.upload(h).expect("upload") };
        m
    };
    let (mc, mg) = (meta(&cpu), meta(&sim));
    for (norm_dt, cache, scale) in
        [(Some(DType::F32), DType::BF16, 1.0f32), (Some(DType::BF16), DType::U8, 0.5), (None, DType::BF16, 1.0)]
    {
        let what = format!("norms {norm_dt:?}, {} cache", cache.name());
        // q, k, the two caches and the launches, on `dev` fused or apart.
        let run = |dev: &Device, m: &super::AttnMeta, fused: bool| {
            let mut q = dev.from_f32(DType::F32, &[t, heads * d], &qs).expect("q");
            let mut k = dev.from_f32(DType::F32, &[t, hkv * d], &ks).expect("k");
            let v = dev.from_f32(DType::F32, &[t, hkv * d], &vs).expect("v");
            let (c, sn) = (
                dev.from_f32(DType::F32, &[t, d / 2], &cos).expect("cos"),
                dev.from_f32(DType::F32, &[t, d / 2], &sin).expect("sin"),
            );
            let norms =
                norm_dt.map(|dt| (dev.from_f32(dt, &[d], &qn).expect("qn"), dev.from_f32(dt, &[d], &kn).expect("kn")));
            let (mut kc, mut vc) =
                (dev.zeros(cache, &[nb, hkv, bs, d]).expect("kc"), dev.zeros(cache, &[nb, hkv, bs, d]).expect("vc"));
            cd.take_ledger();
            if fused {
                let n = norms.as_ref().map(|(a, b)| (a, b, 1e-6f32));
                super::qk_rope_kv(dev, &mut q, &mut k, &v, n, &c, &sn, (&mut kc, &mut vc), (scale, scale), m, heads)
                    .expect("fused");
            } else {
                if let Some((a, b)) = &norms {
                    crate::ops::norm::head_rmsnorm(dev, &mut q, a, 1e-6, t, heads).expect("q norm");
                    crate::ops::norm::head_rmsnorm(dev, &mut k, b, 1e-6, t, hkv).expect("k norm");
                }
                crate::ops::rope::rope(dev, &mut q, &c, &sn, t, heads).expect("q rope");
                crate::ops::rope::rope(dev, &mut k, &c, &sn, t, hkv).expect("k rope");
                super::kv_write(dev, &k, &v, &mut kc, &mut vc, scale, scale, m).expect("kv write");
            }
            let ran: Vec<(&str, u64)> =
                crate::device::cuda::ledger::rows(&cd.take_ledger()).into_iter().map(|r| (r.op, r.launches)).collect();
            let bits = |x: &Tensor| match x.dtype() {
                DType::U8 => x.read_u8(0, x.numel()).expect("read").into_iter().map(u32::from).collect::<Vec<u32>>(),
                _ => x.to_f32_vec().expect("read").iter().map(|v| v.to_bits()).collect(),
            };
            ([bits(&q), bits(&k), bits(&kc), bits(&vc)], ran)
        };
        let (apart, _) = run(&sim, &mg, false);
        let (fused, ran) = run(&sim, &mg, true);
        assert_eq!(ran, [("ct_qk_rope_kv", 1)], "{what}: one launch");
        for (i, name) in ["q", "k", "key cache", "value cache"].iter().enumerate() {
            assert!(fused[i] == apart[i], "{what}: {name} fused against apart");
        }
        assert!(fused[2].iter().any(|&b| b != 0), "{what}: the keys were written");
        let (twin, _) = run(&cpu, &mc, true);
        for i in 0..2 {
            for (j, (&g, &c)) in fused[i].iter().zip(&twin[i]).enumerate() {
                let (g, c) = (f32::from_bits(g) as f64, f32::from_bits(c) as f64);
                assert!((g - c).abs() <= 1e-5 + 1e-5 * c.abs(), "{what}: {} [{j}] gpu {g} cpu {c}", ["q", "k"][i]);
            }
        }
    }
}
