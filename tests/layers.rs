//! The crate's modules form layers: a top-level module may name (`crate::m`) only modules listed
//! before it in `src/lib.rs`, so the `crate::` paths between top-level modules have no cycle.
//! And the device layer names nothing above it. Comments are ignored; every other line of every
//! file under `src/` is checked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level modules in the order lib.rs declares them.
fn layers(src: &Path) -> Vec<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs");
    lib.lines().filter_map(|l| l.trim().strip_prefix("pub mod ")).map(|m| m.trim_end_matches(';').to_string()).collect()
}

/// Every `crate::<name>` (and `crate::{a, b}`) named outside comments in `text`.
fn named(text: &str, modules: &[String]) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + 7..];
            let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
                group
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(|s| s.trim().split("::").next().unwrap_or("").trim())
                    .collect()
            } else {
                vec![rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("")]
            };
            for n in names {
                if modules.iter().any(|m| m == n) {
                    out.push((i + 1, n.to_string()));
                }
            }
        }
    }
    out
}

#[test]
fn no_module_names_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let order = layers(&src);
    // (rustfmt.toml keeps rustfmt from sorting the list: reorder_modules = false.)
    assert!(
        order.len() >= 10
            && order.first().map(String::as_str) == Some("util")
            && order.last().map(String::as_str) == Some("cli"),
        "lib.rs lists {order:?}: the bottom layer first, the CLI last"
    );
    let rank: BTreeMap<&str, usize> = order.iter().enumerate().map(|(i, m)| (m.as_str(), i)).collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).expect("under src");
        let top =
            rel.components().next().expect("a path").as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        let Some(&mine) = rank.get(top.as_str()) else { continue }; // lib.rs, main.rs
        let text = std::fs::read_to_string(f).expect("source");
        for (line, m) in named(&text, &order) {
            if rank[m.as_str()] > mine {
                bad.push(format!("src/{}:{line}: `{top}` names `crate::{m}`, a layer above it", rel.display()));
            }
        }
    }
    assert!(bad.is_empty(), "{} upward imports (the order is src/lib.rs's):\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn the_checker_sees_an_upward_import() {
    let order: Vec<String> = ["device", "ops"].iter().map(|s| s.to_string()).collect();
    assert_eq!(named("use crate::ops::norm; // crate::device", &order), vec![(1, "ops".to_string())]);
    assert_eq!(named("use crate::{device::Tensor, ops};", &order).len(), 2);
    assert!(named("// use crate::ops::x;", &order).is_empty());
}
