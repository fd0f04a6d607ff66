//! The op checks of `colotrain device-check`: every CUDA op against its CPU twin on fresh
//! random inputs (never zeros; outputs poisoned with NaN before each run), in groups that the
//! parent process runs one by one (`super`). Each check prints its table row as soon as it is
//! recorded.
//!
//! Tolerances (`|gpu − cpu| ≤ atol + rtol·|cpu|`), chosen from each kernel's arithmetic:
//! - exact (bitwise): rope, embedding, gather_rows, kv_write (all cache dtypes), amax,
//!   fake_quant_rows and requantize (FP8, NVFP4, RHT, stochastic rounding: codes, block
//!   scales and tensor scale), the guard's view check (device codes against the host's fresh
//!   quantization of sampled rows), sampled tokens;
//! - 1e-5 / 1e-5: RMSNorm (parallel sum of squares); 1e-6 / 1e-6: SwiGLU (expf ulp);
//!   1.2e-7 / 0: RoPE tables (double cos/sin of CUDA vs libm); 1e-5 / 1e-4: paged attention
//!   (f32 online softmax in another order); 1e-5 / 1e-6: log-probs (f64 sums);
//! - 1e-4 / 1e-4: F32 linear (FP32 GEMM, another summation order);
//! - 1e-2 / 1e-2: linears with BF16 / F16 or quantized weights (the GPU rounds the f32 input
//!   rows to BF16 / F16; outputs are ~N(0, 1));
//! - 1e-3 / 1e-3: real W8A8 / W4A4 GEMMs against the CPU's emulation (the same products, FP32
//!   sums in another order);
//! - 1e-4 / 1e-4: the backward GEMMs with F32 operands; 1e-2 / 1e-2 with BF16 operands
//!   (outputs ~N(0, 1)); 1e-5 / 1e-4: the fused LM-head loss with an F32 head (f32 logits,
//!   sums in another order);
//! - 2e-5 / 1e-4 (forward), 5e-5 / 1e-4 (backward): training attention (f32 dot products and
//!   softmax sums in another order; the backward sums a column of rows);
//! - exact: the optimizer step (master, moments, clipped gradient, compute weights, amax);
//!   0 / 1e-6 for the squared norm (f64 sums in another order, compared as f32);
//! - exact: decode graphs against the same padded steps launched eagerly (`engine_checks`).
//!
//! Owns: the check groups and their table rows. May call: the ops, the device. Must not: time
//! anything (`device_bench` does).

use crate::device::cuda::CudaDevice;
use crate::device::{CpuStorage, DType, Device, Storage, Tensor};
use crate::ops::attention::AttnMeta;
use crate::ops::linear as matmul;
use crate::ops::linear::cuda_lowp as lowp;
use crate::ops::quantize::ActQuant;
use crate::ops::sample::SampleParams;
use crate::ops::{attention, elementwise, logprob, norm, quantize, rope, sample};
use crate::quant::nvfp4::Nvfp4Opts;
use crate::quant::qtensor::{QFormat, QTensor};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy)]
pub(super) enum Tol {
    Exact,
    Close(f64, f64),
}

/// One row of the table.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Check {
    pub op: String,
    pub dtype: String,
    pub values: usize,
    pub max_abs: f64,
    pub max_rel: f64,
    pub tolerance: String,
    pub mismatches: usize,
    /// None: skipped (not available on this GPU / build).
    pub pass: Option<bool>,
    pub note: String,
}

impl Check {
    /// The table's header.
    pub fn header() -> String {
        format!(
            "{:<48} {:<22} {:>8} {:>10} {:>10} {:>18} {:>6}",
            "op", "dtype", "values", "max|Δ|", "max rel", "tolerance", "result"
        )
    }

    /// The row as the table prints it.
    pub fn row(&self) -> String {
        let res = match self.pass {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "skip",
        };
        format!(
            "{:<48} {:<22} {:>8} {:>10.2e} {:>10.2e} {:>18} {:>6} {}",
            self.op, self.dtype, self.values, self.max_abs, self.max_rel, self.tolerance, res, self.note
        )
    }
}

/// The check groups, in the order they run: (name, what it covers).
pub const GROUPS: [(&str, &str); 10] = [
    ("dense", "linears, RMSNorm, head norm, RoPE"),
    ("rows", "embedding, SwiGLU, gathers, amax, log-probs, sampling"),
    ("attention", "KV writes, prefill and decode attention: head_dim 64, 3 query heads per KV head"),
    ("attention-128", "the same at head_dim 128 with 7 query heads per KV head (Qwen2.5-7B's shape)"),
    ("quant", "fake quantization, requantize, the W8A8 / W4A4 GEMM paths"),
    ("scale-layout", "NVFP4 scale layout sizes of the sm_100 CUTLASS kernels"),
    ("optim", "the optimizer step (AdamW, SGD, clipping, compute weights and their amax), the squared norm, the device collective on its own stream"),
    ("train-gemm", "the backward GEMMs dx = dy·W, dW = dyᵀ·x and the fused LM-head loss (plain and centered)"),
    ("backward", "the layers' backward kernels: RMSNorm, RoPE, SwiGLU, embedding, bias, attention; a checkpointed model backward"),
    ("decode-graph", "decode steps replayed as CUDA graphs per batch bucket vs the same padded steps launched eagerly, before and after an in-place resync and a KV cache release"),
];

/// Runs check group `name` on `cuda`, printing each row as it is recorded; returns the rows.
pub fn run_group(name: &str, cuda: &CudaDevice, seed: u64) -> Result<Vec<Check>> {
    let index = GROUPS.iter().position(|g| g.0 == name).unwrap_or(GROUPS.len());
    let mut x = Ctx {
        cpu: Device::cpu(0)?,
        gpu: Device::Cuda(cuda.clone()),
        cuda: cuda.clone(),
        // Each group its own stream of the seed: a group's inputs do not depend on which
        // groups ran before it.
        rng: crate::rand::Stream::new(seed, 0xDC00 + index as u64),
        checks: Vec::new(),
    };
    let r = match name {
        "dense" => check_dense(&mut x),
        "rows" => check_rows(&mut x),
        "attention" => check_attention(&mut x, 2, 6, 64),
        "attention-128" => check_attention(&mut x, 2, 14, 128),
        "quant" => check_quant(&mut x),
        "scale-layout" => check_scale_layout(&mut x),
        "optim" => super::train_checks::optim(&mut x),
        "train-gemm" => super::train_checks::train_gemm(&mut x),
        "backward" => super::train_checks::backward(&mut x),
        "decode-graph" => super::engine_checks::decode_graph(&mut x),
        other => bail!("no check group '{other}'"),
    };
    r.map(|_| x.checks)
}

pub(super) struct Ctx {
    pub(super) cpu: Device,
    pub(super) gpu: Device,
    pub(super) cuda: CudaDevice,
    pub(super) rng: crate::rand::Stream,
    checks: Vec<Check>,
}

/// A tensor on each device.
pub(super) struct Pair {
    pub(super) c: Tensor,
    pub(super) g: Tensor,
}

fn bytes(t: &Tensor) -> Result<Vec<u8>> {
    match t.storage() {
        Storage::Cpu(CpuStorage::U8(v)) => Ok(v.clone()),
        Storage::Cuda(s) => {
            let mut v = vec![0u8; t.numel()];
            s.read_raw(&mut v)?;
            Ok(v)
        }
        _ => bail!("expected a u8 tensor"),
    }
}

impl Ctx {
    pub(super) fn randn(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| (self.rng.normal() as f32) * std).collect()
    }
    pub(super) fn pair(&self, dtype: DType, shape: &[usize], data: &[f32]) -> Result<Pair> {
        Ok(Pair { c: self.cpu.from_f32(dtype, shape, data)?, g: self.gpu.from_f32(dtype, shape, data)? })
    }
    pub(super) fn randp(&mut self, dtype: DType, shape: &[usize], std: f32) -> Result<Pair> {
        let d = self.randn(shape.iter().product(), std);
        self.pair(dtype, shape, &d)
    }
    pub(super) fn u32s(&self, shape: &[usize], data: Vec<u32>) -> Result<Pair> {
        let h = Tensor::from_u32_host(shape, data)?;
        Ok(Pair { g: self.gpu.upload(h.try_clone()?)?, c: h })
    }
    fn u8s(&self, shape: &[usize], data: &[u8]) -> Result<Pair> {
        let mut h = Tensor::cpu_zeros(DType::U8, shape);
        if let CpuStorage::U8(v) = h.cpu_mut()? {
            v.copy_from_slice(data);
        }
        Ok(Pair { g: self.gpu.upload(h.try_clone()?)?, c: h })
    }
    /// An f32 output on each device, poisoned with NaN.
    pub(super) fn out(&self, shape: &[usize]) -> Result<Pair> {
        let n: usize = shape.iter().product();
        self.pair(DType::F32, shape, &vec![f32::NAN; n])
    }
    pub(super) fn record(&mut self, op: &str, dtype: &str, c: &[f32], g: &[f32], tol: Tol) {
        let (mut max_abs, mut max_rel, mut bad) = (0.0f64, 0.0f64, 0usize);
        for (&x, &y) in c.iter().zip(g) {
            let ok = match tol {
                Tol::Exact => x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                Tol::Close(atol, rtol) => {
                    (x.is_nan() && y.is_nan()) || ((y as f64 - x as f64).abs() <= atol + rtol * (x as f64).abs())
                }
            };
            let e = (y as f64 - x as f64).abs();
            if e.is_finite() {
                max_abs = max_abs.max(e);
                max_rel = max_rel.max(e / (x as f64).abs().max(1e-30));
            }
            bad += (!ok) as usize;
        }
        if c.len() != g.len() {
            bad += 1;
        }
        // Every input is finite, so a NaN in the CPU reference means a twin left its output
        // (poisoned with NaN) unwritten, and the GPU leaving the same values unwritten would
        // pass as "both NaN": such a check fails.
        let ref_nan = c.iter().filter(|x| x.is_nan()).count();
        let tolerance = match tol {
            Tol::Exact => "exact".to_string(),
            Tol::Close(a, r) => format!("{a:.0e} + {r:.0e}·|ref|"),
        };
        self.checks.push(Check {
            op: op.into(),
            dtype: dtype.into(),
            values: c.len(),
            max_abs,
            max_rel,
            tolerance,
            mismatches: bad,
            pass: Some(bad == 0 && ref_nan == 0),
            note: if ref_nan > 0 { format!("{ref_nan} NaN in the CPU reference") } else { String::new() },
        });
        self.print_last();
    }

    fn print_last(&self) {
        if let Some(c) = self.checks.last() {
            println!("{}", c.row());
        }
    }
    pub(super) fn cmp(&mut self, op: &str, dtype: &str, p: &Pair, tol: Tol) -> Result<()> {
        let (c, g) = (p.c.to_f32_vec()?, p.g.to_f32_vec()?);
        self.record(op, dtype, &c, &g, tol);
        Ok(())
    }
    fn cmp_bytes(&mut self, op: &str, c: &Tensor, g: &Tensor) -> Result<()> {
        let (c, g) = (bytes(c)?, bytes(g)?);
        let as_f = |v: &[u8]| v.iter().map(|&b| b as f32).collect::<Vec<_>>();
        self.record(op, "u8", &as_f(&c), &as_f(&g), Tol::Exact);
        Ok(())
    }
    pub(super) fn skip(&mut self, op: &str, dtype: &str, why: String) {
        self.checks.push(Check {
            op: op.into(),
            dtype: dtype.into(),
            values: 0,
            max_abs: 0.0,
            max_rel: 0.0,
            tolerance: "-".into(),
            mismatches: 0,
            pass: None,
            note: why,
        });
        self.print_last();
    }
    /// Runs `f` on both devices (CPU first).
    pub(super) fn both(&self, mut f: impl FnMut(&Device, bool) -> Result<()>) -> Result<()> {
        f(&self.cpu, false)?;
        f(&self.gpu, true)?;
        self.gpu.synchronize()
    }
}

pub(super) fn pick(p: &Pair, gpu: bool) -> &Tensor {
    if gpu {
        &p.g
    } else {
        &p.c
    }
}

pub(super) fn pick_mut(p: &mut Pair, gpu: bool) -> &mut Tensor {
    if gpu {
        &mut p.g
    } else {
        &mut p.c
    }
}

pub(super) const M: usize = 37;
pub(super) const C: usize = 512;
pub(super) const N: usize = 384;

fn check_dense(x: &mut Ctx) -> Result<()> {
    let xin = x.randp(DType::F32, &[M, C], 1.0)?;
    for (dt, tol) in [
        (DType::F32, Tol::Close(1e-4, 1e-4)),
        (DType::BF16, Tol::Close(1e-2, 1e-2)),
        (DType::F16, Tol::Close(1e-2, 1e-2)),
    ] {
        let w = x.randp(dt, &[N, C], 1.0 / (C as f32).sqrt())?;
        let b = x.randp(dt, &[N], 0.5)?;
        let mut y = x.out(&[M, N])?;
        x.both(|d, g| matmul::linear(d, pick(&xin, g), pick(&w, g), Some(pick(&b, g)), pick_mut(&mut y, g), M, false))?;
        x.cmp("linear + bias", dt.name(), &y, tol)?;
        let start = x.randn(M * N, 1.0);
        y.c.write_f32(&start)?;
        y.g.write_f32(&start)?;
        x.both(|d, g| matmul::linear(d, pick(&xin, g), pick(&w, g), None, pick_mut(&mut y, g), M, true))?;
        x.cmp("linear accumulate", dt.name(), &y, tol)?;
    }
    let w = x.randp(DType::BF16, &[C], 1.0)?;
    let mut y = x.out(&[M, C])?;
    x.both(|d, g| norm::rmsnorm(d, pick(&xin, g), pick(&w, g), 1e-6, pick_mut(&mut y, g), M))?;
    x.cmp("rmsnorm", "bf16 w", &y, Tol::Close(1e-5, 1e-5))?;
    let mut res = x.randp(DType::F32, &[M, C], 1.0)?;
    let upd = x.randp(DType::F32, &[M, C], 1.0)?;
    x.both(|d, g| {
        let r = pick_mut(&mut res, g);
        norm::add_rmsnorm(d, r, pick(&upd, g), pick(&w, g), 1e-6, pick_mut(&mut y, g), M)
    })?;
    x.cmp("add_rmsnorm (output)", "bf16 w", &y, Tol::Close(1e-5, 1e-5))?;
    x.cmp("add_rmsnorm (residual)", "f32", &res, Tol::Exact)?;
    // The engine's BF16 norm outputs (a dense BF16 linear's input) against the f32 ones
    // rounded to nearest even on the host: exact. The residual is updated once per call, so
    // both runs start from the same residual.
    let r0 = res.c.to_f32_vec()?;
    let (mut r32, mut r16) = (x.gpu.from_f32(DType::F32, &[M, C], &r0)?, x.gpu.from_f32(DType::F32, &[M, C], &r0)?);
    let (mut y32, mut y16) = (x.gpu.zeros(DType::F32, &[M, C])?, x.gpu.zeros(DType::BF16, &[M, C])?);
    norm::add_rmsnorm(&x.gpu, &mut r32, &upd.g, &w.g, 1e-6, &mut y32, M)?;
    norm::add_rmsnorm(&x.gpu, &mut r16, &upd.g, &w.g, 1e-6, &mut y16, M)?;
    bf16_output(x, "add_rmsnorm: BF16 output vs the f32 output rounded", "bf16", &y32, &y16)?;
    x.record("add_rmsnorm: residual beside a BF16 output", "f32", &r32.to_f32_vec()?, &r16.to_f32_vec()?, Tol::Exact);
    let (heads, d) = (6, 64);
    let mut q = x.randp(DType::F32, &[M, heads * d], 1.0)?;
    let wn = x.randp(DType::F32, &[d], 1.0)?;
    x.both(|dv, g| norm::head_rmsnorm(dv, pick_mut(&mut q, g), pick(&wn, g), 1e-6, M, heads))?;
    x.cmp("head_rmsnorm", "f32 w", &q, Tol::Close(1e-5, 1e-5))?;
    // RoPE: tables on each device, then the rotation from identical tables.
    let pos = x.u32s(&[M], (0..M as u32).map(|i| i * 977 % 32768).collect())?;
    let f: Vec<f32> = (0..d / 2).map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / d as f32)).collect();
    let inv = x.pair(DType::F32, &[d / 2], &f)?;
    let (mut cs, mut sn) = (x.out(&[M, d / 2])?, x.out(&[M, d / 2])?);
    x.both(|dv, g| {
        let (c, s) = (pick_mut(&mut cs, g), pick_mut(&mut sn, g));
        rope::rope_table(dv, pick(&pos, g), pick(&inv, g), c, s, M)
    })?;
    x.cmp("rope_table cos", "f32", &cs, Tol::Close(1.2e-7, 0.0))?;
    x.cmp("rope_table sin", "f32", &sn, Tol::Close(1.2e-7, 0.0))?;
    let (c0, s0) = (cs.c.to_f32_vec()?, sn.c.to_f32_vec()?);
    let (ct, st) = (x.pair(DType::F32, &[M, d / 2], &c0)?, x.pair(DType::F32, &[M, d / 2], &s0)?);
    let mut qr = x.randp(DType::F32, &[M, heads * d], 1.0)?;
    x.both(|dv, g| rope::rope(dv, pick_mut(&mut qr, g), pick(&ct, g), pick(&st, g), M, heads))?;
    x.cmp("rope (identical tables)", "f32", &qr, Tol::Exact)?;
    Ok(())
}

fn check_rows(x: &mut Ctx) -> Result<()> {
    let v = 5003;
    let table = x.randp(DType::BF16, &[v, C], 1.0)?;
    let ids = x.u32s(&[M], (0..M as u32).map(|i| i.wrapping_mul(2654435761) % v as u32).collect())?;
    let mut e = x.out(&[M, C])?;
    x.both(|d, g| elementwise::embedding(d, pick(&table, g), pick(&ids, g), pick_mut(&mut e, g), M))?;
    x.cmp("embedding", "bf16 table", &e, Tol::Exact)?;
    let (gate, up) = (x.randp(DType::F32, &[M, N], 2.0)?, x.randp(DType::F32, &[M, N], 1.0)?);
    let mut o = x.out(&[M, N])?;
    x.both(|d, g| elementwise::swiglu(d, pick(&gate, g), pick(&up, g), pick_mut(&mut o, g), M))?;
    x.cmp("swiglu", "f32", &o, Tol::Close(1e-6, 1e-6))?;
    let idx = x.u32s(&[9], vec![36, 0, 5, 5, 17, 2, 30, 11, 1])?;
    let mut gr = x.out(&[9, N])?;
    x.both(|d, g| elementwise::gather_rows(d, pick(&gate, g), pick(&idx, g), pick_mut(&mut gr, g), 9))?;
    x.cmp("gather_rows", "f32", &gr, Tol::Exact)?;
    let mut am = [0.0f32; 2];
    for (i, d) in [&x.cpu, &x.gpu].into_iter().enumerate() {
        am[i] = elementwise::amax_rows(d, if i == 0 { &gate.c } else { &gate.g }, M)?;
    }
    x.record("amax_rows", "f32", &am[..1], &am[1..], Tol::Exact);
    // Log-probs at T = 0.7 over a vocabulary of 5003.
    let z = x.randp(DType::F32, &[9, v], 3.0)?;
    let t = x.u32s(&[9], (0..9u32).map(|i| i * 557 % v as u32).collect())?;
    let mut lp = x.out(&[9])?;
    x.both(|d, g| logprob::log_softmax_gather(d, pick(&z, g), pick(&t, g), 0.7, pick_mut(&mut lp, g), 9))?;
    x.cmp("log_softmax_gather", "f32", &lp, Tol::Close(1e-5, 1e-6))?;
    // Sampling: greedy and untruncated rows (ct_sample), top-k / top-p rows (ct_sample_topk;
    // a top-p prefix longer than its CT_TOPK_CAP candidates goes to the host twin).
    let rows = 24;
    let zs = x.randp(DType::F32, &[rows, v], 3.0)?;
    let params: Vec<SampleParams> = (0..rows)
        .map(|i| SampleParams {
            temperature: [0.0, 1.0, 0.7, 1.0, 0.8, 1.0][i / 4],
            top_k: [0, 0, 40, 0, 7, 0][i / 4],
            top_p: [1.0, 1.0, 1.0, 0.9, 0.5, 0.999][i / 4],
            seed: 11,
            request: i as u64,
            sample: (i % 2) as u32,
            position: 100 + i as u32,
        })
        .collect();
    let (mut tc, mut lc, mut tg, mut lg) =
        (vec![0u32; rows], vec![0f32; rows], vec![u32::MAX; rows], vec![f32::NAN; rows]);
    sample::sample(&x.cpu, &zs.c, &params, &mut tc, &mut lc)?;
    sample::sample(&x.gpu, &zs.g, &params, &mut tg, &mut lg)?;
    let f = |v: &[u32]| v.iter().map(|&t| t as f32).collect::<Vec<_>>();
    x.record("sample tokens", "u32", &f(&tc), &f(&tg), Tol::Exact);
    x.record("sample log-probs", "f32", &lc, &lg, Tol::Close(1e-5, 1e-6));
    Ok(())
}

fn attn_meta(
    x: &Ctx,
    dev: &Device,
    bs: usize,
    max_blocks: usize,
    seqs: &[(u32, u32)],
    tables: &[u32],
    slots: &[u32],
) -> Result<AttnMeta> {
    let up = |shape: &[usize], v: Vec<u32>| -> Result<Tensor> {
        let h = Tensor::from_u32_host(shape, v)?;
        if dev.is_cpu() {
            Ok(h)
        } else {
            x.gpu.upload(h)
        }
    };
    let mut qs = vec![0u32];
    for (q_len, _) in seqs {
        qs.push(qs.last().copied().unwrap_or(0) + q_len);
    }
    let tokens = *qs.last().unwrap_or(&0) as usize;
    let attended = crate::ops::attention::attended_keys(&qs, &seqs.iter().map(|s| s.1).collect::<Vec<_>>());
    Ok(AttnMeta {
        num_seqs: seqs.len(),
        num_tokens: tokens,
        block_size: bs,
        max_blocks,
        q_start: up(&[seqs.len() + 1], qs)?,
        ctx_len: up(&[seqs.len()], seqs.iter().map(|s| s.1).collect())?,
        block_tables: up(&[seqs.len(), max_blocks], tables.to_vec())?,
        slot_mapping: up(&[tokens], slots.to_vec())?,
        attended,
        packed: Default::default(),
    })
}

/// Attention with `hkv` KV heads of `heads` query heads of dimension `d`.
fn check_attention(x: &mut Ctx, hkv: usize, heads: usize, d: usize) -> Result<()> {
    let (bs, nb, maxb) = (16usize, 44usize, 10usize);
    let shape_note = format!("h{heads}/kv{hkv} d{d}");
    // (q_len, ctx_len): a fresh prefill, a decode row, a chunk of a longer prefill, and a long
    // chunk (70 rows at positions 80..149: several key and query tiles).
    let seqs = [(5u32, 5u32), (1, 40), (7, 23), (70, 150)];
    let mut perm: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        perm.swap(i, x.rng.below(i as u64 + 1) as usize);
    }
    let tables: Vec<u32> = perm[..seqs.len() * maxb].to_vec();
    let mut slots = Vec::new();
    for (s, (q_len, ctx)) in seqs.iter().enumerate() {
        for p in (ctx - q_len)..*ctx {
            slots.push(tables[s * maxb + p as usize / bs] * bs as u32 + p % bs as u32);
        }
    }
    let (mc, mg) = (
        attn_meta(x, &x.cpu, bs, maxb, &seqs, &tables, &slots)?,
        attn_meta(x, &x.gpu, bs, maxb, &seqs, &tables, &slots)?,
    );
    // Sequence 1's decode row alone: few rows per sequence, so ct_paged_attention runs (the
    // whole batch, mostly prefill rows, runs ct_prefill_attention).
    let (dec, dec_tables) = ([(1u32, 40u32)], &tables[maxb..2 * maxb]);
    let (dc, dg) = (
        attn_meta(x, &x.cpu, bs, maxb, &dec, dec_tables, &slots[5..6])?,
        attn_meta(x, &x.gpu, bs, maxb, &dec, dec_tables, &slots[5..6])?,
    );
    let t = mc.num_tokens;
    let shape = [nb, hkv, bs, d];
    let nval = nb * hkv * bs * d;
    let q = x.randp(DType::F32, &[t, heads * d], 1.0)?;
    let (k, v) = (x.randp(DType::F32, &[t, hkv * d], 1.0)?, x.randp(DType::F32, &[t, hkv * d], 1.0)?);
    for dt in [DType::F32, DType::BF16, DType::U8] {
        let (ks, vs) = if dt == DType::U8 { (0.02f32, 0.03f32) } else { (1.0, 1.0) };
        let (mut kc, mut vc) = if dt == DType::U8 {
            let codes: Vec<u8> =
                (0..nval).map(|_| x.rng.below(255) as u8).map(|c| if c & 0x7F == 0x7F { c - 1 } else { c }).collect();
            (x.u8s(&shape, &codes)?, x.u8s(&shape, &codes)?)
        } else {
            (x.randp(dt, &shape, 1.0)?, x.randp(dt, &shape, 1.0)?)
        };
        x.both(|dv, g| {
            let m = if g { &mg } else { &mc };
            let (kcm, vcm) = (pick_mut(&mut kc, g), pick_mut(&mut vc, g));
            attention::kv_write(dv, pick(&k, g), pick(&v, g), kcm, vcm, ks, vs, m)
        })?;
        if dt == DType::U8 {
            x.cmp_bytes(&format!("kv_write {shape_note} (keys)"), &kc.c, &kc.g)?;
            x.cmp_bytes(&format!("kv_write {shape_note} (values)"), &vc.c, &vc.g)?;
        } else {
            x.cmp(&format!("kv_write {shape_note} (keys)"), dt.name(), &kc, Tol::Exact)?;
            x.cmp(&format!("kv_write {shape_note} (values)"), dt.name(), &vc, Tol::Exact)?;
        }
        // The whole batch (mostly prefill rows: ct_prefill_attention, or with a BF16 cache
        // ct_prefill_attention_tc, whose tensor cores round q and the probabilities to BF16),
        // then the decode row alone (ct_paged_attention).
        let tc = dt == DType::BF16;
        for (what, rows, (m_c, m_g)) in [("prefill", t, (&mc, &mg)), ("decode", 1, (&dc, &dg))] {
            let mut o = x.out(&[rows, heads * d])?;
            x.both(|dv, g| {
                let m = if g { m_g } else { m_c };
                let (qq, kk, vv) = (pick(&q, g), pick(&kc, g), pick(&vc, g));
                attention::paged_attention(dv, qq, kk, vv, ks, vs, m, pick_mut(&mut o, g), heads)
            })?;
            let (kernel, tol) = match (what, tc) {
                ("prefill", true) => ("prefill kernel (tensor cores)", Tol::Close(1e-2, 1e-2)),
                _ => (if what == "prefill" { "prefill kernel" } else { "decode kernel" }, Tol::Close(1e-5, 1e-4)),
            };
            x.cmp(&format!("attention {shape_note}, {kernel}"), &format!("{} cache", dt.name()), &o, tol)?;
            let mut o16 = x.gpu.zeros(DType::BF16, &[rows, heads * d])?;
            attention::paged_attention(&x.gpu, &q.g, &kc.g, &vc.g, ks, vs, m_g, &mut o16, heads)?;
            let what = format!("attention {shape_note}, {kernel}, BF16 output");
            bf16_output(x, &what, &format!("{} cache", dt.name()), &o.g, &o16)?;
        }
    }
    super::prep_checks::qk_rope_kv(x, &mg, heads, shape)?;
    split_decode(x, hkv, heads, d)?;
    packed_prefill(x, hkv, heads, d)
}

/// Three decode rows of 700, 37 and 300 keys through 48-block tables: too few (row, KV head)
/// blocks for the SMs, so ct_paged_attention splits each row's keys (3 splits on an H200 and
/// on the simulator) and ct_attention_merge combines them; the CPU twin does not split.
fn split_decode(x: &mut Ctx, hkv: usize, heads: usize, d: usize) -> Result<()> {
    let (bs, maxb, seqs) = (16usize, 48usize, [(1u32, 700u32), (1, 37), (1, 300)]);
    let nb = seqs.len() * maxb;
    let tables: Vec<u32> = (0..nb as u32).map(|i| (i * 7 + 3) % nb as u32).collect();
    let slots = [699u32, 36, 299].map(|p| p % bs as u32);
    let (mc, mg) = (
        attn_meta(x, &x.cpu, bs, maxb, &seqs, &tables, &slots)?,
        attn_meta(x, &x.gpu, bs, maxb, &seqs, &tables, &slots)?,
    );
    let q = x.randp(DType::F32, &[3, heads * d], 1.0)?;
    for dt in [DType::F32, DType::BF16] {
        let (kc, vc) = (x.randp(dt, &[nb, hkv, bs, d], 1.0)?, x.randp(dt, &[nb, hkv, bs, d], 1.0)?);
        let mut o = x.out(&[3, heads * d])?;
        x.both(|dv, g| {
            let m = if g { &mg } else { &mc };
            attention::paged_attention(
                dv,
                pick(&q, g),
                pick(&kc, g),
                pick(&vc, g),
                1.0,
                1.0,
                m,
                pick_mut(&mut o, g),
                heads,
            )
        })?;
        let what = format!("attention h{heads}/kv{hkv} d{d}, decode split over the keys + merge");
        x.cmp(&what, &format!("{} cache", dt.name()), &o, Tol::Close(1e-5, 1e-4))?;
    }
    Ok(())
}

/// A GPU op run again storing BF16, `o16` (what a dense BF16 linear multiplies): exactly the
/// host's round-to-nearest-even of the same op's f32 output `f32_out`.
pub(super) fn bf16_output(x: &mut Ctx, what: &str, dtype: &str, f32_out: &Tensor, o16: &Tensor) -> Result<()> {
    let rounded: Vec<f32> = f32_out.to_f32_vec()?.iter().map(|&v| crate::device::bf16_rne(v).to_f32()).collect();
    x.record(what, dtype, &rounded, &o16.to_f32_vec()?, Tol::Exact);
    Ok(())
}

/// A prefill step with a BF16 cache: a continuing chunk (7 rows at positions 16..23, through
/// the cache), then three whole sequences (every one starting at position 0). The engine's
/// attention (`attention::packed_prefill`: the chunk paged, the whole sequences on the tensor
/// cores, the training forward over their own q, k, v) against the CPU's paged attention over
/// the cache the step wrote. BF16 tolerance: the tensor cores round q and the probabilities too.
fn packed_prefill(x: &mut Ctx, hkv: usize, heads: usize, d: usize) -> Result<()> {
    let (bs, nb, maxb) = (16usize, 16usize, 3usize);
    let seqs = [(7u32, 23u32), (5, 5), (33, 33), (17, 17)];
    let tables: Vec<u32> = (0..(seqs.len() * maxb) as u32).map(|i| (i * 5 + 2) % nb as u32).collect();
    let mut slots = Vec::new();
    for (s, (q_len, ctx)) in seqs.iter().enumerate() {
        slots.extend((ctx - q_len..*ctx).map(|p| tables[s * maxb + p as usize / bs] * bs as u32 + p % bs as u32));
    }
    let mc = attn_meta(x, &x.cpu, bs, maxb, &seqs, &tables, &slots)?;
    let mut mg = attn_meta(x, &x.gpu, bs, maxb, &seqs, &tables, &slots)?;
    mg.packed.cu = Some(x.gpu.zeros(DType::U32, &[seqs.len() + 1])?);
    let mut offsets = vec![0u32];
    for s in &seqs {
        offsets.push(offsets[offsets.len() - 1] + s.0);
    }
    attention::plan_packed(&mut mg, &offsets, &seqs.map(|s| s.1))?;
    let t = mc.num_tokens;
    let q = x.randp(DType::F32, &[t, heads * d], 1.0)?;
    let (k, v) = (x.randp(DType::F32, &[t, hkv * d], 1.0)?, x.randp(DType::F32, &[t, hkv * d], 1.0)?);
    let shape = [nb, hkv, bs, d];
    let (mut kc, mut vc) = (x.randp(DType::BF16, &shape, 1.0)?, x.randp(DType::BF16, &shape, 1.0)?);
    let mut o = x.out(&[t, heads * d])?;
    attention::kv_write(&x.cpu, &k.c, &v.c, &mut kc.c, &mut vc.c, 1.0, 1.0, &mc)?;
    attention::paged_attention(&x.cpu, &q.c, &kc.c, &vc.c, 1.0, 1.0, &mc, &mut o.c, heads)?;
    attention::kv_write(&x.gpu, &k.g, &v.g, &mut kc.g, &mut vc.g, 1.0, 1.0, &mg)?;
    let ran = attention::packed_prefill(&x.gpu, &q.g, &k.g, &v.g, &kc.g, &vc.g, &mut mg, &mut o.g, heads)?;
    x.gpu.synchronize()?;
    if !ran || mg.packed.from != 1 {
        bail!("the packed prefill did not take the step's 3 whole sequences (h{heads}/kv{hkv} d{d})");
    }
    let what = format!("attention h{heads}/kv{hkv} d{d}, packed prefill (tensor cores)");
    x.cmp(&what, "bf16 cache", &o, Tol::Close(1e-2, 1e-2))?;
    // Its outputs in BF16 (both kernels of the step), after the same cache writes.
    let mut o16 = x.gpu.zeros(DType::BF16, &[t, heads * d])?;
    attention::packed_prefill(&x.gpu, &q.g, &k.g, &v.g, &kc.g, &vc.g, &mut mg, &mut o16, heads)?;
    bf16_output(x, &format!("{what}, BF16 output"), "bf16 cache", &o.g, &o16)
}

fn check_quant(x: &mut Ctx) -> Result<()> {
    let (rows, k) = (N, C);
    let xin = x.randp(DType::F32, &[M, k], 1.0)?;
    let amax = xin.c.to_f32_vec()?.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let variants = [
        ("plain", Nvfp4Opts::default()),
        ("rht", Nvfp4Opts { rht: Some(3), stochastic: None }),
        ("sr", Nvfp4Opts { rht: None, stochastic: Some(4) }),
        ("rht+sr", Nvfp4Opts { rht: Some(3), stochastic: Some(4) }),
    ];
    let mut acts = vec![("fp8".to_string(), ActQuant::Fp8 { scale: amax / 448.0 })];
    for (name, opts) in variants {
        acts.push((format!("nvfp4 {name}"), ActQuant::Nvfp4 { global: amax / 2688.0, opts }));
    }
    for (name, act) in &acts {
        let mut y = x.out(&[M, k])?;
        x.both(|d, g| quantize::fake_quant_rows(d, pick(&xin, g), pick_mut(&mut y, g), M, act))?;
        x.cmp("fake_quant_rows", name, &y, Tol::Exact)?;
    }
    for src_dt in [DType::BF16, DType::F32] {
        let w = x.randp(src_dt, &[rows, k], 0.05)?;
        for (fmt, name, opts) in [
            (QFormat::Fp8, "fp8", Nvfp4Opts::default()),
            (QFormat::Nvfp4, "nvfp4", Nvfp4Opts::default()),
            (QFormat::Nvfp4, "nvfp4 rht+sr", Nvfp4Opts { rht: Some(3), stochastic: Some(4) }),
        ] {
            let mut qc = QTensor::alloc(fmt, rows, k, opts)?;
            let mut qg = QTensor::alloc_on(&x.gpu, fmt, rows, k, opts)?;
            // Poison the device buffers: a byte the kernel forgets to write shows up (unless the
            // CPU wrote 0xA5 there too).
            qg.codes = x.u8s(&[qg.codes.numel()], &vec![0xA5; qg.codes.numel()])?.g;
            qg.block_scales = x.u8s(&[qg.block_scales.numel()], &vec![0xA5; qg.block_scales.numel()])?.g;
            qg.scale = f32::NAN;
            quantize::requantize(&x.cpu, &w.c, &mut qc, "w")?;
            quantize::requantize(&x.gpu, &w.g, &mut qg, "w")?;
            let label = format!("{name} from {}", src_dt.name());
            x.cmp_bytes(&format!("requantize codes {label}"), &qc.codes, &qg.codes)?;
            if fmt == QFormat::Nvfp4 {
                x.cmp_bytes(&format!("requantize block scales {label}"), &qc.block_scales, &qg.block_scales)?;
            }
            x.record(&format!("requantize tensor scale {label}"), "f32", &[qc.scale], &[qg.scale], Tol::Exact);
            let cd = x.cuda.clone();
            let at = |t: &Tensor, dt: DType| crate::device::cuda::args::ptr(&cd, t, &[dt], "kept operand");
            if lowp::emulated_here(&x.gpu, fmt, rows, k) {
                // An engine's kept decoded weight (NVFP4 on Hopper), written by the requantize:
                // bit for bit what the emulated GEMM decodes per call from the same codes.
                let mut qk = QTensor::alloc_on(&x.gpu, fmt, rows, k, opts)?;
                qk.keep_decoded(&x.gpu)?;
                quantize::requantize(&x.gpu, &w.g, &mut qk, "w")?;
                let per_call = x.gpu.zeros(DType::BF16, &[rows, k])?;
                quantize::dequant(&cd, &qg, at(&per_call, DType::BF16)?, DType::BF16)?;
                let kept = qk.decoded.as_ref().map(|t| t.to_f32_vec()).transpose()?.unwrap_or_default();
                let op = format!("requantize kept decoded weight {label}");
                x.record(&op, "bf16", &per_call.to_f32_vec()?, &kept, Tol::Exact);
            } else if fmt == QFormat::Nvfp4 {
                // Its tiled block scales where CUTLASS takes NVFP4 (sm_100): what the GEMM tiles
                // per call from the same scales.
                let bytes = lowp::swizzled_sf_bytes(rows, k);
                let mut qk = QTensor::alloc_on(&x.gpu, fmt, rows, k, opts)?;
                qk.keep_swizzled(&x.gpu, bytes)?;
                quantize::requantize(&x.gpu, &w.g, &mut qk, "w")?;
                let per_call = x.gpu.zeros(DType::U8, &[bytes])?;
                quantize::swizzle_sf_into(&cd, at(&qg.block_scales, DType::U8)?, at(&per_call, DType::U8)?, rows, k)?;
                match &qk.swizzled {
                    Some(t) => x.cmp_bytes(&format!("requantize kept tiled scales {label}"), &per_call, t)?,
                    None => bail!("an NVFP4 weight kept no tiled scales"),
                }
            }
            if src_dt == DType::BF16 && opts == Nvfp4Opts::default() {
                super::gemm_checks::qlinear(x, &xin, &qc, &qg, name, amax)?;
            }
            // The mismatch guard's consistency check: the host's fresh quantization of sampled
            // rows must equal the codes the device wrote, and must catch them zeroed.
            let sample = crate::model::quant_state::sample_rows(rows, 8);
            let src = crate::device::CpuFloats::of(&w.c)?;
            let same = qg.matches_fresh(src, "w", &sample)?;
            qg.codes.fill_zero()?;
            let caught = !qg.matches_fresh(src, "w", &sample)?;
            x.record(
                &format!("guard view check {label}"),
                "agree, caught",
                &[1.0, 1.0],
                &[same as u8 as f32, caught as u8 as f32],
                Tol::Exact,
            );
        }
        // The NVFP4 learner's operands (rotated, rounded, rotated back): a weight under its
        // tensor amax, activation rows under their own or a fixed global scale.
        use crate::quant::nvfp4::Global;
        let rht = Nvfp4Opts { rht: Some(3), stochastic: Some(4) };
        for (label, global) in
            [("tensor", Global::Tensor), ("row", Global::Row), ("fixed", Global::Fixed(amax / 2688.0))]
        {
            let mut y = x.out(&[rows, k])?;
            x.both(|d, g| quantize::learner_round(d, pick(&w, g), pick_mut(&mut y, g), rows, global, &rht))?;
            x.cmp(&format!("learner_round {label} global, rht+sr"), src_dt.name(), &y, Tol::Exact)?;
            if src_dt == DType::F32 {
                super::learner_checks::w4a4(x, &xin, &w, global, &rht, label)?;
                super::learner_checks::backward(x, &xin, &w, global, &rht, label)?;
            }
        }
    }
    super::gemm_checks::w4a4_split_k(x)?;
    super::gemm_checks::swiglu_down(x)
}

/// The sizes of the sm_100 CUTLASS kernels' NVFP4 scale tensors against the swizzled layout
/// the glue writes (a build without them skips).
fn check_scale_layout(x: &mut Ctx) -> Result<()> {
    for (m, n, k) in [(37usize, 384usize, 512usize), (1, 18944, 3584), (4096, 512, 3584)] {
        match lowp::cutlass_nvfp4_sf_bytes(m, n, k) {
            Some((a, b)) => {
                let want = [lowp::swizzled_sf_bytes(m, k) as f32, lowp::swizzled_sf_bytes(n, k) as f32];
                x.record(
                    &format!("NVFP4 scale layout size m={m} n={n} k={k}"),
                    "bytes",
                    &want,
                    &[a as f32, b as f32],
                    Tol::Exact,
                );
            }
            None => {
                x.skip("NVFP4 scale layout sizes", "bytes", "this build has no sm100 CUTLASS kernels".into());
                break;
            }
        }
    }
    Ok(())
}
