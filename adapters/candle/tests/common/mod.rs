//! A tiny synthetic llama written to a safetensors directory (HF layout) for tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

pub const HIDDEN: usize = 32;
pub const INTER: usize = 96;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const VOCAB: usize = 64;

/// A fresh directory under the target's temp area.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn randn(dims: &[usize], scale: f64) -> Tensor {
    (Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap() * scale).unwrap()
}

/// The tensors of a random llama with `hidden_act` = `act`.
pub fn tensors() -> HashMap<String, Tensor> {
    let mut t = HashMap::new();
    let hd = HIDDEN / HEADS;
    let s = 1.0 / (HIDDEN as f64).sqrt();
    t.insert(
        "model.embed_tokens.weight".into(),
        randn(&[VOCAB, HIDDEN], 1.0),
    );
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap();
        t.insert(format!("{p}.input_layernorm.weight"), ones.clone());
        t.insert(format!("{p}.post_attention_layernorm.weight"), ones);
        t.insert(
            format!("{p}.self_attn.q_proj.weight"),
            randn(&[HEADS * hd, HIDDEN], s),
        );
        t.insert(
            format!("{p}.self_attn.k_proj.weight"),
            randn(&[KV_HEADS * hd, HIDDEN], s),
        );
        t.insert(
            format!("{p}.self_attn.v_proj.weight"),
            randn(&[KV_HEADS * hd, HIDDEN], s),
        );
        t.insert(
            format!("{p}.self_attn.o_proj.weight"),
            randn(&[HIDDEN, HEADS * hd], s),
        );
        t.insert(
            format!("{p}.mlp.gate_proj.weight"),
            randn(&[INTER, HIDDEN], s),
        );
        t.insert(
            format!("{p}.mlp.up_proj.weight"),
            randn(&[INTER, HIDDEN], s),
        );
        t.insert(
            format!("{p}.mlp.down_proj.weight"),
            randn(&[HIDDEN, INTER], 1.0 / (INTER as f64).sqrt()),
        );
    }
    t
}

pub fn config_json(act: &str, context: usize) -> String {
    format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": {HIDDEN},
            "intermediate_size": {INTER}, "num_hidden_layers": {LAYERS}, "num_attention_heads": {HEADS},
            "num_key_value_heads": {KV_HEADS}, "vocab_size": {VOCAB}, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": {context}, "hidden_act": "{act}",
            "tie_word_embeddings": true}}"#
    )
}

/// Writes `tensors` and a config to `dir`.
pub fn write_model(dir: &Path, tensors: &HashMap<String, Tensor>, config: &str) {
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
}

/// Shape and storage of a random GGUF llama written by [`write_gguf_llama`].
#[derive(Debug, Clone, Copy)]
pub struct GgufSpec {
    pub hidden: usize,
    pub inter: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub vocab: usize,
    /// Block type of every projection and of the embedding.
    pub dtype: candle_core::quantized::GgmlDType,
    /// No `output.weight`: the LM head is the embedding.
    pub tied: bool,
    pub seed: u64,
}

/// Writes a random llama-architecture GGUF file (no tokenizer) with `s`'s shapes and block type.
pub fn write_gguf_llama(path: &Path, s: &GgufSpec) {
    write_gguf_llama_with_heads(path, s, s.heads, s.kv_heads)
}

/// Like [`write_gguf_llama`], with the metadata stating `heads` and `kv_heads` whatever the
/// tensors hold (for hostile files).
pub fn write_gguf_llama_with_heads(path: &Path, s: &GgufSpec, heads: usize, kv_heads: usize) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use gguf_file::Value;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(s.seed);
    let mut rnd = |dims: &[usize], scale: f32| -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale * 1.7)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    };
    let hd = s.hidden / s.heads;
    let w = 1.0 / (s.hidden as f32).sqrt();
    let mut t: Vec<(String, Tensor, GgmlDType)> = vec![
        (
            "token_embd.weight".into(),
            rnd(&[s.vocab, s.hidden], 1.0),
            s.dtype,
        ),
        (
            "output_norm.weight".into(),
            (rnd(&[s.hidden], 0.1) + 1.0).unwrap(),
            GgmlDType::F32,
        ),
    ];
    if !s.tied {
        t.push((
            "output.weight".into(),
            rnd(&[s.vocab, s.hidden], w),
            s.dtype,
        ));
    }
    for l in 0..s.layers {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        let f32_ = GgmlDType::F32;
        t.push((p("attn_norm"), (rnd(&[s.hidden], 0.1) + 1.0).unwrap(), f32_));
        t.push((p("ffn_norm"), (rnd(&[s.hidden], 0.2) + 1.0).unwrap(), f32_));
        t.push((p("attn_q"), rnd(&[s.heads * hd, s.hidden], w), s.dtype));
        t.push((p("attn_k"), rnd(&[s.kv_heads * hd, s.hidden], w), s.dtype));
        t.push((p("attn_v"), rnd(&[s.kv_heads * hd, s.hidden], w), s.dtype));
        t.push((p("attn_output"), rnd(&[s.hidden, s.heads * hd], w), s.dtype));
        t.push((p("ffn_gate"), rnd(&[s.inter, s.hidden], w), s.dtype));
        t.push((p("ffn_up"), rnd(&[s.inter, s.hidden], w), s.dtype));
        t.push((
            p("ffn_down"),
            rnd(&[s.hidden, s.inter], 1.0 / (s.inter as f32).sqrt()),
            s.dtype,
        ));
    }
    let meta = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(s.layers as u32)),
        ("llama.embedding_length", Value::U32(s.hidden as u32)),
        ("llama.feed_forward_length", Value::U32(s.inter as u32)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(kv_heads as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(512)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ];
    let qs: Vec<(String, QTensor)> = t
        .iter()
        .map(|(n, x, dt)| (n.clone(), QTensor::quantize(x, *dt).unwrap()))
        .collect();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let q: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &m, &q).unwrap();
}

/// The index of the largest logit (the first of equals).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
