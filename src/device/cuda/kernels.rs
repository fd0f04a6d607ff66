//! The kernels of csrc/kernels/, loaded from the cubins build.rs embedded for this device's
//! architecture, with one typed launcher each: the launcher takes the kernel's parameter struct
//! (csrc/include/colotrain_kernels.h, bound in ffi.rs), so what a kernel receives is spelled
//! out field by field in one place, and it picks the launch shape. Every launch's result is
//! checked; with COLOTRAIN_CUDA_SYNC=1 every launch is also followed by a synchronization, so an
//! asynchronous fault is reported at the kernel that caused it. Not yet run on a GPU.

use super::ffi;
use super::{CudaDevice, CUBINS};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// Threads per block of the row kernels of logprob.cu, sample.cu and sample_topk.cu (CT_ROW_THREADS).
pub const ROW_THREADS: u32 = 1024;
/// Threads per block of paged attention and its key tile (CT_ATT_TILE).
pub const ATT_THREADS: u32 = 128;
pub const ATT_TILE: usize = 32;
/// Threads per block of ct_prefill_attention and keys per shared tile (CT_PF_THREADS, CT_PF_KEYS).
pub const PF_THREADS: u32 = 128;
pub const PF_KEYS: usize = 32;

/// (query rows per tile, query vectors held in shared memory) of ct_prefill_attention: the
/// device functions ct_pf_rows and max(ct_pf_qv, groups) of attention_prefill.cu.
pub fn prefill_shape(head_dim: usize, groups: usize) -> (usize, usize) {
    let qv = if head_dim > 128 { 32 } else { 64 };
    ((qv / groups.max(1)).max(1), qv.max(groups))
}

/// Bytes of dynamic shared memory of ct_paged_attention (its layout comment in attention.cu).
pub fn paged_attention_smem(groups: usize, head_dim: usize) -> usize {
    (2 * groups * head_dim + groups * ATT_TILE + 3 * groups) * 4
}

/// (grid.x, bytes of dynamic shared memory) of ct_prefill_attention (its layout comment in
/// attention_prefill.cu). grid.x bounds the tiles: each sequence's last tile may be partial.
pub fn prefill_launch(num_tokens: usize, num_seqs: usize, groups: usize, head_dim: usize) -> (usize, usize) {
    let (rows, qv) = prefill_shape(head_dim, groups);
    let smem = (2 * qv * head_dim + PF_KEYS * (head_dim + 1) + PF_KEYS * head_dim + qv * (PF_KEYS + 1) + 3 * qv) * 4;
    (num_tokens / rows + num_seqs, smem)
}

const ELEMENTWISE_THREADS: u32 = 256;
const NORM_THREADS: u32 = 256;

pub(super) struct Kernels {
    rmsnorm: CudaFunction,
    rope_table: CudaFunction,
    rope: CudaFunction,
    embedding: CudaFunction,
    swiglu: CudaFunction,
    gather_rows: CudaFunction,
    add_bias: CudaFunction,
    cast: CudaFunction,
    fill_normal: CudaFunction,
    kv_write: CudaFunction,
    paged_attention: CudaFunction,
    prefill_attention: CudaFunction,
    log_softmax_gather: CudaFunction,
    sample: CudaFunction,
    sample_topk: CudaFunction,
    amax: CudaFunction,
    quant_fp8: CudaFunction,
    quant_nvfp4: CudaFunction,
    dequant: CudaFunction,
    swizzle_sf: CudaFunction,
}

impl Kernels {
    /// Loads every module's cubin for `arch` (never PTX: no JIT) and looks up every kernel.
    pub fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Kernels> {
        let mut modules = std::collections::HashMap::new();
        for c in CUBINS.iter().filter(|c| c.arch == arch) {
            let m = ctx.load_module(Ptx::from_binary(c.bytes.to_vec())).map_err(|e| {
                anyhow!(
                    "cannot load the {arch} cubin of csrc/kernels/{}.cu: {e} (a driver older than CUDA 13.0 \
                     rejects cubins of the pinned 13.0 toolchain)",
                    c.module
                )
            })?;
            modules.insert(c.module, m);
        }
        let f = |module: &str, name: &str| -> Result<CudaFunction> {
            let m = modules.get(module).ok_or_else(|| anyhow!("no {arch} cubin of csrc/kernels/{module}.cu"))?;
            m.load_function(name)
                .with_context(|| format!("kernel {name} missing from csrc/kernels/{module}.cu ({arch})"))
        };
        Ok(Kernels {
            rmsnorm: f("norm", "ct_rmsnorm")?,
            rope_table: f("rope", "ct_rope_table")?,
            rope: f("rope", "ct_rope")?,
            embedding: f("elementwise", "ct_embedding")?,
            swiglu: f("elementwise", "ct_swiglu")?,
            gather_rows: f("elementwise", "ct_gather_rows")?,
            add_bias: f("elementwise", "ct_add_bias")?,
            cast: f("elementwise", "ct_cast")?,
            fill_normal: f("elementwise", "ct_fill_normal")?,
            kv_write: f("attention", "ct_kv_write")?,
            paged_attention: f("attention", "ct_paged_attention")?,
            prefill_attention: f("attention_prefill", "ct_prefill_attention")?,
            log_softmax_gather: f("logprob", "ct_log_softmax_gather")?,
            sample: f("sample", "ct_sample")?,
            sample_topk: f("sample_topk", "ct_sample_topk")?,
            amax: f("quantize", "ct_amax")?,
            quant_fp8: f("quantize", "ct_quant_fp8")?,
            quant_nvfp4: f("quantize", "ct_quant_nvfp4")?,
            dequant: f("quantize", "ct_dequant")?,
            swizzle_sf: f("quantize", "ct_swizzle_sf")?,
        })
    }
}

fn u32_dim(n: i64, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow!("{what}: {n} is too large for one launch"))
}

/// Launch shapes and the launch itself.
impl CudaDevice {
    /// Blocks for a grid-stride loop over `n` items: enough to fill the GPU, at most one per
    /// `threads` items.
    fn stride_grid(&self, n: i64, threads: u32) -> u32 {
        let want = (n.max(1) as u64).div_ceil(threads as u64);
        want.min(self.inner.sm_count as u64 * 16).max(1) as u32
    }

    fn launch<P: Copy>(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        p: &P,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.bind()?;
        if smem > 48 * 1024 {
            // SAFETY: `f` is a live function of a loaded module; the attribute only raises the
            // dynamic shared memory limit of later launches.
            unsafe {
                cudarc::driver::result::function::set_function_attribute(
                    f.cu_function(),
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .map_err(|e| anyhow!("{name}: {smem} bytes of shared memory refused: {e}"))?;
        }
        let mut args = [p as *const P as *mut std::ffi::c_void];
        // SAFETY: every kernel of csrc/kernels takes exactly one parameter, its ct_*_params
        // struct by value, and `P` is that struct (ffi.rs, layout asserted at compile time);
        // `args` and `p` outlive the call, which copies the parameter. The pointers inside
        // `p` are device allocations kept alive by the caller's tensors until the stream
        // reaches the kernel (freed blocks are only reused by later work on the same stream).
        unsafe {
            cudarc::driver::result::launch_kernel(f.cu_function(), grid, (block, 1, 1), smem, self.stream(), &mut args)
        }
        .map_err(|e| anyhow!("launch of {name} on {} failed: {e}", self.name()))?;
        if self.inner.sync_launches {
            self.synchronize().with_context(|| format!("after {name}"))?;
        }
        Ok(())
    }

    pub fn k_rmsnorm(&self, p: ffi::ct_rmsnorm_params) -> Result<()> {
        self.launch(&self.inner.kernels.rmsnorm, "ct_rmsnorm", (p.rows as u32, 1, 1), NORM_THREADS, 0, &p)
    }

    pub fn k_rope_table(&self, p: ffi::ct_rope_table_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.half as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.rope_table, "ct_rope_table", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_rope(&self, p: ffi::ct_rope_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.heads as i64 * p.half as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.rope, "ct_rope", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_embedding(&self, p: ffi::ct_embedding_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.embedding, "ct_embedding", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_swiglu(&self, p: ffi::ct_swiglu_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.swiglu, "ct_swiglu", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_gather_rows(&self, p: ffi::ct_gather_rows_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.gather_rows, "ct_gather_rows", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_add_bias(&self, p: ffi::ct_add_bias_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.add_bias, "ct_add_bias", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_cast(&self, p: ffi::ct_cast_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.cast, "ct_cast", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_fill_normal(&self, p: ffi::ct_fill_normal_params) -> Result<()> {
        let g = self.stride_grid((p.n + 1) / 2, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.fill_normal, "ct_fill_normal", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_kv_write(&self, p: ffi::ct_kv_write_params) -> Result<()> {
        let g = self.stride_grid(p.tokens as i64 * p.kv_heads as i64 * p.head_dim as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.kv_write, "ct_kv_write", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_paged_attention(&self, p: ffi::ct_attention_params) -> Result<()> {
        if p.kv_heads <= 0 || p.heads % p.kv_heads != 0 {
            bail!("paged attention: {} query heads not a multiple of {} KV heads", p.heads, p.kv_heads);
        }
        let groups = (p.heads / p.kv_heads) as usize;
        let d = p.head_dim as usize;
        let smem = paged_attention_smem(groups, d);
        if smem > 200 * 1024 {
            bail!(
                "paged attention: {groups} query heads per KV head of dimension {d} need {smem} bytes of shared memory"
            );
        }
        let grid = (u32_dim(p.num_tokens as i64, "attention rows")?, p.kv_heads as u32, 1);
        self.launch(&self.inner.kernels.paged_attention, "ct_paged_attention", grid, ATT_THREADS, smem as u32, &p)
    }

    pub fn k_prefill_attention(&self, p: ffi::ct_attention_params) -> Result<()> {
        if p.kv_heads <= 0 || p.heads % p.kv_heads != 0 {
            bail!("prefill attention: {} query heads not a multiple of {} KV heads", p.heads, p.kv_heads);
        }
        let (groups, d) = ((p.heads / p.kv_heads) as usize, p.head_dim as usize);
        let (tiles, smem) = prefill_launch(p.num_tokens.max(0) as usize, p.num_seqs.max(0) as usize, groups, d);
        if smem > 200 * 1024 {
            bail!("prefill attention: {groups} query heads per KV head of dimension {d} need {smem} bytes of shared memory");
        }
        let grid = (u32_dim(tiles as i64, "prefill attention tiles")?, p.kv_heads as u32, 1);
        self.launch(&self.inner.kernels.prefill_attention, "ct_prefill_attention", grid, PF_THREADS, smem as u32, &p)
    }

    pub fn k_log_softmax_gather(&self, p: ffi::ct_logprob_params) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "log-prob rows")?, 1, 1);
        self.launch(&self.inner.kernels.log_softmax_gather, "ct_log_softmax_gather", grid, ROW_THREADS, 0, &p)
    }

    pub fn k_sample(&self, p: ffi::ct_sample_params) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "sampled rows")?, 1, 1);
        self.launch(&self.inner.kernels.sample, "ct_sample", grid, ROW_THREADS, 0, &p)
    }

    pub fn k_sample_topk(&self, p: ffi::ct_sample_params) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "sampling rows")?, 1, 1);
        self.launch(&self.inner.kernels.sample_topk, "ct_sample_topk", grid, ROW_THREADS, 0, &p)
    }

    pub fn k_amax(&self, p: ffi::ct_amax_params) -> Result<()> {
        let items = if p.rht != 0 { p.n / 16 } else { p.n };
        let g = self.stride_grid(items, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.amax, "ct_amax", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_quant_fp8(&self, p: ffi::ct_quant_fp8_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.quant_fp8, "ct_quant_fp8", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_quant_nvfp4(&self, p: ffi::ct_quant_nvfp4_params) -> Result<()> {
        if p.n % 16 != 0 {
            bail!("NVFP4 quantization of {} values: not a multiple of 16", p.n);
        }
        let g = self.stride_grid(p.n / 16, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.quant_nvfp4, "ct_quant_nvfp4", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_dequant(&self, p: ffi::ct_dequant_params) -> Result<()> {
        let items = if p.format == ffi::CT_FORMAT_NVFP4 { p.n / 16 } else { p.n };
        let g = self.stride_grid(items, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.dequant, "ct_dequant", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }

    pub fn k_swizzle_sf(&self, p: ffi::ct_swizzle_sf_params) -> Result<()> {
        let g = self.stride_grid(p.padded_rows as i64 * p.padded_cols as i64, ELEMENTWISE_THREADS);
        self.launch(&self.inner.kernels.swizzle_sf, "ct_swizzle_sf", (g, 1, 1), ELEMENTWISE_THREADS, 0, &p)
    }
}
