//! The kernels of csrc/kernels/ ([`Kernel`]: on a GPU loaded from the cubins build.rs embedded
//! for its architecture, in the simulator compiled for the host), with one typed launcher
//! each: the launcher takes the kernel's parameter struct
//! (csrc/include/colotrain_kernels.h, bound in ffi.rs), so what a kernel receives is spelled
//! out field by field in one place, and it picks the launch shape. Every launch's result is
//! checked; with COLOTRAIN_CUDA_SYNC=1 every launch is also followed by a synchronization, so an
//! asynchronous fault is reported at the kernel that caused it. Not yet run on a GPU.

use super::cost::{
    self,
    AttnPart::{self, BwdDkv, BwdDq},
    Charge,
};
use super::ffi;
use super::CudaDevice;
use anyhow::{anyhow, bail, Context, Result};

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

/// Whether ct_prefill_attention_tc takes `groups` query heads per KV head of `head_dim`.
pub fn prefill_tc_fits(groups: usize, head_dim: usize) -> bool {
    (1..=TC_Q as usize).contains(&groups) && head_dim % 16 == 0 && (16..=TC_MAX_D).contains(&head_dim)
}

/// Query rows per tile of ct_prefill_attention_tc: its 64 mma rows hold rows × groups vectors.
pub fn prefill_tc_rows(groups: usize) -> usize {
    (TC_Q as usize / groups.max(1)).max(1)
}

const ELEMENTWISE_THREADS: u32 = 256;
const NORM_THREADS: u32 = 256;
/// ct_attention_merge's block: threads over head_dim.
const MERGE_THREADS: u32 = 128;
/// A column sum's block: 128 columns (one chunk of rows each).
const COLUMN_THREADS: u32 = 128;
const OPTIM_THREADS: u32 = 256;
/// Threads per block of attention_train.cu (CT_AT_TILE: keys per tile).
pub const AT_TILE: u32 = 128;
/// Query rows per block of the tensor-core forward (CT_TC_Q), and its largest head_dim
/// (CT_TC_MAX_D; a multiple of 16 below it).
pub const TC_Q: i64 = 64;
pub const TC_MAX_D: usize = 128;
/// ct_gemm_w4a4 (gemm_w4a4.cu): threads per block (CT_W4A4_WARPS warps), output columns per
/// block (CT_W4A4_COLS), the most activation rows (16·CT_W4A4_MT) and K's step (CT_W4A4_CHUNK).
pub const W4A4_THREADS: u32 = 8 * 32;
pub const W4A4_COLS: usize = 32;
pub const W4A4_MAX_M: usize = 64;
pub const W4A4_K_STEP: usize = 128;
/// The most splits of K a ct_gemm_w4a4 launch takes ([`CudaDevice::w4a4_splits`]).
pub const W4A4_MAX_SPLITS: usize = 16;
/// Threads per block of lm_head.cu's row kernels (CT_LM_THREADS).
pub const LM_THREADS: u32 = 1024;

/// Every kernel of csrc/kernels, in the order of csrc/hostemu/sim.cpp's `ct_sim_launch` ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Rmsnorm,
    RopeTable,
    Rope,
    Embedding,
    Swiglu,
    GatherRows,
    AddBias,
    Cast,
    FillNormal,
    KvWrite,
    PagedAttention,
    PrefillAttention,
    LogSoftmaxGather,
    Sample,
    SampleTopk,
    Amax,
    QuantFp8,
    QuantNvfp4,
    Dequant,
    SwizzleSf,
    Optim,
    SumSq,
    SumSqFinish,
    ScatterAddRows,
    LmStats,
    LmDz,
    RmsnormTrain,
    RmsnormBwd,
    RmsnormDw,
    SwigluBwd,
    RopeBwd,
    ColSum,
    EmbedBwd,
    AttnFwd,
    AttnBwdDq,
    AttnBwdDkv,
    AttnFwdTc,
    AttnBwdDqTc,
    AttnBwdDkvTc,
    Nvfp4ScaleOut,
    GemmW4a4,
    PrefillAttentionTc,
    AttentionMerge,
    GemmW4a4Merge,
    QkRopeKv,
}

impl Kernel {
    pub const ALL: [Kernel; 45] = [
        Kernel::Rmsnorm,
        Kernel::RopeTable,
        Kernel::Rope,
        Kernel::Embedding,
        Kernel::Swiglu,
        Kernel::GatherRows,
        Kernel::AddBias,
        Kernel::Cast,
        Kernel::FillNormal,
        Kernel::KvWrite,
        Kernel::PagedAttention,
        Kernel::PrefillAttention,
        Kernel::LogSoftmaxGather,
        Kernel::Sample,
        Kernel::SampleTopk,
        Kernel::Amax,
        Kernel::QuantFp8,
        Kernel::QuantNvfp4,
        Kernel::Dequant,
        Kernel::SwizzleSf,
        Kernel::Optim,
        Kernel::SumSq,
        Kernel::SumSqFinish,
        Kernel::ScatterAddRows,
        Kernel::LmStats,
        Kernel::LmDz,
        Kernel::RmsnormTrain,
        Kernel::RmsnormBwd,
        Kernel::RmsnormDw,
        Kernel::SwigluBwd,
        Kernel::RopeBwd,
        Kernel::ColSum,
        Kernel::EmbedBwd,
        Kernel::AttnFwd,
        Kernel::AttnBwdDq,
        Kernel::AttnBwdDkv,
        Kernel::AttnFwdTc,
        Kernel::AttnBwdDqTc,
        Kernel::AttnBwdDkvTc,
        Kernel::Nvfp4ScaleOut,
        Kernel::GemmW4a4,
        Kernel::PrefillAttentionTc,
        Kernel::AttentionMerge,
        Kernel::GemmW4a4Merge,
        Kernel::QkRopeKv,
    ];

    /// (the kernel's name, the csrc/kernels/ file that defines it, without `.cu`).
    pub fn symbol(self) -> (&'static str, &'static str) {
        match self {
            Kernel::Rmsnorm => ("ct_rmsnorm", "norm"),
            Kernel::RopeTable => ("ct_rope_table", "rope"),
            Kernel::Rope => ("ct_rope", "rope"),
            Kernel::Embedding => ("ct_embedding", "elementwise"),
            Kernel::Swiglu => ("ct_swiglu", "elementwise"),
            Kernel::GatherRows => ("ct_gather_rows", "elementwise"),
            Kernel::AddBias => ("ct_add_bias", "elementwise"),
            Kernel::Cast => ("ct_cast", "elementwise"),
            Kernel::FillNormal => ("ct_fill_normal", "elementwise"),
            Kernel::KvWrite => ("ct_kv_write", "attention"),
            Kernel::PagedAttention => ("ct_paged_attention", "attention"),
            Kernel::PrefillAttention => ("ct_prefill_attention", "attention_prefill"),
            Kernel::LogSoftmaxGather => ("ct_log_softmax_gather", "logprob"),
            Kernel::Sample => ("ct_sample", "sample"),
            Kernel::SampleTopk => ("ct_sample_topk", "sample_topk"),
            Kernel::Amax => ("ct_amax", "quantize"),
            Kernel::QuantFp8 => ("ct_quant_fp8", "quantize"),
            Kernel::QuantNvfp4 => ("ct_quant_nvfp4", "quantize"),
            Kernel::Dequant => ("ct_dequant", "quantize"),
            Kernel::SwizzleSf => ("ct_swizzle_sf", "quantize"),
            Kernel::Optim => ("ct_optim", "optimizer"),
            Kernel::SumSq => ("ct_sum_sq", "optimizer"),
            Kernel::SumSqFinish => ("ct_sum_sq_finish", "optimizer"),
            Kernel::ScatterAddRows => ("ct_scatter_add_rows", "elementwise"),
            Kernel::LmStats => ("ct_lm_stats", "lm_head"),
            Kernel::LmDz => ("ct_lm_dz", "lm_head"),
            Kernel::RmsnormTrain => ("ct_rmsnorm_train", "grad"),
            Kernel::RmsnormBwd => ("ct_rmsnorm_bwd", "grad"),
            Kernel::RmsnormDw => ("ct_rmsnorm_dw", "grad"),
            Kernel::SwigluBwd => ("ct_swiglu_bwd", "grad"),
            Kernel::RopeBwd => ("ct_rope_bwd", "grad"),
            Kernel::ColSum => ("ct_col_sum", "grad"),
            Kernel::EmbedBwd => ("ct_embed_bwd", "grad"),
            Kernel::AttnFwd => ("ct_attn_fwd", "attention_train"),
            Kernel::AttnBwdDq => ("ct_attn_bwd_dq", "attention_train"),
            Kernel::AttnBwdDkv => ("ct_attn_bwd_dkv", "attention_train"),
            Kernel::AttnFwdTc => ("ct_attn_fwd_tc", "attention_train"),
            Kernel::AttnBwdDqTc => ("ct_attn_bwd_dq_tc", "attention_train"),
            Kernel::AttnBwdDkvTc => ("ct_attn_bwd_dkv_tc", "attention_train"),
            Kernel::Nvfp4ScaleOut => ("ct_nvfp4_scale_out", "elementwise"),
            Kernel::GemmW4a4 => ("ct_gemm_w4a4", "gemm_w4a4"),
            Kernel::PrefillAttentionTc => ("ct_prefill_attention_tc", "attention_prefill"),
            Kernel::AttentionMerge => ("ct_attention_merge", "attention"),
            Kernel::GemmW4a4Merge => ("ct_gemm_w4a4_merge", "gemm_w4a4"),
            Kernel::QkRopeKv => ("ct_qk_rope_kv", "attention"),
        }
    }

    pub fn name(self) -> &'static str {
        self.symbol().0
    }

    /// The smallest element (bytes) any pointer parameter of the kernel is read or written
    /// as: the alignment the simulator requires of every device pointer in its parameters (a
    /// misaligned load faults on a GPU). Coarse by design: a kernel that reads BF16 weights
    /// and f32 rows is held to 2 bytes for both.
    pub fn ptr_align(self) -> u64 {
        use Kernel::*;
        match self {
            KvWrite | PagedAttention | PrefillAttention | QuantFp8 | QuantNvfp4 | Dequant | SwizzleSf | GemmW4a4 => 1,
            QkRopeKv => 1,
            Rmsnorm | Embedding | AddBias | Cast | FillNormal | Amax | Optim | PrefillAttentionTc | Swiglu => 2,
            AttentionMerge => 2,
            RopeTable | Rope | GatherRows | LogSoftmaxGather | Sample | SampleTopk | SumSq | SumSqFinish
            | ScatterAddRows | LmStats | LmDz | Nvfp4ScaleOut => 4,
            RmsnormTrain | SwigluBwd => 2,
            RmsnormBwd | RmsnormDw | RopeBwd | ColSum | EmbedBwd | GemmW4a4Merge => 4,
            AttnFwd | AttnBwdDq | AttnBwdDkv | AttnFwdTc | AttnBwdDqTc | AttnBwdDkvTc => 4,
        }
    }

    /// The index of the kernel in [`Kernel::ALL`] (and `ct_sim_launch`'s id).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Whether ct_gemm_w4a4 takes an (m, n, k) problem whose code tensors start at `codes`: at most
/// W4A4_MAX_M rows, whole blocks of columns and of K, rows of codes on 16-byte boundaries.
pub fn w4a4_fits(m: usize, n: usize, k: usize, codes: &[u64]) -> bool {
    (1..=W4A4_MAX_M).contains(&m) && w4a4_takes(n, k) && codes.iter().all(|&c| c % 16 == 0)
}

/// Whether ct_gemm_w4a4 takes an (n, K) weight at all (whole blocks of columns and of K): what
/// an engine decides what to keep by (`Kept::on`), before any activation exists.
pub fn w4a4_takes(n: usize, k: usize) -> bool {
    n % W4A4_COLS == 0 && k % W4A4_K_STEP == 0 && n.max(k) <= i32::MAX as usize
}

/// The grid of a column sum's pass over `rows` rows in chunks of `chunk_rows` (one block of
/// COLUMN_THREADS per 128 columns and chunk), and its chunks: one chunk exactly when there is
/// no partial buffer (the pass adds onto the total itself), see `ops::reduction_chunk_rows`.
fn column_grid(rows: i32, cols: i32, chunk_rows: i32, direct: bool, what: &str) -> Result<((u32, u32, u32), i32)> {
    if chunk_rows <= 0 {
        bail!("{what}: chunks of {chunk_rows} rows");
    }
    let chunks = (rows.max(1) as u32).div_ceil(chunk_rows as u32) as i32;
    if chunks > 65535 {
        bail!("{what}: {chunks} chunks of {chunk_rows} rows, more than a grid's 65,535");
    }
    if direct != (chunks == 1) {
        bail!(
            "{what}: {rows} rows in {chunks} chunks {} a buffer for their sums",
            if direct { "without" } else { "with" }
        );
    }
    let blocks = u32_dim((cols.max(1) as u32).div_ceil(COLUMN_THREADS) as i64, "column blocks")?;
    Ok(((blocks, u32_dim(chunks as i64, "chunks")?, 1), chunks))
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
        want.min(self.sm_count() as u64 * 16).max(1) as u32
    }

    /// Launches `k` and adds its declared cost (`cost.rs`) to the device's ledger.
    fn launch<P: Copy>(
        &self,
        k: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        p: &P,
        charge: impl Into<Charge>,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let drv = self.driver();
        drv.bind()?;
        if smem > 48 * 1024 {
            drv.set_max_dynamic_smem(k, smem)
                .map_err(|e| anyhow!("{}: {smem} bytes of shared memory refused: {e}", k.name()))?;
        }
        // Every kernel of csrc/kernels takes exactly one parameter, its ct_*_params struct by
        // value, and `P` is that struct (ffi.rs, layout asserted at compile time). The driver
        // copies it before returning. The pointers inside `p` are device allocations kept alive
        // by the caller's tensors until the stream reaches the kernel (freed blocks are only
        // reused by later work on the same stream).
        let params = p as *const P as *const std::ffi::c_void;
        let ptrs = super::ptr_fields::pointer_offsets(std::any::type_name::<P>());
        drv.launch(&super::driver::Launch { k, grid, block, smem, params, size: std::mem::size_of::<P>(), ptrs })
            .map_err(|e| anyhow!("launch of {} on {} failed: {e:#}", k.name(), self.name()))?;
        // The ledger charges a grid of fewer blocks than SMs at their share of the GPU.
        let blocks = grid.0 as u64 * grid.1 as u64 * grid.2 as u64;
        match charge.into() {
            Charge { base, per_key: None } => self.record(k.name(), base.on_blocks(blocks)),
            Charge { base, per_key: Some((c, keys)) } => {
                self.record_keyed(k.name(), base.on_blocks(blocks), c.on_blocks(blocks), keys)
            }
        }
        // (Not while capturing: a capture may not synchronize; the replay is synchronized whole.)
        if self.sync_launches() && !self.capturing() {
            self.synchronize().with_context(|| format!("after {}", k.name()))?;
        }
        Ok(())
    }

    pub fn k_rmsnorm(&self, p: ffi::ct_rmsnorm_params) -> Result<()> {
        self.launch(Kernel::Rmsnorm, (p.rows as u32, 1, 1), NORM_THREADS, 0, &p, cost::rmsnorm(&p))
    }

    pub fn k_rope_table(&self, p: ffi::ct_rope_table_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.half as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::RopeTable, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::rope_table(&p))
    }

    pub fn k_rope(&self, p: ffi::ct_rope_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.heads as i64 * p.half as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::Rope, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::rope(&p))
    }

    pub fn k_embedding(&self, p: ffi::ct_embedding_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::Embedding, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::embedding(&p))
    }

    pub fn k_swiglu(&self, p: ffi::ct_swiglu_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(Kernel::Swiglu, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::swiglu(&p))
    }

    pub fn k_gather_rows(&self, p: ffi::ct_gather_rows_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::GatherRows, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::gather_rows(&p))
    }

    pub fn k_add_bias(&self, p: ffi::ct_add_bias_params) -> Result<()> {
        let cols = p.cols0 as i64 + p.cols1 as i64 + p.cols2 as i64;
        let g = self.stride_grid(p.rows as i64 * cols, ELEMENTWISE_THREADS);
        self.launch(Kernel::AddBias, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::add_bias(&p))
    }

    pub fn k_nvfp4_scale_out(&self, p: ffi::ct_nvfp4_scale_out_params) -> Result<()> {
        if !p.scalars.is_null() {
            if p.per_row != 0 || p.rht != 0 {
                bail!("ct_nvfp4_scale_out: a GEMM's alpha is one value (no per-row scales, no rotation back)");
            }
            return self.launch(Kernel::Nvfp4ScaleOut, (1, 1, 1), 32, 0, &p, cost::nvfp4_scale_out(&p));
        }
        let n = p.rows as i64 * p.cols as i64;
        if p.rht != 0 && p.cols % 16 != 0 {
            bail!("ct_nvfp4_scale_out: the inverse RHT needs 16-column blocks, got {} columns", p.cols);
        }
        let g = self.stride_grid(if p.rht != 0 { n / 16 } else { n }, ELEMENTWISE_THREADS);
        self.launch(Kernel::Nvfp4ScaleOut, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::nvfp4_scale_out(&p))
    }

    pub fn k_cast(&self, p: ffi::ct_cast_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(Kernel::Cast, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::cast(&p))
    }

    pub fn k_fill_normal(&self, p: ffi::ct_fill_normal_params) -> Result<()> {
        let g = self.stride_grid((p.n + 1) / 2, ELEMENTWISE_THREADS);
        self.launch(Kernel::FillNormal, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::fill_normal(&p))
    }

    pub fn k_kv_write(&self, p: ffi::ct_kv_write_params) -> Result<()> {
        let g = self.stride_grid(p.tokens as i64 * p.kv_heads as i64 * p.head_dim as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::KvWrite, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::kv_write(&p))
    }

    /// ct_qk_rope_kv: one block of NORM_THREADS per (token, query or KV head).
    pub fn k_qk_rope_kv(&self, p: ffi::ct_qk_rope_kv_params) -> Result<()> {
        let (d, heads, kv_heads) = (p.kv.head_dim, p.heads, p.kv.kv_heads);
        if d <= 0 || d % 2 != 0 || heads < 0 || kv_heads < 0 {
            bail!("ct_qk_rope_kv: head dimension {d} (even and positive), {heads} query and {kv_heads} KV heads");
        }
        let grid = (u32_dim(p.kv.tokens as i64, "tokens")?, u32_dim(heads as i64 + kv_heads as i64, "heads")?, 1);
        self.launch(Kernel::QkRopeKv, grid, NORM_THREADS, 0, &p, cost::qk_rope_kv(&p))
    }

    /// `keys`: the cached positions the rows attend, summed over the rows (the ledger's cost).
    pub fn k_paged_attention(&self, p: ffi::ct_attention_params, keys: u64) -> Result<()> {
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
        if p.splits < 1 || (p.splits > 1 && (p.part_acc.is_null() || p.part_ml.is_null())) {
            bail!("paged attention: {} splits of the keys (more than one needs buffers for the parts)", p.splits);
        }
        if p.kv_heads as i64 * p.splits as i64 > 65535 {
            bail!("paged attention: {} KV heads × {} splits, more than a grid's 65,535", p.kv_heads, p.splits);
        }
        let grid = (
            u32_dim(p.num_tokens as i64, "attention rows")?,
            u32_dim(p.kv_heads as i64 * p.splits as i64, "KV heads × splits")?,
            1,
        );
        self.launch(Kernel::PagedAttention, grid, ATT_THREADS, smem as u32, &p, cost::paged_attention(&p, keys))?;
        if p.splits == 1 {
            return Ok(());
        }
        let m = ffi::ct_attention_merge_params {
            part_acc: p.part_acc,
            part_ml: p.part_ml,
            out: p.out,
            out_dtype: p.out_dtype,
            num_tokens: p.num_tokens,
            heads: p.heads,
            head_dim: p.head_dim,
            splits: p.splits,
        };
        let grid = (u32_dim(p.num_tokens as i64, "attention rows")?, p.heads as u32, 1);
        self.launch(Kernel::AttentionMerge, grid, MERGE_THREADS, 0, &m, cost::attention_merge(&m))
    }

    /// How many blocks ct_paged_attention splits each decode row's keys over: 1 when its
    /// (row, KV head) blocks fill the SMs, else enough for one full wave, at most ⌈max_keys /
    /// 256⌉ (`max_keys`: what a row may attend, the block tables' width) and at most 16.
    pub fn decode_splits(&self, rows: usize, kv_heads: usize, max_keys: usize) -> usize {
        let (blocks, sms) = ((rows * kv_heads).max(1), self.sm_count() as usize);
        if blocks >= sms {
            return 1;
        }
        sms.div_ceil(blocks).min(max_keys.div_ceil(256)).clamp(1, 16)
    }

    /// `keys`: as [`CudaDevice::k_paged_attention`]'s.
    pub fn k_prefill_attention(&self, p: ffi::ct_attention_params, keys: u64) -> Result<()> {
        if p.kv_heads <= 0 || p.heads % p.kv_heads != 0 {
            bail!("prefill attention: {} query heads not a multiple of {} KV heads", p.heads, p.kv_heads);
        }
        let (groups, d) = ((p.heads / p.kv_heads) as usize, p.head_dim as usize);
        let (tiles, smem) = prefill_launch(p.num_tokens.max(0) as usize, p.num_seqs.max(0) as usize, groups, d);
        if smem > 200 * 1024 {
            bail!("prefill attention: {groups} query heads per KV head of dimension {d} need {smem} bytes of shared memory");
        }
        let grid = (u32_dim(tiles as i64, "prefill attention tiles")?, p.kv_heads as u32, 1);
        let rows_per_tile = prefill_shape(d, groups).0;
        self.launch(
            Kernel::PrefillAttention,
            grid,
            PF_THREADS,
            smem as u32,
            &p,
            cost::prefill_attention(&p, keys, rows_per_tile),
        )
    }

    /// The tensor-core prefill of a BF16 cache (ct_prefill_attention_tc): grid
    /// (num_tokens / R + num_seqs, kv_heads) of 4 warps, R = max(1, TC_Q / groups) rows a tile.
    /// `keys`: as [`CudaDevice::k_paged_attention`]'s.
    pub fn k_prefill_attention_tc(&self, p: ffi::ct_attention_params, keys: u64) -> Result<()> {
        if p.kv_heads <= 0 || p.heads % p.kv_heads != 0 {
            bail!("prefill attention: {} query heads not a multiple of {} KV heads", p.heads, p.kv_heads);
        }
        let (groups, d) = ((p.heads / p.kv_heads) as usize, p.head_dim as usize);
        if !prefill_tc_fits(groups, d) || p.dtype != ffi::CT_DTYPE_BF16 {
            bail!(
                "tensor-core prefill attention: a BF16 cache, head_dim a multiple of 16 up to {TC_MAX_D} and at most {TC_Q} query heads per KV head (got {groups} of dimension {d}, cache dtype code {})",
                p.dtype
            );
        }
        let rows = prefill_tc_rows(groups);
        let tiles = p.num_tokens.max(0) as usize / rows + p.num_seqs.max(0) as usize;
        let grid = (u32_dim(tiles as i64, "prefill attention tiles")?, p.kv_heads as u32, 1);
        self.launch(Kernel::PrefillAttentionTc, grid, 128, 0, &p, cost::prefill_attention_tc(&p, keys, rows))
    }

    pub fn k_log_softmax_gather(&self, p: ffi::ct_logprob_params) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "log-prob rows")?, 1, 1);
        self.launch(Kernel::LogSoftmaxGather, grid, ROW_THREADS, 0, &p, cost::log_softmax_gather(&p))
    }

    /// `drawn`: the rows this kernel draws (the others are ct_sample_topk's), for the ledger.
    pub fn k_sample(&self, p: ffi::ct_sample_params, drawn: usize) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "sampled rows")?, 1, 1);
        self.launch(Kernel::Sample, grid, ROW_THREADS, 0, &p, cost::sample(&p, drawn))
    }

    /// `drawn`: the truncated rows (top-k / top-p), which this kernel draws.
    pub fn k_sample_topk(&self, p: ffi::ct_sample_params, drawn: usize) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "sampling rows")?, 1, 1);
        self.launch(Kernel::SampleTopk, grid, ROW_THREADS, 0, &p, cost::sample(&p, drawn))
    }

    pub fn k_amax(&self, p: ffi::ct_amax_params) -> Result<()> {
        let items = if p.rht != 0 { p.n / 16 } else { p.n };
        let g = self.stride_grid(items, ELEMENTWISE_THREADS);
        self.launch(Kernel::Amax, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::amax(&p))
    }

    pub fn k_quant_fp8(&self, p: ffi::ct_quant_fp8_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(Kernel::QuantFp8, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::quant_fp8(&p))
    }

    pub fn k_quant_nvfp4(&self, p: ffi::ct_quant_nvfp4_params) -> Result<()> {
        if p.n % 16 != 0 {
            bail!("NVFP4 quantization of {} values: not a multiple of 16", p.n);
        }
        let g = self.stride_grid(p.n / 16, ELEMENTWISE_THREADS);
        self.launch(Kernel::QuantNvfp4, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::quant_nvfp4(&p))
    }

    pub fn k_dequant(&self, p: ffi::ct_dequant_params) -> Result<()> {
        let items = if p.format == ffi::CT_FORMAT_NVFP4 { p.n / 16 } else { p.n };
        let g = self.stride_grid(items, ELEMENTWISE_THREADS);
        self.launch(Kernel::Dequant, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::dequant(&p))
    }

    /// ct_gemm_w4a4: one block per W4A4_COLS output columns and split of K (`p.splits`, from
    /// [`CudaDevice::w4a4_splits`]; more than one needs `p.part` and is followed by
    /// ct_gemm_w4a4_merge). Refuses the shapes and alignments the kernel does not take (the
    /// caller checks [`w4a4_fits`] first).
    pub fn k_gemm_w4a4(&self, p: ffi::ct_gemm_w4a4_params) -> Result<()> {
        let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
        if !w4a4_fits(m, n, k, &[p.a_codes as u64, p.w_codes as u64]) {
            bail!("ct_gemm_w4a4: (m, n, k) = ({m}, {n}, {k}) or its code rows do not fit the kernel");
        }
        if !(1..=W4A4_MAX_SPLITS as i32).contains(&p.splits) || (p.splits > 1 && p.part.is_null()) {
            bail!(
                "ct_gemm_w4a4: {} splits of K (1 to {W4A4_MAX_SPLITS}, more than one with a buffer for their sums)",
                p.splits
            );
        }
        let g = u32_dim((n / W4A4_COLS) as i64, "ct_gemm_w4a4 blocks")?;
        self.launch(Kernel::GemmW4a4, (g, p.splits as u32, 1), W4A4_THREADS, 0, &p, cost::gemm_w4a4(&p))?;
        if p.splits == 1 {
            return Ok(());
        }
        let g = self.stride_grid(m as i64 * n as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::GemmW4a4Merge, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::gemm_w4a4_merge(&p))
    }

    /// How many splits of K ct_gemm_w4a4 takes for an (n, K) weight: 1 when its n / W4A4_COLS
    /// blocks fill the SMs, else enough for one full wave, each split at least one 128-value
    /// chunk per warp, at most W4A4_MAX_SPLITS.
    pub fn w4a4_splits(&self, n: usize, k: usize) -> usize {
        let (blocks, sms) = ((n / W4A4_COLS).max(1), self.sm_count() as usize);
        if blocks >= sms {
            return 1;
        }
        let per_warp = (k / W4A4_K_STEP) / (W4A4_THREADS as usize / 32);
        sms.div_ceil(blocks).min(per_warp).clamp(1, W4A4_MAX_SPLITS)
    }

    pub fn k_swizzle_sf(&self, p: ffi::ct_swizzle_sf_params) -> Result<()> {
        let g = self.stride_grid(p.padded_rows as i64 * p.padded_cols as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::SwizzleSf, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::swizzle_sf(&p))
    }

    /// One block per chunk of the table (`p.num_chunks`), which covers `elems` values.
    pub fn k_optim(&self, p: ffi::ct_optim_params, elems: usize) -> Result<()> {
        let grid = (u32_dim(p.num_chunks as i64, "optimizer chunks")?, 1, 1);
        self.launch(Kernel::Optim, grid, OPTIM_THREADS, 0, &p, cost::optim(&p, elems))
    }

    /// The squared norm: one block per `per_block` elements into `partial`, then one block
    /// summing the partials into `out`.
    pub fn k_sum_sq(&self, p: ffi::ct_sum_sq_params) -> Result<()> {
        let grid = (u32_dim(p.blocks as i64, "squared-norm blocks")?, 1, 1);
        self.launch(Kernel::SumSq, grid, OPTIM_THREADS, 0, &p, cost::sum_sq(&p))?;
        self.launch(Kernel::SumSqFinish, (1, 1, 1), OPTIM_THREADS, 0, &p, cost::sum_sq_finish(&p))
    }

    pub fn k_scatter_add_rows(&self, p: ffi::ct_scatter_add_rows_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::ScatterAddRows, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::scatter_add_rows(&p))
    }

    /// One block of LM_THREADS per row of the chunk.
    pub fn k_lm_stats(&self, p: ffi::ct_lm_params) -> Result<()> {
        let grid = (u32_dim(p.rows as i64, "loss rows")?, 1, 1);
        self.launch(Kernel::LmStats, grid, LM_THREADS, 0, &p, cost::lm_stats(&p))
    }

    /// One block of LM_THREADS per row of the chunk.
    pub fn k_lm_dz(&self, p: ffi::ct_lm_params) -> Result<()> {
        if !p.dz_bf16.is_null() && p.center_k > 0 {
            bail!("ct_lm_dz: a BF16 dz leaves out the centering's fix-ups (store dz in f32 with centering)");
        }
        let grid = (u32_dim(p.rows as i64, "loss rows")?, 1, 1);
        self.launch(Kernel::LmDz, grid, LM_THREADS, 0, &p, cost::lm_dz(&p))
    }

    /// One block of NORM_THREADS per row.
    pub fn k_rmsnorm_train(&self, p: ffi::ct_rmsnorm_train_params) -> Result<()> {
        self.launch(
            Kernel::RmsnormTrain,
            (u32_dim(p.rows as i64, "RMSNorm rows")?, 1, 1),
            NORM_THREADS,
            0,
            &p,
            cost::rmsnorm_train(&p),
        )
    }

    /// dx: one block per row; dw: the chunked column sum (`column_grid`), its chunks' sums
    /// (partial) then added onto dw by `ct_col_sum`.
    pub fn k_rmsnorm_bwd(&self, p: ffi::ct_rmsnorm_bwd_params) -> Result<()> {
        self.launch(
            Kernel::RmsnormBwd,
            (u32_dim(p.rows as i64, "RMSNorm rows")?, 1, 1),
            NORM_THREADS,
            0,
            &p,
            cost::rmsnorm_bwd(&p),
        )?;
        let (grid, chunks) = column_grid(p.rows, p.cols, p.chunk_rows, p.partial.is_null(), "RMSNorm dw")?;
        self.launch(Kernel::RmsnormDw, grid, COLUMN_THREADS, 0, &p, cost::rmsnorm_dw(&p))?;
        self.add_chunks(p.partial, p.dw, chunks, p.cols)
    }

    /// The second pass of a chunked column sum: out (cols) += the `chunks` rows of partial in
    /// order (nothing for one chunk, which the first pass added onto out itself).
    fn add_chunks(&self, partial: *mut f32, out: *mut f32, chunks: i32, cols: i32) -> Result<()> {
        if partial.is_null() {
            return Ok(());
        }
        self.k_col_sum(ffi::ct_col_sum_params {
            x: partial,
            out,
            partial: std::ptr::null_mut(),
            rows: chunks,
            cols,
            chunk_rows: chunks,
        })
    }

    pub fn k_swiglu_bwd(&self, p: ffi::ct_swiglu_bwd_params) -> Result<()> {
        let g = self.stride_grid(p.n, ELEMENTWISE_THREADS);
        self.launch(Kernel::SwigluBwd, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::swiglu_bwd(&p))
    }

    pub fn k_rope_bwd(&self, p: ffi::ct_rope_params) -> Result<()> {
        let g = self.stride_grid(p.rows as i64 * p.heads as i64 * p.half as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::RopeBwd, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::rope(&p))
    }

    /// One thread per (column, chunk) (`column_grid`); with partial, then the chunks' sums
    /// onto out.
    pub fn k_col_sum(&self, p: ffi::ct_col_sum_params) -> Result<()> {
        let (grid, chunks) = column_grid(p.rows, p.cols, p.chunk_rows, p.partial.is_null(), "column sum")?;
        self.launch(Kernel::ColSum, grid, COLUMN_THREADS, 0, &p, cost::col_sum(&p))?;
        self.add_chunks(p.partial, p.out, chunks, p.cols)
    }

    /// One thread per column.
    pub fn k_embed_bwd(&self, p: ffi::ct_embed_bwd_params) -> Result<()> {
        let g = self.stride_grid(p.cols as i64, ELEMENTWISE_THREADS);
        self.launch(Kernel::EmbedBwd, (g, 1, 1), ELEMENTWISE_THREADS, 0, &p, cost::embed_bwd(&p))
    }

    /// Grid (tokens, heads) of AT_TILE threads. `pairs`: the causal (query, key) pairs of the
    /// packed sequences, Σ L(L+1)/2 (the ledger's cost; so for every training attention launcher).
    pub fn k_attn_fwd(&self, p: ffi::ct_attn_train_params, pairs: u64) -> Result<()> {
        let grid = (u32_dim(p.tokens as i64, "attention rows")?, u32_dim(p.heads as i64, "heads")?, 1);
        self.launch(Kernel::AttnFwd, grid, AT_TILE, 0, &p, cost::attn_train(&p, pairs, AttnPart::Fwd, false))
    }

    /// The tensor-core forward: grid (⌈tokens / TC_Q⌉, heads) of 4 warps.
    pub fn k_attn_fwd_tc(&self, p: ffi::ct_attn_train_params, pairs: u64) -> Result<()> {
        let tiles = (p.tokens as i64 + TC_Q - 1) / TC_Q;
        let grid = (u32_dim(tiles, "attention row tiles")?, u32_dim(p.heads as i64, "heads")?, 1);
        self.launch(Kernel::AttnFwdTc, grid, 128, 0, &p, cost::attn_train(&p, pairs, AttnPart::Fwd, true))
    }

    /// The tensor-core backward: dq and delta (grid ⌈tokens / TC_Q⌉ × heads), then dk and dv
    /// (grid ⌈tokens / TC_Q⌉ × KV heads), 4 warps each.
    pub fn k_attn_bwd_tc(&self, p: ffi::ct_attn_train_params, pairs: u64) -> Result<()> {
        let tiles = u32_dim((p.tokens as i64 + TC_Q - 1) / TC_Q, "attention row tiles")?;
        let (dq, dkv) = (cost::attn_train(&p, pairs, BwdDq, true), cost::attn_train(&p, pairs, BwdDkv, true));
        self.launch(Kernel::AttnBwdDqTc, (tiles, u32_dim(p.heads as i64, "heads")?, 1), 128, 0, &p, dq)?;
        self.launch(Kernel::AttnBwdDkvTc, (tiles, u32_dim(p.kv_heads as i64, "KV heads")?, 1), 128, 0, &p, dkv)
    }

    /// dq and delta (grid tokens × heads), then dk and dv (grid tokens × KV heads).
    pub fn k_attn_bwd(&self, p: ffi::ct_attn_train_params, pairs: u64) -> Result<()> {
        let rows = u32_dim(p.tokens as i64, "attention rows")?;
        let (dq, dkv) = (cost::attn_train(&p, pairs, BwdDq, false), cost::attn_train(&p, pairs, BwdDkv, false));
        self.launch(Kernel::AttnBwdDq, (rows, u32_dim(p.heads as i64, "heads")?, 1), AT_TILE, 0, &p, dq)?;
        self.launch(Kernel::AttnBwdDkv, (rows, u32_dim(p.kv_heads as i64, "KV heads")?, 1), AT_TILE, 0, &p, dkv)
    }
}
