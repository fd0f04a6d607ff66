//! The simulator's cuBLASLt: y (m, n) f32 (+)= alpha · x (m, k) · w (n, k)ᵀ read through the
//! same descriptor the real call builds (`GemmKey`: shape, element type, accumulate; TN form,
//! FP32 compute), as a reference GEMM with f64 sums rounded once to f32 (a real GEMM's FP32
//! sums differ from it at the rounding level, as they differ between cuBLASLt's own
//! algorithms). It refuses what cuBLASLt refuses for the low-precision types: FP8 needs K % 16
//! and 16-byte aligned operands. NVFP4 (E2M1 with tiled block scales) is not modelled yet and
//! is refused with a clear error (the engines' NVFP4 path does not call it; the device check's
//! cuBLASLt baseline does).
//!
//! Owns: nothing. May call: `crate::formats`. Must not: be called except from `sim.rs`.

use super::driver::{Elem, GemmKey};
use anyhow::{bail, Result};
use half::{bf16, f16};

/// Bytes per element (E2M1: one byte holds two).
pub(super) fn elem_bytes(e: Elem) -> usize {
    match e {
        Elem::F32 => 4,
        Elem::BF16 | Elem::F16 => 2,
        Elem::E4M3 | Elem::E2M1 => 1,
    }
}

/// Elements per `elem_bytes` bytes.
pub(super) fn per_byte(e: Elem) -> usize {
    if e == Elem::E2M1 {
        2
    } else {
        1
    }
}

/// What cuBLASLt would refuse for this call.
pub(super) fn check(key: &GemmKey, w: u64, x: u64, y: u64, scales: Option<(u64, u64)>) -> Result<()> {
    match key.ab {
        Elem::E2M1 => bail!("NVFP4 (E2M1, tiled block scales) GEMM is not modelled by the simulator"),
        Elem::E4M3 => {
            if key.k % 16 != 0 {
                bail!("FP8 GEMM needs K divisible by 16, got K = {}", key.k);
            }
            if [w, x, y].iter().any(|p| p % 16 != 0) {
                bail!("FP8 GEMM needs 16-byte aligned operands (w {w:#x}, x {x:#x}, y {y:#x})");
            }
            if scales.is_some() {
                bail!("FP8 GEMM: block scales are an NVFP4 attribute");
            }
        }
        _ => {
            if scales.is_some() {
                bail!("{:?} GEMM with block scales", key.ab);
            }
        }
    }
    Ok(())
}

/// Reads element `i` of a matrix of type `e` at `base`.
///
/// SAFETY (callers): `base` is a live simulated allocation holding at least i + 1 elements.
unsafe fn load(e: Elem, base: u64, i: usize) -> f64 {
    // SAFETY: as documented above.
    unsafe {
        match e {
            Elem::F32 => *(base as *const f32).add(i) as f64,
            Elem::BF16 => (*(base as *const bf16).add(i)).to_f64(),
            Elem::F16 => (*(base as *const f16).add(i)).to_f64(),
            Elem::E4M3 => crate::formats::fp8::e4m3_table()[*(base as *const u8).add(i) as usize] as f64,
            // Refused by `check` before anything is queued.
            Elem::E2M1 => f64::NAN,
        }
    }
}

/// Runs a queued GEMM (its ranges were checked against live allocations when it was queued).
pub(super) fn run(key: &GemmKey, w: u64, x: u64, y: u64, alpha: f32) {
    let GemmKey { m, n, k, ab, accumulate } = *key;
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for t in 0..k {
                // SAFETY: x holds m·k and w n·k elements (checked when queued).
                acc += unsafe { load(ab, x, i * k + t) * load(ab, w, j * k + t) };
            }
            let out = (y as *mut f32).wrapping_add(i * n + j);
            // SAFETY: y holds m·n f32 values (checked when queued).
            unsafe {
                let prev = if accumulate { *out as f64 } else { 0.0 };
                *out = (alpha as f64 * acc + prev) as f32;
            }
        }
    }
}
