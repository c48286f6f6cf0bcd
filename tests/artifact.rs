//! The `.powerinfer` artifact: round trip, model mismatch, truncated and corrupted files.

use half::f16;
use powerinfer::analysis::QUANTILE_STEPS;
use powerinfer::{
    format::ArtifactMeta, format::AttentionRuleMeta, format::CalibrationSummary,
    format::InputRuleMeta, format::LayerMeta, format::LayerTensors, Artifact, ErrorKind,
    InputThresholds,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

const SHA: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

fn sample(layers: usize, hidden: usize, n: usize, rank: usize) -> Artifact {
    let mut rng = StdRng::seed_from_u64(7);
    let mut v = |k: usize| -> Vec<f32> { (0..k).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let tensors: Vec<LayerTensors> = (0..layers)
        .map(|l| LayerTensors {
            fc1: v(rank * hidden).into_iter().map(f16::from_f32).collect(),
            fc2: v(n * rank).into_iter().map(f16::from_f32).collect(),
            fc2_bias: v(n),
            hot: (0..n as u32)
                .filter(|i| (i + l as u32).is_multiple_of(3))
                .collect(),
            counts: (0..n as u32).map(|i| i * 7 + l as u32).collect(),
            score_quantiles: (0..=QUANTILE_STEPS).map(|k| k as f32 * 0.1).collect(),
            h_quantiles: (0..=QUANTILE_STEPS).map(|k| k as f32 * 0.01).collect(),
        })
        .collect();
    let meta = ArtifactMeta {
        model_sha256: SHA.into(),
        model_file: "model.gguf".into(),
        budget: 1 << 30,
        hot_bytes: 1000,
        predictor_bytes: 2000,
        calibration: CalibrationSummary {
            sources: vec!["1999.txt".into(), "1998.txt".into()],
            tokens: 12345,
            threshold_tokens: 1000,
            train_rows: 100,
            val_rows: 20,
            target_sparsity: 0.4,
            target_recall: 0.9,
            rank,
            epochs: 3,
            seconds: 12.5,
        },
        layers: (0..layers)
            .map(|l| LayerMeta {
                hidden,
                intermediate: n,
                activation: "silu".into(),
                gated: true,
                h_threshold: 0.01 * l as f32,
                rank,
                score_threshold: -0.5 + l as f32,
                val_recall: 0.91,
                val_precision: 0.7,
                val_predicted: 0.8,
                val_truth: 0.6,
                val_mass: 0.95,
            })
            .collect(),
        input_rule: Some(InputRuleMeta {
            score: "teal".into(),
            target: 0.25,
            allocation: [0.19, 0.19, 0.375],
            layer_allocations: (0..layers).map(|l| [0.1 * l as f64, 0.2, 0.4]).collect(),
            tokens: 2048,
            thresholds: (0..layers)
                .map(|l| InputThresholds {
                    gate: 0.1 * l as f32,
                    up: 0.2,
                    down: 0.003,
                })
                .collect(),
            attention: Some(AttentionRuleMeta {
                fraction: 0.2,
                thresholds: (0..layers).map(|l| [0.05 * l as f32, 0.01]).collect(),
            }),
        }),
    };
    Artifact {
        meta,
        layers: tensors,
    }
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("powerinfer-artifact-{name}-{}", std::process::id()))
}

fn artifact_error(path: &std::path::Path) -> String {
    let e = Artifact::load(path).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Artifact { .. }),
        "expected an Artifact error, got {e:?}"
    );
    e.to_string()
}

#[test]
fn round_trip_is_identical() {
    let a = sample(3, 64, 96, 8);
    let p = temp("roundtrip");
    a.save(&p).unwrap();
    let b = Artifact::load(&p).unwrap();
    assert_eq!(a, b);
    // The predictor and placement it yields are usable.
    let pred = b.predictor(1, None).unwrap();
    assert_eq!(pred.dims(), (64, 96));
    assert_eq!(pred.threshold(), 0.5);
    assert_eq!(b.placement(2).unwrap().hot(), a.layers[2].hot.as_slice());
    std::fs::remove_file(p).unwrap();
}

/// `a` saved with its metadata JSON edited by `edit` and the format version set to `version`.
fn save_edited(
    a: &Artifact,
    name: &str,
    version: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> std::path::PathBuf {
    let p = temp(name);
    a.save(&p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let md = header["__metadata__"].as_object_mut().unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(md["meta"].as_str().unwrap()).unwrap();
    edit(&mut meta);
    md.insert("meta".into(), serde_json::Value::String(meta.to_string()));
    md.insert(
        "format_version".into(),
        serde_json::Value::String(version.into()),
    );
    let mut h = serde_json::to_vec(&header).unwrap();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&p, out).unwrap();
    p
}

#[test]
fn version_1_loads_without_an_input_rule_and_bad_rules_are_refused() {
    let a = sample(2, 32, 64, 4);
    // A version 1 file: no `input_rule` in its metadata.
    let p = save_edited(&a, "v1", "1", |m| {
        m.as_object_mut().unwrap().remove("input_rule");
    });
    let b = Artifact::load(&p).unwrap();
    assert_eq!(b.meta.input_rule, None);
    assert_eq!(b.layers, a.layers);
    let p3 = save_edited(&a, "v3", "3", |_| {});
    assert!(artifact_error(&p3).contains("versions 1 and 2"));
    let bad = [
        ("score", serde_json::json!("relu")),
        (
            "thresholds",
            serde_json::json!([{"gate": 0.0, "up": 0.0, "down": 0.0}]),
        ),
        (
            "thresholds",
            serde_json::json!([{"gate": -1.0, "up": 0.0, "down": 0.0}, {"gate": 0.0, "up": 0.0, "down": 0.0}]),
        ),
    ];
    for (i, (field, v)) in bad.into_iter().enumerate() {
        let p = save_edited(&a, &format!("badrule{i}"), "2", |m| {
            m["input_rule"][field] = v.clone();
        });
        let msg = artifact_error(&p);
        assert!(msg.contains("input") || msg.contains("relu"), "{msg}");
        std::fs::remove_file(p).unwrap();
    }
    // The attention part: one pair per layer, finite, at least 0; a rule without it loads.
    let bad = [
        serde_json::json!([[0.0, 0.0]]),
        serde_json::json!([[0.0, 0.0], [0.1, -1.0]]),
    ];
    for (i, v) in bad.into_iter().enumerate() {
        let p = save_edited(&a, &format!("badattention{i}"), "2", |m| {
            m["input_rule"]["attention"]["thresholds"] = v.clone();
        });
        assert!(artifact_error(&p).contains("attention rule"));
        std::fs::remove_file(p).unwrap();
    }
    let p2 = save_edited(&a, "noattention", "2", |m| {
        m["input_rule"].as_object_mut().unwrap().remove("attention");
    });
    let r = Artifact::load(&p2).unwrap().meta.input_rule.unwrap();
    assert_eq!((r.attention, r.thresholds.len()), (None, 2));
    std::fs::remove_file(p2).unwrap();
    for p in [p, p3] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn another_models_artifact_is_refused() {
    let a = sample(1, 32, 32, 4);
    a.check_model(SHA).unwrap();
    a.check_model(&SHA.to_uppercase()).unwrap();
    let other = "0".repeat(64);
    let e = a.check_model(&other).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::ArtifactMismatch { .. }));
    let msg = e.to_string();
    assert!(msg.contains("model.gguf") && msg.contains(&other), "{msg}");
}

#[test]
fn truncated_and_corrupted_files_are_typed_errors() {
    let a = sample(2, 32, 64, 4);
    let p = temp("good");
    a.save(&p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let bad = temp("bad");
    // Every truncation point, coarsely: a typed error, never a panic.
    for cut in (0..bytes.len()).step_by(97).chain([bytes.len() - 1]) {
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        artifact_error(&bad);
    }
    // Flipped bytes anywhere (header included): an error or an equal-shaped artifact, no panic.
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..200 {
        let mut b = bytes.clone();
        let i = rng.random_range(0..b.len());
        b[i] ^= 1 << rng.random_range(0..8);
        std::fs::write(&bad, &b).unwrap();
        if let Err(e) = Artifact::load(&bad) {
            assert!(matches!(e.kind(), ErrorKind::Artifact { .. }), "{e:?}");
        }
    }
    // Not a safetensors file at all, or one without our metadata.
    std::fs::write(&bad, b"hello").unwrap();
    assert!(artifact_error(&bad).contains("safetensors"));
    let missing = temp("missing");
    let e = Artifact::load(&missing).unwrap_err();
    assert!(e.to_string().contains("reading"), "{e}");
    std::fs::remove_file(p).unwrap();
    std::fs::remove_file(bad).unwrap();
}

#[test]
fn inconsistent_artifacts_are_not_written() {
    let p = temp("inconsistent");
    // NaN in a predictor weight.
    let mut a = sample(1, 32, 32, 4);
    a.layers[0].fc1[3] = f16::NAN;
    assert!(matches!(
        a.save(&p).unwrap_err().kind(),
        ErrorKind::Artifact { .. }
    ));
    // A hot neuron out of range.
    let mut a = sample(1, 32, 32, 4);
    a.layers[0].hot.push(32);
    assert!(a.save(&p).unwrap_err().to_string().contains("32"));
    // Tensors that disagree with the metadata.
    let mut a = sample(2, 32, 32, 4);
    a.layers[1].fc2.pop();
    assert!(a.save(&p).unwrap_err().to_string().contains("layer 1"));
    // More bytes placed than the budget allows.
    let mut a = sample(1, 32, 32, 4);
    a.meta.budget = 10;
    assert!(a.save(&p).unwrap_err().to_string().contains("budget"));
    // An unknown activation.
    let mut a = sample(1, 32, 32, 4);
    a.meta.layers[0].activation = "swish9".into();
    assert!(a.save(&p).unwrap_err().to_string().contains("swish9"));
    assert!(!p.exists());
}

#[test]
fn install_checks_the_spec_and_sets_predictor_and_placement() {
    use candle_core::{Device, Tensor};
    use powerinfer::{Activation, FfnSpec, FfnWeights, HybridFfn, HybridOptions, WeightDType};
    let (hidden, n) = (64, 96);
    let a = sample(2, hidden, n, 8);
    let ffn = |n: usize| {
        let w = |r: usize, c: usize| Tensor::randn(0f32, 0.1, (r, c), &Device::Cpu).unwrap();
        let (g, u, d) = (w(n, hidden), w(n, hidden), w(hidden, n));
        let spec = FfnSpec::gated(hidden, n, Activation::Silu).unwrap();
        let opts = HybridOptions {
            threads: 1,
            ..Default::default()
        };
        let weights = FfnWeights::gated(&g, &u, &d);
        HybridFfn::from_weights(spec, weights, WeightDType::F32, opts).unwrap()
    };
    let mut f = ffn(n);
    a.install(1, &mut f, None).unwrap();
    assert_eq!(f.placement().hot(), &a.layers[1].hot[..]);
    let stored = format!("{:?}", f.predictor());
    assert!(
        stored.contains("rank: 8") && stored.contains("threshold: 0.5"),
        "{stored}"
    );
    a.install(1, &mut f, Some(0.5)).unwrap();
    let chosen = format!("{:?}", f.predictor());
    assert!(chosen.contains("rank: 8") && chosen != stored, "{chosen}");

    let e = a.install(1, &mut f, Some(0.99)).unwrap_err().to_string();
    assert!(e.contains("outside the artifact's sweep"), "{e}");
    let e = a.install(2, &mut f, None).unwrap_err().to_string();
    assert!(e.contains("layer 2 is past the artifact"), "{e}");
    let e = a
        .install(0, &mut ffn(n + 32), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 0 was analyzed as"), "{e}");
}

#[test]
fn model_fingerprint_is_the_file_hash_or_the_hash_of_sorted_hashes() {
    let d = temp("fingerprint");
    std::fs::create_dir_all(&d).unwrap();
    let (a, b) = (d.join("a.safetensors"), d.join("config.json"));
    std::fs::write(&a, b"weights").unwrap();
    std::fs::write(&b, b"{}").unwrap();
    let one = powerinfer::format::model_sha256(std::slice::from_ref(&a)).unwrap();
    assert_eq!(
        one,
        "9a129038d9a00aed0cf6a7ea059ca50a813449061ab87848cf1a13eafdf33b2c", // sha256("weights")
    );
    let ab = powerinfer::format::model_sha256(&[a.clone(), b.clone()]).unwrap();
    let ba = powerinfer::format::model_sha256(&[b.clone(), a.clone()]).unwrap();
    assert_eq!(ab, ba, "order of the files given must not matter");
    assert_ne!(ab, one);
    std::fs::write(&a, b"weightz").unwrap();
    assert_ne!(
        powerinfer::format::model_sha256(&[a.clone(), b.clone()]).unwrap(),
        ab
    );
    let e = powerinfer::format::model_sha256(&[d.join("missing.gguf")]).unwrap_err();
    assert!(e.to_string().contains("missing.gguf"), "{e}");
    assert!(powerinfer::format::model_sha256(&[]).is_err());
    std::fs::remove_dir_all(d).ok();
}

/// Accessors past the end are typed errors or `None`, never a panic.
#[test]
fn accessors_out_of_range() {
    let a = sample(2, 32, 64, 4);
    for l in [2, 99] {
        assert!(a.predictor(l, None).is_err());
        assert!(a.placement(l).is_err());
        assert!(a.spec(l).is_err());
    }
    let mut set = powerinfer::predict::ActiveSet::new();
    set.reset(2, 70);
    set.insert(1, 69).unwrap();
    assert_eq!(set.contains(1, 69), Some(true));
    assert_eq!(set.contains(0, 69), Some(false));
    assert_eq!((set.contains(2, 0), set.contains(0, 70)), (None, None));
    assert_eq!((set.row_count(1), set.row_count(2)), (Some(1), None));
    let mut s = powerinfer::analysis::Samples::new(2, 3, 0.5);
    s.push(&[1.0, 2.0], &[0.1, 0.9, 0.0]).unwrap();
    assert_eq!(s.is_active(0, 1), Some(true));
    assert_eq!(s.is_active(0, 0), Some(false));
    assert_eq!((s.is_active(1, 0), s.is_active(0, 3)), (None, None));
}
