//! Stand-in for the CUDA device when colotrain is built without the `cuda` feature.
//!
//! The types are uninhabited, so every CUDA branch of every op compiles and is provably
//! unreachable; asking for a CUDA device returns a clear error instead.

use super::DType;
use anyhow::{bail, Result};

#[derive(Clone, Debug)]
pub enum CudaDevice {}

#[derive(Debug)]
pub enum CudaStorage {}

const NO_CUDA: &str = "this colotrain binary was built without CUDA support; rebuild with \
`cargo build --release --features cuda` (see third_party/README.md for the toolchain)";

impl CudaDevice {
    pub fn new(_ordinal: usize) -> Result<CudaDevice> {
        bail!(NO_CUDA)
    }
    pub fn name(&self) -> String {
        match *self {}
    }
    pub fn memory(&self) -> (usize, usize, usize, usize) {
        match *self {}
    }
    pub fn zeros(&self, _dtype: DType, _shape: &[usize]) -> Result<super::Tensor> {
        match *self {}
    }
    pub fn upload(&self, _host: &super::Tensor) -> Result<super::Tensor> {
        match *self {}
    }
    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }
}

impl CudaStorage {
    pub fn dtype(&self) -> DType {
        match *self {}
    }
    pub fn device_ptr(&self) -> usize {
        match *self {}
    }
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match *self {}
    }
    pub fn try_clone(&self, _shape: &[usize]) -> Result<super::Tensor> {
        match *self {}
    }
    pub fn copy_from(&mut self, _src: &CudaStorage) -> Result<()> {
        match *self {}
    }
    pub fn read_f32_into(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
    pub fn write_u32(&mut self, _data: &[u32]) -> Result<()> {
        match *self {}
    }
    pub fn write_f32(&mut self, _data: &[f32]) -> Result<()> {
        match *self {}
    }
}

/// The CUDA twins of `crate::ops`, uninhabited here: same signatures as the real ones.
pub mod ops {
    use super::CudaDevice;
    use crate::device::Tensor;
    use crate::ops::attention::AttnMeta;
    use crate::ops::sample::SampleParams;
    use anyhow::Result;

    pub fn linear(
        d: &CudaDevice,
        _x: &Tensor,
        _w: &Tensor,
        _b: Option<&Tensor>,
        _y: &mut Tensor,
        _m: usize,
        _acc: bool,
    ) -> Result<()> {
        match *d {}
    }
    pub fn rmsnorm(d: &CudaDevice, _x: &Tensor, _w: &Tensor, _eps: f32, _y: &mut Tensor, _m: usize) -> Result<()> {
        match *d {}
    }
    pub fn add_rmsnorm(
        d: &CudaDevice,
        _x: &mut Tensor,
        _r: &Tensor,
        _w: &Tensor,
        _eps: f32,
        _y: &mut Tensor,
        _m: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn head_rmsnorm(
        d: &CudaDevice,
        _x: &mut Tensor,
        _w: &Tensor,
        _eps: f32,
        _m: usize,
        _heads: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn rope_table(
        d: &CudaDevice,
        _p: &Tensor,
        _f: &Tensor,
        _c: &mut Tensor,
        _s: &mut Tensor,
        _m: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn rope(d: &CudaDevice, _x: &mut Tensor, _c: &Tensor, _s: &Tensor, _m: usize, _heads: usize) -> Result<()> {
        match *d {}
    }
    pub fn embedding(d: &CudaDevice, _t: &Tensor, _ids: &Tensor, _o: &mut Tensor, _m: usize) -> Result<()> {
        match *d {}
    }
    pub fn swiglu(d: &CudaDevice, _g: &Tensor, _u: &Tensor, _o: &mut Tensor, _m: usize) -> Result<()> {
        match *d {}
    }
    pub fn gather_rows(d: &CudaDevice, _s: &Tensor, _i: &Tensor, _o: &mut Tensor, _r: usize) -> Result<()> {
        match *d {}
    }
    pub fn kv_write(
        d: &CudaDevice,
        _k: &Tensor,
        _v: &Tensor,
        _kc: &mut Tensor,
        _vc: &mut Tensor,
        _ks: f32,
        _vs: f32,
        _m: &AttnMeta,
    ) -> Result<()> {
        match *d {}
    }
    pub fn paged_attention(
        d: &CudaDevice,
        _q: &Tensor,
        _kc: &Tensor,
        _vc: &Tensor,
        _ks: f32,
        _vs: f32,
        _m: &AttnMeta,
        _o: &mut Tensor,
        _h: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn log_softmax_gather(
        d: &CudaDevice,
        _z: &Tensor,
        _y: &Tensor,
        _t: f32,
        _o: &mut Tensor,
        _m: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn requantize(d: &CudaDevice, _src: &Tensor, _q: &mut crate::quant::QTensor, _name: &str) -> Result<()> {
        match *d {}
    }
    pub fn requantize_all(d: &CudaDevice, _items: &mut [(&Tensor, &mut crate::quant::QTensor, &str)]) -> Result<()> {
        match *d {}
    }
    pub fn amax_rows(d: &CudaDevice, _x: &Tensor, _m: usize) -> Result<f32> {
        match *d {}
    }
    pub fn linear_q(
        d: &CudaDevice,
        _x: &Tensor,
        _w: &crate::quant::QTensor,
        _b: Option<&Tensor>,
        _y: &mut Tensor,
        _m: usize,
    ) -> Result<()> {
        match *d {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn linear_act_q(
        d: &CudaDevice,
        _x: &Tensor,
        _act: &crate::ops::quantize::ActQuant,
        _w: &crate::quant::QTensor,
        _b: Option<&Tensor>,
        _y: &mut Tensor,
        _m: usize,
    ) -> Result<()> {
        match *d {}
    }
    pub fn fake_quant_rows(
        d: &CudaDevice,
        _x: &Tensor,
        _y: &mut Tensor,
        _m: usize,
        _q: &crate::ops::quantize::ActQuant,
    ) -> Result<()> {
        match *d {}
    }
    pub fn sample(d: &CudaDevice, _z: &Tensor, _p: &[SampleParams], _t: &mut [u32], _l: &mut [f32]) -> Result<()> {
        match *d {}
    }
}
