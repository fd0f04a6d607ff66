//! Small helpers shared by every module: durable file writes, JSONL reading, and [`str_enum!`]
//! (the modes that config files spell as strings).
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

/// A global allocator that forwards to the system allocator, tracks live and peak bytes, and
/// starts every block of [`ALIGN_FROM`] bytes or more on a 64-byte cache line. The `colotrain`
/// binary installs it (benchmarks and memory reports read it); elsewhere the counters stay at
/// zero.
///
/// Why the alignment: glibc starts a large block 16 bytes into a page, so every 64-byte vector
/// load from a tensor (weights, KV cache, activations) spanned two cache lines. Measured on the
/// 2-core Zen 4 VM: 16 keys' q·k products in 22 ns aligned against 31 ns, and batch-32 decode
/// attention 22–26% faster in alternating runs (the same bits). A large block is the system's block of 64 more
/// bytes, its start rounded up past an 8-byte header that holds the system's pointer, so that
/// `alloc_zeroed` stays `calloc` (fresh pages stay untouched until used).
pub struct TrackingAlloc;

/// Blocks from this size on start on a cache line.
pub const ALIGN_FROM: usize = 4 << 10;
/// The cache line.
const LINE: usize = 64;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether [`TrackingAlloc`] lines up a block of layout `l` itself.
fn lined(l: std::alloc::Layout) -> bool {
    l.size() >= ALIGN_FROM && l.align() <= LINE
}

/// The system block behind a lined block of `size` bytes: LINE bytes more, the system's
/// alignment. None when that overflows (the caller then fails as the system would).
fn outer(size: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(size.checked_add(LINE)?, 16).ok()
}

/// The lined start inside the system block `raw` (LINE bytes longer than the caller's block),
/// with the header (raw itself) written just before it.
///
/// # Safety
/// `raw` is a live, 16-byte aligned system block of [`outer`] of the caller's size.
unsafe fn line_up(raw: *mut u8) -> *mut u8 {
    // raw + 8 ≤ start ≤ raw + 64: the header fits before it, the block after it.
    let start = raw.add((raw as usize + 8).next_multiple_of(LINE) - raw as usize);
    (start as *mut usize).sub(1).write_unaligned(raw as usize);
    start
}

/// A lined block of `size` bytes (zeroed: through `calloc`), or null.
///
/// # Safety
/// As `GlobalAlloc::alloc` for a layout of this size that [`lined`] accepts.
unsafe fn alloc_lined(size: usize, zeroed: bool) -> *mut u8 {
    let Some(o) = outer(size) else { return std::ptr::null_mut() };
    use std::alloc::GlobalAlloc;
    let raw = if zeroed { std::alloc::System.alloc_zeroed(o) } else { std::alloc::System.alloc(o) };
    if raw.is_null() {
        raw
    } else {
        line_up(raw)
    }
}

fn count_up(n: usize) {
    let now = LIVE.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
    PEAK.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
}

// SAFETY: a block that is not `lined` is allocated, grown and freed by `System` with the
// caller's layout. A `lined` block is a `System` block of `outer(size)` (LINE bytes more,
// 16-aligned), and the caller gets `line_up`'s pointer into it: 64-aligned (so aligned for any
// `align` ≤ LINE), with `size` bytes before the system block ends, and the system pointer in
// the 8 bytes just before it, which only `dealloc` reads. `lined` is a pure function of the
// layout, which the caller passes unchanged to `dealloc`, so every block is freed the way it
// was allocated. `realloc` across or within lined sizes allocates anew, copies min(old, new)
// bytes and frees the old block. The counters are plain atomics.
unsafe impl std::alloc::GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        let p = if lined(l) { alloc_lined(l.size(), false) } else { std::alloc::System.alloc(l) };
        if !p.is_null() {
            count_up(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        match outer(l.size()).filter(|_| lined(l)) {
            Some(o) => std::alloc::System.dealloc((p as *const usize).sub(1).read_unaligned() as *mut u8, o),
            None => std::alloc::System.dealloc(p, l),
        }
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        let p = if lined(l) { alloc_lined(l.size(), true) } else { std::alloc::System.alloc_zeroed(l) };
        if !p.is_null() {
            count_up(l.size());
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        // SAFETY: the caller guarantees that n rounded up to l.align() does not overflow isize.
        let nl = std::alloc::Layout::from_size_align_unchecked(n, l.align());
        if lined(l) || lined(nl) {
            let q = self.alloc(nl);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(n));
                self.dealloc(p, l);
            }
            return q;
        }
        let q = std::alloc::System.realloc(p, l, n);
        if !q.is_null() {
            if n >= l.size() {
                count_up(n - l.size());
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

/// An enum of named modes that a config file or a flag spells as a string: `as_str` (the
/// spelling), `Display`, `FromStr` and serde through those spellings, so the TOML stays as
/// written and a `match` on the mode is checked by the compiler. An unknown spelling is the
/// error `"{key}: {message}"`, where the message format names the value (`{s}`) and the
/// spellings it expected (`{expected}`: "a, b or c").
///
/// ```text
/// str_enum! {
///     /// How rollout and training share the devices.
///     pub enum Placement("schedule.placement", "expected {expected}, got '{s}'") {
///         Colocated = "colocated",
///         Split = "split",
///     }
/// }
/// ```
#[macro_export]
macro_rules! str_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident ($key:literal, $fmt:literal) {
        $($(#[$vm:meta])* $var:ident = $s:literal),+ $(,)?
    }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "&'static str")]
        $vis enum $name {
            $($(#[$vm])* $var),+
        }

        impl $name {
            /// Every mode, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$var),+];

            /// The spelling in config files and on the command line.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$var => $s),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = anyhow::Error;
            fn from_str(s: &str) -> anyhow::Result<$name> {
                match s {
                    $($s => Ok($name::$var),)+
                    _ => {
                        let expected = $crate::util::or_list(&[$($s),+]);
                        Err(anyhow::anyhow!(concat!("{key}: ", $fmt), key = $key, s = s, expected = expected))
                    }
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = anyhow::Error;
            fn try_from(s: String) -> anyhow::Result<$name> {
                s.parse()
            }
        }

        impl From<$name> for &'static str {
            fn from(m: $name) -> &'static str {
                m.as_str()
            }
        }
    };
}

/// "a", "a or b", "a, b or c".
pub fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    crate::str_enum! {
        /// A mode for the tests.
        enum Weather("sky.weather", "no weather '{s}': expected {expected}") {
            Sun = "sun",
            Light = "light-rain",
            Storm = "storm",
        }
    }

    #[test]
    fn str_enum_round_trips_its_spellings_and_names_the_key_when_unknown() {
        for w in Weather::ALL {
            assert_eq!(w.as_str().parse::<Weather>().unwrap(), *w);
            assert_eq!(w.to_string(), w.as_str());
        }
        assert_eq!(Weather::Light.as_str(), "light-rain");
        let e = "hail".parse::<Weather>().unwrap_err().to_string();
        assert_eq!(e, "sky.weather: no weather 'hail': expected sun, light-rain or storm");
        #[derive(serde::Deserialize, serde::Serialize)]
        struct Sky {
            weather: Weather,
        }
        let s: Sky = toml::from_str("weather = \"storm\"").unwrap();
        assert_eq!(s.weather, Weather::Storm);
        assert_eq!(toml::to_string(&s).unwrap().trim(), "weather = \"storm\"");
        let e = toml::from_str::<Sky>("weather = \"Storm\"").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("sky.weather: no weather 'Storm'"), "{e}");
        assert_eq!(super::or_list(&["a"]), "a");
        assert_eq!(super::or_list(&["a", "b"]), "a or b");
    }

    use super::{TrackingAlloc, ALIGN_FROM};
    use std::alloc::{GlobalAlloc, Layout};

    /// Fills a block with a pattern that depends on the position, and checks it back.
    unsafe fn fill(p: *mut u8, n: usize, seed: u8) {
        for i in 0..n {
            p.add(i).write((i as u8).wrapping_mul(31).wrapping_add(seed));
        }
    }
    unsafe fn holds(p: *const u8, n: usize, seed: u8) -> bool {
        (0..n).all(|i| p.add(i).read() == (i as u8).wrapping_mul(31).wrapping_add(seed))
    }

    #[test]
    fn large_blocks_start_on_a_cache_line_and_keep_their_bytes() {
        let a = TrackingAlloc;
        // SAFETY: every block is used within its size and freed once with its own layout.
        unsafe {
            for size in [ALIGN_FROM, ALIGN_FROM + 1, 100_003, 3 << 20] {
                for align in [1, 4, 16, 64] {
                    let l = Layout::from_size_align(size, align).unwrap();
                    let p = a.alloc(l);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % 64, 0, "size {size} align {align}");
                    fill(p, size, 7);
                    assert!(holds(p, size, 7));
                    a.dealloc(p, l);
                    let z = a.alloc_zeroed(l);
                    assert_eq!(z as usize % 64, 0);
                    assert!((0..size).all(|i| z.add(i).read() == 0), "alloc_zeroed of {size} not zero");
                    a.dealloc(z, l);
                }
            }
            // Below the threshold: the system's block (aligned as asked).
            let l = Layout::from_size_align(100, 8).unwrap();
            let p = a.alloc(l);
            assert_eq!(p as usize % 8, 0);
            fill(p, 100, 1);
            assert!(holds(p, 100, 1));
            a.dealloc(p, l);
        }
    }

    #[test]
    fn realloc_keeps_the_bytes_across_the_threshold_both_ways() {
        let a = TrackingAlloc;
        // SAFETY: as above; each realloc's result replaces the block it was given.
        unsafe {
            let l = Layout::from_size_align(1000, 4).unwrap();
            let p = a.alloc(l);
            fill(p, 1000, 3);
            // small → large: the old bytes, on a cache line.
            let q = a.realloc(p, l, 2 * ALIGN_FROM);
            assert_eq!(q as usize % 64, 0);
            assert!(holds(q, 1000, 3));
            fill(q, 2 * ALIGN_FROM, 5);
            // large → larger.
            let big = Layout::from_size_align(2 * ALIGN_FROM, 4).unwrap();
            let r = a.realloc(q, big, 5 * ALIGN_FROM + 3);
            assert_eq!(r as usize % 64, 0);
            assert!(holds(r, 2 * ALIGN_FROM, 5));
            // large → small: the first bytes.
            let bigger = Layout::from_size_align(5 * ALIGN_FROM + 3, 4).unwrap();
            let s = a.realloc(r, bigger, 200);
            assert!(holds(s, 200, 5));
            a.dealloc(s, Layout::from_size_align(200, 4).unwrap());
        }
    }
}
