//! The CUDA twin of the fused log-softmax + gather: the ct_log_softmax_gather launch
//! (csrc/kernels/logprob.cu), equal to the CPU twin to rounding of the f64 sum. Not yet run on
//! a GPU.

use crate::device::cuda::args::{err_word, f32p, i32_of, ptr, u32p};
use crate::device::cuda::{ffi, CudaDevice};
use crate::device::{DType, Tensor};
use anyhow::Result;

pub fn log_softmax_gather(d: &CudaDevice, z: &Tensor, y: &Tensor, t: f32, o: &mut Tensor, m: usize) -> Result<()> {
    let v = z.dim(z.shape().len() - 1);
    d.k_log_softmax_gather(ffi::ct_logprob_params {
        logits: ptr(d, z, &[DType::F32], "logits")? as *const f32,
        targets: u32p(ptr(d, y, &[DType::U32], "targets")?),
        out: f32p(ptr(d, o, &[DType::F32], "log-prob output")?),
        rows: i32_of(m, "rows")?,
        vocab: i32_of(v, "vocabulary")?,
        temperature: t,
        err: err_word(d),
    })
}
