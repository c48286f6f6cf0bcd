//! The properties the fuzz targets in `fuzz/` check, one function per target, each taking the
//! fuzzer's bytes. Every function returns normally when the property holds and panics (with
//! what was wrong) when it does not, so a fuzzer reports the input, and `tests/replay.rs` feeds
//! the committed corpus and every crash input found so far (`fuzz/corpus/<target>`,
//! `fuzz/regressions/<target>`) through the same function on stable Rust.
//!
//! The properties: a file reader returns a value that satisfies the format's invariants or a
//! typed error, never a panic and never an allocation beyond a small multiple of the input
//! (the fuzzers run with libFuzzer's `-malloc_limit_mb`); the planner never passes its budget;
//! the FFN equals the dense reference on the same stored weights, or returns a typed error.

mod bytes;
mod ffn;
mod files;

pub use ffn::{forward, hostile_indices, placement};
pub use files::{artifact, gguf, gpuidx, safetensors};

/// A property: returns when it holds, panics when it does not.
pub type Property = fn(&[u8]);

/// Every target: its name (the directory under `fuzz/corpus` and `fuzz/regressions`) and its
/// property.
pub const TARGETS: &[(&str, Property)] = &[
    ("gguf", gguf),
    ("gpuidx", gpuidx),
    ("artifact", artifact),
    ("safetensors", safetensors),
    ("placement", placement),
    ("forward", forward),
    ("hostile_indices", hostile_indices),
];
