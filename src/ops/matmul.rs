//! Linear layers: `y = x · Wᵀ (+ b)` for an nn.Linear weight W (N, K).

use super::linear_panels::Panels;
use super::{check_rows, linear_cpu};
use crate::device::{cuda, CpuFloats, Device, Tensor};
use anyhow::{bail, Result};

/// y[..m] (m, N) = x[..m] (m, K) · wᵀ, w (N, K), plus `bias` (N) when given; `accumulate` adds to y.
pub fn linear(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    linear_packed(dev, x, w, None, bias, y, m, accumulate)
}

/// [`linear`], reading W from `panels` (the same weight packed once, see
/// `ModelWeights::pack_panels`) where given: the same bits on CPU; CUDA ignores them.
#[allow(clippy::too_many_arguments)]
pub fn linear_packed(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    panels: Option<&Panels>,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    m: usize,
    accumulate: bool,
) -> Result<()> {
    linears_acc(dev, x, [Proj { w, panels, bias, y }], m, accumulate, false)
}

/// [`linear_packed`] (no bias) for an output written once, read once later, and too large to
/// stay in cache: the LM head's logits. On CPU its rows skip the caches where they can (see
/// `linear_cpu::Job::streamed`), the same bits; CUDA runs [`linear_packed`].
pub fn linear_packed_streamed(
    dev: &Device,
    x: &Tensor,
    w: &Tensor,
    panels: Option<&Panels>,
    y: &mut Tensor,
    m: usize,
) -> Result<()> {
    linears_acc(dev, x, [Proj { w, panels, bias: None, y }], m, false, true)
}

/// One projection of [`linears`]: y = x · wᵀ (+ bias), w (N, K), its panels when packed.
pub struct Proj<'a> {
    pub w: &'a Tensor,
    pub panels: Option<&'a Panels>,
    pub bias: Option<&'a Tensor>,
    pub y: &'a mut Tensor,
}

/// Several projections of one input (q/k/v, gate/up): y_i[..m] = x[..m] · w_iᵀ (+ b_i), each
/// with the bits of its own [`linear_packed`]. On CPU they run as one parallel region with x
/// transposed once; CUDA runs them one after another.
pub fn linears<const J: usize>(dev: &Device, x: &Tensor, projs: [Proj<'_>; J], m: usize) -> Result<()> {
    linears_acc(dev, x, projs, m, false, false)
}

fn linears_acc<const J: usize>(
    dev: &Device,
    x: &Tensor,
    projs: [Proj<'_>; J],
    m: usize,
    accumulate: bool,
    stream: bool,
) -> Result<()> {
    const { assert!(J >= 1 && J <= linear_cpu::MAX_JOBS) };
    for p in &projs {
        let (n, kw) = (p.w.dim(0), p.w.dim(1));
        if let Some(pn) = p.panels {
            if pn.dims() != (n, kw) {
                bail!("linear: packed panels of {:?} for a weight of ({n}, {kw})", pn.dims());
            }
        }
        check_rows(x, m, kw, "linear input")?;
        check_rows(p.y, m, n, "linear output")?;
        if let Some(b) = p.bias {
            check_rows(b, 1, n, "linear bias")?;
        }
    }
    // (Every projection's K equals x's row width: checked above.)
    let k = projs[0].w.dim(1);
    match dev {
        Device::Cpu(c) => {
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
                        (Some(p), _) => linear_cpu::Job::panels(p, y, n, accumulate),
                        (None, Some(w)) => linear_cpu::Job::rows(w, n, y, n, accumulate),
                        (None, None) => linear_cpu::Job::rows(CpuFloats::F32(&[]), 0, y, n, accumulate),
                    };
                    let job = job.with_bias(b);
                    if stream {
                        job.streamed()
                    } else {
                        job
                    }
                });
                c.install(|| linear_cpu::linear_many(m, k, xs, &mut jobs));
            });
            Ok(())
        }
        Device::Cuda(c) => {
            for p in projs {
                cuda::ops::linear(c, x, p.w, p.bias, p.y, m, accumulate)?;
            }
            Ok(())
        }
    }
}

thread_local! {
    /// BF16/F16 biases widened for one call (grown once to the model's largest).
    static BIAS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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

/// y[..m] = quant(x[..m])·wqᵀ (+ bias): a quantized engine's linear, the input quantized with
/// `act` in the weight's format. CPU (the reference, the paper's emulated path): x is
/// fake-quantized into the scratch `xq` (reshaped to x's row width), then [`linear_q`]. CUDA:
/// the real W8A8 / W4A4 GEMM on the same codes (`xq` unused); only the FP32 summation order
/// differs, which the device check bounds.
#[allow(clippy::too_many_arguments)]
pub fn linear_act_q(dev: &Device, x: &Tensor, xq: &mut Tensor, act: &crate::ops::quantize::ActQuant, wq: &crate::quant::QTensor, bias: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    match dev {
        Device::Cpu(_) => {
            let k = x.dim(x.shape().len() - 1);
            xq.reshape(&[xq.numel() / k, k])?;
            crate::ops::quantize::fake_quant_rows(dev, x, xq, m, act)?;
            linear_q(dev, xq, wq, bias, y, m)
        }
        Device::Cuda(c) => cuda::ops::linear_act_q(c, x, act, wq, bias, y, m),
    }
}

/// y[..m] (m, N) = x[..m] · dequant(wq)ᵀ (+ bias): the emulated low-precision linear. The weight
/// is decoded exactly (FP8: e4m3·scale; NVFP4: f32(e2m1·bs)·global) block by block inside the
/// same kernel as [`linear`], so the products equal those of a real FP8/FP4 GEMM and only the
/// f32 summation order differs.
pub fn linear_q(dev: &Device, x: &Tensor, wq: &crate::quant::QTensor, bias: Option<&Tensor>, y: &mut Tensor, m: usize) -> Result<()> {
    let (n, k) = (wq.rows, wq.k);
    check_rows(x, m, k, "linear input")?;
    check_rows(y, m, n, "linear output")?;
    match dev {
        Device::Cpu(c) => {
            let xs = x.f32s()?;
            let bf = bias.map(CpuFloats::of).transpose()?;
            let wv = wq.view()?;
            let ys = y.f32s_mut()?;
            with_f32_biases([bf], |[b]| {
                let mut jobs = [linear_cpu::Job::rows(wv, n, ys, n, false).with_bias(b)];
                c.install(|| linear_cpu::linear_many(m, k, xs, &mut jobs))
            });
            Ok(())
        }
        Device::Cuda(c) => cuda::ops::linear_q(c, x, wq, bias, y, m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DType;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = crate::rand::Stream::new(seed, 0);
        (0..n).map(|_| s.normal() as f32).collect()
    }

    #[test]
    fn fused_projections_equal_the_kernel_then_the_bias() {
        // BF16 and F32 weights and biases (the BF16 bias widened into scratch), one packed once:
        // each output of `linears` equals linear_nt alone followed by y += f32(bias), bitwise.
        let dev = Device::cpu(2).unwrap();
        let (m, k) = (11, 24);
        let x = dev.from_f32(DType::F32, &[m, k], &data(m * k, 1)).unwrap();
        let shapes = [(24, DType::BF16), (8, DType::F32), (13, DType::BF16)];
        let ws: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, &(n, dt))| dev.from_f32(dt, &[n, k], &data(n * k, 10 + i as u64)).unwrap()).collect();
        let bs: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, &(n, dt))| dev.from_f32(dt, &[n], &data(n, 20 + i as u64)).unwrap()).collect();
        let p1 = Panels::pack(CpuFloats::of(&ws[1]).unwrap(), 8, k).unwrap();
        let mut ys: Vec<Tensor> = shapes.iter().map(|&(n, _)| dev.zeros(DType::F32, &[m, n]).unwrap()).collect();
        let [y0, y1, y2] = &mut ys[..] else { unreachable!() };
        let projs = [
            Proj { w: &ws[0], panels: None, bias: Some(&bs[0]), y: y0 },
            Proj { w: &ws[1], panels: Some(&p1), bias: Some(&bs[1]), y: y1 },
            Proj { w: &ws[2], panels: None, bias: Some(&bs[2]), y: y2 },
        ];
        linears(&dev, &x, projs, m).unwrap();
        let xs = x.to_f32_vec().unwrap();
        for (i, &(n, _)) in shapes.iter().enumerate() {
            let mut want = vec![0.0f32; m * n];
            linear_cpu::linear_nt(m, n, k, &xs, CpuFloats::of(&ws[i]).unwrap(), &mut want, n, false);
            let b = bs[i].to_f32_vec().unwrap();
            for r in 0..m {
                for j in 0..n {
                    want[r * n + j] += b[j];
                }
            }
            let got = ys[i].to_f32_vec().unwrap();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "projection {i}");
        }
    }

    #[test]
    fn a_nested_call_with_the_bias_scratch_in_use_gets_its_own() {
        // As when rayon runs another caller's linear on a thread waiting inside one: the
        // thread's widened-bias scratch is borrowed; the nested call must still be right.
        let dev = Device::cpu(1).unwrap();
        let (m, k, n) = (3, 8, 5);
        let x = dev.from_f32(DType::F32, &[m, k], &data(m * k, 1)).unwrap();
        let w = dev.from_f32(DType::F32, &[n, k], &data(n * k, 2)).unwrap();
        let b = dev.from_f32(DType::BF16, &[n], &data(n, 3)).unwrap();
        let mut want = dev.zeros(DType::F32, &[m, n]).unwrap();
        linear(&dev, &x, &w, Some(&b), &mut want, m, false).unwrap();
        let mut got = dev.zeros(DType::F32, &[m, n]).unwrap();
        BIAS.with(|c| {
            let _held = c.borrow_mut();
            linear(&dev, &x, &w, Some(&b), &mut got, m, false).unwrap();
        });
        assert_eq!(got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    }

    #[test]
    fn a_misshapen_projection_is_an_error() {
        let dev = Device::cpu(1).unwrap();
        let x = dev.zeros(DType::F32, &[2, 4]).unwrap();
        let w = dev.zeros(DType::F32, &[3, 4]).unwrap();
        let b = dev.zeros(DType::F32, &[5]).unwrap();
        let mut y = dev.zeros(DType::F32, &[2, 3]).unwrap();
        let e = linears(&dev, &x, [Proj { w: &w, panels: None, bias: Some(&b), y: &mut y }], 2).unwrap_err();
        assert!(format!("{e:#}").contains("bias"), "{e:#}");
    }
}
