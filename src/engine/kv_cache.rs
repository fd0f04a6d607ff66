//! The paged KV cache: per layer, keys and values in fixed-size blocks
//! (num_blocks, Hkv, block_size, D), and a free list of block ids. Between decoding phases its
//! memory can be handed back and allocated again ([`KvCache::release_memory`],
//! [`KvCache::commit_memory`]): the block table, the reserved blocks and the FP8 scales stay.
//! On CUDA every layer's keys and values lie in one virtual-memory reservation
//! ([`Device::remappable`]), so the memory comes back at the same addresses and the decode
//! graphs that read them stay valid; on the CPU the tensors are dropped and allocated again.
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
    /// (key, value) dtype of each layer, to allocate them again after a release.
    dtypes: Vec<(DType, DType)>,
    /// (num_blocks, Hkv, block_size, D) of every layer's keys and values.
    shape: [usize; 4],
    /// False between `release_memory` and `commit_memory`: the layers hold empty tensors on
    /// the CPU, and views of an unmapped reservation on CUDA (not to be read).
    resident: bool,
    /// The layers' (key, value) addresses before the last release.
    released_at: Vec<(usize, usize)>,
    /// The reservation every layer's keys and values are views of (CUDA); None on the CPU.
    arena: Option<crate::device::Tensor>,
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
        let mut parts = Vec::with_capacity(2 * cfg.num_layers);
        for &(kd, vd) in dtypes {
            for d in [kd, vd] {
                if !matches!(d, DType::F32 | DType::BF16 | DType::F16 | DType::U8) {
                    bail!("KV cache dtype {} is not supported (f32, bf16, f16, or u8 for FP8)", d.name());
                }
                parts.push((d, shape.to_vec()));
            }
        }
        let (arena, tensors) = match dev.remappable(&parts, "the KV cache")? {
            Some((arena, tensors)) => (Some(arena), tensors),
            // Committed now: the decode loop neither faults pages in nor walks 4 KiB page tables.
            None => (None, parts.iter().map(|(d, s)| dev.zeros_committed(*d, s)).collect::<Result<Vec<_>>>()?),
        };
        let mut tensors = tensors.into_iter();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        while let (Some(k), Some(v)) = (tensors.next(), tensors.next()) {
            layers.push(KvLayer { k, v, k_scale: 1.0, v_scale: 1.0 });
        }
        let dtype = dtypes[0].0;
        // Pop from the end: hand out low block ids first.
        let free = (0..num_blocks as u32).rev().collect();
        Ok(KvCache {
            block_size,
            num_blocks,
            dtype,
            layers,
            free,
            reserved: 0,
            dtypes: dtypes.to_vec(),
            shape,
            resident: true,
            released_at: Vec::new(),
            arena,
        })
    }

    /// Whether the keys and values are allocated (see [`KvCache::release_memory`]).
    pub fn is_resident(&self) -> bool {
        self.resident
    }

    /// Frees every layer's keys and values; the bytes freed. Only an idle cache can: a block
    /// a sequence holds would lose its keys. On CUDA the reservation's memory goes back to the
    /// driver and the layers keep their tensors, which must not be read until the commit; on
    /// the CPU the layers keep empty tensors.
    pub fn release_memory(&mut self, dev: &Device) -> Result<usize> {
        if !self.resident {
            return Ok(0);
        }
        let held = self.num_blocks - self.reserved - self.free.len();
        if held > 0 {
            bail!("KV cache: {held} block(s) still belong to sequences; only an idle cache can release its memory");
        }
        let bytes = self.size_bytes();
        self.released_at = self.addresses();
        if let Some(a) = &self.arena {
            dev.unmap(a)?;
            self.resident = false;
            return Ok(bytes);
        }
        let empty = [0, self.shape[1], self.shape[2], self.shape[3]];
        for (l, &(kd, vd)) in self.layers.iter_mut().zip(&self.dtypes) {
            l.k = dev.zeros(kd, &empty)?;
            l.v = dev.zeros(vd, &empty)?;
        }
        self.resident = false;
        Ok(bytes)
    }

    /// Allocates the keys and values again, zero-filled as [`KvCache::with_layers`] made them
    /// (a step reads only the positions its sequences wrote, so the stale bytes a cache that
    /// never left would hold are never read either; zeros keep even an out-of-range read
    /// finite). Whether any layer came back at another address (never on CUDA).
    pub fn commit_memory(&mut self, dev: &Device) -> Result<bool> {
        if self.resident {
            return Ok(false);
        }
        if let Some(a) = &self.arena {
            dev.remap(a)?;
            self.resident = true;
            return Ok(self.addresses() != self.released_at);
        }
        for (l, &(kd, vd)) in self.layers.iter_mut().zip(&self.dtypes) {
            l.k = dev.zeros_committed(kd, &self.shape)?;
            l.v = dev.zeros_committed(vd, &self.shape)?;
        }
        self.resident = true;
        Ok(self.addresses() != self.released_at)
    }

    fn addresses(&self) -> Vec<(usize, usize)> {
        self.layers.iter().map(|l| (l.k.data_ptr(), l.v.data_ptr())).collect()
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

    /// The device memory the cache holds when resident (and takes back at a commit while
    /// released): on CUDA its reservation's whole granules, on the CPU its layers' bytes.
    pub fn size_bytes(&self) -> usize {
        match &self.arena {
            Some(a) => a.size_bytes(),
            None => {
                let values: usize = self.shape.iter().product();
                self.dtypes.iter().map(|(k, v)| values * (k.size() + v.size())).sum()
            }
        }
    }
}
