//! The cuBLASLt GEMM entry points of a [`CudaDevice`]: the forward form (y (+)= x·wᵀ), the
//! residual form (y = c + x·wᵀ, cuBLASLt's C ≠ D) and the backward forms, each checked through
//! the driver seam and declared to the launch ledger at its shapes.
//!
//! Owns: nothing (methods of `CudaDevice`). May call: the driver seam, `cost`. Must not: touch
//! the allocator or tensors.

use super::{cost, CudaDevice, Elem, Form, GemmKey, GemmOperands};
use anyhow::Result;

impl CudaDevice {
    /// y (m, n) f32 (+)= alpha · x (m, k) · w (n, k)ᵀ through cuBLASLt, w and x of element type
    /// `ab` (device addresses); `scales`: NVFP4's (weight, activation) block-scale buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        ab: Elem,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        accumulate: bool,
        scales: Option<(u64, u64)>,
    ) -> Result<()> {
        self.run_gemm(
            GemmKey { m, n, k, ab, accumulate, form: Form::Nt, device_scalars: false },
            GemmOperands { w, x, c: y, y, alpha, scales, scalars: 0 },
        )
    }

    /// y (m, n) f32 = alpha · x (m, k) · w (n, k)ᵀ + beta · y through cuBLASLt in device pointer
    /// mode: (alpha, beta) are two f32 at `scalars` on the device, written by an earlier launch
    /// of the same stream (beta 1 with `accumulate`, else 0) — a scale the host does not know
    /// applied in the GEMM's epilogue instead of a pass over y.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_device_scalars(
        &self,
        ab: Elem,
        w: u64,
        x: u64,
        y: u64,
        (m, n, k): (usize, usize, usize),
        scalars: u64,
        accumulate: bool,
    ) -> Result<()> {
        self.run_gemm(
            GemmKey { m, n, k, ab, accumulate, form: Form::Nt, device_scalars: true },
            GemmOperands { w, x, c: y, y, alpha: 1.0, scales: None, scalars },
        )
    }

    /// y (m, n) f32 = c (m, n) f32 + x (m, k) · w (n, k)ᵀ through cuBLASLt (C ≠ D: a residual
    /// added without copying it into y first), w and x of element type `ab`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_residual(&self, ab: Elem, w: u64, x: u64, c: u64, y: u64, m: usize, n: usize, k: usize) -> Result<()> {
        let ops = GemmOperands { w, x, c, y, alpha: 1.0, scales: None, scalars: 0 };
        self.run_gemm(GemmKey { m, n, k, ab, accumulate: true, form: Form::Nt, device_scalars: false }, ops)
    }

    /// y (m, n) f32 (+)= alpha · op(x) · op(w) through cuBLASLt in `form` (`Form::Nn`: the
    /// data gradient x·w, `Form::Tn`: the weight gradient xᵀ·w; F32, BF16 or F16 operands).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_form(
        &self,
        form: Form,
        ab: Elem,
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        accumulate: bool,
    ) -> Result<()> {
        let key = GemmKey { m, n, k, ab, accumulate, form, device_scalars: false };
        self.run_gemm(key, GemmOperands { w, x, c: y, y, alpha, scales: None, scalars: 0 })
    }

    fn run_gemm(&self, key: GemmKey, ops: GemmOperands) -> Result<()> {
        if key.m == 0 || key.n == 0 {
            return Ok(());
        }
        self.bind()?;
        self.inner.driver.gemm(key, ops)?;
        self.record(key.op_name(), cost::gemm(&key));
        Ok(())
    }
}
