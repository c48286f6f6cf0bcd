//! The pictures: every function writes a PNG and an SVG, on synthetic data shaped like a real
//! analysis (30 layers x 1536 neurons, power-law frequencies) and on the edge cases (empty, one
//! layer, zeros, NaN/inf, a budget of 0). Set `POWERINFER_PLOTS_DIR` to keep the files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use powerinfer_cli::{
    frequency_curves, frequency_heatmap, placement_split, sparsity_perplexity, speed, Series,
    SpeedRow, SplitLayer,
};

/// A fresh folder per test: under `POWERINFER_PLOTS_DIR` when set (kept), else a temp dir.
struct OutDir {
    path: PathBuf,
    keep: bool,
}

impl OutDir {
    fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        if let Some(root) = std::env::var_os("POWERINFER_PLOTS_DIR") {
            return Self {
                path: PathBuf::from(root).join(name),
                keep: true,
            };
        }
        let unique = format!(
            "powerinfer-plots-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            path: std::env::temp_dir().join(unique),
            keep: false,
        }
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Both files exist, the PNG is a PNG of `size`, the SVG is an SVG.
fn check(paths: &[PathBuf], dir: &Path, stem: &str, size: (u32, u32)) {
    assert_eq!(
        paths,
        [
            dir.join(format!("{stem}.png")),
            dir.join(format!("{stem}.svg"))
        ]
    );
    let png = std::fs::read(&paths[0]).unwrap();
    assert!(png.len() > 1000, "PNG of {} bytes", png.len());
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert_eq!((w, h), size);
    let svg = std::fs::read_to_string(&paths[1]).unwrap();
    let head = svg.trim_start();
    assert!(
        head.starts_with("<svg") || head.starts_with("<?xml"),
        "{}",
        &head[..40.min(head.len())]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("<text"), "SVG without text");
}

/// Deterministic power-law frequencies: layer `l`'s neuron at rank `r` fires with
/// 0.9 (r + 1)^-(0.5 + l / 40), ranks shuffled over neuron indices.
fn power_law(layers: usize, neurons: usize) -> Vec<Vec<f64>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..layers)
        .map(|l| {
            let alpha = 0.5 + l as f64 / 40.0;
            let mut row: Vec<f64> = (0..neurons)
                .map(|r| 0.9 * ((r + 1) as f64).powf(-alpha))
                .collect();
            for i in (1..row.len()).rev() {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                row.swap(i, (state >> 33) as usize % (i + 1));
            }
            row
        })
        .collect()
}

#[test]
fn frequency_curves_power_law() {
    let out = OutDir::new("curves");
    let freqs = power_law(30, 1536);
    let paths = frequency_curves(
        &out.path,
        "frequency_curves",
        "SmolLM2-135M: activation frequency",
        &freqs,
    )
    .unwrap();
    check(&paths, &out.path, "frequency_curves", (1000, 600));
}

#[test]
fn frequency_heatmap_power_law() {
    let out = OutDir::new("heatmap");
    let freqs = power_law(30, 1536);
    let paths = frequency_heatmap(
        &out.path,
        "frequency_heatmap",
        "SmolLM2-135M: activation frequency",
        &freqs,
    )
    .unwrap();
    check(&paths, &out.path, "frequency_heatmap", (1200, 650));
}

#[test]
fn frequency_heatmap_wide_layers_are_averaged() {
    let out = OutDir::new("heatmap-wide");
    let freqs = power_law(2, 11008);
    let paths = frequency_heatmap(&out.path, "wide", "11008 neurons", &freqs).unwrap();
    check(&paths, &out.path, "wide", (1200, 650));
    let svg = std::fs::read_to_string(&paths[1]).unwrap();
    assert!(svg.contains("mean of 12 neurons"));
    // 2 rows of ceil(11008 / 12) = 918 columns, not 2 x 11008 cells.
    assert!(svg.matches("<rect").count() < 3000);
}

fn split_layers() -> Vec<SplitLayer> {
    (0..30u64)
        .map(|l| {
            let total = 3 * 576 * 1536 * 2;
            let hot = total * (60 - l) / 100;
            SplitLayer {
                hot_bytes: hot,
                cold_bytes: total - hot,
            }
        })
        .collect()
}

#[test]
fn placement_split_against_budget() {
    let out = OutDir::new("split");
    let paths = placement_split(
        &out.path,
        "placement",
        "Hot/cold split, 64 MiB budget",
        &split_layers(),
        64 << 20,
        3 << 20,
    )
    .unwrap();
    check(&paths, &out.path, "placement", (1000, 600));
    let svg = std::fs::read_to_string(&paths[1]).unwrap();
    assert!(svg.contains("budget"));
}

#[test]
fn placement_split_budget_zero_and_zero_bytes() {
    let out = OutDir::new("split-zero");
    let cold: Vec<SplitLayer> = split_layers()
        .iter()
        .map(|l| SplitLayer {
            hot_bytes: 0,
            cold_bytes: l.hot_bytes + l.cold_bytes,
        })
        .collect();
    let paths = placement_split(&out.path, "budget0", "No budget", &cold, 0, 0).unwrap();
    check(&paths, &out.path, "budget0", (1000, 600));
    let zeros = [SplitLayer::default(); 3];
    let paths = placement_split(&out.path, "zeros", "Nothing", &zeros, 0, 0).unwrap();
    check(&paths, &out.path, "zeros", (1000, 600));
    let one = [SplitLayer {
        hot_bytes: u64::MAX,
        cold_bytes: u64::MAX,
    }];
    let paths = placement_split(
        &out.path,
        "huge",
        "One huge layer",
        &one,
        u64::MAX,
        u64::MAX,
    )
    .unwrap();
    check(&paths, &out.path, "huge", (1000, 600));
}

fn sweep() -> Vec<Series> {
    let curve = |name: &str, k: f64| Series {
        name: name.into(),
        points: [0.1, 0.3, 0.5, 0.7, 0.9]
            .iter()
            .map(|&s: &f64| (s, 16.0 * (1.0 + k * s.powi(3))))
            .collect(),
    };
    vec![
        curve("calibrated thresholds", 0.6),
        curve("one threshold", 1.5),
    ]
}

#[test]
fn sparsity_perplexity_sweep() {
    let out = OutDir::new("sweep");
    let paths = sparsity_perplexity(
        &out.path,
        "sparsity_ppl",
        "Held-out perplexity vs FFN sparsity",
        16.0,
        &sweep(),
    )
    .unwrap();
    check(&paths, &out.path, "sparsity_ppl", (1000, 600));
    let svg = std::fs::read_to_string(&paths[1]).unwrap();
    assert!(svg.contains("calibrated thresholds") && svg.contains("dense: 16.00"));
}

#[test]
fn sparsity_perplexity_log_axis_and_bad_points() {
    let out = OutDir::new("sweep-log");
    let mut series = sweep();
    series[1].points.push((0.95, 2000.0));
    series[1].points.push((f64::NAN, 20.0));
    series[0].points.push((0.2, f64::INFINITY));
    series.push(Series {
        name: "empty".into(),
        points: vec![],
    });
    let paths = sparsity_perplexity(&out.path, "log", "Blow-up at 95%", 16.0, &series).unwrap();
    check(&paths, &out.path, "log", (1000, 600));
    let svg = std::fs::read_to_string(&paths[1]).unwrap();
    assert!(svg.contains("log scale") && svg.contains("2 points with a non-finite value"));
    // Only the dense line, or only points.
    sparsity_perplexity(&out.path, "dense_only", "Dense only", 16.0, &[]).unwrap();
    sparsity_perplexity(&out.path, "no_dense", "No dense", f64::NAN, &sweep()[..1]).unwrap();
}

#[test]
fn empty_inputs_are_errors_naming_the_problem() {
    let out = OutDir::new("empty");
    let err = |r: anyhow::Result<Vec<PathBuf>>| format!("{:#}", r.unwrap_err());
    assert!(err(frequency_curves(&out.path, "a", "t", &[])).contains("no layers"));
    assert!(err(frequency_heatmap(&out.path, "a", "t", &[])).contains("no layers"));
    assert!(err(frequency_curves(&out.path, "a", "t", &[vec![], vec![]])).contains("no neurons"));
    assert!(err(frequency_heatmap(&out.path, "a", "t", &[vec![]])).contains("no neurons"));
    assert!(err(placement_split(&out.path, "a", "t", &[], 1, 0)).contains("no layers"));
    let nothing = [Series {
        name: "nan".into(),
        points: vec![(f64::NAN, 1.0), (0.5, -1.0)],
    }];
    assert!(err(sparsity_perplexity(
        &out.path,
        "a",
        "t",
        f64::INFINITY,
        &nothing
    ))
    .contains("nothing to plot"));
    let one = [vec![0.5]];
    assert!(err(frequency_curves(&out.path, "", "t", &one)).contains("file stem"));
    assert!(err(frequency_curves(&out.path, "a/b", "t", &one)).contains("file stem"));
    assert!(!out.path.join("a.png").exists());
}

#[test]
fn odd_frequencies_draw() {
    let out = OutDir::new("odd");
    let cases: [(&str, Vec<Vec<f64>>); 5] = [
        ("single_layer", power_law(1, 1536)),
        ("single_neuron", vec![vec![0.3]]),
        ("all_zero", vec![vec![0.0; 1536]; 30]),
        (
            "non_finite",
            vec![
                vec![f64::NAN, f64::INFINITY, 0.5, f64::NEG_INFINITY, 1.5, -0.1],
                vec![f64::NAN; 6],
            ],
        ),
        ("ragged", vec![vec![0.5; 100], vec![], vec![0.1; 40]]),
    ];
    for (stem, freqs) in &cases {
        let paths = frequency_curves(&out.path, &format!("{stem}_curves"), stem, freqs).unwrap();
        check(&paths, &out.path, &format!("{stem}_curves"), (1000, 600));
        let paths = frequency_heatmap(&out.path, &format!("{stem}_heatmap"), stem, freqs).unwrap();
        check(&paths, &out.path, &format!("{stem}_heatmap"), (1200, 650));
    }
    let svg = std::fs::read_to_string(out.path.join("non_finite_curves.svg")).unwrap();
    assert!(
        svg.contains("9 NaN/inf values skipped") && svg.contains("2 values outside [0, 1] clamped")
    );
}

fn speed_row(name: &str, decode_tps: f64, prompt_tps: f64) -> SpeedRow {
    SpeedRow {
        name: name.into(),
        decode_tps,
        prompt_tps,
    }
}

/// `bench --plot`: one bar pair per row, the width growing with the rows; rows with a NaN or
/// negative speed are left out, and a table with none left is an error.
#[test]
fn speed_bars_per_row() {
    let out = OutDir::new("speed");
    let rows = [
        speed_row("llama.cpp", 17.1, 120.0),
        speed_row("dense", 23.2, 160.5),
        speed_row("input", 23.2, 158.0),
    ];
    let note = "2 thread(s), prompt 32 tokens, decode 32 tokens";
    let p = speed(&out.path, "three", "model: tok/s", note, &rows).unwrap();
    check(&p, &out.path, "three", (260 + 3 * 120, 560));
    let svg = std::fs::read_to_string(&p[1]).unwrap();
    for label in ["llama.cpp", "dense", "input", "23.2", "17.1"] {
        assert!(svg.contains(label), "{label} not in the SVG");
    }
    let mut odd = rows.to_vec();
    odd.push(speed_row("nan", f64::NAN, 1.0));
    odd.push(speed_row("zero", 0.0, 0.0));
    let p = speed(&out.path, "odd", "t", "", &odd).unwrap();
    check(&p, &out.path, "odd", (260 + 4 * 120, 560));
    let bad = [speed_row("nan", f64::NAN, 1.0), speed_row("neg", -1.0, 1.0)];
    let e = speed(&out.path, "bad", "t", "", &bad).unwrap_err();
    assert!(
        format!("{e:#}").contains("no row with finite tok/s"),
        "{e:#}"
    );
    assert!(!out.path.join("bad.png").exists());
}
