//! The shape of the house, checked on the sources: the engine's top-level modules form a chain in
//! which each depends only on modules before it (so the module graph has no cycle), and the
//! crate graph points inward: CLI -> adapters -> engine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The engine's modules in dependency order (ARCHITECTURE.md's code map lists them so): a module
/// may use only the modules before it.
const ORDER: [&str; 13] = [
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
];

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

/// `crate::NAME` paths used in code (comments and doc links skipped), by top-level module.
fn module_deps() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for name in crate_paths(&code) {
            if name != module {
                deps.entry(module.clone()).or_default().insert(name);
            }
        }
    }
    deps
}

/// The top-level modules `code` names after `crate::`: `crate::m::X` and every entry of a group,
/// `crate::{m::X, n::{Y, Z}}` (over several lines too). Root items (`crate::Error`) name none.
fn crate_paths(code: &str) -> Vec<String> {
    let module = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level entries, up to its closing brace.
            let (mut depth, mut start) = (0usize, 0usize);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(module(&group[start..j]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(module(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(module(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

#[test]
fn crate_paths_read_groups() {
    let code = "use crate::cpu::Pool;\nuse crate::{\n    error::Result,\n    ffn::{FfnSpec, NeuronBundles},\n    Error,\n};";
    assert_eq!(crate_paths(code), ["cpu", "error", "ffn"]);
}

#[test]
fn engine_modules_depend_only_on_earlier_ones() {
    let deps = module_deps();
    assert!(deps.len() >= 8, "found too few modules: {deps:?}");
    for (module, used) in &deps {
        if module == "lib" {
            continue;
        }
        let at = ORDER
            .iter()
            .position(|m| m == module)
            .unwrap_or_else(|| panic!("module `{module}` is not in the documented order"));
        for u in used {
            let before = ORDER.iter().position(|m| m == u);
            assert!(
                before.is_some_and(|b| b < at),
                "`{module}` uses `crate::{u}`, which is not before it in {ORDER:?}"
            );
        }
    }
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
