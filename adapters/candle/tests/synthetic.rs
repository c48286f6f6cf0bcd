//! Synthetic llama files (`SyntheticLlama`) are real llama GGUF files: candle-transformers'
//! `quantized_llama` and our loaders read them, and agree on their logits; the tokenizer reads
//! their vocabulary; every block type it writes decodes to finite weights of about the asked
//! spread; a seed always writes the same bytes; a profile skews the FFN inputs; bad shapes and
//! profiles are typed errors.

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use powerinfer_candle::{open, FfnMode, SyntheticLlama};

fn tiny_seeded(blocks: GgmlDType, seed: u64) -> SyntheticLlama {
    SyntheticLlama {
        layers: 2,
        hidden: 256,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        vocab: 400,
        context: 128,
        blocks,
        seed,
    }
}

fn tiny(blocks: GgmlDType) -> SyntheticLlama {
    tiny_seeded(blocks, 11)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn candle_and_our_loaders_read_it_and_agree() {
    let dir = std::env::temp_dir().join(format!("powerinfer-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for blocks in [
        GgmlDType::Q4_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let spec = tiny(blocks);
        let path = dir.join(format!("{blocks:?}.gguf"));
        spec.write(&path).unwrap();

        // The weights: finite, spread about 0.02.
        let mut f = std::fs::File::open(&path).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        let w = ct
            .tensor(&mut f, "blk.0.ffn_down.weight", &Device::Cpu)
            .unwrap();
        assert_eq!(w.dtype(), blocks);
        let v: Vec<f32> = w
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt();
        assert!((0.005..0.05).contains(&std), "{blocks:?}: std {std}");

        // candle-transformers' model of the file.
        let mut peer = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
        let (mut ours, tok) = open(&path, &FfnMode::Dense).unwrap();
        let ids = tok.encode_sequence("the quick brown fox").unwrap();
        assert_eq!(ids.first(), Some(&1), "starts with <s>");
        assert!(
            ids.len() > 2 && ids.iter().all(|&i| (i as usize) < spec.vocab),
            "{ids:?}"
        );
        let x = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let want: Vec<f32> = peer
            .forward(&x, 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(want.iter().all(|x| x.is_finite()));
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let dense: Vec<f32> = ours.forward(&ids, 0).unwrap().to_vec1().unwrap();
        // The same candle ops in the same order: the same bits (measured: 0).
        assert!(
            max_abs(&dense, &want) <= 1e-5 * scale.max(1.0),
            "{blocks:?} dense: {} of {scale}",
            max_abs(&dense, &want)
        );

        // Our fused decoder on the file's blocks.
        let (mut fused, _) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
        let got: Vec<f32> = fused.forward(&ids, 0).unwrap().to_vec1().unwrap();
        // Measured: below 1e-6 of the scale for Q4_0, Q4_K and Q6_K, 1.5% for Q8_0 (whose input
        // the two quantize differently).
        assert!(
            max_abs(&got, &want) <= 0.03 * scale.max(1.0),
            "{blocks:?} fused: {} of {scale}",
            max_abs(&got, &want)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Energy share of the top tenth of a profile curve's points.
fn top_tenth(c: &[f32]) -> f32 {
    let k = c.len() / 10;
    c[..k].iter().map(|v| v * v).sum::<f32>() / c.iter().map(|v| v * v).sum::<f32>()
}

/// A profile gives the synthetic model its skew: measured back from the written file, the top
/// tenth of the FFN input channels holds far more of the energy than without it, close to the
/// profile's own share; a profile survives JSON; a bad one is refused naming the profile.
#[test]
fn a_profile_skews_the_ffn_inputs_as_measured() {
    use powerinfer_candle::{FfnProfile, LayerProfile, PROFILE_POINTS};
    let dir = std::env::temp_dir().join(format!("powerinfer-synth-prof-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A steep curve: the first 4 of 32 points 4x the rest.
    let steep: Vec<f32> = (0..PROFILE_POINTS)
        .map(|i| if i < 4 { 4.0 } else { 1.0 })
        .collect();
    let profile = FfnProfile {
        model: "steep".into(),
        tokens: 1,
        layers: vec![
            LayerProfile {
                x: steep.clone(),
                h: steep.clone()
            };
            2
        ],
    };
    let json = serde_json::to_string(&profile).unwrap();
    assert_eq!(serde_json::from_str::<FfnProfile>(&json).unwrap(), profile);
    let text: Vec<u32> = (0..256).map(|i| (i * 37 % 390 + 3) as u32).collect();
    let measured = |p: Option<&FfnProfile>, name: &str| {
        let path = dir.join(name);
        tiny(GgmlDType::Q4K).write_with(&path, p).unwrap();
        let (mut m, _) = open(&path, &FfnMode::Dense).unwrap();
        FfnProfile::measure(&mut m, name, &text, 64).unwrap()
    };
    let flat = measured(None, "flat.gguf");
    let skewed = measured(Some(&profile), "skewed.gguf");
    assert_eq!((skewed.layers.len(), skewed.tokens), (2, 256));
    let (f, s, want) = (
        top_tenth(&flat.layers[1].x),
        top_tenth(&skewed.layers[1].x),
        top_tenth(&steep),
    );
    // Measured: flat 0.17, skewed 0.57, the profile 0.52.
    assert!(
        s > f + 0.15 && (s - want).abs() < 0.15,
        "flat {f}, skewed {s}, profile {want}"
    );

    let mut bad = profile.clone();
    bad.layers[0].x[3] = -1.0;
    let err = tiny(GgmlDType::Q4K)
        .write_with(&dir.join("bad.gguf"), Some(&bad))
        .unwrap_err();
    assert!(err.to_string().contains("profile"), "{err}");
    let (mut m, _) = open(&dir.join("flat.gguf"), &FfnMode::Dense).unwrap();
    assert!(FfnProfile::measure(&mut m, "x", &[], 64).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_shapes_are_typed_errors_naming_them() {
    let dir = std::env::temp_dir();
    let path = dir.join(format!(
        "powerinfer-synthetic-bad-{}.gguf",
        std::process::id()
    ));
    for (spec, says) in [
        (
            SyntheticLlama {
                hidden: 100,
                ..tiny_seeded(GgmlDType::Q4K, 1)
            },
            "hidden 100",
        ),
        (
            SyntheticLlama {
                heads: 3,
                ..tiny_seeded(GgmlDType::Q4_0, 1)
            },
            "3 heads",
        ),
        (
            SyntheticLlama {
                vocab: 10,
                ..tiny_seeded(GgmlDType::Q4_0, 1)
            },
            "vocabulary 10",
        ),
        (
            SyntheticLlama {
                layers: 0,
                ..tiny_seeded(GgmlDType::Q4_0, 1)
            },
            "layers",
        ),
        (tiny_seeded(GgmlDType::Q5K, 1), "Q5K"),
    ] {
        let err = spec.write(&path).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
        assert!(!path.exists(), "nothing written for a bad shape");
    }
}

#[test]
fn the_same_seed_writes_the_same_bytes_and_sizes_add_up() {
    let dir = std::env::temp_dir().join(format!("powerinfer-synthetic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let read = |spec: SyntheticLlama, name: &str| {
        let p = dir.join(name);
        spec.write(&p).unwrap();
        std::fs::read(&p).unwrap()
    };
    let a = read(tiny_seeded(GgmlDType::Q4K, 7), "a.gguf");
    let b = read(tiny_seeded(GgmlDType::Q4K, 7), "b.gguf");
    let c = read(tiny_seeded(GgmlDType::Q4K, 8), "c.gguf");
    assert_eq!(a, b);
    assert_ne!(a, c);
    let spec = tiny_seeded(GgmlDType::Q6K, 1);
    let bytes = read(spec, "d.gguf").len();
    // The blocks, plus the header, the metadata (the vocabulary) and alignment padding.
    assert!(
        bytes > spec.weight_bytes() && bytes < spec.weight_bytes() + 64 * 1024,
        "{bytes}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
