//! cuBLASLt GEMMs, at the `cudarc::cublaslt::result` level: y (m, n) f32 (+)= alpha · x (m, k) ·
//! w (n, k)ᵀ for an nn.Linear weight w, with CUBLAS_COMPUTE_32F (FP32 accumulation; never TF32),
//! inputs F32, BF16, F16, FP8 E4M3, or NVFP4 (E2M1 with VEC16_UE4M3 block scales in the tiled
//! layout), and the data- and weight-gradient forms (`Form::Nn`: y = x·w, `Form::Tn`: y = xᵀ·w).
//! In cuBLASLt's column-major terms the row-major y (m, n) is D (n × m) = op(A) · op(B) with A
//! the w side and B the x side: Nt: A = w as (k × n) transposed, B = x as (k × m); Nn: A = w as
//! (n × k), B = x as (k × m); Tn: A = w as (n × k), B = x as (m × k) transposed. The descriptors and the heuristic's algorithm are built once per shape and
//! cached. FP8 and NVFP4 here are the library baselines the device check times the CUTLASS
//! kernels against. Not yet run on a GPU.

use super::driver::{Elem, Form, GemmKey, GemmOperands};
use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;

/// Workspace for cuBLASLt (NVIDIA recommends 32 MiB on Hopper and Blackwell).
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;
// cublasOperation_t values (the enum lives in cuBLAS, not cuBLASLt).
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// cuBLASLt's name of an element type.
fn cuda_type(e: Elem) -> sys::cudaDataType {
    match e {
        Elem::F32 => sys::cudaDataType::CUDA_R_32F,
        Elem::BF16 => sys::cudaDataType::CUDA_R_16BF,
        Elem::F16 => sys::cudaDataType::CUDA_R_16F,
        Elem::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Elem::E2M1 => sys::cudaDataType::CUDA_R_4F_E2M1,
    }
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    la: sys::cublasLtMatrixLayout_t,
    lb: sys::cublasLtMatrixLayout_t,
    lc: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

pub(super) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    plans: HashMap<GemmKey, Plan>,
}

// SAFETY: the handle and descriptors are plain pointers owned by this struct, only used while
// the device's Mutex<Blas> is held, and the cuBLASLt handle may be used from any thread.
unsafe impl Send for Blas {}

fn err(what: &str, e: lt::CublasError) -> anyhow::Error {
    anyhow!("cuBLASLt {what}: {e:?}")
}

/// Sets one descriptor attribute from a plain value.
///
/// SAFETY (callers): `desc` is a live descriptor and `T` is the attribute's documented type.
unsafe fn set_attr<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    // SAFETY: as documented above; cuBLASLt copies the value.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(|e| err("descriptor attribute", e))
}

impl Blas {
    /// A handle and a workspace (a device allocation of `workspace_bytes` owned by the caller).
    pub fn new(workspace: u64, workspace_bytes: usize) -> Result<Blas> {
        // SAFETY: only tries to dlopen libcublasLt.
        if !unsafe { sys::is_culib_present() } {
            bail!("libcublasLt (CUDA 13) could not be loaded: add the CUDA 13 libraries' folder to LD_LIBRARY_PATH");
        }
        let handle = std::panic::catch_unwind(lt::create_handle)
            .map_err(|_| {
                anyhow!("libcublasLt lacks a CUDA 13.0 symbol: it is older than the toolkit colotrain was built for")
            })?
            .map_err(|e| err("handle", e))?;
        Ok(Blas { handle, workspace, workspace_bytes, plans: HashMap::new() })
    }

    fn plan(&mut self, key: GemmKey) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            let p = self.build(key)?;
            self.plans.insert(key, p);
        }
        self.plans.get(&key).ok_or_else(|| anyhow!("cuBLASLt plan cache"))
    }

    fn build(&self, key: GemmKey) -> Result<Plan> {
        let GemmKey { m, n, k, ab, form, .. } = key;
        if form != Form::Nt && !matches!(ab, Elem::F32 | Elem::BF16 | Elem::F16) {
            bail!("cuBLASLt takes {ab:?} operands in the TN form only, not {form:?}");
        }
        let (op_a, op_b) = match form {
            Form::Nt => (OP_T, OP_N),
            Form::Nn => (OP_N, OP_N),
            Form::Tn => (OP_N, OP_T),
        };
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| err("matmul descriptor", e))?;
        // SAFETY: `desc` is live; TRANSA/TRANSB take an int32 cublasOperation_t, the scale
        // modes a uint32 cublasLtMatmulMatrixScale_t.
        unsafe {
            set_attr(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_a)?;
            set_attr(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_b)?;
            if key.device_scalars {
                let mode = sys::cublasLtPointerMode_t::CUBLASLT_POINTER_MODE_DEVICE as i32;
                set_attr(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode)?;
            }
            if ab == Elem::E2M1 {
                let mode = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 as u32;
                set_attr(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode)?;
                set_attr(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode)?;
            }
        }
        let layout = |t: Elem, rows: usize, cols: usize| {
            lt::create_matrix_layout(cuda_type(t), rows as u64, cols as u64, rows as i64)
                .map_err(|e| err("matrix layout", e))
        };
        let (la, lb) = match form {
            Form::Nt => (layout(ab, k, n)?, layout(ab, k, m)?),
            Form::Nn => (layout(ab, n, k)?, layout(ab, k, m)?),
            Form::Tn => (layout(ab, n, k)?, layout(ab, m, k)?),
        };
        let lc = layout(Elem::F32, n, m)?;
        let pref = lt::create_matmul_pref().map_err(|e| err("preference", e))?;
        let ws = self.workspace_bytes as u64;
        // SAFETY: `pref` is live; MAX_WORKSPACE_BYTES takes a uint64.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )
        }
        .map_err(|e| err("preference attribute", e))?;
        // SAFETY: every descriptor above is live.
        let heur = unsafe { lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref) };
        // SAFETY: `pref` is live and no longer used.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heur = heur.map_err(|e| anyhow!("cuBLASLt has no algorithm for {ab:?} GEMM m={m} n={n} k={k}: {e:?}"))?;
        Ok(Plan { desc, la, lb, lc, algo: heur.algo })
    }

    /// y = alpha · op(x) · op(w) (+ c with `key.accumulate`: c = y in place, or another buffer
    /// of y's layout, cuBLASLt's C ≠ D) on `stream` (see the module header and
    /// [`GemmOperands`]). For E2M1, `ops.scales` are the tiled block scales of (w, x).
    pub fn gemm(&mut self, stream: cudarc::driver::sys::CUstream, key: GemmKey, ops: GemmOperands) -> Result<()> {
        let GemmOperands { w, x, c, y, alpha, scales, scalars } = ops;
        if key.m == 0 || key.n == 0 {
            return Ok(());
        }
        let beta: f32 = if key.accumulate { 1.0 } else { 0.0 };
        let (handle, ws, ws_bytes) = (self.handle, self.workspace, self.workspace_bytes);
        let plan = self.plan(key)?;
        if let Some((sw, sx)) = scales {
            let (sw, sx) = (sw as *const c_void, sx as *const c_void);
            // SAFETY: the plan's descriptor is live; the scale pointers are device pointers.
            unsafe {
                set_attr(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw)?;
                set_attr(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx)?;
            }
        }
        // Host scalars that outlive the call, or in device pointer mode (the plan's descriptor
        // says which) two f32 on the device that the stream wrote before this launch.
        let (pa, pb) = match key.device_scalars {
            true => (scalars as *const c_void, (scalars + 4) as *const c_void),
            false => (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void),
        };
        // SAFETY: w, x, c, y are device allocations of the plan's shapes (checked by the callers),
        // the workspace is owned by the device and only used on its single stream, and alpha /
        // beta are as above.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                pa,
                pb,
                w as *const c_void,
                plan.la,
                x as *const c_void,
                plan.lb,
                c as *const c_void,
                plan.lc,
                y as *mut c_void,
                plan.lc,
                &plan.algo,
                ws as *mut c_void,
                ws_bytes,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| err(&format!("{:?} GEMM m={} n={} k={}", key.ab, key.m, key.n, key.k), e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        for (_, p) in self.plans.drain() {
            // SAFETY: each descriptor was created by this Blas and is destroyed once.
            unsafe {
                let _ = lt::destroy_matrix_layout(p.la);
                let _ = lt::destroy_matrix_layout(p.lb);
                let _ = lt::destroy_matrix_layout(p.lc);
                let _ = lt::destroy_matmul_desc(p.desc);
            }
        }
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}
