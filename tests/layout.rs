//! The shape of the house, checked on the sources: within each layered folder its modules form
//! a chain in which each uses only the modules before it (so no import runs up and no circle
//! forms), and the crate graph points inward: CLI -> adapters -> engine.
//!
//! A module's uses are the paths in its code (comments and doc links skipped) that name a sibling:
//! `crate::FOLDER::m`, `super::m` (as many `super::` as the file lies below the folder), and an
//! item the folder's `mod.rs`/`lib.rs` re-exports, which counts as a use of the module it comes
//! from. An item the folder file defines itself is the sibling `mod`. The folder file's own
//! `pub use` lines are its face, not uses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The engine's top-level modules in dependency order (ARCHITECTURE.md's code map lists them
/// so); `lib.rs` is the crate's face.
const ENGINE: &[&str] = &[
    "error",
    "activation",
    "active",
    "cpu",
    "ffn",
    "tensor_io",
    "linear",
    "predict",
    "analysis",
    "hybrid",
    "cuda",
    "input_sparse",
    "format",
    "mod",
];

/// The engine's CPU kernels: leaves, then the block and layout modules, the kernel table, and
/// the drivers. `mod.rs` holds the prefetch and pool-share helpers every kernel uses.
const CPU: &[&str] = &[
    "mod",
    "heap",
    "bandwidth",
    "simd",
    "pool",
    "attention",
    "quant",
    "x86",
    "neon",
    "blocks",
    "bundles",
    "column_matrix",
    "split",
    "packed",
    "column_blocks",
    "kernels",
    "dense_pass",
    "sparse",
    "float_rows",
];

/// The candle adapter: errors and configuration, the file, the model, then what loads, tunes and
/// runs it.
const CANDLE: &[&str] = &[
    "error",
    "config",
    "gguf",
    "tokenizer",
    "model",
    "pwri",
    "tiers",
    "input_rule",
    "generate",
    "synthetic",
    "analyze",
    "load",
    "hot",
    "pipeline",
    "eval",
    "mod",
];

/// The candle model: its parts, the fused decoder over them, and `Llama` (`mod.rs`) on top.
const MODEL: &[&str] = &["kernel_ffn", "layers", "timing", "rope", "decoder", "mod"];

/// One layered folder: its path under the crate's `src`, its module path, and its order.
struct Folder<'a> {
    dir: PathBuf,
    module: &'a str,
    order: &'a [&'a str],
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `text` without its comment lines (doc links included).
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first path segment after each `prefix` in `code`: `PREFIX m::X` gives `m`, and a group
/// `PREFIX {m::X, n::{Y, Z}, W}` (over several lines too) gives each entry's first segment.
/// A `prefix` preceded by another `super::` is not a match (it names a folder further up).
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        if code[..i].ends_with("super::")
            || code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &code[i + prefix.len()..];
        if rest.starts_with("super::") {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0usize, 0usize);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident(&group[start..j]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// What the folder file's `pub use` / `pub(crate) use` lines re-export: item -> the child module
/// it comes from.
fn reexports(face: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in face_statements(&code(face)) {
        let Some((child, items)) = stmt.split_once("::") else {
            continue;
        };
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            // `a::b::Item`, `Item as Alias`: the name the folder gives it.
            let item = item.trim();
            let name = item.rsplit(" as ").next().unwrap_or(item);
            let name = name.rsplit("::").next().unwrap_or(name).trim();
            if !name.is_empty() {
                out.insert(name.to_string(), child.trim().to_string());
            }
        }
    }
    out
}

/// The `pub use` / `pub(crate) use` statements of `code` that start a line, each after its
/// `use` and without its `;`.
fn face_statements(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for marker in ["\npub use ", "\npub(crate) use "] {
        let text = code;
        for (i, _) in format!("\n{text}").match_indices(marker) {
            let rest = &text[i + marker.len() - 1..];
            out.push(rest.split(';').next().unwrap_or(rest));
        }
    }
    out
}

/// `code` without the face statements ([`face_statements`]).
fn without_face(code: &str) -> String {
    let mut out = code.to_string();
    for s in face_statements(code) {
        out = out.replacen(s, "", 1);
    }
    out
}

/// Every use in `folder` that does not go to a sibling before the user, as `user -> used
/// (path)` lines.
fn upward_uses(folder: &Folder) -> Vec<String> {
    let face_file = ["mod.rs", "lib.rs"]
        .iter()
        .map(|f| folder.dir.join(f))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{}: no mod.rs or lib.rs", folder.dir.display()));
    let face = std::fs::read_to_string(&face_file).unwrap();
    let reexported = reexports(&face);
    let mut files = Vec::new();
    rust_files(&folder.dir, &mut files);
    let rank = |m: &str| folder.order.iter().position(|o| *o == m);
    let mut bad = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&folder.dir).unwrap();
        let parts: Vec<String> = rel
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .collect();
        // The sibling this file belongs to, and how many `super::` reach the folder from it.
        let (child, depth) = match parts.as_slice() {
            [one] if one == "mod" || one == "lib" => ("mod".to_string(), 0),
            [one] => (one.clone(), 1),
            [first, .., last] if last == "mod" => (first.clone(), parts.len() - 1),
            [first, ..] => (first.clone(), parts.len()),
            [] => unreachable!(),
        };
        let Some(at) = rank(&child) else {
            bad.push(format!(
                "{}: `{child}` is not in the folder's order",
                rel.display()
            ));
            continue;
        };
        let mut code = code(&std::fs::read_to_string(&f).unwrap());
        if child == "mod" {
            // The face's re-exports are not uses.
            code = without_face(&code);
        }
        let mut prefixes = vec![match folder.module {
            "" => "crate::".to_string(),
            m => format!("crate::{m}::"),
        }];
        if depth > 0 {
            prefixes.push("super::".repeat(depth));
        }
        for prefix in &prefixes {
            for name in paths_after(&code, prefix) {
                let used = if rank(&name).is_some() && name != "mod" {
                    name.clone()
                } else if let Some(m) = reexported.get(&name) {
                    m.clone()
                } else {
                    "mod".to_string()
                };
                let Some(to) = rank(&used) else {
                    continue;
                };
                if used != child && to > at {
                    bad.push(format!(
                        "{}: `{child}` uses `{used}` ({prefix}{name}), which comes after it",
                        rel.display()
                    ));
                }
            }
        }
    }
    bad
}

fn folders() -> Vec<(Folder<'static>, &'static str)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let candle = root.join("adapters/candle/src");
    vec![
        (
            Folder {
                dir: root.join("src"),
                module: "",
                order: ENGINE,
            },
            "ENGINE",
        ),
        (
            Folder {
                dir: root.join("src/cpu"),
                module: "cpu",
                order: CPU,
            },
            "CPU",
        ),
        (
            Folder {
                dir: candle.clone(),
                module: "",
                order: CANDLE,
            },
            "CANDLE",
        ),
        (
            Folder {
                dir: candle.join("model"),
                module: "model",
                order: MODEL,
            },
            "MODEL",
        ),
    ]
}

#[test]
fn paths_after_reads_groups_and_depths() {
    let code = "use crate::cpu::Pool;\nuse crate::{\n    error::Result,\n    ffn::{FfnSpec, NeuronBundles},\n    Error,\n};\nuse super::super::x::Y;\nlet a = super::quant::QK;";
    assert_eq!(
        paths_after(code, "crate::"),
        ["cpu", "error", "ffn", "Error"]
    );
    assert_eq!(paths_after(code, "super::"), ["quant"]);
    assert_eq!(paths_after(code, "super::super::"), ["x"]);
    let face = "mod a;\npub use a::{Item, b::Deep as Shallow};\npub(crate) use c::helper;";
    let r = reexports(face);
    assert_eq!(r["Item"], "a");
    assert_eq!(r["Shallow"], "a");
    assert_eq!(r["helper"], "c");
}

/// The check fails on an upward use: a throwaway folder where a leaf imports, through the face's
/// re-export, a module that comes after it.
#[test]
fn an_upward_use_fails() {
    let dir = std::env::temp_dir().join(format!("powerinfer-layout-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("top")).unwrap();
    std::fs::write(
        dir.join("lib.rs"),
        "mod leaf;\nmod top;\npub use top::Top;\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("top/mod.rs"),
        "use crate::leaf::Leaf;\npub struct Top(Leaf);\n",
    )
    .unwrap();
    std::fs::write(dir.join("leaf.rs"), "pub struct Leaf;\n").unwrap();
    let folder = Folder {
        dir: dir.clone(),
        module: "",
        order: &["leaf", "top", "mod"],
    };
    assert_eq!(upward_uses(&folder), Vec::<String>::new());
    std::fs::write(
        dir.join("leaf.rs"),
        "// crate::Top in a comment is no use\npub struct Leaf;\nfn f(_: crate::Top) {}\n",
    )
    .unwrap();
    let bad = upward_uses(&folder);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        bad,
        ["leaf.rs: `leaf` uses `top` (crate::Top), which comes after it"]
    );
}

#[test]
fn layered_folders_import_only_downward() {
    let mut bad = Vec::new();
    for (folder, name) in folders() {
        for b in upward_uses(&folder) {
            bad.push(format!("{name} ({}): {b}", folder.dir.display()));
        }
    }
    assert!(bad.is_empty(), "imports that run up:\n{}", bad.join("\n"));
}

/// The `powerinfer*` crates a manifest's `[dependencies]` names.
fn our_deps(manifest: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(manifest))
        .unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps && line.starts_with("powerinfer") {
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            out.insert(name);
        }
    }
    out
}

#[test]
fn crate_graph_points_inward() {
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        our_deps("Cargo.toml"),
        set(&[]),
        "the engine depends on none of ours"
    );
    assert_eq!(our_deps("adapters/candle/Cargo.toml"), set(&["powerinfer"]));
    assert_eq!(
        our_deps("tools/data/Cargo.toml"),
        set(&[]),
        "the data fetcher depends on none of ours (the mistral.rs workspace takes it)"
    );
    assert_eq!(
        our_deps("adapters/cli/Cargo.toml"),
        set(&["powerinfer", "powerinfer-candle", "powerinfer-data"])
    );
    assert_eq!(
        our_deps("adapters/mistralrs/Cargo.toml"),
        set(&["powerinfer-data"]),
        "the mistral.rs example reaches the engine only through the patched mistralrs-core"
    );
}
