//! The paged KV cache: per layer, keys and values in fixed-size blocks
//! (num_blocks, Hkv, block_size, D), and a free list of block ids.
//!
//! Owns: cache memory and block allocation. May call: `crate::device`. Must not: decide which
//! sequence gets blocks (that is the scheduler's job).

use crate::device::{DType, Device};
use crate::model::transformer::KvLayer;
use crate::model::ModelConfig;
use anyhow::{bail, Result};

pub struct KvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: DType,
    pub layers: Vec<KvLayer>,
    free: Vec<u32>,
    /// Blocks taken out of circulation ([`KvCache::reserve_block`]).
    reserved: usize,
}

impl KvCache {
    /// Bytes of one block across all layers (keys and values).
    pub fn block_bytes(cfg: &ModelConfig, block_size: usize, dtype: DType) -> usize {
        Self::block_bytes_layers(cfg, block_size, &vec![(dtype, dtype); cfg.num_layers])
    }

    /// Bytes of one block with (key, value) dtypes per layer.
    pub fn block_bytes_layers(cfg: &ModelConfig, block_size: usize, dtypes: &[(DType, DType)]) -> usize {
        dtypes.iter().map(|(k, v)| cfg.num_kv_heads * block_size * cfg.head_dim * (k.size() + v.size())).sum()
    }

    pub fn new(dev: &Device, cfg: &ModelConfig, block_size: usize, num_blocks: usize, dtype: DType) -> Result<KvCache> {
        Self::with_layers(dev, cfg, block_size, num_blocks, &vec![(dtype, dtype); cfg.num_layers])
    }

    /// A cache whose layer l stores keys and values as `dtypes[l]`: f32, bf16, f16, or u8 for
    /// FP8 E4M3 with a per-layer scale (1 until set).
    pub fn with_layers(
        dev: &Device,
        cfg: &ModelConfig,
        block_size: usize,
        num_blocks: usize,
        dtypes: &[(DType, DType)],
    ) -> Result<KvCache> {
        if block_size == 0 || num_blocks == 0 {
            bail!("KV cache needs a positive block size and block count (got {block_size} x {num_blocks})");
        }
        if dtypes.len() != cfg.num_layers {
            bail!("KV cache: {} layer dtypes for {} layers", dtypes.len(), cfg.num_layers);
        }
        let shape = [num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim];
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for &(kd, vd) in dtypes {
            for d in [kd, vd] {
                if !matches!(d, DType::F32 | DType::BF16 | DType::F16 | DType::U8) {
                    bail!("KV cache dtype {} is not supported (f32, bf16, f16, or u8 for FP8)", d.name());
                }
            }
            // Committed now: the decode loop neither faults pages in nor walks 4 KiB page tables.
            let (k, v) = (dev.zeros_committed(kd, &shape)?, dev.zeros_committed(vd, &shape)?);
            layers.push(KvLayer { k, v, k_scale: 1.0, v_scale: 1.0 });
        }
        let dtype = dtypes[0].0;
        // Pop from the end: hand out low block ids first.
        let free = (0..num_blocks as u32).rev().collect();
        Ok(KvCache { block_size, num_blocks, dtype, layers, free, reserved: 0 })
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Capacity in tokens (reserved blocks excluded).
    pub fn capacity_tokens(&self) -> usize {
        (self.num_blocks - self.reserved) * self.block_size
    }

    /// Takes a free block out of circulation for good: no sequence is ever given it (the
    /// decode graphs' padding rows write their keys and values there).
    pub fn reserve_block(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.reserved += 1;
        Some(b)
    }

    pub fn alloc(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn release(&mut self, blocks: &mut Vec<u32>) {
        self.free.append(blocks);
    }

    pub fn size_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.size_bytes() + l.v.size_bytes()).sum()
    }
}
