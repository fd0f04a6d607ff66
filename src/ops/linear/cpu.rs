//! The CPU twin of the linears: tensors turned into the kernel's jobs (`super::kernel`), biases
//! widened to f32 once per call. `super` checks the shapes.

use super::kernel::{self, Job};
use super::Proj;
use crate::device::{CpuDevice, CpuFloats, Tensor};
use crate::quant::qtensor::QTensor;
use anyhow::{bail, Result};

/// Every projection of one input in one parallel region (x transposed once).
pub fn linears<const J: usize>(
    c: &CpuDevice,
    x: &Tensor,
    projs: [Proj<'_>; J],
    m: usize,
    k: usize,
    accumulate: bool,
    stream: bool,
) -> Result<()> {
    let xs = x.f32s()?;
    let mut bias = [None; J];
    for (b, p) in bias.iter_mut().zip(&projs) {
        *b = p.bias.map(CpuFloats::of).transpose()?;
    }
    let ws = projs.each_ref().map(|p| CpuFloats::of(p.w));
    if let Some(Err(e)) = ws.iter().find(|w| w.is_err()) {
        bail!("linear weight: {e:#}");
    }
    let ys = projs.map(|p| (p.w.dim(0), p.panels, p.y.f32s_mut()));
    if let Some((_, _, Err(e))) = ys.iter().find(|y| y.2.is_err()) {
        bail!("linear output: {e:#}");
    }
    with_f32_biases(bias, |bias| {
        let mut i = 0;
        let mut jobs = ys.map(|(n, panels, y)| {
            let (w, b) = (ws[i].as_ref().ok().copied(), bias[i]);
            i += 1;
            // (Errors were reported above; an empty job would do nothing.)
            let y: &mut [f32] = y.unwrap_or_default();
            let job = match (panels, w) {
                (Some(p), _) => Job::panels(p, y, n, accumulate),
                (None, Some(w)) => Job::rows(w, n, y, n, accumulate),
                (None, None) => Job::rows(CpuFloats::F32(&[]), 0, y, n, accumulate),
            };
            let job = job.with_bias(b);
            if stream {
                job.streamed()
            } else {
                job
            }
        });
        c.install(|| kernel::linear_many(m, k, xs, &mut jobs));
    });
    Ok(())
}

/// y[..m] = x[..m] · dequant(wq)ᵀ (+ bias), the weight decoded block by block in the kernel.
pub fn linear_q(
    c: &CpuDevice,
    x: &Tensor,
    wq: &QTensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    let xs = x.f32s()?;
    let bf = bias.map(CpuFloats::of).transpose()?;
    let wv = wq.view()?;
    let ys = y.f32s_mut()?;
    with_f32_biases([bf], |[b]| {
        let mut jobs = [Job::rows(wv, n, ys, n, false).with_bias(b)];
        c.install(|| kernel::linear_many(m, k, xs, &mut jobs))
    });
    Ok(())
}

thread_local! {
    /// BF16/F16 biases widened for one call (grown once to the model's largest).
    pub(super) static BIAS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with the biases as f32: borrowed when they are f32, else widened into this thread's
/// scratch.
fn with_f32_biases<const J: usize, R>(bias: [Option<CpuFloats>; J], f: impl FnOnce([Option<&[f32]>; J]) -> R) -> R {
    let wide: usize = bias.iter().flatten().filter(|b| !matches!(b, CpuFloats::F32(_))).map(|b| b.len()).sum();
    if wide == 0 {
        return f(bias.map(|b| match b {
            Some(CpuFloats::F32(v)) => Some(v),
            _ => None,
        }));
    }
    BIAS.with(|cell| {
        let mut held = cell.try_borrow_mut();
        let mut own = Vec::new();
        // Borrowed already: this thread is inside another caller's linear (rayon ran that
        // caller's job while it waited for its own tasks); this call gets its own buffer.
        let s: &mut Vec<f32> = match held.as_deref_mut() {
            Ok(s) => s,
            Err(_) => &mut own,
        };
        if s.len() < wide {
            s.resize(wide, 0.0);
        }
        let mut rest: &mut [f32] = &mut s[..wide];
        let out = bias.map(|b| match b {
            None => None,
            Some(CpuFloats::F32(v)) => Some(v),
            Some(b) => {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(b.len());
                b.read_into(0, mine);
                rest = tail;
                Some(&*mine)
            }
        });
        f(out)
    })
}

/// The data gradient in f32 (`super::linear_dx`): the weight widened to f32.
pub fn linear_dx(dy: &Tensor, w: &Tensor, dx: &mut Tensor, m: usize, accumulate: bool) -> Result<()> {
    let (n, k) = (w.dim(0), w.dim(1));
    let wf = w.to_f32_vec()?;
    super::grad::nn(m, n, k, &dy.f32s()?[..m * n], &wf, &mut dx.f32s_mut()?[..m * k], accumulate);
    Ok(())
}

/// The weight gradient in f32 (`super::linear_dw`), the operands rounded to BF16 first when
/// asked.
pub fn linear_dw(
    dy: &Tensor,
    x: &Tensor,
    dw: &mut Tensor,
    m: usize,
    accumulate: bool,
    operands: crate::device::DType,
) -> Result<()> {
    let (n, k) = (dw.dim(0), dw.dim(1));
    let round = |v: &[f32]| -> Vec<f32> {
        if operands == crate::device::DType::BF16 {
            v.iter().map(|&a| crate::device::bf16_rne(a).to_f32()).collect()
        } else {
            v.to_vec()
        }
    };
    let (dyr, xr) = (round(&dy.f32s()?[..m * n]), round(&x.f32s()?[..m * k]));
    super::grad::tn(m, n, k, &dyr, &xr, dw.f32s_mut()?, accumulate);
    Ok(())
}
