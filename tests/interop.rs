//! PowerInfer's own files: a `PWRI` GGUF with predictors and a `.gpuidx` placement, written here
//! byte for byte the way PowerInfer's converters write them, read back through the engine.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};
use common::tensor;
use powerinfer::format::{read_gpuidx, GgufMagic, PowerInferFile};
use powerinfer::{
    predict::Oracle, tier::LayerPlacement, Activation, ErrorKind, FfnSpec, FfnWeights, HybridFfn,
    HybridOptions, WeightDType,
};
use rand::{rngs::StdRng, SeedableRng};

const HIDDEN: usize = 64;
const INTER: usize = 128;
const RANK: usize = 16;
const LAYERS: usize = 2;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-interop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Pred {
    fc1: Tensor,
    fc2: Tensor,
    down: Tensor,
}

fn preds(seed: u64) -> Vec<Pred> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..LAYERS)
        .map(|_| Pred {
            // PowerInfer's convert.py writes 2-D tensors as f16 by default: store f16.
            fc1: tensor(&mut rng, &[RANK, HIDDEN], 0.3)
                .to_dtype(DType::F16)
                .unwrap(),
            fc2: tensor(&mut rng, &[INTER, RANK], 0.5)
                .to_dtype(DType::F16)
                .unwrap(),
            down: tensor(&mut rng, &[HIDDEN, INTER], 0.1),
        })
        .collect()
}

/// Writes a GGUF with candle, then turns it into what PowerInfer's `convert.py` leaves: magic
/// `PWRI`, version 3 (GGUF v2 and v3 have the same little-endian layout).
fn write_pwri(path: &Path, p: &[Pred], threshold: Option<f32>, skip: Option<&str>) {
    let mut meta: Vec<(String, gguf_file::Value)> = vec![
        (
            "general.architecture".into(),
            gguf_file::Value::String("llama".into()),
        ),
        (
            "llama.block_count".into(),
            gguf_file::Value::U32(LAYERS as u32),
        ),
        (
            "llama.embedding_length".into(),
            gguf_file::Value::U32(HIDDEN as u32),
        ),
        (
            "llama.feed_forward_length".into(),
            gguf_file::Value::U32(INTER as u32),
        ),
    ];
    if let Some(t) = threshold {
        meta.push((
            "powerinfer.sparse_threshold".into(),
            gguf_file::Value::F32(t),
        ));
    }
    let mut qs: Vec<(String, QTensor)> = Vec::new();
    for (l, pr) in p.iter().enumerate() {
        let q16 = |t: &Tensor| QTensor::quantize(&t.to_dtype(DType::F32).unwrap(), GgmlDType::F16);
        qs.push((format!("blk.{l}.fc1.weight"), q16(&pr.fc1).unwrap()));
        qs.push((format!("blk.{l}.fc2.weight"), q16(&pr.fc2).unwrap()));
        let down_t = pr.down.t().unwrap().contiguous().unwrap();
        qs.push((
            format!("blk.{l}.ffn_down_t.weight"),
            QTensor::quantize(&down_t, GgmlDType::F32).unwrap(),
        ));
    }
    qs.retain(|(n, _)| Some(n.as_str()) != skip);
    let m: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &m, &t).unwrap();
    drop(f);
    patch_header(path, b"PWRI", 3);
}

fn patch_header(path: &Path, magic: &[u8; 4], version: u32) {
    let mut b = std::fs::read(path).unwrap();
    b[0..4].copy_from_slice(magic);
    b[4..8].copy_from_slice(&version.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

/// One layer of a `.gpuidx` file: `(gpu_idx name, values, gpu_bucket name, values)`.
type GpuLayer = (String, Vec<i32>, String, Vec<i32>);

/// Writes a `.gpuidx` exactly as `powerinfer-py/powerinfer/export_split.py` does through
/// gguf-py's `GGUFWriter`: header, `general.architecture = "generic.gpu_index"`,
/// `generic.gpu_index.block_count` (u32), `split.vram_capacity` (u64), tensor infos
/// (`blk.N.gpu_idx`, `blk.N.gpu_bucket`, GGML type 18 = I32, 1-D), data aligned to 32, then the
/// first 8 bytes overwritten with `PWRI` and version 3. `ty` replaces the I32 type number.
fn write_gpuidx_as_powerinfer(path: &Path, layers: &[GpuLayer], block_count: u32, ty: u32) {
    fn s(b: &mut Vec<u8>, x: &str) {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    }
    let mut tensors: Vec<(&str, &[i32])> = Vec::new();
    for (a, av, b, bv) in layers {
        tensors.push((a, av));
        tensors.push((b, bv));
    }
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(3u64.to_le_bytes());
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "generic.gpu_index");
    s(&mut b, "generic.gpu_index.block_count");
    b.extend(4u32.to_le_bytes());
    b.extend(block_count.to_le_bytes());
    s(&mut b, "split.vram_capacity");
    b.extend(10u32.to_le_bytes());
    b.extend(123_456u64.to_le_bytes());
    let mut offset = 0u64;
    for (name, v) in &tensors {
        s(&mut b, name);
        b.extend(1u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (v.len() as u64 * 4).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, v) in &tensors {
        for x in v.iter() {
            b.extend(x.to_le_bytes());
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b[0..4].copy_from_slice(b"PWRI");
    b[4..8].copy_from_slice(&3u32.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

/// `export_split.py`'s `append_gpu_idx` for a chosen hot set: flags and the sorted indices.
fn gpu_layer(l: usize, hot: &[i32]) -> GpuLayer {
    let mut flags = vec![0i32; INTER];
    for &i in hot {
        flags[i as usize] = 1;
    }
    let mut bucket = hot.to_vec();
    bucket.sort();
    (
        format!("blk.{l}.gpu_idx"),
        flags,
        format!("blk.{l}.gpu_bucket"),
        bucket,
    )
}

fn hot_sets() -> Vec<Vec<i32>> {
    vec![
        (0..INTER as i32).filter(|i| i % 3 == 0).collect(),
        vec![], // PowerInfer writes an empty bucket when the solver gives a layer no GPU neurons
    ]
}

#[test]
fn pwri_file_reads_back_identical() {
    let d = dir("roundtrip");
    let p = preds(1);
    let path = d.join("model.powerinfer.gguf");
    write_pwri(&path, &p, Some(-0.25), None);
    let mut f = PowerInferFile::open(&path).unwrap();
    assert_eq!(f.magic(), GgufMagic::PowerInfer);
    assert_eq!(f.layers().unwrap(), LAYERS);
    assert_eq!(f.threshold().unwrap(), -0.25);
    assert!(f.has_predictors());
    for (l, pr) in p.iter().enumerate() {
        let (fc1, fc2) = f.predictor_weights(l).unwrap();
        let want1 = pr.fc1.to_dtype(DType::F32).unwrap();
        let want2 = pr.fc2.to_dtype(DType::F32).unwrap();
        assert_eq!(
            fc1.to_vec2::<f32>().unwrap(),
            want1.to_vec2::<f32>().unwrap()
        );
        assert_eq!(
            fc2.to_vec2::<f32>().unwrap(),
            want2.to_vec2::<f32>().unwrap()
        );
        let down = f.down_from_transposed(l).unwrap();
        assert_eq!(
            down.to_vec2::<f32>().unwrap(),
            pr.down.to_vec2::<f32>().unwrap()
        );
        let lr = f.predictor(l).unwrap();
        assert_eq!((lr.rank(), lr.dims()), (RANK, (HIDDEN, INTER)));
    }
    // No key: PowerInfer's default threshold, 0. A GGUF magic is read too.
    write_pwri(&path, &p, None, None);
    patch_header(&path, b"GGUF", 3);
    let f = PowerInferFile::open(&path).unwrap();
    assert_eq!(f.magic(), GgufMagic::Gguf);
    assert_eq!(f.threshold().unwrap(), 0.0);
}

#[test]
fn gpuidx_reads_back_identical() {
    let d = dir("gpuidx");
    let path = d.join("model.gpuidx");
    let hot = hot_sets();
    let layers: Vec<GpuLayer> = (0..LAYERS).map(|l| gpu_layer(l, &hot[l])).collect();
    write_gpuidx_as_powerinfer(&path, &layers, LAYERS as u32, 18);
    let got = read_gpuidx(&path, LAYERS, INTER).unwrap();
    let want: Vec<LayerPlacement> = hot
        .iter()
        .enumerate()
        .map(|(l, h)| LayerPlacement::new(INTER, h.iter().map(|&i| i as u32).collect(), Some(l)))
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(got[0].hot().len(), INTER.div_ceil(3));
    assert!(got[1].hot().is_empty());
}

/// PowerInfer's rule on the pre-norm input `u`: neuron `i` of row `r` runs when
/// `fc2 relu(fc1 u_r) >= t`. Returns the sets and the smallest distance of a score to `t`.
fn reference_sets(fc1: &Tensor, fc2: &Tensor, u: &Tensor, t: f32) -> (Vec<Vec<u32>>, f32) {
    let z = u.matmul(&fc1.t().unwrap()).unwrap().relu().unwrap();
    let s = z
        .matmul(&fc2.t().unwrap())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let mut margin = f32::INFINITY;
    let sets = s
        .iter()
        .map(|row| {
            row.iter()
                .enumerate()
                .filter(|(_, &v)| {
                    margin = margin.min((v - t).abs());
                    v >= t
                })
                .map(|(i, _)| i as u32)
                .collect()
        })
        .collect();
    (sets, margin)
}

#[test]
fn pre_norm_predictor_applies_powerinfers_rule_exactly() {
    let d = dir("prenorm");
    let p = preds(2);
    let mut rng = StdRng::seed_from_u64(3);
    let spec = FfnSpec::gated(HIDDEN, INTER, Activation::Relu).unwrap();
    let gate = tensor(&mut rng, &[INTER, HIDDEN], 0.2);
    let up = tensor(&mut rng, &[INTER, HIDDEN], 0.2);
    let rows = 5;
    // A residual stream with a large scale, and a norm weight that is not all ones.
    let u = (tensor(&mut rng, &[rows, HIDDEN], 1.0) * 7.0).unwrap();
    let w = (tensor(&mut rng, &[HIDDEN], 0.5) + 1.0).unwrap();
    let eps = 1e-5f32;
    let n = candle_nn::ops::rms_norm(&u, &w, eps).unwrap();
    let rms: Vec<f32> = u
        .sqr()
        .unwrap()
        .mean_keepdim(1)
        .unwrap()
        .affine(1.0, eps as f64)
        .unwrap()
        .sqrt()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for t in [0.0f32, -0.3, 0.2] {
        let path = d.join("m.gguf");
        write_pwri(&path, &p, Some(t), None);
        let mut f = PowerInferFile::open(&path).unwrap();
        let (fc1, fc2) = f.predictor_weights(0).unwrap();
        let (sets, margin) = reference_sets(&fc1, &fc2, &u, t);
        assert!(
            margin > 1e-4,
            "seed leaves a score {margin} from the threshold"
        );
        let total: usize = sets.iter().map(|s| s.len()).sum();
        assert!(total > 0 && total < rows * INTER, "t={t}: {total} active");
        let build = || {
            HybridFfn::from_weights(
                spec,
                FfnWeights::gated(&gate, &up, &p[0].down),
                WeightDType::F32,
                HybridOptions::default(),
            )
            .unwrap()
        };
        let oracle = build().with_predictor(Oracle::new(sets));
        let ours = build().with_predictor(f.pre_norm_predictor(0, &w).unwrap());
        assert_eq!(ours.needs_row_rms(), t != 0.0);
        let a = oracle.forward(&n).unwrap().to_vec2::<f32>().unwrap();
        // The rows' pre-norm RMS goes in with the call.
        let x: Vec<f32> = n.flatten_all().unwrap().to_vec1().unwrap();
        let mut out = vec![0f32; x.len()];
        ours.forward_f32_with_row_rms(&x, rows, &rms, &mut out)
            .unwrap();
        let b: Vec<Vec<f32>> = out.chunks(x.len() / rows).map(<[f32]>::to_vec).collect();
        assert_eq!(ours.last_active(), oracle.last_active(), "t={t}");
        assert_eq!(a, b, "t={t}");
        if t != 0.0 {
            // Without the row RMS a non-zero threshold cannot be applied: typed error.
            let no_rms = build().with_predictor(f.pre_norm_predictor(0, &w).unwrap());
            let e = no_rms.forward_tensor(&n).unwrap_err();
            assert!(
                matches!(e.kind(), ErrorKind::Config { setting, .. } if setting == "row_rms"),
                "{e}"
            );
            // ... nor with a count that is not one per row.
            let e = ours
                .forward_f32_with_row_rms(&x, rows, &rms[1..], &mut out)
                .unwrap_err();
            assert!(e.to_string().contains("row_rms values per row"), "{e}");
        }
    }
    let zero_w = w.affine(0.0, 0.0).unwrap();
    let mut f = PowerInferFile::open(&d.join("m.gguf")).unwrap();
    let e = f.pre_norm_predictor(0, &zero_w).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Config { setting, .. } if setting == "ffn_norm.weight"));
}

#[test]
fn truncated_pwri_file_is_a_typed_error() {
    let d = dir("trunc");
    let path = d.join("m.gguf");
    write_pwri(&path, &preds(4), Some(0.0), None);
    let bytes = std::fs::read(&path).unwrap();
    for (cut, header) in [(bytes.len() - 10, false), (40, true), (2, true)] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = PowerInferFile::open(&path).unwrap_err();
        match e.kind() {
            ErrorKind::Truncated { what, len, .. } => {
                assert_eq!(*len, cut as u64);
                if !header {
                    assert!(what.contains("tensor `blk."), "{what}");
                }
            }
            k => panic!("cut {cut}: {k:?}"),
        }
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}

#[test]
fn wrong_magic_is_a_typed_error() {
    let d = dir("magic");
    let path = d.join("m.gguf");
    write_pwri(&path, &preds(5), None, None);
    patch_header(&path, b"GGML", 3);
    let e = PowerInferFile::open(&path).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::BadMagic { got, .. } if got == b"GGML"),
        "{e}"
    );
    let g = d.join("x.gpuidx");
    write_gpuidx_as_powerinfer(&g, &[gpu_layer(0, &[1]), gpu_layer(1, &[2])], 2, 18);
    let mut b = std::fs::read(&g).unwrap();
    b[0..4].copy_from_slice(b"XXXX");
    std::fs::write(&g, b).unwrap();
    let e = read_gpuidx(&g, LAYERS, INTER).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::BadMagic { .. }), "{e}");
}

#[test]
fn missing_fc2_names_the_tensor() {
    let d = dir("missing");
    let path = d.join("m.gguf");
    write_pwri(&path, &preds(6), None, Some("blk.1.fc2.weight"));
    let mut f = PowerInferFile::open(&path).unwrap();
    assert!(f.predictor(0).is_ok());
    let e = f.predictor(1).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::MissingTensor { name } if name == "blk.1.fc2.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("blk.1.fc2.weight"));
}

#[test]
fn bad_gpuidx_files_are_typed_errors() {
    let d = dir("badidx");
    let g = d.join("m.gpuidx");
    let good = || vec![gpu_layer(0, &[1, 5]), gpu_layer(1, &[2])];
    let read = |layers: &[GpuLayer], count: u32, ty: u32| {
        write_gpuidx_as_powerinfer(&g, layers, count, ty);
        read_gpuidx(&g, LAYERS, INTER).unwrap_err()
    };
    // gpu_bucket index out of range.
    let mut l = good();
    l[1].3 = vec![INTER as i32];
    l[1].1[2] = 0;
    let e = read(&l, 2, 18);
    assert!(
        matches!(e.kind(), ErrorKind::NeuronOutOfRange { layer: Some(1), neuron, intermediate }
            if *neuron == INTER && *intermediate == INTER),
        "{e}"
    );
    // gpu_idx and gpu_bucket disagree, both ways.
    let mut l = good();
    l[0].1[7] = 1;
    let e = read(&l, 2, 18);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::GpuIndexMismatch {
                layer: 0,
                neuron: 7,
                flagged_not_listed: true
            }
        ),
        "{e}"
    );
    let mut l = good();
    l[1].3.push(9);
    let e = read(&l, 2, 18);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::GpuIndexMismatch {
                layer: 1,
                neuron: 9,
                flagged_not_listed: false
            }
        ),
        "{e}"
    );
    // Layer counts: tensors for one layer only, or a block count that disagrees.
    let e = read(&good()[..1], 2, 18);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Count {
                expected: 4,
                got: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = read(&good(), 3, 18);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Count {
                expected: 2,
                got: 3,
                ..
            }
        ),
        "{e}"
    );
    // Wrong element type (F32 = 0 instead of I32 = 18).
    let e = read(&good(), 2, 0);
    assert!(
        matches!(e.kind(), ErrorKind::TensorType { tensor, .. } if tensor == "blk.0.gpu_idx"),
        "{e}"
    );
    // gpu_idx of the wrong length.
    let mut l = good();
    l[0].1.pop();
    let e = read(&l, 2, 18);
    assert!(
        matches!(e.kind(), ErrorKind::Shape { tensor, .. } if tensor == "blk.0.gpu_idx"),
        "{e}"
    );
    // A repeated index.
    let mut l = good();
    l[0].3 = vec![1, 1, 5];
    let e = read(&l, 2, 18);
    assert!(
        matches!(
            e.kind(),
            ErrorKind::DuplicateNeuron {
                layer: Some(0),
                neuron: 1
            }
        ),
        "{e}"
    );
    // Truncated anywhere: a typed error, never a panic.
    write_gpuidx_as_powerinfer(&g, &good(), 2, 18);
    let bytes = std::fs::read(&g).unwrap();
    // The last tensor (one i32) ends 28 bytes before the end: the rest is alignment padding.
    let data_end = bytes.len() - 28;
    for cut in data_end..=bytes.len() {
        assert!(powerinfer::format::parse_gpuidx(&bytes[..cut], "cut", LAYERS, INTER).is_ok());
    }
    for cut in 0..data_end {
        let e = powerinfer::format::parse_gpuidx(&bytes[..cut], "cut", LAYERS, INTER).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Truncated { .. }),
            "cut {cut}: {e}"
        );
    }
}
