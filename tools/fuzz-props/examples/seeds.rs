//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*`: small valid
//! files (a llama GGUF in three block types and as `PWRI`, a `.gpuidx`, an artifact, a
//! safetensors checkpoint with its config) and a few structured byte strings, so the fuzzers
//! start from inputs that reach deep into the readers. Run once; the files are committed.
//!
//!     cargo run -p powerinfer-fuzz-props --example seeds

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use powerinfer::{
    format::ArtifactMeta, format::CalibrationSummary, format::LayerMeta, format::LayerTensors,
    Artifact,
};

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tensor(seed: u64, dims: &[usize], scale: f32) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(seed, n, scale), dims, &Device::Cpu).unwrap()
}

/// A one-layer llama GGUF file.
fn llama_gguf(hidden: usize, dtype: GgmlDType, tied: bool) -> Vec<u8> {
    use gguf_file::Value;
    let (inter, vocab, heads, kv) = (2 * hidden, 32, 4, 2);
    let hd = hidden / heads;
    let mut t: Vec<(String, Tensor, GgmlDType)> = vec![
        (
            "token_embd.weight".into(),
            tensor(1, &[vocab, hidden], 1.0),
            dtype,
        ),
        (
            "output_norm.weight".into(),
            tensor(2, &[hidden], 1.0),
            GgmlDType::F32,
        ),
        (
            "blk.0.attn_norm.weight".into(),
            tensor(3, &[hidden], 1.0),
            GgmlDType::F32,
        ),
        (
            "blk.0.ffn_norm.weight".into(),
            tensor(4, &[hidden], 1.0),
            GgmlDType::F32,
        ),
        (
            "blk.0.attn_q.weight".into(),
            tensor(5, &[heads * hd, hidden], 0.2),
            dtype,
        ),
        (
            "blk.0.attn_k.weight".into(),
            tensor(6, &[kv * hd, hidden], 0.2),
            dtype,
        ),
        (
            "blk.0.attn_v.weight".into(),
            tensor(7, &[kv * hd, hidden], 0.2),
            dtype,
        ),
        (
            "blk.0.attn_output.weight".into(),
            tensor(8, &[hidden, heads * hd], 0.2),
            dtype,
        ),
        (
            "blk.0.ffn_gate.weight".into(),
            tensor(9, &[inter, hidden], 0.2),
            dtype,
        ),
        (
            "blk.0.ffn_up.weight".into(),
            tensor(10, &[inter, hidden], 0.2),
            dtype,
        ),
        (
            "blk.0.ffn_down.weight".into(),
            tensor(11, &[hidden, inter], 0.2),
            dtype,
        ),
    ];
    if !tied {
        t.push((
            "output.weight".into(),
            tensor(12, &[vocab, hidden], 0.2),
            dtype,
        ));
    }
    let meta = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(1)),
        ("llama.embedding_length", Value::U32(hidden as u32)),
        ("llama.feed_forward_length", Value::U32(inter as u32)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(kv as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(64)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ];
    let qs: Vec<(String, QTensor)> = t
        .iter()
        .map(|(n, x, dt)| (n.clone(), QTensor::quantize(x, *dt).unwrap()))
        .collect();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let q: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &m, &q).unwrap();
    out.into_inner()
}

/// A `.gpuidx` for `layers` layers of `n` neurons, as PowerInfer's `export_split.py` writes it.
fn gpuidx(layers: usize, n: usize) -> Vec<u8> {
    fn s(b: &mut Vec<u8>, x: &str) {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    }
    let mut tensors: Vec<(String, Vec<i32>)> = Vec::new();
    for l in 0..layers {
        let hot: Vec<i32> = (0..n as i32)
            .filter(|i| (i + l as i32).rem_euclid(3) == 0)
            .collect();
        let mut flags = vec![0i32; n];
        hot.iter().for_each(|&i| flags[i as usize] = 1);
        tensors.push((format!("blk.{l}.gpu_idx"), flags));
        tensors.push((format!("blk.{l}.gpu_bucket"), hot));
    }
    let mut b = Vec::new();
    b.extend(b"PWRI");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(2u64.to_le_bytes());
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "generic.gpu_index");
    s(&mut b, "generic.gpu_index.block_count");
    b.extend(4u32.to_le_bytes());
    b.extend((layers as u32).to_le_bytes());
    let mut offset = 0u64;
    for (name, v) in &tensors {
        s(&mut b, name);
        b.extend(1u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(18u32.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (v.len() as u64 * 4).div_ceil(32) * 32;
    }
    for (_, v) in &tensors {
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for x in v {
            b.extend(x.to_le_bytes());
        }
    }
    let mut with_shape = Vec::new();
    with_shape.extend(((layers - 1) as u16).to_le_bytes());
    with_shape.extend(((n - 1) as u16).to_le_bytes());
    with_shape.extend(b);
    with_shape
}

fn artifact(layers: usize, hidden: usize, n: usize, rank: usize) -> Vec<u8> {
    use powerinfer::analysis::QUANTILE_STEPS;
    let tensors: Vec<LayerTensors> = (0..layers)
        .map(|l| LayerTensors {
            fc1: values(20 + l as u64, rank * hidden, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect(),
            fc2: values(30 + l as u64, n * rank, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect(),
            fc2_bias: values(40 + l as u64, n, 1.0),
            hot: (0..n as u32)
                .filter(|i| (i + l as u32).is_multiple_of(3))
                .collect(),
            counts: (0..n as u32).map(|i| i * 7 + l as u32).collect(),
            score_quantiles: (0..=QUANTILE_STEPS).map(|k| k as f32 * 0.1).collect(),
            h_quantiles: (0..=QUANTILE_STEPS).map(|k| k as f32 * 0.01).collect(),
        })
        .collect();
    let meta = ArtifactMeta {
        model_sha256: "0".repeat(64),
        model_file: "model.gguf".into(),
        budget: 1 << 20,
        hot_bytes: 1000,
        predictor_bytes: 2000,
        calibration: CalibrationSummary {
            sources: vec!["1999.txt".into()],
            tokens: 1000,
            threshold_tokens: 100,
            train_rows: 100,
            val_rows: 20,
            target_sparsity: 0.4,
            target_recall: 0.9,
            rank,
            epochs: 1,
            seconds: 1.0,
        },
        layers: (0..layers)
            .map(|l| LayerMeta {
                hidden,
                intermediate: n,
                activation: "silu".into(),
                gated: true,
                h_threshold: 0.01,
                rank,
                score_threshold: -0.5 + l as f32,
                val_recall: 0.9,
                val_precision: 0.7,
                val_predicted: 0.8,
                val_truth: 0.6,
                val_mass: 0.95,
            })
            .collect(),
        input_rule: None,
    };
    let path =
        std::env::temp_dir().join(format!("powerinfer-seed-{}.powerinfer", std::process::id()));
    Artifact {
        meta,
        layers: tensors,
    }
    .save(&path)
    .unwrap();
    let b = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    b
}

/// `config.json` length, `config.json`, `model.safetensors` of a one-layer llama.
fn checkpoint(hidden: usize) -> Vec<u8> {
    let (inter, vocab, heads, kv) = (2 * hidden, 16, 2, 1);
    let hd = hidden / heads;
    let config = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": {hidden},
"intermediate_size": {inter}, "num_hidden_layers": 1, "num_attention_heads": {heads},
"num_key_value_heads": {kv}, "vocab_size": {vocab}, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
"max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": true}}"#
    );
    let p = "model.layers.0";
    let t: Vec<(String, Tensor)> = vec![
        (
            "model.embed_tokens.weight".into(),
            tensor(1, &[vocab, hidden], 1.0),
        ),
        ("model.norm.weight".into(), tensor(2, &[hidden], 1.0)),
        (
            format!("{p}.input_layernorm.weight"),
            tensor(3, &[hidden], 1.0),
        ),
        (
            format!("{p}.post_attention_layernorm.weight"),
            tensor(4, &[hidden], 1.0),
        ),
        (
            format!("{p}.self_attn.q_proj.weight"),
            tensor(5, &[heads * hd, hidden], 0.3),
        ),
        (
            format!("{p}.self_attn.k_proj.weight"),
            tensor(6, &[kv * hd, hidden], 0.3),
        ),
        (
            format!("{p}.self_attn.v_proj.weight"),
            tensor(7, &[kv * hd, hidden], 0.3),
        ),
        (
            format!("{p}.self_attn.o_proj.weight"),
            tensor(8, &[hidden, heads * hd], 0.3),
        ),
        (
            format!("{p}.mlp.gate_proj.weight"),
            tensor(9, &[inter, hidden], 0.3),
        ),
        (
            format!("{p}.mlp.up_proj.weight"),
            tensor(10, &[inter, hidden], 0.3),
        ),
        (
            format!("{p}.mlp.down_proj.weight"),
            tensor(11, &[hidden, inter], 0.3),
        ),
    ];
    let path = std::env::temp_dir().join(format!(
        "powerinfer-seed-{}.safetensors",
        std::process::id()
    ));
    let map: std::collections::HashMap<String, Tensor> = t.into_iter().collect();
    candle_core::safetensors::save(&map, &path).unwrap();
    let weights = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let mut b = Vec::new();
    b.extend((config.len() as u16).to_le_bytes());
    b.extend(config.as_bytes());
    b.extend(weights);
    b
}

fn write(root: &Path, target: &str, name: &str, bytes: &[u8]) {
    let dir = root.join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    write(&root, "gguf", "f32", &llama_gguf(8, GgmlDType::F32, true));
    write(
        &root,
        "gguf",
        "q8_0",
        &llama_gguf(32, GgmlDType::Q8_0, false),
    );
    write(
        &root,
        "gguf",
        "q4_1",
        &llama_gguf(32, GgmlDType::Q4_1, true),
    );
    let mut pwri = llama_gguf(8, GgmlDType::F16, false);
    pwri[..4].copy_from_slice(b"PWRI");
    write(&root, "gguf", "pwri", &pwri);
    write(&root, "gpuidx", "2x12", &gpuidx(2, 12));
    write(&root, "gpuidx", "1x40", &gpuidx(1, 40));
    write(&root, "artifact", "2x16", &artifact(2, 8, 16, 4));
    write(&root, "safetensors", "h8", &checkpoint(8));
    // Structured byte strings: the first bytes choose sizes and types (see the properties).
    for (k, s) in [(0u64, 48usize), (1, 96), (2, 200), (3, 400)] {
        let bytes: Vec<u8> = values(100 + k, s, 1.0)
            .iter()
            .map(|v| ((v + 1.0) * 127.0) as u8)
            .collect();
        for target in ["placement", "forward", "hostile_indices"] {
            write(&root, target, &format!("{k}"), &bytes);
        }
    }
}
