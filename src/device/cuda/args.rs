//! How a tensor reaches a kernel: its device address after checking that it lives on this
//! device with a dtype the kernel reads, the kernels' dtype codes and 32-bit sizes, and the
//! device's error word. Used by the op rooms' CUDA twins (`ops/<op>/cuda.rs`).
//!
//! Owns: nothing. May call: the tensor types. Must not: launch anything.

use super::{ffi, CudaDevice, CudaStorage};
use crate::device::{DType, Storage, Tensor};
use anyhow::{bail, Result};
use std::ffi::c_void;

/// The float dtypes a weight may have (the kernels read each).
pub const FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];

/// The storage of `t` if it lives on `d`, else an error naming `what`.
pub fn storage<'a>(d: &CudaDevice, t: &'a Tensor, what: &str) -> Result<&'a CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) if s.ordinal() == d.ordinal() => Ok(s),
        Storage::Cuda(s) => bail!("{what}: tensor on cuda:{}, op on {}", s.ordinal(), d.name()),
        Storage::Cpu(_) => bail!("{what}: expected a tensor on {}, found a CPU tensor", d.name()),
    }
}

/// The device address of a tensor of one of `dtypes`.
pub fn ptr(d: &CudaDevice, t: &Tensor, dtypes: &[DType], what: &str) -> Result<u64> {
    let s = storage(d, t, what)?;
    if !dtypes.contains(&s.dtype()) {
        let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        bail!("{what}: expected a {} tensor, found {}", want.join(" or "), s.dtype().name());
    }
    Ok(s.device_ptr() as u64)
}

/// The kernels' code for a dtype (CT_DTYPE_*).
pub fn code(dt: DType) -> i32 {
    match dt {
        DType::F32 => ffi::CT_DTYPE_F32,
        DType::BF16 => ffi::CT_DTYPE_BF16,
        DType::F16 => ffi::CT_DTYPE_F16,
        DType::U8 | DType::U32 => ffi::CT_DTYPE_U8,
    }
}

/// `n` as the kernels' 32-bit size, or an error naming `what`.
pub fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow::anyhow!("{what}: {n} does not fit the kernels' 32-bit sizes"))
}

pub fn f32p(p: u64) -> *mut f32 {
    p as *mut f32
}

pub fn u32p(p: u64) -> *const u32 {
    p as *const u32
}

pub fn vp(p: u64) -> *mut c_void {
    p as *mut c_void
}

/// The device's error word, where kernels record a bad index (see `CudaDevice::synchronize`).
pub fn err_word(d: &CudaDevice) -> *mut u32 {
    d.err_word() as *mut u32
}
