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
