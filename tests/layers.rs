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

/// `text` without comments and without the contents of string and char literals (so a `//`
/// or a `crate::` inside a string is neither a comment nor a path), newlines kept.
fn code_only(text: &str) -> String {
    let (b, mut out, mut i) = (text.as_bytes(), String::with_capacity(text.len()), 0);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                i += 2;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal ('x', '\n'), not a lifetime ('a).
            b'\'' if b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'')) => {
                i += if b[i + 1] == b'\\' { 4 } else { 3 };
                out.push_str("' '");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// The paths in a `use` group after `{` at `text[at..]`: `a::b, c::{d, e}` gives a, c (the
/// first segment of each, at any nesting), and the length consumed.
fn group_heads(text: &str) -> (Vec<String>, usize) {
    let (mut heads, mut depth, mut start) = (Vec::new(), 0usize, true);
    for (i, c) in text.char_indices() {
        match c {
            '{' => {
                depth += 1;
                start = depth == 1;
            }
            '}' => {
                if depth <= 1 {
                    return (heads, i + 1);
                }
                depth -= 1;
            }
            ',' if depth == 1 => start = true,
            c if start && depth == 1 && (c.is_alphanumeric() || c == '_') => {
                let name: String = text[i..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                heads.push(name);
                start = false;
            }
            _ => {}
        }
    }
    (heads, text.len())
}

/// Every top-level module named by a path in `text`, with its line: `crate::m`, the heads of
/// `crate::{…}` groups (nested, across lines), and `super::…` paths that climb out of the file's
/// own top-level module (`module` is the file's module path, e.g. ["ops", "norm", "cpu"]).
fn named(text: &str, modules: &[String], module: &[String]) -> Vec<(usize, String)> {
    let code = code_only(text);
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut push = |at: usize, name: &str| {
        if modules.iter().any(|m| m == name) {
            out.push((line_of(at), name.to_string()));
        }
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + 7..];
        if rest.starts_with('{') {
            for h in group_heads(rest).0 {
                push(at, &h);
            }
        } else {
            push(at, rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or(""));
        }
    }
    for (at, _) in code.match_indices("super::") {
        // Count this `super::` run once, from its first link.
        if code[..at].ends_with("super::") {
            continue;
        }
        let mut rest = &code[at..];
        let mut ups = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
            ups += 1;
        }
        if ups >= module.len() {
            // Out of the top-level module: the next segment is a top-level module.
            if rest.starts_with('{') {
                for h in group_heads(rest).0 {
                    push(at, &h);
                }
            } else {
                push(at, rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or(""));
            }
        }
    }
    out
}

/// A file's module path below src/: ops/norm/mod.rs is [ops, norm], ops/norm/cpu.rs is
/// [ops, norm, cpu] (for `super::` in a mod.rs, the parent is one level up).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    if parts.last().map(String::as_str) == Some("mod") {
        parts.pop();
    }
    parts
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
        for (line, m) in named(&text, &order, &module_path(rel)) {
            if rank[m.as_str()] > mine {
                bad.push(format!("src/{}:{line}: `{top}` names `crate::{m}`, a layer above it", rel.display()));
            }
        }
    }
    assert!(bad.is_empty(), "{} upward imports (the order is src/lib.rs's):\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn the_checker_sees_an_upward_import() {
    let order: Vec<String> = ["device", "ops", "model"].iter().map(|s| s.to_string()).collect();
    let m = |text: &str| named(text, &order, &["device".to_string(), "cuda".to_string()]);
    let heads = |v: Vec<(usize, String)>| v.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
    assert_eq!(m("use crate::ops::norm; // crate::device"), vec![(1, "ops".to_string())]);
    assert_eq!(heads(m("use crate::{device::Tensor, ops};")), ["device", "ops"]);
    // Groups across lines and nested groups.
    assert_eq!(heads(m("use crate::{\n    device::{Tensor, DType},\n    model,\n};")), ["device", "model"]);
    // super:: out of the file's top-level module (device/cuda: two levels).
    assert_eq!(heads(m("use super::super::model::X;")), ["model"]);
    assert!(m("use super::ffi;").is_empty());
    // Comments and strings are not paths; `//` in a string does not hide what follows.
    assert!(m("// use crate::ops::x;\n/* crate::model */").is_empty());
    assert_eq!(heads(m("let u = \"http://x\"; use crate::model;")), ["model"]);
    assert!(m("let s = \"crate::ops\";").is_empty());
}

#[test]
fn lib_rs_declares_every_module_in_the_layer_list() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).expect("lib.rs");
    for l in lib.lines().map(str::trim) {
        if l.contains("mod ") && l.ends_with(';') {
            assert!(l.starts_with("pub mod "), "lib.rs: `{l}`: every top-level module is a `pub mod` (a layer)");
        }
    }
}
