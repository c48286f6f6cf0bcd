//! The model table and the cache's verification marker, without a registry: no test here
//! downloads.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use powerinfer_data::{marker_path, model_in, verified, Error, Model, Verified};

/// sha256("abc").
const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-data-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn set_mtime(p: &std::path::Path, t: SystemTime) {
    fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

#[test]
fn model_names_round_trip() {
    let names: Vec<&str> = Model::ALL.iter().map(|m| m.name()).collect();
    assert_eq!(
        names,
        [
            "smollm2",
            "gemma3-270m",
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-1.5b"
        ]
    );
    for m in Model::ALL {
        assert_eq!(m.name().parse::<Model>().unwrap(), m);
        assert_eq!(m.to_string().to_uppercase().parse::<Model>().unwrap(), m);
        assert_eq!(m.sha256().len(), 64, "{m}");
        assert!(m
            .sha256()
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert!(m.file_name().ends_with(".gguf") && m.size() > 0, "{m}");
        assert!(
            !m.architecture().is_empty() && !m.licence().is_empty(),
            "{m}"
        );
        assert!(m.source().starts_with("PyPI "), "{m}");
    }
    assert_eq!(Model::SmolLM2.file_name(), powerinfer_data::SMOLLM2_FILE);
    assert_eq!(Model::Gemma3_270M.architecture(), "gemma3");
    assert!(Model::Gemma3_270M.licence().contains("Gemma Terms of Use"));
    let e = "llama-7b".parse::<Model>().expect_err("unknown");
    assert!(matches!(e, Error::UnknownModel { .. }), "{e}");
    assert!(e.to_string().contains("qwen2.5-coder-1.5b"), "{e}");
    fn send_sync<T: Send + Sync + 'static>(_: &T) {}
    send_sync(&e);
}

#[test]
fn marker_spares_rehashing_an_unchanged_file_only() {
    let dir = temp_dir("marker");
    let f = dir.join("m.gguf");
    fs::write(&f, b"abc").unwrap();
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    set_mtime(&f, t0);
    let hashed = std::cell::Cell::new(0);
    let mut log = |m: &str| {
        assert!(m.starts_with("checking sha256 of "), "{m}");
        hashed.set(hashed.get() + 1);
    };

    assert_eq!(verified(&f, 3, ABC, &mut log).unwrap(), Verified::Hashed);
    let marker = fs::read_to_string(marker_path(&f)).unwrap();
    assert_eq!(marker.trim(), format!("3 1700000000000000000 {ABC}"));
    assert_eq!(verified(&f, 3, ABC, &mut log).unwrap(), Verified::Marker);
    assert_eq!(hashed.get(), 1, "only the first check hashes");

    // Another pinned sum or size is not vouched for by this marker.
    let other = "0".repeat(64);
    let e = verified(&f, 3, &other, &mut log).expect_err("other sum");
    assert!(matches!(e, Error::Checksum { .. }), "{e}");
    assert!(!marker_path(&f).exists(), "a failed check drops the marker");
    assert_eq!(verified(&f, 3, ABC, &mut log).unwrap(), Verified::Hashed);

    // A touched but unchanged file is re-hashed, accepted, and marked anew.
    set_mtime(&f, t0 + Duration::from_secs(1));
    assert_eq!(verified(&f, 3, ABC, &mut log).unwrap(), Verified::Hashed);
    assert_eq!(verified(&f, 3, ABC, &mut log).unwrap(), Verified::Marker);

    // Same size, new content and mtime: re-hashed, refused, and stays refused.
    fs::write(&f, b"abd").unwrap();
    set_mtime(&f, t0 + Duration::from_secs(2));
    let n = hashed.get();
    let e = verified(&f, 3, ABC, &mut log).expect_err("modified");
    assert!(matches!(e, Error::Checksum { .. }), "{e}");
    assert_eq!(hashed.get(), n + 1, "the modified file was hashed");
    assert!(verified(&f, 3, ABC, &mut log).is_err());

    // A different size is re-hashed too (and a forged marker does not help).
    fs::write(&f, b"abcd").unwrap();
    set_mtime(&f, t0);
    fs::write(marker_path(&f), format!("3 1700000000000000000 {ABC}\n")).unwrap();
    assert!(matches!(
        verified(&f, 3, ABC, &mut log),
        Err(Error::Checksum { .. })
    ));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cached_chunk_model_is_checked_not_fetched() {
    // A wrong file in the cache is a checksum error for every model: never used, never
    // silently refetched.
    let dir = temp_dir("chunk-cache");
    fs::create_dir_all(dir.join("models")).unwrap();
    for m in Model::ALL {
        fs::write(dir.join("models").join(m.file_name()), b"not the model").unwrap();
        let e = model_in(&dir, m, &mut |_| ()).expect_err("corrupt");
        assert!(matches!(e, Error::Checksum { .. }), "{m}: {e}");
    }
    fs::remove_dir_all(&dir).unwrap();
}
