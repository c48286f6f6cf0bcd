//! This process's resident memory, for `bench`'s per-row peaks: Linux's `/proc/self/status`
//! (`VmHWM`, the peak; reset by writing `5` to `/proc/self/clear_refs`). Elsewhere nothing is
//! measured and the rows say so.

/// Resets the peak to what is resident now. `false` where the system cannot.
pub(crate) fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The peak resident bytes since the last [`reset_peak`] (or the start).
pub(crate) fn peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_kib(&status, "VmHWM:").map(|k| k * 1024)
}

/// Resident bytes now.
pub(crate) fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_kib(&status, "VmRSS:").map(|k| k * 1024)
}

/// Logs (at `-v`) the resident and peak memory at step `what` of a load.
pub(crate) fn trace(what: &str) {
    let mb = |b: Option<u64>| b.map_or(f64::NAN, |b| b as f64 / 1e6);
    tracing::info!(
        "{what}: {:.0} MB resident, peak {:.0} MB",
        mb(resident_bytes()),
        mb(peak_bytes())
    );
}

/// The value in KiB of the `/proc/PID/status` line starting with `key`.
fn status_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

/// The bytes a model's file (or directory of safetensors) takes on disk.
pub(crate) fn file_bytes(path: &std::path::Path) -> u64 {
    if !path.is_dir() {
        return std::fs::metadata(path).map_or(0, |m| m.len());
    }
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// The f32 KV cache of `positions` positions: keys and values of every layer's KV heads.
pub(crate) fn kv_bytes(cfg: &powerinfer_candle::LlamaConfig, positions: usize) -> u64 {
    (2 * cfg.layers * cfg.kv_heads * cfg.head_dim * positions * 4) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_status_lines() {
        let s = "Name:\tx\nVmHWM:\t  123456 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(status_kib(s, "VmHWM:"), Some(123_456));
        assert_eq!(status_kib(s, "VmRSS:"), Some(1000));
        assert_eq!(status_kib(s, "VmSwap:"), None);
        assert_eq!(status_kib("VmHWM: lots", "VmHWM:"), None);
        #[cfg(target_os = "linux")]
        {
            assert!(reset_peak());
            let big = std::hint::black_box(vec![1u8; 64 << 20]);
            let peak = peak_bytes().unwrap();
            assert!(peak >= 64 << 20, "{peak}");
            drop(big);
        }
    }
}
