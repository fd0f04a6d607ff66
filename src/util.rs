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
