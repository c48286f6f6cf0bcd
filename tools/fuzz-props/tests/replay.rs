//! Replays the committed fuzz corpus (`fuzz/corpus/<target>`: the seeds and what the fuzzers
//! kept) and every crash input found so far (`fuzz/regressions/<target>`) through the
//! properties the fuzz targets check, on stable Rust: what a fuzzer once found stays fixed.

use std::path::PathBuf;

fn files(dir: &PathBuf) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.is_file());
    v.sort();
    v
}

#[test]
fn corpus_and_crash_inputs_hold_their_properties() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut failed = Vec::new();
    for &(name, property) in powerinfer_fuzz_props::TARGETS {
        let corpus = files(&root.join("corpus").join(name));
        let crashes = files(&root.join("regressions").join(name));
        assert!(
            !corpus.is_empty(),
            "fuzz/corpus/{name} is empty: `cargo run -p powerinfer-fuzz-props --example seeds`"
        );
        for f in corpus.iter().chain(&crashes) {
            let bytes = std::fs::read(f).expect("read a corpus file");
            if std::panic::catch_unwind(|| property(&bytes)).is_err() {
                failed.push(f.display().to_string());
            }
        }
        eprintln!(
            "{name}: {} corpus files, {} crash inputs",
            corpus.len(),
            crashes.len()
        );
    }
    assert!(failed.is_empty(), "properties broken by: {failed:#?}");
}

/// The file seeds are valid files, so the fuzzers start deep inside the readers: every GGUF
/// seed loads as a model and runs, the `.gpuidx`, artifact and checkpoint seeds load.
#[test]
fn file_seeds_are_valid() {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let seeds = |t: &str| -> Vec<PathBuf> {
        let mut v = files(&corpus.join(t));
        v.retain(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        });
        assert!(!v.is_empty(), "no seed for {t}");
        v
    };
    for f in seeds("gguf") {
        let mut g = powerinfer_candle::GgufFile::open(&f).unwrap();
        let mut m =
            powerinfer_candle::load_gguf(&mut g, &powerinfer_candle::FfnMode::Dense).unwrap();
        m.forward(&[1, 2], 0).unwrap();
    }
    for f in seeds("gpuidx") {
        let b = std::fs::read(&f).unwrap();
        let layers = 1 + u16::from_le_bytes([b[0], b[1]]) as usize;
        let n = 1 + u16::from_le_bytes([b[2], b[3]]) as usize;
        powerinfer::format::parse_gpuidx(&b[4..], "seed", layers, n).unwrap();
    }
    for f in seeds("artifact") {
        powerinfer::Artifact::load(&f).unwrap();
    }
    for f in seeds("safetensors") {
        let b = std::fs::read(&f).unwrap();
        let len = u16::from_le_bytes([b[0], b[1]]) as usize;
        let dir =
            std::env::temp_dir().join(format!("powerinfer-seed-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), &b[2..2 + len]).unwrap();
        std::fs::write(dir.join("model.safetensors"), &b[2 + len..]).unwrap();
        let mut m =
            powerinfer_candle::load_safetensors(&dir, &powerinfer_candle::FfnMode::Dense).unwrap();
        m.forward(&[1, 2], 0).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
