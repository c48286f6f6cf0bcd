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
