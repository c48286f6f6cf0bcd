//! The input rules `--input-target auto` chose, cached per model file: the search scores held-out
//! text several times (minutes on a 1.5B model), so it runs once per file and settings.
//!
//! A cache entry is `<cache>/rules/<file stem>-<hash>.json` holding the whole key (the model's
//! canonical path, size and modification time, the rule's options, the search, the token
//! counts), the rule and the trials. An entry whose key differs, or that does not parse, is a
//! miss: the rule is searched again and the entry rewritten.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};
use powerinfer::format::InputRuleMeta;
use powerinfer_candle::{InputRuleOptions, TargetSearch, TargetTrial};

/// Bump when the search or the calibration text changes what a key gives.
const VERSION: u32 = 3;

/// What a cached rule was made from, and where it lives.
pub(crate) struct Key {
    text: String,
    path: PathBuf,
}

impl Key {
    /// The key of the rule for `model` with these settings.
    pub(crate) fn new(
        model: &Path,
        opts: &InputRuleOptions,
        search: &TargetSearch,
        calibration_tokens: usize,
        held_tokens: usize,
    ) -> Result<Self> {
        let canonical = model
            .canonicalize()
            .with_context(|| format!("reading {}", model.display()))?;
        let meta = std::fs::metadata(&canonical)
            .with_context(|| format!("reading {}", canonical.display()))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let text = format!(
            "v{VERSION} {} {} {mtime} {opts:?} {search:?} calibration {calibration_tokens} held \
             {held_tokens}",
            canonical.display(),
            meta.len(),
        );
        let stem = canonical
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        let path = powerinfer_data::cache_dir()
            .join("rules")
            .join(format!("{stem}-{:016x}.json", fnv1a(text.as_bytes())));
        Ok(Key { text, path })
    }

    /// The cached rule, if the entry exists and was made from this key.
    pub(crate) fn read(&self) -> Option<InputRuleMeta> {
        let raw = std::fs::read_to_string(&self.path).ok()?;
        let v: serde_json::Value = serde_json::from_str(&raw).ok()?;
        if v["key"].as_str() != Some(self.text.as_str()) {
            return None;
        }
        serde_json::from_value(v["rule"].clone()).ok()
    }

    /// The cache entry's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Saves `rule` and the trials that chose it (a failure to write only costs a search next
    /// time, so it is a warning).
    pub(crate) fn write(&self, rule: &InputRuleMeta, kinds: &[&str], trials: &[TargetTrial]) {
        let trials: Vec<_> = trials
            .iter()
            .map(|t| serde_json::json!({"target": t.target, "losses": t.losses}))
            .collect();
        let v =
            serde_json::json!({"key": self.text, "kinds": kinds, "trials": trials, "rule": rule});
        let tmp = self
            .path
            .with_extension(format!("tmp{}", std::process::id()));
        let saved = self
            .path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, v.to_string()))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = saved {
            let _ = std::fs::remove_file(&tmp);
            eprintln!(
                "warning: could not cache the input rule in {}: {e}",
                self.path.display()
            );
        }
    }
}

/// FNV-1a, 64 bits: a stable name for a key (std's hasher may change between releases; the
/// file name only has to be stable, the key itself is compared in full).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
