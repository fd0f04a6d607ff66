//! The simulator's GEMM libraries: reference GEMMs that read the operands exactly as the real
//! libraries are told to read them, and refuse what they refuse.
//!
//! - cuBLASLt: y (m, n) f32 (+)= alpha · op(x) · op(w) read through the same descriptor the
//!   real call builds (`GemmKey`: shape, element type, accumulate, form — x·wᵀ, x·w or xᵀ·w;
//!   FP32 compute; NVFP4 with VEC16_UE4M3 block scales in the tiled layout). FP8 and NVFP4 take
//!   the x·wᵀ (TN) form only and need K % 16 (FP4: K % 32, 16 bytes of a row) and 16-byte
//!   aligned operands and scales.
//! - CUTLASS (csrc/cutlass): D (m, n) f32 = alpha · A (m, k) · B (n, k)ᵀ, A and B with k
//!   contiguous; NVFP4 with UE4M3 scales in the swizzled layout of sm_100's block-scaled
//!   kernels. Only the kernels of the device's architecture exist (no NVFP4 on sm_90), and the
//!   kernels' `can_implement` rules apply (the TMA's 16-byte strides: K % 16 for FP8, K % 32
//!   for NVFP4, N % 4 for the f32 output), as does TMA's 16-byte alignment of every operand.
//!
//! The sums are f64, rounded once to f32 (a real GEMM's FP32 sums differ from it at the
//! rounding level, as they differ between the library's own algorithms).
//!
//! The scale layout is decoded here from CUTLASS's description (`Sm1xxBlockScaledConfig`: an
//! atom of 128 rows × 4 blocks of 16 values, shape ((32, 4), (16, 4)) with strides
//! ((16, 4), (0, 1)) in bytes, atoms tiled with K fastest), written independently of the
//! kernel that produces it (`ct_swizzle_sf`), so a change to either shows.
//!
//! Owns: nothing. May call: `crate::formats`. Must not: be called except from `sim.rs`.

use super::driver::{Cutlass, CutlassArgs, Elem, Form, GemmKey, GemmOperands};
use crate::formats::fp8::{e4m3_table, E2M1_VALUES};
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

/// Bytes of a (rows, k) matrix of `e`.
pub(super) fn matrix_bytes(e: Elem, rows: usize, k: usize) -> usize {
    rows * k * elem_bytes(e) / per_byte(e)
}

/// Bytes of the swizzled / tiled block scales of a (rows, k) NVFP4 operand: whole atoms of 128
/// rows × 4 blocks of 16 values.
pub(super) fn sf_bytes(rows: usize, k: usize) -> usize {
    rows.div_ceil(128) * (k / 16).div_ceil(4) * 512
}

/// Byte offset of the scale of row `r`, 16-value block `kb`, in a swizzled layout of `k`
/// values per row (see the module header).
fn sf_offset(r: usize, kb: usize, k: usize) -> usize {
    let k_atoms = (k / 16).div_ceil(4);
    let atom = (r / 128) * k_atoms + kb / 4;
    let (m0, m1, k1) = (r % 32, (r / 32) % 4, kb % 4);
    atom * 512 + m0 * 16 + m1 * 4 + k1
}

/// What cuBLASLt would refuse for this call.
pub(super) fn check(key: &GemmKey, ops: &GemmOperands) -> Result<()> {
    let GemmOperands { w, x, c, y, scales, scalars, .. } = *ops;
    match (key.device_scalars, scalars) {
        (true, 0) => bail!("device pointer mode without the (alpha, beta) address"),
        (false, s) if s != 0 => bail!("an (alpha, beta) address in host pointer mode"),
        (true, s) if s % 4 != 0 => bail!("(alpha, beta) at {s:#x}: not 4-byte aligned"),
        _ => {}
    }
    if key.form != Form::Nt && !matches!(key.ab, Elem::F32 | Elem::BF16 | Elem::F16) {
        bail!("{:?} operands in the TN form only, not {:?}", key.ab, key.form);
    }
    match key.ab {
        Elem::E4M3 | Elem::E2M1 => {
            let (name, k_mult) = if key.ab == Elem::E4M3 { ("FP8", 16) } else { ("NVFP4", 32) };
            if key.k % k_mult != 0 {
                bail!("{name} GEMM needs K divisible by {k_mult}, got K = {}", key.k);
            }
            if [w, x, c, y].iter().any(|p| p % 16 != 0) {
                bail!("{name} GEMM needs 16-byte aligned operands (w {w:#x}, x {x:#x}, y {y:#x})");
            }
            match (key.ab, scales) {
                (Elem::E4M3, Some(_)) => bail!("FP8 GEMM: block scales are an NVFP4 attribute"),
                (Elem::E2M1, None) => bail!("NVFP4 GEMM without its VEC16_UE4M3 block scales"),
                (Elem::E2M1, Some((sw, sx))) if sw % 16 != 0 || sx % 16 != 0 => {
                    bail!("NVFP4 GEMM needs 16-byte aligned block scales (w {sw:#x}, x {sx:#x})")
                }
                _ => {}
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

/// What running CUTLASS GEMM `g` on an `arch_major` GPU would do with `a`: an error (no image
/// of the kernel for this GPU, an operand TMA cannot address), Ok(false) (`can_implement`
/// refuses the shape), or Ok(true).
pub(super) fn cutlass_check(g: Cutlass, arch_major: i32, a: &CutlassArgs) -> Result<bool> {
    if g.major() != arch_major {
        bail!(
            "{} is built for sm_{}0a and has no image for this sm_{arch_major}0 device (a GPU fails the launch with \
             'no kernel image is available')",
            g.name(),
            g.major()
        );
    }
    let nvfp4 = g == Cutlass::Nvfp4Sm100;
    let mut ptrs = vec![("A", a.a), ("B", a.b), ("D", a.d)];
    if nvfp4 {
        ptrs.extend([("SFA", a.sfa), ("SFB", a.sfb)]);
    }
    for (what, p) in ptrs {
        if p == 0 || p % 16 != 0 {
            bail!("{}: operand {what} at {p:#x} is not 16-byte aligned (TMA needs 16 bytes)", g.name());
        }
    }
    let k_mult = if nvfp4 { 32 } else { 16 };
    Ok(a.m > 0 && a.n > 0 && a.k > 0 && a.k % k_mult == 0 && a.n % 4 == 0)
}

/// One operand as a library reads it: element (r, t) of `e` at `ptr` + r·rs + t·cs elements
/// (r: the row of the output it feeds, t: the reduction index); NVFP4 (rs = k, cs = 1 only)
/// with the scales at `sf` in the swizzled layout.
#[derive(Clone, Copy)]
struct Operand {
    e: Elem,
    ptr: u64,
    sf: u64,
    k: usize,
    rs: usize,
    cs: usize,
}

impl Operand {
    /// Rows of k contiguous values (the TN form's operands).
    fn rows(e: Elem, ptr: u64, sf: u64, k: usize) -> Operand {
        Operand { e, ptr, sf, k, rs: k, cs: 1 }
    }

    /// Element (r, t).
    ///
    /// SAFETY (callers): the operand's ranges were checked against live allocations.
    unsafe fn at(&self, r: usize, t: usize) -> f64 {
        let i = r * self.rs + t * self.cs;
        // SAFETY: as documented above.
        unsafe {
            match self.e {
                Elem::F32 => *(self.ptr as *const f32).add(i) as f64,
                Elem::BF16 => (*(self.ptr as *const bf16).add(i)).to_f64(),
                Elem::F16 => (*(self.ptr as *const f16).add(i)).to_f64(),
                Elem::E4M3 => e4m3_table()[*(self.ptr as *const u8).add(i) as usize] as f64,
                Elem::E2M1 => {
                    let byte = *(self.ptr as *const u8).add(i / 2);
                    let code = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
                    let scale = e4m3_table()[*(self.sf as *const u8).add(sf_offset(r, t / 16, self.k)) as usize];
                    E2M1_VALUES[code as usize] as f64 * scale as f64
                }
            }
        }
    }
}

/// y (m, n) = alpha · a · bᵀ (+ beta · c (m, n) with a beta; c may be y).
///
/// SAFETY (callers): every range was checked against a live allocation when the op was queued.
#[allow(clippy::too_many_arguments)]
unsafe fn reference(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: u64,
    y: u64,
    alpha: f32,
    beta: Option<f32>,
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for t in 0..k {
                // SAFETY: as documented above.
                acc += unsafe { a.at(i, t) * b.at(j, t) };
            }
            let (out, src) = ((y as *mut f32).wrapping_add(i * n + j), (c as *const f32).wrapping_add(i * n + j));
            // SAFETY: y (and with a beta c) holds m·n f32 values.
            unsafe {
                let prev = beta.map(|b| b as f64 * *src as f64).unwrap_or(0.0);
                *out = (alpha as f64 * acc + prev) as f32;
            }
        }
    }
}

/// Runs a queued cuBLASLt GEMM (`scales`: the tiled block scales of (w, x) for NVFP4).
pub(super) fn run(key: &GemmKey, ops: &GemmOperands) {
    let GemmKey { m, n, k, ab, accumulate, form, device_scalars } = *key;
    let GemmOperands { w, x, c, y, alpha, scales, scalars } = *ops;
    let (alpha, beta) = match device_scalars {
        // SAFETY: `Sim::gemm` checked the 8 bytes at `scalars` when the GEMM was queued, and
        // the launches before it on the stream have run.
        true => unsafe { (*(scalars as *const f32), Some(*(scalars as *const f32).add(1)).filter(|&b| b != 0.0)) },
        false => (alpha, accumulate.then_some(1.0)),
    };
    let (sw, sx) = scales.unwrap_or((0, 0));
    let (mut a, mut b) = (Operand::rows(ab, x, sx, k), Operand::rows(ab, w, sw, k));
    // x (m, k) or, for Tn, (k, m); w (n, k) or, for Nn and Tn, (k, n).
    if form == Form::Tn {
        (a.rs, a.cs) = (1, m);
    }
    if form != Form::Nt {
        (b.rs, b.cs) = (1, n);
    }
    // SAFETY: the ranges were checked when the GEMM was queued (`Sim::gemm`).
    unsafe { reference(m, n, k, a, b, c, y, alpha, beta) }
}

/// Runs a queued CUTLASS GEMM.
pub(super) fn run_cutlass(g: Cutlass, p: &CutlassArgs) {
    let e = if g == Cutlass::Nvfp4Sm100 { Elem::E2M1 } else { Elem::E4M3 };
    let (a, b) = (Operand::rows(e, p.a, p.sfa, p.k), Operand::rows(e, p.b, p.sfb, p.k));
    // SAFETY: the ranges were checked when the GEMM was queued (`Sim::cutlass`).
    unsafe { reference(p.m, p.n, p.k, a, b, p.d, p.d, p.alpha, None) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The atom of CUTLASS's description, enumerated coordinate by coordinate: within one
    /// atom, the 512 (row, block) pairs of 128 rows × 4 blocks land on 512 distinct bytes, the
    /// 32 rows of a row group 16 bytes apart, the four row groups 4 bytes apart, the blocks
    /// adjacent; the next atom along K starts 512 bytes later, along M a K-row of atoms later.
    #[test]
    fn the_scale_layout_is_cutlass_atom() {
        let k = 16 * 4 * 3; // three atoms along K
        let mut seen = vec![false; 512];
        for r in 0..128 {
            for kb in 0..4 {
                let o = sf_offset(r, kb, k);
                assert_eq!(o, (r % 32) * 16 + (r / 32) * 4 + kb, "row {r} block {kb}");
                assert!(!seen[o], "row {r} block {kb} lands on byte {o} twice");
                seen[o] = true;
            }
        }
        assert_eq!(sf_offset(0, 4, k), 512);
        assert_eq!(sf_offset(0, 11, k), 2 * 512 + 3);
        assert_eq!(sf_offset(128, 0, k), 3 * 512);
        assert_eq!(sf_offset(130, 5, k), 3 * 512 + 512 + 2 * 16 + 1);
        assert_eq!(sf_bytes(129, k), 2 * 3 * 512);
    }
}
