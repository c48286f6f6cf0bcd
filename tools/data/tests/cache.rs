//! The cache refuses what it did not fetch: a wrong file is a checksum error, never used.

use powerinfer_data::{smollm2_in, speeches, Error, SMOLLM2_FILE};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn corrupt_cached_model_is_a_checksum_error() {
    let dir = temp_dir("cache");
    std::fs::create_dir_all(dir.join("models")).unwrap();
    std::fs::write(dir.join("models").join(SMOLLM2_FILE), b"not the model").unwrap();
    let e = smollm2_in(&dir, &mut |_| ()).expect_err("corrupt");
    assert!(matches!(e, Error::Checksum { .. }), "{e}");
    assert!(e.to_string().contains("delete it to refetch"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn speeches_are_filtered_by_year_and_sorted() {
    let dir = temp_dir("speeches");
    for f in [
        "2001_b_x.txt",
        "1999_a_y.txt",
        "2000_c_z.txt",
        "2000_notes.md",
        "abcd.txt",
    ] {
        std::fs::write(dir.join(f), "text").unwrap();
    }
    let got: Vec<String> = speeches(&dir, 1999..=2000)
        .unwrap()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(got, ["1999_a_y.txt", "2000_c_z.txt"]);
    let e = speeches(&dir.join("missing"), 1..=2).expect_err("no dir");
    assert!(matches!(e, Error::Io { .. }), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
