//! The CUDA arm of the fused LM-head loss, per chunk of rows: gather the rows of h
//! (ct_gather_rows), the logits z = hc·Whᵀ (cuBLASLt), their statistics (ct_lm_stats), and for
//! the gradient dz in place of z (ct_lm_dz), dWh += dzᵀ·hc and dhc = dz·Wh (cuBLASLt's weight-
//! and data-gradient forms), dh[rows] += dhc (ct_scatter_add_rows). At most `chunk × V` logits
//! exist at once; only per-row numbers come back to the host (the loss terms). A BF16 head
//! runs the GEMMs on BF16 operands (hc, dz rounded) with FP32 accumulation. Not yet run on a GPU.

use super::{Coef, Pass, Rows};
use crate::device::cuda::args::{err_word, i32_of, ptr};
use crate::device::cuda::{ffi, CudaDevice, DevBuf, Elem, Form};
use crate::device::{DType, Tensor};
use crate::ops::linear::cast_rows;
use anyhow::{bail, Result};

/// The pointers one pass needs, checked once.
struct Head {
    h: u64,
    wh: u64,
    rows: u64,
    targets: u64,
    n_h: usize,
    v: usize,
    c: usize,
    bf16: bool,
}

impl Head {
    fn new(d: &CudaDevice, h: &Tensor, wh: &Tensor, r: &Rows<'_>) -> Result<Head> {
        let (v, c) = (wh.dim(0), wh.dim(1));
        Ok(Head {
            h: ptr(d, h, &[DType::F32], "LM head hidden rows")?,
            wh: ptr(d, wh, &[DType::F32, DType::BF16], "LM head weight")?,
            rows: ptr(d, r.rows, &[DType::U32], "LM head row indices")?,
            targets: ptr(d, r.targets, &[DType::U32], "LM head targets")?,
            n_h: h.numel() / c.max(1),
            v,
            c,
            bf16: wh.dtype() == DType::BF16,
        })
    }

    fn elem(&self) -> Elem {
        if self.bf16 {
            Elem::BF16
        } else {
            Elem::F32
        }
    }

    /// The chunk's rows of h gathered (n, C), and its logits z (n, V) = hc·Whᵀ.
    fn logits(&self, d: &CudaDevice, start: usize, n: usize) -> Result<(DevBuf, DevBuf)> {
        let hc = d.scratch(n * self.c * 4, "LM head rows")?;
        d.k_gather_rows(ffi::ct_gather_rows_params {
            src: self.h as *const f32,
            idx: (self.rows + 4 * start as u64) as *const u32,
            dst: hc.ptr as *mut f32,
            rows: i32_of(n, "LM head rows")?,
            cols: i32_of(self.c, "LM head width")?,
            src_rows: i32_of(self.n_h, "hidden rows")?,
            err: err_word(d),
        })?;
        let z = d.scratch(n * self.v * 4, "LM head logits chunk")?;
        if self.bf16 {
            let hb = cast_rows(d, hc.ptr, n * self.c, DType::BF16)?;
            d.gemm(Elem::BF16, self.wh, hb.ptr, z.ptr, n, self.v, self.c, 1.0, false, None)?;
        } else {
            d.gemm(Elem::F32, self.wh, hc.ptr, z.ptr, n, self.v, self.c, 1.0, false, None)?;
        }
        Ok((hc, z))
    }

    fn params(
        &self,
        d: &CudaDevice,
        z: u64,
        start: usize,
        n: usize,
        inv_t: f32,
        lse: u64,
    ) -> Result<ffi::ct_lm_params> {
        let targets = (self.targets + 4 * start as u64) as *const u32;
        lm_params(d, z, targets, n, self.v, inv_t, lse)
    }
}

/// A chunk's ct_lm_params: `rows` rows of `vocab` logits at z, their targets and normalizers;
/// nothing else asked for (no statistics, coefficients, centering or loss).
fn lm_params(
    d: &CudaDevice,
    z: u64,
    targets: *const u32,
    rows: usize,
    vocab: usize,
    inv_t: f32,
    lse: u64,
) -> Result<ffi::ct_lm_params> {
    Ok(ffi::ct_lm_params {
        z: z as *mut f32,
        targets,
        rows: i32_of(rows, "LM head rows")?,
        vocab: i32_of(vocab, "vocabulary")?,
        inv_t,
        lse: lse as *mut f32,
        logp: std::ptr::null_mut(),
        entropy: std::ptr::null_mut(),
        coef: std::ptr::null(),
        center_k: 0,
        center_ids: std::ptr::null(),
        center_probs: std::ptr::null(),
        loss: std::ptr::null_mut(),
        err: err_word(d),
        coef_den: std::ptr::null(),
        coef_teacher: std::ptr::null(),
        coef_offset: 0.0,
        coef_out: std::ptr::null_mut(),
        coef_sampler: std::ptr::null(),
        coef_adv: std::ptr::null(),
        coef_cap: 0.0,
        dz_bf16: std::ptr::null_mut(),
    })
}

#[allow(clippy::too_many_arguments)]
pub fn stats(
    d: &CudaDevice,
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    temperature: f32,
    chunk: usize,
    logp: &mut Tensor,
    entropy: &mut Tensor,
) -> Result<()> {
    let pass = Head::new(d, h, wh, r)?;
    let (lp, en) = (ptr(d, logp, &[DType::F32], "log-probs")?, ptr(d, entropy, &[DType::F32], "entropies")?);
    let total = r.rows.numel();
    let inv_t = 1.0 / temperature;
    let lse = d.scratch(chunk.min(total).max(1) * 4, "LM head normalizers")?;
    for start in (0..total).step_by(chunk) {
        let n = chunk.min(total - start);
        let (_hc, z) = pass.logits(d, start, n)?;
        let mut p = pass.params(d, z.ptr, start, n, inv_t, lse.ptr)?;
        p.logp = (lp + 4 * start as u64) as *mut f32;
        p.entropy = (en + 4 * start as u64) as *mut f32;
        d.k_lm_stats(p)?;
    }
    Ok(())
}

/// The loss pass; with [`Coef::Rule`] each chunk's ct_lm_stats also writes its rows'
/// coefficients into a scratch that its ct_lm_dz reads (no statistics pass before it). The
/// loss terms are read back (a synchronization) only when `p.loss` asks for them.
pub fn loss_grad(
    d: &CudaDevice,
    h: &Tensor,
    wh: &Tensor,
    r: &Rows<'_>,
    p: Pass<'_, '_>,
    dh: &mut Tensor,
    dwh: &mut Tensor,
) -> Result<Option<f64>> {
    let pass = Head::new(d, h, wh, r)?;
    let total = r.rows.numel();
    // (den, teacher or 0, offset, TIS's (sampler, advantages, cap)) of a rule, and the
    // coefficients' buffer.
    let (rule, own);
    let cp = match p.coef {
        Coef::Given(c) => {
            rule = None;
            ptr(d, c, &[DType::F32], "loss coefficients")?
        }
        Coef::Rule { den, teacher, offset, tis } => {
            let tp = match teacher {
                Some(t) => ptr(d, t, &[DType::F32], "teacher log-probs")?,
                None => 0,
            };
            let tis = match tis {
                Some(t) => {
                    let adv = ptr(d, t.adv, &[DType::U32], "advantages")?;
                    if adv % 8 != 0 {
                        bail!("LM head: the advantages' words at {adv:#x} are not 8-byte aligned (read as f64)");
                    }
                    Some((ptr(d, t.sampler, &[DType::F32], "sampler log-probs")?, adv, t.cap))
                }
                None => None,
            };
            rule = Some((ptr(d, den, &[DType::U32], "loss weight denominators")?, tp, offset, tis));
            own = d.scratch(total.max(1) * 4, "loss coefficients")?;
            own.ptr
        }
    };
    let outs = match p.stats {
        Some(s) => Some((ptr(d, s.logp, &[DType::F32], "log-probs")?, ptr(d, s.entropy, &[DType::F32], "entropies")?)),
        None => None,
    };
    let dhp = ptr(d, dh, &[DType::F32], "hidden-row gradient")?;
    let dwp = ptr(d, dwh, &[DType::F32], "LM head weight gradient")?;
    let ct = match p.center {
        Some(ct) => Some((
            ct.k,
            ptr(d, ct.ids, &[DType::U32], "centering token ids")?,
            ptr(d, ct.probs, &[DType::F32], "centering probabilities")?,
        )),
        None => None,
    };
    let (temperature, chunk, p_loss) = (p.temperature, p.chunk, p.loss);
    let inv_t = 1.0 / temperature;
    let (v, c, e) = (pass.v, pass.c, pass.elem());
    let lse = d.scratch(chunk.min(total).max(1) * 4, "LM head normalizers")?;
    let losses = d.scratch(total.max(1) * 4, "loss terms")?;
    for start in (0..total).step_by(chunk) {
        let n = chunk.min(total - start);
        let (hc, z) = pass.logits(d, start, n)?;
        let mut p = pass.params(d, z.ptr, start, n, inv_t, lse.ptr)?;
        let at = |base: u64| base + 4 * start as u64;
        let mut sp = p;
        if let Some((lp, en)) = outs {
            (sp.logp, sp.entropy) = (at(lp) as *mut f32, at(en) as *mut f32);
        }
        if let Some((den, teacher, offset, tis)) = rule {
            sp.coef_den = at(den) as *const u32;
            sp.coef_teacher = if teacher == 0 { std::ptr::null() } else { at(teacher) as *const f32 };
            (sp.coef_offset, sp.coef_out) = (offset, at(cp) as *mut f32);
            if let Some((sampler, adv, cap)) = tis {
                sp.coef_sampler = at(sampler) as *const f32;
                (sp.coef_adv, sp.coef_cap) = ((adv + 8 * start as u64) as *const f64, cap);
            }
        }
        d.k_lm_stats(sp)?;
        p.coef = at(cp) as *const f32;
        p.loss = (losses.ptr + 4 * start as u64) as *mut f32;
        if let Some((k, ids, probs)) = ct {
            p.center_k = i32_of(k, "centering k")?;
            p.center_ids = (ids + 4 * (start * k) as u64) as *const u32;
            p.center_probs = (probs + 4 * (start * k) as u64) as *const f32;
        }
        // A BF16 head's GEMMs read dz in BF16: ct_lm_dz stores it so (without centering, whose
        // fix-ups come after the pass), else dz over z, rounded after.
        let zb = match pass.bf16 && ct.is_none() {
            true => Some(d.scratch(n * v * 2, "LM head logit gradients, BF16")?),
            false => None,
        };
        p.dz_bf16 = zb.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr as *mut std::ffi::c_void);
        d.k_lm_dz(p)?;
        // dWh (V, C) += dzᵀ·hc; dhc (n, C) = dz·Wh.
        let dhc = d.scratch(n * c * 4, "LM head row gradients")?;
        if pass.bf16 {
            let zb = match zb {
                Some(zb) => zb,
                None => cast_rows(d, z.ptr, n * v, DType::BF16)?,
            };
            let hb = cast_rows(d, hc.ptr, n * c, DType::BF16)?;
            d.gemm_form(Form::Tn, e, hb.ptr, zb.ptr, dwp, v, c, n, 1.0, true)?;
            d.gemm_form(Form::Nn, e, pass.wh, zb.ptr, dhc.ptr, n, c, v, 1.0, false)?;
        } else {
            d.gemm_form(Form::Tn, e, hc.ptr, z.ptr, dwp, v, c, n, 1.0, true)?;
            d.gemm_form(Form::Nn, e, pass.wh, z.ptr, dhc.ptr, n, c, v, 1.0, false)?;
        }
        d.k_scatter_add_rows(ffi::ct_scatter_add_rows_params {
            src: dhc.ptr as *const f32,
            idx: (pass.rows + 4 * start as u64) as *const u32,
            dst: dhp as *mut f32,
            rows: i32_of(n, "LM head rows")?,
            cols: i32_of(c, "LM head width")?,
            dst_rows: i32_of(pass.n_h, "hidden rows")?,
            err: err_word(d),
        })?;
    }
    if !p_loss {
        return Ok(None);
    }
    let mut terms = vec![0.0f32; total];
    d.dtoh(&mut terms, losses.ptr)?;
    Ok(Some(terms.iter().map(|&t| t as f64).sum()))
}

/// ct_lm_dz both ways on the same inputs (`z` (rows, vocab) of logits, each row's normalizer,
/// coefficient and target; no centering): (its f32 dz over z, rounded to BF16 on the host; the
/// BF16 dz it stores itself), which must be the same bits. The device check's row and the
/// unit test.
pub fn dz_two_ways(
    d: &CudaDevice,
    z: &[f32],
    lse: &[f32],
    coef: &[f32],
    targets: &[u32],
    inv_t: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let dev = crate::device::Device::Cuda(d.clone());
    let (rows, v) = (lse.len(), z.len() / lse.len().max(1));
    if rows == 0 || coef.len() != rows || targets.len() != rows || z.len() != rows * v {
        bail!(
            "ct_lm_dz check: {} logits for {rows} rows, {} coefficients, {} targets",
            z.len(),
            coef.len(),
            targets.len()
        );
    }
    let zt = dev.from_f32(DType::F32, &[rows, v], z)?;
    let z16 = dev.zeros(DType::BF16, &[rows, v])?;
    let (lt, ct) = (dev.from_f32(DType::F32, &[rows], lse)?, dev.from_f32(DType::F32, &[rows], coef)?);
    let tt = dev.upload(Tensor::from_u32_host(&[rows], targets.to_vec())?)?;
    let loss = dev.zeros(DType::F32, &[rows])?;
    let at = |t: &Tensor| t.data_ptr() as u64;
    let p = |dz: *mut std::ffi::c_void| -> Result<ffi::ct_lm_params> {
        let mut p = lm_params(d, at(&zt), at(&tt) as *const u32, rows, v, inv_t, at(&lt))?;
        (p.coef, p.loss, p.dz_bf16) = (at(&ct) as *const f32, at(&loss) as *mut f32, dz);
        Ok(p)
    };
    d.k_lm_dz(p(z16.data_ptr() as *mut std::ffi::c_void)?)?;
    if zt.to_f32_vec()? != z {
        bail!("ct_lm_dz storing BF16 wrote over z");
    }
    d.k_lm_dz(p(std::ptr::null_mut())?)?;
    let rounded = zt.to_f32_vec()?.iter().map(|&x| crate::device::bf16_rne(x).to_f32()).collect();
    Ok((rounded, z16.to_f32_vec()?))
}
