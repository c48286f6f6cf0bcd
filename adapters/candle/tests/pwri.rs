//! A tiny llama in PowerInfer's `PWRI` GGUF format (ReLU FFN, `ffn_down_t`, predictors), plus a
//! `.gpuidx`, written here and run through the candle adapter.

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use powerinfer::format::{read_gpuidx, PowerInferFile};
use powerinfer::{HybridOptions, WeightDType};
use powerinfer_candle::{load_gguf, ErrorKind, Ffn, FfnMode, GgufFile, Llama, Neurons};

const HIDDEN: usize = 64;
const INTER: usize = 128;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 100;
const RANK: usize = 16;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-pwri-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn randn(dims: &[usize], scale: f64) -> Tensor {
    (Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap() * scale).unwrap()
}

/// The tensors of a random tiny llama in PowerInfer's naming. `zero_fc1`: predictors whose
/// scores are all 0, so every neuron passes PowerInfer's `score >= 0` (all active).
fn tensors(zero_fc1: bool) -> Vec<(String, Tensor)> {
    let hd = HIDDEN / HEADS;
    let s = 1.0 / (HIDDEN as f64).sqrt();
    let mut t = vec![
        (
            "token_embd.weight".to_string(),
            randn(&[VOCAB, HIDDEN], 1.0),
        ),
        (
            "output_norm.weight".into(),
            (randn(&[HIDDEN], 0.1) + 1.0).unwrap(),
        ),
        ("output.weight".into(), randn(&[VOCAB, HIDDEN], s)),
    ];
    for l in 0..LAYERS {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        t.push((p("attn_norm"), (randn(&[HIDDEN], 0.1) + 1.0).unwrap()));
        t.push((p("ffn_norm"), (randn(&[HIDDEN], 0.2) + 1.0).unwrap()));
        t.push((p("attn_q"), randn(&[HEADS * hd, HIDDEN], s)));
        t.push((p("attn_k"), randn(&[KV_HEADS * hd, HIDDEN], s)));
        t.push((p("attn_v"), randn(&[KV_HEADS * hd, HIDDEN], s)));
        t.push((p("attn_output"), randn(&[HIDDEN, HEADS * hd], s)));
        t.push((p("ffn_gate"), randn(&[INTER, HIDDEN], s)));
        t.push((p("ffn_up"), randn(&[INTER, HIDDEN], s)));
        // PowerInfer's convert.py stores down transposed: [intermediate, hidden].
        t.push((p("ffn_down_t"), randn(&[INTER, HIDDEN], 0.1)));
        let fc1 = if zero_fc1 {
            Tensor::zeros((RANK, HIDDEN), DType::F32, &Device::Cpu).unwrap()
        } else {
            randn(&[RANK, HIDDEN], 0.3)
        };
        t.push((p("fc1"), fc1));
        t.push((p("fc2"), randn(&[INTER, RANK], 0.5)));
    }
    t
}

/// Writes the model as PowerInfer's `convert.py` leaves it: GGUF v3 with the magic `PWRI`;
/// 2-D weights f16 except the FFN's (f32, so the dense comparison is tight), norms f32.
fn write_pwri(path: &Path, t: &[(String, Tensor)], threshold: Option<f32>) {
    use gguf_file::Value;
    let mut meta = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(INTER as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(64)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ];
    if let Some(th) = threshold {
        meta.push(("powerinfer.sparse_threshold", Value::F32(th)));
    }
    let qs: Vec<(String, QTensor)> = t
        .iter()
        .map(|(n, x)| {
            let dt = if n.contains("fc1") || n.contains("fc2") {
                GgmlDType::F16
            } else {
                GgmlDType::F32
            };
            (n.clone(), QTensor::quantize(x, dt).unwrap())
        })
        .collect();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let q: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &m, &q).unwrap();
    drop(f);
    let mut b = std::fs::read(path).unwrap();
    b[0..4].copy_from_slice(b"PWRI");
    b[4..8].copy_from_slice(&3u32.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

/// A `.gpuidx` as `powerinfer-py`'s `export_split.py` writes it (see tests/interop.rs in the
/// engine for the field-by-field account).
fn write_gpuidx(path: &Path, hot: &[Vec<i32>]) {
    fn s(b: &mut Vec<u8>, x: &str) {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    }
    let mut ts: Vec<(String, Vec<i32>)> = Vec::new();
    for (l, h) in hot.iter().enumerate() {
        let mut flags = vec![0i32; INTER];
        for &i in h {
            flags[i as usize] = 1;
        }
        ts.push((format!("blk.{l}.gpu_idx"), flags));
        ts.push((format!("blk.{l}.gpu_bucket"), h.clone()));
    }
    let mut b = Vec::new();
    b.extend(b"PWRI");
    b.extend(3u32.to_le_bytes());
    b.extend((ts.len() as u64).to_le_bytes());
    b.extend(2u64.to_le_bytes());
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "generic.gpu_index");
    s(&mut b, "split.vram_capacity");
    b.extend(10u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let mut off = 0u64;
    for (n, v) in &ts {
        s(&mut b, n);
        b.extend(1u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(18u32.to_le_bytes());
        b.extend(off.to_le_bytes());
        off += (v.len() as u64 * 4).div_ceil(32) * 32;
    }
    for (_, v) in &ts {
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for x in v {
            b.extend(x.to_le_bytes());
        }
    }
    std::fs::write(path, b).unwrap();
}

fn hybrid() -> FfnMode {
    FfnMode::Hybrid {
        storage: Some(WeightDType::F32),
        predictor: Neurons::All,
        options: HybridOptions::default(),
        powerinfer_linears: false,
    }
}

fn load(path: &Path, mode: &FfnMode) -> Llama {
    let mut g = GgufFile::open(path).unwrap();
    assert_eq!(g.magic, powerinfer::format::GgufMagic::PowerInfer);
    load_gguf(&mut g, mode).unwrap()
}

const TOKENS: [u32; 6] = [1, 17, 42, 99, 3, 64];

fn logits(m: &mut Llama) -> Vec<Vec<f32>> {
    m.clear_kv_cache();
    let mut out = m
        .forward_all(&TOKENS[..4], 0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (i, &t) in TOKENS[4..].iter().enumerate() {
        out.push(m.forward(&[t], 4 + i).unwrap().to_vec1::<f32>().unwrap());
    }
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn pwri_model_loads_with_relu_and_transposed_down() {
    let d = dir("load");
    let path = d.join("m.powerinfer.gguf");
    let t = tensors(false);
    write_pwri(&path, &t, None);
    let m = load(&path, &FfnMode::DenseF32);
    assert_eq!(m.config().activation, powerinfer::Activation::Relu);
    // ffn_down is served from ffn_down_t, transposed back, value for value.
    let mut g = GgufFile::open(&path).unwrap();
    let down = g.dequantized("blk.1.ffn_down.weight").unwrap();
    let down_t = &t
        .iter()
        .find(|(n, _)| n == "blk.1.ffn_down_t.weight")
        .unwrap()
        .1;
    assert_eq!(down.dims(), &[HIDDEN, INTER]);
    assert_eq!(
        down.to_vec2::<f32>().unwrap(),
        down_t.t().unwrap().to_vec2::<f32>().unwrap()
    );
    // Predictors come back as written (f16 in the file).
    let mut f = PowerInferFile::open(&path).unwrap();
    let (fc1, fc2) = f.predictor_weights(0).unwrap();
    let want = |n: &str| {
        t.iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    assert_eq!(fc1.to_vec2::<f32>().unwrap(), want("blk.0.fc1.weight"));
    assert_eq!(fc2.to_vec2::<f32>().unwrap(), want("blk.0.fc2.weight"));
}

#[test]
fn all_active_powerinfer_predictor_equals_dense() {
    let d = dir("dense");
    let path = d.join("m.gguf");
    write_pwri(&path, &tensors(true), None);
    let mut dense = load(&path, &FfnMode::DenseF32);
    let mut sparse = load(&path, &hybrid());
    let mut f = PowerInferFile::open(&path).unwrap();
    sparse.use_powerinfer_predictors(&mut f).unwrap();
    let (a, b) = (logits(&mut dense), logits(&mut sparse));
    let diff = max_diff(&a, &b);
    assert!(diff < 1e-4, "max |dense - powerinfer| = {diff}");
    for ffn in sparse.ffns() {
        let Ffn::Hybrid(h) = ffn else {
            panic!("dense layer")
        };
        assert!(format!("{h:?}").contains("PreNormLowRank"), "{h:?}");
    }
}

#[test]
fn powerinfer_predictors_and_gpuidx_run() {
    let d = dir("run");
    let path = d.join("m.gguf");
    write_pwri(&path, &tensors(false), Some(-0.05));
    let mut m = load(&path, &hybrid());
    let all = logits(&mut m);
    let all_active: Vec<usize> = m
        .ffns()
        .map(|f| match f {
            Ffn::Hybrid(h) => h.last_active(),
            _ => panic!("dense layer"),
        })
        .collect();
    let mut f = PowerInferFile::open(&path).unwrap();
    assert_eq!(f.threshold().unwrap(), -0.05);
    m.use_powerinfer_predictors(&mut f).unwrap();
    let a = logits(&mut m);
    assert!(a.iter().flatten().all(|x| x.is_finite()));
    // The predictor leaves out some neurons that would have fired: the output moves.
    assert!(max_diff(&a, &all) > 1e-4);
    let active: Vec<usize> = m
        .ffns()
        .map(|f| match f {
            Ffn::Hybrid(h) => h.last_active(),
            _ => panic!("dense layer"),
        })
        .collect();
    assert!(active.iter().all(|&n| n > 0), "{active:?}");
    assert!(
        active.iter().zip(&all_active).all(|(p, a)| p <= a),
        "{active:?} {all_active:?}"
    );
    // The same neurons predicted, some placed hot: the output does not change.
    let g = d.join("m.gpuidx");
    let hot = vec![
        (0..INTER as i32).filter(|i| i % 2 == 0).collect::<Vec<_>>(),
        (0..40).collect(),
    ];
    write_gpuidx(&g, &hot);
    let placements = read_gpuidx(&g, LAYERS, INTER).unwrap();
    assert_eq!(placements[1].hot().len(), 40);
    m.apply_placements(placements).unwrap();
    let b = logits(&mut m);
    let diff = max_diff(&a, &b);
    assert!(diff < 1e-5, "placement changed the output by {diff}");
    // Wrong layer count: typed.
    let e = m.apply_placements(Vec::new()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Engine(_)), "{e}");
}

#[test]
fn predictors_need_a_hybrid_model_and_matching_layers() {
    let d = dir("errors");
    let path = d.join("m.gguf");
    write_pwri(&path, &tensors(false), None);
    let mut dense = load(&path, &FfnMode::DenseF32);
    let mut f = PowerInferFile::open(&path).unwrap();
    let e = dense.use_powerinfer_predictors(&mut f).unwrap_err();
    assert!(e.to_string().contains("dense FFN"), "{e}");
    // Wrong magic through the adapter: a Format error naming the magic.
    let mut b = std::fs::read(&path).unwrap();
    b[0..4].copy_from_slice(b"GGJT");
    let bad = d.join("bad.gguf");
    std::fs::write(&bad, b).unwrap();
    let e = GgufFile::open(&bad).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Format { .. }), "{e}");
    assert!(e.to_string().contains("magic"), "{e}");
}
