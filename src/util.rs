//! Small helpers shared by every module: durable file writes and JSONL reading.
//!
//! Owns nothing stateful. May call std only.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` durably: a temporary sibling, fsync, rename, fsync of the directory.
/// An existing file at `path` is replaced atomically, never left half-written.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().with_context(|| format!("{}: not a file path", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
        f.sync_all().with_context(|| format!("cannot fsync {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads a JSONL file into (line number, parsed value) pairs, skipping blank lines. Errors name
/// the file and the 1-based line.
pub fn read_jsonl(path: &Path) -> Result<Vec<(usize, serde_json::Value)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| {
            let hint = if line.contains("NaN") || line.contains("Infinity") {
                " (it holds a non-finite number: NaN and Infinity are not JSON and not valid values)"
            } else {
                ""
            };
            format!("{}:{}: not a valid JSON line{hint}", path.display(), i + 1)
        })?;
        out.push((i + 1, v));
    }
    Ok(out)
}

/// A global allocator that forwards to the system allocator and tracks live and peak bytes.
/// The `colotrain` binary installs it (benchmarks and memory reports read it); elsewhere the
/// counters stay at zero.
pub struct TrackingAlloc;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the same arguments; the counters are plain atomics.
unsafe impl std::alloc::GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        std::alloc::System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        let p = std::alloc::System.alloc_zeroed(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        let q = std::alloc::System.realloc(p, l, n);
        if !q.is_null() {
            if n >= l.size() {
                let now = LIVE.fetch_add(n - l.size(), std::sync::atomic::Ordering::Relaxed) + n - l.size();
                PEAK.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - n, std::sync::atomic::Ordering::Relaxed);
            }
        }
        q
    }
}

/// Live heap bytes (0 unless [`TrackingAlloc`] is installed).
pub fn heap_live() -> usize {
    LIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Peak heap bytes since the last [`reset_heap_peak`].
pub fn heap_peak() -> usize {
    PEAK.load(std::sync::atomic::Ordering::Relaxed)
}

/// Starts a new peak measurement from the current live bytes.
pub fn reset_heap_peak() {
    PEAK.store(heap_live(), std::sync::atomic::Ordering::Relaxed);
}

/// Asks Linux to back `[ptr, ptr + bytes)` with transparent huge pages (2 MiB) when they are
/// touched first: the decode loop streams ~100 MB of weights and KV cache per step, and with 4
/// KiB pages every page costs a TLB walk. A hint: where THP is off, or elsewhere, nothing happens.
pub fn advise_huge_pages<T>(ptr: *const T, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + bytes) / PAGE * PAGE;
        if end > start + (2 << 20) {
            // SAFETY: madvise only changes how the kernel backs pages of this process's own
            // mapping (the range lies inside the caller's allocation); it never moves or frees
            // memory, and an error (e.g. THP disabled) is ignored.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, bytes);
}
