//! The training checks of `colotrain device-check`: the optimizer step (and the device
//! collective's two streams), the backward GEMMs and the fused LM-head loss, the layers' backward kernels, each against its CPU twin on fresh
//! random inputs (the context and tolerances of `checks`); and a whole model's backward with
//! activation checkpointing against the one that kept its activations, bit for bit.
//!
//! Owns: the training check groups. May call: the ops. Must not: time anything.

use super::checks::{bf16_output, pick, pick_mut, Ctx, Tol, C, M, N};
use crate::device::{DType, Tensor};
use crate::ops::linear as matmul;
use anyhow::Result;

/// Two steps of each rule over tensors that cross chunk boundaries (the second step clipped),
/// the compute weights in BF16 and F32, then the squared norm of a gradient of 2.5 chunks.
pub(super) fn optim(x: &mut Ctx) -> Result<()> {
    use crate::ops::optim::{self, Compute, Layout, Rule, State, CHUNK};
    let sizes = [3, CHUNK + 5, 2 * CHUNK];
    let layout = Layout::new(vec![(0, 3), (3, CHUNK + 5), (CHUNK + 8, 2 * CHUNK)])?;
    let n = layout.len();
    for (adam, cdt) in [(true, DType::BF16), (false, DType::F32)] {
        let name = if adam { "AdamW" } else { "SGD" };
        let mut master = x.randp(DType::F32, &[n], 1.0)?;
        let mut m = x.pair(DType::F32, &[n], &vec![0.0; n])?;
        let mut v = x.pair(DType::F32, &[n], &vec![0.0; n])?;
        // The compute weights: one tensor per parameter (the engine's own buffers).
        let mut w = sizes.iter().map(|&k| x.pair(cdt, &[k], &vec![f32::NAN; k])).collect::<Result<Vec<_>>>()?;
        let mut grad = x.pair(DType::F32, &[n], &vec![0.0; n])?;
        let nan = || Tensor::from_u32_host(&[3], vec![f32::NAN.to_bits(); 3]);
        let mut amax = [x.cpu.upload(nan()?)?, x.gpu.upload(nan()?)?];
        for t in 1..=2u64 {
            let g = x.randn(n, 0.3);
            grad.c.write_f32(&g)?;
            grad.g.write_f32(&g)?;
            let rule = if adam { Rule::adamw(1e-2, 0.1, [0.9, 0.999], 1e-8, t) } else { Rule::sgd(0.5, 0.01) };
            let clip = if t == 2 { 0.25 } else { 1.0 };
            for (i, gpu) in [false, true].into_iter().enumerate() {
                let dev = if gpu { &x.gpu } else { &x.cpu };
                let mut st = State {
                    master: pick_mut(&mut master, gpu),
                    m: adam.then(|| pick_mut(&mut m, gpu)),
                    v: adam.then(|| pick_mut(&mut v, gpu)),
                    layout: &layout,
                };
                let mut ws: Vec<&mut Tensor> = w.iter_mut().map(|p| pick_mut(p, gpu)).collect();
                let out = Compute { weights: &mut ws, amax: Some(&mut amax[i]) };
                optim::step(dev, &mut st, pick_mut(&mut grad, gpu), clip, &rule, Some(out))?;
            }
        }
        x.cmp(&format!("optim {name}: master"), "f32", &master, Tol::Exact)?;
        if adam {
            x.cmp(&format!("optim {name}: moments m"), "f32", &m, Tol::Exact)?;
            x.cmp(&format!("optim {name}: moments v"), "f32", &v, Tol::Exact)?;
        }
        x.cmp(&format!("optim {name}: clipped gradient"), "f32", &grad, Tol::Exact)?;
        for (t, wt) in w.iter().enumerate() {
            x.cmp(&format!("optim {name}: compute weights of tensor {t}"), cdt.name(), wt, Tol::Exact)?;
        }
        let [ac, ag] = amax.map(|a| a.to_u32_vec().map(|b| b.into_iter().map(f32::from_bits).collect::<Vec<_>>()));
        x.record(&format!("optim {name}: amax per tensor (fused)"), cdt.name(), &ac?, &ag?, Tol::Exact);
    }
    let g = x.randp(DType::F32, &[5 * CHUNK / 2], 2.0)?;
    let (c, gg) = (optim::sum_sq(&x.cpu, &g.c)?, optim::sum_sq(&x.gpu, &g.g)?);
    x.record("optim: squared norm", "f64", &[c as f32], &[gg as f32], Tol::Close(0.0, 1e-6));
    // The device collective on one GPU: the copy and the column sum run on the communication
    // stream, the compute stream waits on its event and reads the result (the two streams and
    // their events on real hardware; with one rank the sum is the gradient itself).
    use crate::train::device_coll::{DeviceCollective, PeerCopy};
    let n = 3 * CHUNK + 7;
    let v = x.randn(n, 1.0);
    let send = x.gpu.from_f32(DType::F32, &[n], &v)?;
    let (mut staging, mut recv) = (x.gpu.zeros(DType::F32, &[1, n])?, x.gpu.zeros(DType::F32, &[n])?);
    let coll = PeerCopy::new(1)?;
    let e = coll.reduce_scatter(0, &send, &mut staging, &mut recv)?;
    x.cuda.wait_event(&e)?;
    let got = recv.to_f32_vec()?;
    x.record("device collective: reduce-scatter on the communication stream (1 GPU)", "f32", &v, &got, Tol::Exact);
    // The same through NCCL (libnccl, one communicator, the group call on the communication
    // stream between two events), then its in-place all-gather, which leaves one rank's buffer
    // as it is.
    let nccl = crate::train::device_nccl::NcclDevice::new(std::slice::from_ref(&x.cuda))?;
    let mut recv = x.gpu.zeros(DType::F32, &[n])?;
    let e = nccl.reduce_scatter(0, &send, &mut staging, &mut recv)?;
    x.cuda.wait_event(&e)?;
    x.record("NCCL: reduce-scatter on the communication stream (1 GPU)", "f32", &v, &recv.to_f32_vec()?, Tol::Exact);
    let e = nccl.all_gather_in_place(0, &mut recv)?;
    x.cuda.wait_event(&e)?;
    x.record("NCCL: all-gather in place (1 GPU)", "f32", &v, &recv.to_f32_vec()?, Tol::Exact);
    // The split placement's weight broadcast: two tensors in one group call (one ncclBroadcast
    // each), which leaves the root's tensors as they are.
    let w = x.randn(CHUNK + 5, 1.0);
    let mut t1 = x.gpu.from_f32(DType::F32, &[n], &v)?;
    let mut t2 = x.gpu.from_f32(DType::F32, &[w.len()], &w)?;
    let e = nccl.broadcast(0, 0, &mut [&mut t1, &mut t2])?;
    x.cuda.wait_event(&e)?;
    let (want, got) = ([v, w].concat(), [t1.to_f32_vec()?, t2.to_f32_vec()?].concat());
    x.record("NCCL: broadcast of two tensors in place (1 GPU)", "f32", &want, &got, Tol::Exact);
    Ok(())
}

/// The backward GEMMs of a linear and the fused LM-head loss against their CPU twins.
pub(super) fn train_gemm(x: &mut Ctx) -> Result<()> {
    use crate::ops::lm_head::{self, DevCenter, Rows};
    let (m, n, k) = (M, N, C);
    let dy = x.randp(DType::F32, &[m, n], 1.0 / (n as f32).sqrt())?;
    let xin = x.randp(DType::F32, &[m, k], 1.0)?;
    for (dt, tol) in [(DType::F32, Tol::Close(1e-4, 1e-4)), (DType::BF16, Tol::Close(1e-2, 1e-2))] {
        let w = x.randp(dt, &[n, k], 1.0)?;
        let mut dx = x.out(&[m, k])?;
        x.both(|d, g| matmul::linear_dx(d, pick(&dy, g), pick(&w, g), pick_mut(&mut dx, g), m, false))?;
        x.cmp("linear dx = dy·W", dt.name(), &dx, tol)?;
        let mut dw = x.randp(DType::F32, &[n, k], 1.0)?;
        x.both(|d, g| matmul::linear_dw(d, pick(&dy, g), pick(&xin, g), pick_mut(&mut dw, g), m, true, dt))?;
        x.cmp("linear dW += dyᵀ·x", &format!("{} operands", dt.name()), &dw, tol)?;
        // y = r + x·Wᵀ with cuBLASLt reading r as C and writing y (C ≠ D), against r copied
        // into y and accumulated in place, on the GPU: exact.
        let r = x.randp(DType::F32, &[m, n], 1.0)?;
        let mut inplace = x.gpu.zeros(DType::F32, &[m, n])?;
        inplace.copy_from(&r.g)?;
        matmul::linear(&x.gpu, &xin.g, &w.g, None, &mut inplace, m, true)?;
        let mut out = x.gpu.zeros(DType::F32, &[m, n])?;
        matmul::linear_residual(&x.gpu, &xin.g, &w.g, None, &r.g, &mut out, m)?;
        let (want, got) = (inplace.to_f32_vec()?, out.to_f32_vec()?);
        x.record("linear y = r + x·Wᵀ (C ≠ D) vs r + x·Wᵀ in place", dt.name(), &want, &got, Tol::Exact);
    }
    projections(x, &xin)?;
    // The fused loss: 29 of 40 hidden rows scored, chunks of 8, a vocabulary of 5003.
    let (n_h, c, v, rows, k_c) = (40usize, 256usize, 5003usize, 29usize, 4usize);
    let h = x.randp(DType::F32, &[n_h, c], 1.0)?;
    let wh = x.randp(DType::F32, &[v, c], 1.0 / (c as f32).sqrt())?;
    let mut perm: Vec<u32> = (0..n_h as u32).collect();
    for i in (1..n_h).rev() {
        perm.swap(i, x.rng.below(i as u64 + 1) as usize);
    }
    let idx = x.u32s(&[rows], perm[..rows].to_vec())?;
    let tg = x.u32s(&[rows], (0..rows as u32).map(|i| (i * 2741 + 5) % v as u32).collect())?;
    let ids = x.u32s(&[rows * k_c], (0..(rows * k_c) as u32).map(|i| (i * 577 + 3) % v as u32).collect())?;
    let probs =
        x.pair(DType::F32, &[rows * k_c], &(0..rows * k_c).map(|i| [0.4, 0.3, 0.2, 0.1][i % 4]).collect::<Vec<_>>())?;
    let coef = x.randp(DType::F32, &[rows], 1.0)?;
    let (mut lp, mut en) = (x.out(&[rows])?, x.out(&[rows])?);
    x.both(|d, g| {
        let r = Rows { rows: pick(&idx, g), targets: pick(&tg, g) };
        let (l, e) = (pick_mut(&mut lp, g), pick_mut(&mut en, g));
        lm_head::stats(d, pick(&h, g), pick(&wh, g), &r, 0.7, 8, l, e)
    })?;
    x.cmp("LM head log p(y)", "f32 head", &lp, Tol::Close(1e-5, 1e-4))?;
    x.cmp("LM head entropy", "f32 head", &en, Tol::Close(1e-5, 1e-4))?;
    for centered in [false, true] {
        let name = if centered { "LM head loss (centered)" } else { "LM head loss" };
        let mut dh = x.pair(DType::F32, &[n_h, c], &vec![0.0; n_h * c])?;
        let mut dwh = x.pair(DType::F32, &[v, c], &vec![0.0; v * c])?;
        let mut loss = [0.0f32; 2];
        for (i, g) in [false, true].into_iter().enumerate() {
            let dev = if g { &x.gpu } else { &x.cpu };
            let r = Rows { rows: pick(&idx, g), targets: pick(&tg, g) };
            let ct = DevCenter { k: k_c, ids: pick(&ids, g), probs: pick(&probs, g) };
            let (a, b) = (pick_mut(&mut dh, g), pick_mut(&mut dwh, g));
            loss[i] = lm_head::loss_grad(
                dev,
                pick(&h, g),
                pick(&wh, g),
                &r,
                pick(&coef, g),
                centered.then_some(&ct),
                0.7,
                8,
                a,
                b,
            )? as f32;
        }
        x.gpu.synchronize()?;
        x.record(&format!("{name}: value"), "f32 head", &loss[..1], &loss[1..], Tol::Close(1e-5, 1e-4));
        x.cmp(&format!("{name}: dh"), "f32 head", &dh, Tol::Close(1e-5, 1e-4))?;
        x.cmp(&format!("{name}: dWh"), "f32 head", &dwh, Tol::Close(1e-5, 1e-4))?;
    }
    // A BF16 head's loss pass: ct_lm_dz stores dz in BF16 itself, the bits of its f32 dz rounded.
    let zs = x.randn(3 * v, 2.0);
    let (rounded, direct) =
        lm_head::dz_two_ways(&x.cuda.clone(), &zs, &[7.5, 8.0, 6.9], &[0.8, -1.3, 0.05], &[5, 99, 0], 1.4)?;
    x.record("LM head dz stored in BF16 by ct_lm_dz vs its f32 dz rounded", "bf16", &rounded, &direct, Tol::Exact);
    let r = Rows { rows: &idx.g, targets: &tg.g };
    one_pass(x, &h.g, &wh.g, &r)
}

/// The one-pass loss on the GPU (`lm_head::Coef::Rule`: the loss pass evaluates each row's
/// coefficient from its own log-prob, token-mean over the rows with one masked) against the
/// GPU's two passes (statistics, the objective on the host, then the loss pass given those
/// coefficients): OPD (offset 0.15) the same bits; GRPO with TIS (C = 2, advantages of both
/// signs, the sampler's log-probs around the head's) within 1e-6 + 1e-5·|ref| for what the
/// coefficients reach (the device's f64 exp may differ from the host's in its last bit, which
/// may move a coefficient's last f32 bit), the statistics the same bits.
fn one_pass(x: &mut Ctx, h: &Tensor, wh: &Tensor, r: &crate::ops::lm_head::Rows<'_>) -> Result<()> {
    use crate::config::LossAgg;
    use crate::objective::grpo::{self, PgConfig};
    use crate::objective::{agg_denominators, opd, TokenStats};
    use crate::ops::lm_head::{self, Coef, Pass, StatsOut, TisRule};
    let (n, g) = (r.rows.numel(), x.gpu.clone());
    let teacher: Vec<f32> = x.randn(n, 0.5).iter().map(|v| v - 1.5).collect();
    let gap: Vec<f32> = x.randn(n, 0.6);
    let adv: Vec<f64> = (0..n).map(|i| if i % 3 == 0 { -0.75 } else { 1.5 }).collect();
    let pg = PgConfig { eps_low: 0.2, eps_high: 0.28, tis_cap: Some(2.0) };
    let mask: Vec<bool> = (0..n).map(|i| i != 3).collect();
    let zeros = vec![0.0f32; n];
    let lens = [n];
    let s = TokenStats { mask: Some(&mask), ..TokenStats::of(&lens, &zeros) };
    let dens: Vec<u32> = agg_denominators(&s, LossAgg::TokenMean).iter().map(|&d| d as u32).collect();
    let den = g.upload(Tensor::from_u32_host(&[n], dens)?)?;
    let tt = g.from_f32(DType::F32, &[n], &teacher)?;
    let adv_t = g.upload(Tensor::from_u32_host(&[2 * n], TisRule::words(&adv))?)?;
    let (v, c) = (wh.dim(0), wh.dim(1));
    let zero = |shape: &[usize]| g.zeros(DType::F32, shape);
    let (mut lp2, mut en2) = (zero(&[n])?, zero(&[n])?);
    lm_head::stats(&g, h, wh, r, 0.7, 8, &mut lp2, &mut en2)?;
    let lp2v = lp2.to_f32_vec()?;
    let sampler: Vec<f32> = lp2v.iter().zip(&gap).map(|(l, d)| l + d).collect();
    let st = g.from_f32(DType::F32, &[n], &sampler)?;
    for kind in ["OPD", "TIS"] {
        let (mut dh1, mut dw1, mut lp1, mut en1) = (zero(h.shape())?, zero(&[v, c])?, zero(&[n])?, zero(&[n])?);
        let tis = (kind == "TIS").then_some(TisRule { sampler: &st, adv: &adv_t, cap: 2.0 });
        let coef = Coef::Rule { den: &den, teacher: (kind == "OPD").then_some(&tt), offset: 0.15, tis };
        let stats = Some(StatsOut { logp: &mut lp1, entropy: &mut en1 });
        let pass = Pass { coef, center: None, temperature: 0.7, chunk: 8, stats, loss: true };
        let l1 = lm_head::loss_grad_with(&g, h, wh, r, pass, &mut dh1, &mut dw1)?.unwrap_or(f64::NAN) as f32;
        let s = TokenStats {
            teacher: Some(&teacher),
            mask: Some(&mask),
            logp_old: Some(&lp2v),
            sampler: Some(&sampler),
            advantages: Some(&adv),
            ..TokenStats::of(&lens, &lp2v)
        };
        let cf = match kind {
            "OPD" => opd::coefficients_with_offset(&s, LossAgg::TokenMean, 0.15)?,
            _ => grpo::coefficients(&s, LossAgg::TokenMean, &pg)?,
        };
        let coef2 = g.from_f32(DType::F32, &[n], &cf.coef)?;
        let (mut dh2, mut dw2) = (zero(h.shape())?, zero(&[v, c])?);
        let l2 = lm_head::loss_grad(&g, h, wh, r, &coef2, None, 0.7, 8, &mut dh2, &mut dw2)? as f32;
        let tol = if kind == "OPD" { Tol::Exact } else { Tol::Close(1e-6, 1e-5) };
        let name = format!("LM head one pass ({kind} coefficients on the GPU) vs two passes");
        x.record(&format!("{name}: log p(y)"), "f32 head", &lp2v, &lp1.to_f32_vec()?, Tol::Exact);
        x.record(&format!("{name}: entropy"), "f32 head", &en2.to_f32_vec()?, &en1.to_f32_vec()?, Tol::Exact);
        x.record(&format!("{name}: value"), "f32 head", &[l2], &[l1], tol);
        x.record(&format!("{name}: dh"), "f32 head", &dh2.to_f32_vec()?, &dh1.to_f32_vec()?, tol);
        x.record(&format!("{name}: dWh"), "f32 head", &dw2.to_f32_vec()?, &dw1.to_f32_vec()?, tol);
    }
    Ok(())
}

/// The layers' backward kernels (`ops/backward_tests.rs` has the f64 references).
pub(super) fn backward(x: &mut Ctx) -> Result<()> {
    use crate::ops::{elementwise, norm, rope};
    let tol = Tol::Close(1e-5, 1e-5);
    // The last shape's weight gradient sums 1,000 chunks of 40 rows (`ops::reduction_chunk_rows`).
    for (rows, c) in [(M, C), (M * 7, 128), (40_000, 8)] {
        let xin = x.randp(DType::F32, &[rows, c], 1.0)?;
        let w = x.randp(DType::F32, &[c], 1.0)?;
        let (mut y, mut rstd) = (x.out(&[rows, c])?, x.out(&[rows])?);
        x.both(|d, g| {
            norm::rmsnorm_train(d, pick(&xin, g), pick(&w, g), 1e-6, pick_mut(&mut y, g), pick_mut(&mut rstd, g), rows)
        })?;
        let shape = format!("{rows}x{c}");
        x.cmp(&format!("rmsnorm train {shape}: y"), "f32", &y, tol)?;
        x.cmp(&format!("rmsnorm train {shape}: 1/rms"), "f32", &rstd, tol)?;
        // The BF16 output (the trainer's GEMM-only inputs) is the f32 output rounded to
        // nearest even, on the host: exact.
        let mut yb = x.gpu.zeros(DType::BF16, &[rows, c])?;
        let mut rs2 = x.gpu.zeros(DType::F32, &[rows])?;
        norm::rmsnorm_train(&x.gpu, &xin.g, &w.g, 1e-6, &mut yb, &mut rs2, rows)?;
        bf16_output(x, &format!("rmsnorm train {shape}: BF16 output vs the f32 output rounded"), "bf16", &y.g, &yb)?;
        let dy = x.randp(DType::F32, &[rows, c], 1.0)?;
        let (mut dx, mut dw) = (x.randp(DType::F32, &[rows, c], 1.0)?, x.randp(DType::F32, &[c], 1.0)?);
        let r = rstd.c.to_f32_vec()?;
        let rs = x.pair(DType::F32, &[rows], &r)?;
        x.both(|d, g| {
            let (a, b) = (pick_mut(&mut dx, g), pick_mut(&mut dw, g));
            norm::rmsnorm_bwd(d, pick(&dy, g), pick(&xin, g), pick(&w, g), pick(&rs, g), a, true, b, rows)
        })?;
        x.cmp(&format!("rmsnorm backward {shape}: dx"), "f32", &dx, Tol::Close(1e-5, 1e-4))?;
        // dw sums in the CPU's chunked order, the same products: exact.
        x.cmp(&format!("rmsnorm backward {shape}: dw (chunked column sum)"), "f32", &dw, Tol::Exact)?;
    }
    let (heads, d) = (7usize, 128usize);
    let mut q = x.randp(DType::F32, &[M, heads * d], 1.0)?;
    let (cs, sn) = (x.randp(DType::F32, &[M, d / 2], 1.0)?, x.randp(DType::F32, &[M, d / 2], 1.0)?);
    x.both(|dv, g| rope::rope_bwd(dv, pick_mut(&mut q, g), pick(&cs, g), pick(&sn, g), M, heads))?;
    x.cmp("rope backward", "f32", &q, Tol::Exact)?;
    let (da, gt, up) =
        (x.randp(DType::F32, &[M, N], 1.0)?, x.randp(DType::F32, &[M, N], 2.0)?, x.randp(DType::F32, &[M, N], 1.0)?);
    let (mut dg, mut du) = (x.out(&[M, N])?, x.out(&[M, N])?);
    x.both(|d, g| {
        elementwise::swiglu_bwd(d, pick(&da, g), pick(&gt, g), pick(&up, g), pick_mut(&mut dg, g), pick_mut(&mut du, g))
    })?;
    // SwiGLU's BF16 output (down_proj's input in the trainer) against its f32 output rounded
    // to nearest even on the host: exact.
    let (mut a32, mut a16) = (x.gpu.zeros(DType::F32, &[M, N])?, x.gpu.zeros(DType::BF16, &[M, N])?);
    elementwise::swiglu(&x.gpu, &gt.g, &up.g, &mut a32, M)?;
    elementwise::swiglu(&x.gpu, &gt.g, &up.g, &mut a16, M)?;
    bf16_output(x, "swiglu: BF16 output vs the f32 output rounded", "bf16", &a32, &a16)?;
    x.cmp("swiglu backward: dg", "f32", &dg, Tol::Close(1e-6, 1e-5))?;
    x.cmp("swiglu backward: du", "f32", &du, Tol::Close(1e-6, 1e-5))?;
    // Its BF16 gradients (the gate and up projections' dy in the trainer) against its f32
    // ones rounded to nearest even on the host: exact.
    let (mut gb, mut ub) = (x.gpu.zeros(DType::BF16, &[M, N])?, x.gpu.zeros(DType::BF16, &[M, N])?);
    elementwise::swiglu_bwd(&x.gpu, &da.g, &gt.g, &up.g, &mut gb, &mut ub)?;
    for (what, f, b) in [("dg", &dg.g, &gb), ("du", &du.g, &ub)] {
        let want: Vec<f32> = f.to_f32_vec()?.iter().map(|&v| crate::device::bf16_rne(v).to_f32()).collect();
        let name = format!("swiglu backward: BF16 {what} vs the f32 {what} rounded");
        x.record(&name, "bf16", &want, &b.to_f32_vec()?, Tol::Exact);
    }
    let v = 1000usize;
    let ids = x.u32s(&[M * 4], (0..(M * 4) as u32).map(|i| (i * i * 7 + 3) % 50).collect())?;
    let dxe = x.randp(DType::F32, &[M * 4, C], 1.0)?;
    let mut dt = x.randp(DType::F32, &[v, C], 1.0)?;
    x.both(|d, g| elementwise::embed_bwd(d, pick(&ids, g), pick(&dxe, g), pick_mut(&mut dt, g), M * 4, Some(3)))?;
    x.cmp("embedding backward (repeated ids)", "f32", &dt, Tol::Exact)?;
    let mut db = x.randp(DType::F32, &[N], 1.0)?;
    x.both(|d, g| matmul::bias_grad(d, pick(&da, g), pick_mut(&mut db, g), M))?;
    x.cmp("bias gradient", "f32", &db, Tol::Exact)?;
    let dl = x.randp(DType::F32, &[40_000, 8], 1.0)?;
    let mut db = x.randp(DType::F32, &[8], 1.0)?;
    x.both(|d, g| matmul::bias_grad(d, pick(&dl, g), pick_mut(&mut db, g), 40_000))?;
    x.cmp("bias gradient of 40000 rows (1000 chunks of 40)", "f32", &db, Tol::Exact)?;
    attention(x)?;
    checkpointed(x)
}

/// A whole model's backward with activation checkpointing (each layer run again from its
/// saved input) against the one that kept every layer's activations, on the GPU: the same
/// gradients bit for bit (the same launches on the same values; no training kernel uses a
/// floating-point atomic). A 2-layer qwen3 (q/k norms) with BF16 weights, 3 sequences.
fn checkpointed(x: &mut Ctx) -> Result<()> {
    use crate::model::tiny::{tiny_config, TinySpec};
    use crate::model::trainable::TrainBatch;
    use crate::model::trainable_device::DeviceTrainable;
    use crate::model::weights::param_specs;
    let spec = TinySpec {
        arch: "qwen3".into(),
        layers: 2,
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: Some(32),
        intermediate: Some(256),
        vocab: 320,
        max_position: 128,
        tie: false,
    };
    let cfg = tiny_config(&spec)?;
    let specs = param_specs(&cfg);
    let mut params = Vec::with_capacity(specs.len());
    for (_, shape) in &specs {
        params.push(x.randp(DType::BF16, shape, 0.1)?.g);
    }
    let p: Vec<&Tensor> = params.iter().collect();
    let mut b = TrainBatch::default();
    for (i, len) in [(0u32, 17usize), (1, 40), (2, 5)] {
        let response: Vec<u32> = (0..len as u32).map(|t| (t * 13 + i * 101 + 7) % 320).collect();
        b.push(&[1 + i, 2, 3, 4], &response);
    }
    let m = b.rows.len();
    let coef: Vec<f32> = (0..m).map(|_| x.rng.normal() as f32).collect();
    let coef = x.gpu.from_f32(DType::F32, &[m], &coef)?;
    let grads_of = |checkpoint: bool| -> Result<Vec<f32>> {
        let mut t = DeviceTrainable::new(&cfg, &x.gpu)?;
        t.set_checkpointing(checkpoint);
        let mut grads = specs.iter().map(|(_, s)| x.gpu.zeros(DType::F32, s)).collect::<Result<Vec<_>>>()?;
        t.forward(&p, &b)?;
        t.backward(&p, &coef, None, 1.0, 64, &mut grads)?;
        let mut out = Vec::new();
        for g in &grads {
            out.extend(g.to_f32_vec()?);
        }
        Ok(out)
    };
    let (kept, again) = (grads_of(false)?, grads_of(true)?);
    x.record("model backward: checkpointed vs kept", "bf16 weights, f32 grads", &kept, &again, Tol::Exact);
    Ok(())
}

/// Training attention forward and backward (CUDA cores and tensor cores) at Qwen2.5-7B's head
/// shape (14 query heads over 2 KV heads of 128), packed sequences of 3, 150 and 40 tokens.
fn attention(x: &mut Ctx) -> Result<()> {
    use crate::ops::attention::grad::Shape;
    use crate::ops::attention::train::{self, Packed};
    let (h, hkv, d, t) = (14usize, 2usize, 128usize, 193usize);
    let s = Shape { heads: h, kv_heads: hkv, head_dim: d };
    let cu = x.u32s(&[4], vec![0, 3, 153, 193])?;
    let offsets = [0, 3, 153, 193];
    let (q, k, v) = (
        x.randp(DType::F32, &[t, h * d], 1.0)?,
        x.randp(DType::F32, &[t, hkv * d], 1.0)?,
        x.randp(DType::F32, &[t, hkv * d], 1.0)?,
    );
    let dout = x.randp(DType::F32, &[t, h * d], 1.0)?;
    let (mut o, mut lse) = (x.out(&[t, h * d])?, x.out(&[t, h])?);
    x.both(|dv, g| {
        let p = Packed { q: pick(&q, g), k: pick(&k, g), v: pick(&v, g), cu: pick(&cu, g), offsets: &offsets };
        train::fwd(dv, &s, &p, pick_mut(&mut o, g), pick_mut(&mut lse, g))
    })?;
    let tol = Tol::Close(2e-5, 1e-4);
    x.cmp("training attention h14/kv2 d128: out", "f32", &o, tol)?;
    x.cmp("training attention h14/kv2 d128: lse", "f32", &lse, tol)?;
    // The tensor-core forward against the CPU's f32 forward: q, k, v and P rounded to BF16.
    let (mut otc, mut ltc) = (x.out(&[t, h * d])?, x.out(&[t, h])?);
    x.both(|dv, g| {
        let p = Packed { q: pick(&q, g), k: pick(&k, g), v: pick(&v, g), cu: pick(&cu, g), offsets: &offsets };
        train::fwd_tensor_cores(dv, &s, &p, pick_mut(&mut otc, g), pick_mut(&mut ltc, g))
    })?;
    // BF16 q·k over 128 dims: |Δ score| ~ 2^-8 · |q||k| / √D; 1e-2 seen at most, 3e-2 allowed.
    let tol = Tol::Close(3e-2, 2e-2);
    x.cmp("training attention tensor cores: out", "bf16 ops", &otc, tol)?;
    x.cmp("training attention tensor cores: lse", "bf16 ops", &ltc, tol)?;
    // Both forwards storing BF16 outputs (o_proj's GEMM input): their own f32 outputs rounded.
    let p = Packed { q: &q.g, k: &k.g, v: &v.g, cu: &cu.g, offsets: &offsets };
    for (tc, what, f32_out) in [(false, "training attention", &o.g), (true, "training attention tensor cores", &otc.g)]
    {
        let (mut o16, mut l) = (x.gpu.zeros(DType::BF16, &[t, h * d])?, x.gpu.zeros(DType::F32, &[t, h])?);
        match tc {
            true => train::fwd_tensor_cores(&x.gpu, &s, &p, &mut o16, &mut l)?,
            false => train::fwd(&x.gpu, &s, &p, &mut o16, &mut l)?,
        }
        bf16_output(x, &format!("{what}: out, BF16 output"), "f32", f32_out, &o16)?;
    }
    let (mut dq, mut dk, mut dv) = (x.out(&[t, h * d])?, x.out(&[t, hkv * d])?, x.out(&[t, hkv * d])?);
    x.both(|dev, g| {
        let p = Packed { q: pick(&q, g), k: pick(&k, g), v: pick(&v, g), cu: pick(&cu, g), offsets: &offsets };
        let (a, b, c) = (pick_mut(&mut dq, g), pick_mut(&mut dk, g), pick_mut(&mut dv, g));
        train::bwd(dev, &s, &p, pick(&o, g), pick(&lse, g), pick(&dout, g), a, b, c)
    })?;
    // The backward sums up to 150 rows' terms per value: more room for the summation order.
    let tol = Tol::Close(5e-5, 1e-4);
    x.cmp("training attention backward: dq", "f32", &dq, tol)?;
    x.cmp("training attention backward: dk", "f32", &dk, tol)?;
    x.cmp("training attention backward: dv", "f32", &dv, tol)?;
    // The tensor-core backward against the CPU's f32 backward (from the same out and lse).
    let (mut dq, mut dk, mut dv) = (x.out(&[t, h * d])?, x.out(&[t, hkv * d])?, x.out(&[t, hkv * d])?);
    x.both(|dev, g| {
        let p = Packed { q: pick(&q, g), k: pick(&k, g), v: pick(&v, g), cu: pick(&cu, g), offsets: &offsets };
        let (a, b, c) = (pick_mut(&mut dq, g), pick_mut(&mut dk, g), pick_mut(&mut dv, g));
        train::bwd_tensor_cores(dev, &s, &p, pick(&o, g), pick(&lse, g), pick(&dout, g), a, b, c)
    })?;
    // Every operand rounded to BF16 (q, k, v, dout, P, dS), sums over up to 150 rows: errors
    // of 2^-8·√150 ≈ 5e-2 of a term's size; 3.7e-2 seen at most on the simulator.
    let tol = Tol::Close(1e-1, 5e-2);
    x.cmp("training attention backward tensor cores: dq", "bf16 ops", &dq, tol)?;
    x.cmp("training attention backward tensor cores: dk", "bf16 ops", &dk, tol)?;
    x.cmp("training attention backward tensor cores: dv", "bf16 ops", &dv, tol)?;
    Ok(())
}

/// Three projections of one input (q/k/v-shaped: N, N/2, N/2 rows): `linears` with biases
/// (added in one launch) and `linear_grads`, which round x once for all of them and each dy
/// once for both of its GEMMs, against the CPU twin (per-dtype tolerance), and on the GPU
/// against one `linear`, `linear_dx` and `linear_dw` call per projection (exact: the same
/// roundings, GEMMs and adds).
fn projections(x: &mut Ctx, xin: &super::checks::Pair) -> Result<()> {
    use crate::ops::linear::{GradProj, Proj};
    let (m, k, ns) = (M, C, [N, N / 2, N / 2]);
    for (dt, tol) in [(DType::F32, Tol::Close(1e-4, 1e-4)), (DType::BF16, Tol::Close(1e-2, 1e-2))] {
        let (mut ws, mut bs) = (Vec::new(), Vec::new());
        let mut dy = Vec::new();
        for n in ns {
            ws.push(x.randp(dt, &[n, k], 1.0 / (k as f32).sqrt())?);
            bs.push(x.randp(dt, &[n], 1.0)?);
            dy.push(x.randp(DType::F32, &[m, n], 1.0 / (n as f32).sqrt())?);
        }
        let dw0: Vec<Vec<f32>> = ns.iter().map(|&n| x.randn(n * k, 1.0)).collect();
        let dws =
            |x: &Ctx| ns.iter().zip(&dw0).map(|(&n, v)| x.pair(DType::F32, &[n, k], v)).collect::<Result<Vec<_>>>();
        // The forward.
        let mut ys = ns.iter().map(|&n| x.out(&[m, n])).collect::<Result<Vec<_>>>()?;
        x.both(|d, g| {
            let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
            let projs = [(0, y0), (1, y1), (2, y2)].map(|(j, y)| Proj {
                w: pick(&ws[j], g),
                panels: None,
                bias: Some(pick(&bs[j], g)),
                y: pick_mut(y, g),
            });
            matmul::linears(d, pick(xin, g), projs, m)
        })?;
        for (j, y) in ys.iter().enumerate() {
            x.cmp(&format!("linears, one input: projection {j}"), dt.name(), y, tol)?;
            let mut one = x.gpu.zeros(DType::F32, &[m, ns[j]])?;
            matmul::linear(&x.gpu, &xin.g, &ws[j].g, Some(&bs[j].g), &mut one, m, false)?;
            let (a, b) = (one.to_f32_vec()?, y.g.to_f32_vec()?);
            x.record(&format!("linears vs one linear on the GPU: projection {j}"), dt.name(), &a, &b, Tol::Exact);
        }
        // The backward.
        let mut dx = x.out(&[m, k])?;
        let mut dw = dws(x)?;
        x.both(|d, g| {
            let [g0, g1, g2] = &mut dw[..] else { unreachable!() };
            let projs = [(0, g0), (1, g1), (2, g2)].map(|(j, dw)| GradProj {
                dy: pick(&dy[j], g),
                w: pick(&ws[j], g),
                dw: pick_mut(dw, g),
            });
            matmul::linear_grads(d, pick(xin, g), projs, pick_mut(&mut dx, g), false, m, dt)
        })?;
        x.cmp("linear_grads, one input: dx = Σ dy·W", dt.name(), &dx, tol)?;
        let (mut dx1, mut dw1) = (x.gpu.zeros(DType::F32, &[m, k])?, dws(x)?);
        for j in 0..3 {
            matmul::linear_dx(&x.gpu, &dy[j].g, &ws[j].g, &mut dx1, m, j > 0)?;
            matmul::linear_dw(&x.gpu, &dy[j].g, &xin.g, &mut dw1[j].g, m, true, dt)?;
        }
        let (a, b) = (dx1.to_f32_vec()?, dx.g.to_f32_vec()?);
        x.record("linear_grads vs linear_dx per projection (GPU): dx", dt.name(), &a, &b, Tol::Exact);
        for j in 0..3 {
            x.cmp(&format!("linear_grads, one input: dW += dyᵀ·x, projection {j}"), dt.name(), &dw[j], tol)?;
            let (a, b) = (dw1[j].g.to_f32_vec()?, dw[j].g.to_f32_vec()?);
            x.record(&format!("linear_grads vs linear_dw (GPU): projection {j}"), dt.name(), &a, &b, Tol::Exact);
        }
    }
    Ok(())
}
