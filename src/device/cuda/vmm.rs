//! Device memory that keeps its address while it is handed back: a virtual-memory reservation
//! (cuMemAddressReserve) whose physical memory is mapped (cuMemCreate + cuMemMap) and unmapped
//! (cuMemUnmap + cuMemRelease) as phases need it. The KV caches live in one each, so a cache
//! released for the train phase comes back at the same addresses and the decode graphs, which
//! hold those addresses, replay without capturing again.
//!
//! Mapped bytes count as in use in the device's allocator (budget and peak); an unmapped
//! reservation costs address space only. The simulator does the same with host pages and
//! reports any use of an unmapped range (`sim_vmm.rs`).
//!
//! Owns: [`Region`] and the remappable tensors' lifecycle. May call: the device's driver and
//! allocator. Must not: know which engine or cache uses the memory.

use super::{CudaDevice, CudaStorage, DevBuf};
use crate::device::{DType, Storage, Tensor};
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Parts of a reservation start at multiples of this (every kernel's vector loads are aligned).
const ALIGN: usize = 256;

/// A reservation behind a [`DevBuf`]: its size (a multiple of the mapping granularity) and
/// whether memory is mapped into it now.
pub(super) struct Region {
    bytes: usize,
    mapped: AtomicBool,
}

impl CudaDevice {
    /// One reservation holding `parts` ((dtype, shape) each) back to back, each at a 256-byte
    /// boundary, mapped and zero-filled. Returns the whole reservation (a U8 tensor: the
    /// handle for [`CudaDevice::unmap`] and [`CudaDevice::remap`]) and one tensor per part,
    /// views that share it. `what` names it in errors.
    pub fn remappable(&self, parts: &[(DType, Vec<usize>)], what: &str) -> Result<(Tensor, Vec<Tensor>)> {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut end = 0usize;
        for (d, shape) in parts {
            offsets.push(end);
            end = (end + shape.iter().product::<usize>() * d.size()).div_ceil(ALIGN) * ALIGN;
        }
        let g = self.inner.driver.granularity()?;
        let bytes = end.max(1).div_ceil(g) * g;
        let ptr = self.inner.driver.reserve(bytes)?;
        let region = Region { bytes, mapped: AtomicBool::new(false) };
        let buf = Arc::new(DevBuf { ptr, class: 0, dev: self.clone(), region: Some(region) });
        let whole = CudaStorage { buf, ptr, len: bytes, dtype: DType::U8 };
        let views = parts
            .iter()
            .zip(&offsets)
            .map(|((d, shape), &off)| {
                let len = shape.iter().product();
                let s = CudaStorage { buf: whole.buf.clone(), ptr: ptr + off as u64, len, dtype: *d };
                Tensor::from_storage(shape, Storage::Cuda(s))
            })
            .collect();
        let whole = Tensor::from_storage(&[bytes], Storage::Cuda(whole));
        self.remap_named(&whole, what)?;
        Ok((whole, views))
    }

    fn region_of<'a>(&self, t: &'a Tensor) -> Result<(&'a DevBuf, &'a Region)> {
        match t.storage() {
            Storage::Cuda(s) if s.buf.dev.inner.ordinal == self.inner.ordinal => match &s.buf.region {
                Some(r) => Ok((&s.buf, r)),
                None => bail!("{}: the tensor is not a remappable reservation", self.name()),
            },
            _ => bail!("{}: the tensor is not in this device's memory", self.name()),
        }
    }

    /// Once the queued work has run, gives the memory of reservation `t` back to the driver;
    /// its views keep their addresses and must not be used until [`CudaDevice::remap`]. The
    /// bytes given back (0 when it was unmapped already).
    pub fn unmap(&self, t: &Tensor) -> Result<usize> {
        let (buf, r) = self.region_of(t)?;
        if !r.mapped.load(Ordering::Acquire) {
            return Ok(0);
        }
        self.synchronize()?;
        self.inner.driver.unmap(buf.ptr, r.bytes)?;
        r.mapped.store(false, Ordering::Release);
        self.allocator().unmap(r.bytes);
        Ok(r.bytes)
    }

    /// Maps memory into reservation `t` again, at the same address, and zero-fills it (queued).
    pub fn remap(&self, t: &Tensor) -> Result<()> {
        self.remap_named(t, "a remapped reservation")
    }

    fn remap_named(&self, t: &Tensor, what: &str) -> Result<()> {
        let (buf, r) = self.region_of(t)?;
        if r.mapped.load(Ordering::Acquire) {
            return Ok(());
        }
        self.allocator().map(&self.inner.driver, r.bytes, what)?;
        let mut mapped = self.inner.driver.map(buf.ptr, r.bytes);
        if mapped.is_err() && self.allocator().cached > 0 {
            // The driver is out of memory: the allocator's cached blocks go back first, as
            // for any allocation.
            let a = self.allocator().release(&self.inner.driver);
            mapped = a.and_then(|_| self.inner.driver.map(buf.ptr, r.bytes));
        }
        if let Err(e) = mapped {
            self.allocator().unmap(r.bytes);
            return Err(e.context(format!("{}: mapping {what} ({} bytes)", self.name(), r.bytes)));
        }
        r.mapped.store(true, Ordering::Release);
        self.memset0(buf.ptr, r.bytes)
    }

    /// The last view of a reservation is gone: its memory and its addresses go back.
    pub(super) fn drop_region(&self, ptr: u64, r: &Region) {
        // Queued work may still use it (the driver's synchronize leaves the error word alone).
        let _ = self.inner.driver.synchronize();
        if r.mapped.swap(false, Ordering::AcqRel) {
            self.allocator().unmap(r.bytes);
        }
        self.inner.driver.unreserve(ptr, r.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulated GPU 3: no other lib test opens it, so its allocator's counts are this test's.
    fn dev() -> CudaDevice {
        CudaDevice::sim(3).expect("a simulated GPU")
    }

    #[test]
    fn a_reservation_keeps_its_address_and_its_memory_leaves_while_unmapped() {
        let d = dev();
        let before = d.allocator().in_use;
        let parts = [(DType::F32, vec![3, 5]), (DType::U8, vec![7]), (DType::BF16, vec![2, 2])];
        let (whole, views) = d.remappable(&parts, "a test cache").unwrap();
        let (p0, p1, p2) = (views[0].data_ptr(), views[1].data_ptr(), views[2].data_ptr());
        // Back to back at 256-byte boundaries, in one reservation of whole 2 MiB granules.
        assert_eq!((p1 - p0, p2 - p1), (256, 256));
        assert_eq!(whole.numel(), 2 << 20);
        assert_eq!(d.allocator().in_use - before, 2 << 20, "the mapped bytes count as in use");
        assert!(views[0].to_f32_vec().unwrap().iter().all(|&x| x == 0.0), "zero-filled at creation");

        let mut views = views;
        views[0].write_f32(&[1.5; 15]).unwrap();
        assert_eq!(views[0].to_f32_vec().unwrap(), vec![1.5; 15]);
        assert_eq!(d.unmap(&whole).unwrap(), 2 << 20);
        assert_eq!(d.allocator().in_use, before, "unmapped: the budget has the bytes back");
        assert_eq!(d.unmap(&whole).unwrap(), 0, "unmapping twice gives back nothing");

        // A read of a view while unmapped is the simulator's illegal-address fault.
        let e = format!("{:#}", views[0].to_f32_vec().unwrap_err());
        assert!(e.contains("unmapped") && e.contains("cuda-sim:3"), "{e}");

        // So is a queued write (a kernel's, a memset's), when the stream reaches it.
        views[1].fill_zero().unwrap();
        let e = format!("{:#}", d.synchronize().unwrap_err());
        assert!(e.contains("unmapped") && e.contains("a memset"), "{e}");

        d.remap(&whole).unwrap();
        assert_eq!(views[0].data_ptr(), p0, "the same address after the remap");
        assert_eq!(d.allocator().in_use - before, 2 << 20);
        let v = views[0].to_f32_vec().unwrap();
        assert!(v.iter().all(|&x| x == 0.0), "remapped memory is zero-filled, not the old contents: {v:?}");
        drop((views, whole));
        assert_eq!(d.allocator().in_use, before, "dropping the last view frees the reservation");
    }
}
