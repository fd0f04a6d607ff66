//! The CUDA twins of the row-wise ops: launches of csrc/kernels/elementwise.cu (and ct_amax of
//! quantize.cu through `quantize`'s launcher), no arithmetic of their own. Embedding, SwiGLU
//! and gather are bit-exact with the CPU. Not yet run on a GPU.

use crate::device::cuda::args::{code, err_word, f32p, i32_of, ptr, u32p, vp, FLOATS};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

pub fn embedding(d: &CudaDevice, t: &Tensor, ids: &Tensor, o: &mut Tensor, m: usize) -> Result<()> {
    let (v, c) = (t.dim(0), t.dim(1));
    d.k_embedding(ffi::ct_embedding_params {
        table: vp(ptr(d, t, FLOATS, "embedding table")?),
        dtype: code(t.dtype()),
        vocab: i32_of(v, "vocabulary")?,
        ids: u32p(ptr(d, ids, &[DType::U32], "token ids")?),
        out: f32p(ptr(d, o, &[DType::F32], "embedding output")?),
        rows: i32_of(m, "embedding rows")?,
        cols: i32_of(c, "embedding width")?,
        err: err_word(d),
    })
}

pub fn swiglu(d: &CudaDevice, g: &Tensor, u: &Tensor, o: &mut Tensor, m: usize) -> Result<()> {
    let i = g.dim(g.shape().len() - 1);
    d.k_swiglu(ffi::ct_swiglu_params {
        gate: ptr(d, g, &[DType::F32], "swiglu gate")? as *const f32,
        up: ptr(d, u, &[DType::F32], "swiglu up")? as *const f32,
        out: vp(ptr(d, o, &[DType::F32, DType::BF16], "swiglu output")?),
        out_dtype: code(o.dtype()),
        n: (m * i) as i64,
    })
}

pub fn gather_rows(d: &CudaDevice, s: &Tensor, i: &Tensor, o: &mut Tensor, r: usize) -> Result<()> {
    let c = s.dim(s.shape().len() - 1);
    d.k_gather_rows(ffi::ct_gather_rows_params {
        src: ptr(d, s, &[DType::F32], "gather_rows source")? as *const f32,
        idx: u32p(ptr(d, i, &[DType::U32], "gather_rows indices")?),
        dst: f32p(ptr(d, o, &[DType::F32], "gather_rows output")?),
        rows: i32_of(r, "gathered rows")?,
        cols: i32_of(c, "gather width")?,
        src_rows: i32_of(s.numel() / c.max(1), "source rows")?,
        err: err_word(d),
    })
}

pub fn amax_rows(d: &CudaDevice, x: &Tensor, m: usize) -> Result<f32> {
    let c = x.dim(x.shape().len() - 1);
    crate::ops::quantize::amax(d, ptr(d, x, &[DType::F32], "amax input")?, DType::F32, m * c, None)
}

/// Fills a float tensor with mean + std · N(0, 1) on the device (no CPU twin: the device
/// check's and benchmarks' random inputs).
pub fn fill_normal(d: &CudaDevice, t: &mut Tensor, seed: u64, stream: u64, mean: f32, std: f32) -> Result<()> {
    let p = ptr(d, t, FLOATS, "fill_normal")?;
    d.k_fill_normal(ffi::ct_fill_normal_params {
        out: vp(p),
        dtype: code(t.dtype()),
        n: t.numel() as i64,
        seed,
        stream,
        mean,
        std,
    })
}

pub fn swiglu_bwd(d: &CudaDevice, da: &Tensor, g: &Tensor, u: &Tensor, dg: &mut Tensor, du: &mut Tensor) -> Result<()> {
    let f = |t: &Tensor, what: &str| ptr(d, t, &[DType::F32], what);
    let out = |t: &Tensor, what: &str| ptr(d, t, &[DType::F32, DType::BF16], what).map(vp);
    d.k_swiglu_bwd(ffi::ct_swiglu_bwd_params {
        da: f(da, "swiglu output gradient")? as *const f32,
        g: f(g, "swiglu gate")? as *const f32,
        u: f(u, "swiglu up")? as *const f32,
        dg: out(dg, "swiglu gate gradient")?,
        du: out(du, "swiglu up gradient")?,
        out_dtype: code(dg.dtype()),
        n: da.numel() as i64,
    })
}

pub fn embed_bwd(
    d: &CudaDevice,
    ids: &Tensor,
    dx: &Tensor,
    dt: &mut Tensor,
    tokens: usize,
    skip: Option<u32>,
) -> Result<()> {
    let (v, c) = (dt.dim(0), dt.dim(1));
    d.k_embed_bwd(ffi::ct_embed_bwd_params {
        dx: ptr(d, dx, &[DType::F32], "embedding output gradient")? as *const f32,
        ids: u32p(ptr(d, ids, &[DType::U32], "token ids")?),
        dtable: f32p(ptr(d, dt, &[DType::F32], "embedding gradient")?),
        tokens: i32_of(tokens, "tokens")?,
        cols: i32_of(c, "embedding width")?,
        vocab: i32_of(v, "vocabulary")?,
        skip: skip.unwrap_or(0),
        has_skip: skip.is_some() as i32,
        err: err_word(d),
    })
}
