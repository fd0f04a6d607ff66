//! [`Prefetch`]: the cache lines a CPU linear's register tile asks for, one per FMA step, while
//! it computes (the next weight panel, into L2).
//!
//! Owns nothing. May call: std::arch. Must not touch: anything else.

/// Up to `n` cache lines, one per FMA step, to prefetch while a tile computes.
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    base: *const u8,
    n: usize,
}

impl Prefetch {
    pub(super) const NONE: Prefetch = Prefetch { base: std::ptr::null(), n: 0 };

    /// Lines first..first+n of `bytes` (fewer where it ends).
    pub(super) fn lines(bytes: &[u8], first: usize, n: usize) -> Prefetch {
        let have = bytes.len().div_ceil(64);
        if first >= have {
            return Prefetch::NONE;
        }
        // SAFETY: first < the number of (partial) lines, so the offset is inside `bytes`.
        Prefetch { base: unsafe { bytes.as_ptr().add(first * 64) }, n: n.min(have - first) }
    }

    /// Prefetches line `p` (if there is one) into L2; a hint, never a fault.
    #[inline(always)]
    pub(super) fn line(self, p: usize) {
        #[cfg(target_arch = "x86_64")]
        if p < self.n {
            // SAFETY: prefetching is a hint that cannot fault; the address is inside the slice
            // given to `lines` (p < n lines from its start).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(self.base.add(p * 64) as *const i8)
            }
        }
    }
}
