//! Llama-family hyper-parameters, from GGUF metadata or an HF `config.json`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use powerinfer::Activation;

use crate::error::{Error, ErrorKind, Result};

/// Hyper-parameters of a llama-family decoder (Llama, Mistral, Qwen2, SmolLM).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Model size.
    pub hidden: usize,
    /// FFN neurons per layer.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base.
    pub rope_theta: f32,
    /// Context length the model was trained for.
    pub context: usize,
    /// FFN activation.
    pub activation: Activation,
    /// GGUF stores q/k permuted for interleaved RoPE; HF checkpoints use the half-split form.
    pub rope_interleaved: bool,
    /// Whether q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
}

impl LlamaConfig {
    /// Dimension of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Refuses head counts the model cannot run: no heads, a hidden size the heads do not divide
    /// into even halves (RoPE), or query heads that do not share KV heads evenly; and sizes
    /// beyond any model, which a corrupted or hostile file declares to make a loader allocate
    /// without bound: they are refused before anything is allocated. The limits are several
    /// times the largest open models' (Llama 3.1 405B: 126 layers, hidden 16384, intermediate
    /// 53248, 128 heads; vocabularies up to 256k).
    fn checked(self) -> Result<Self> {
        let bad = |reason: String| -> Result<Self> {
            Err(powerinfer::Error::config("model config", reason).into())
        };
        for (what, v, limit) in [
            ("layers", self.layers, 1 << 12),
            ("hidden size", self.hidden, 1 << 17),
            ("intermediate size", self.intermediate, 1 << 20),
            ("attention heads", self.heads, 1 << 12),
            ("KV heads", self.kv_heads, 1 << 12),
            ("vocabulary", self.vocab, 1 << 23),
        ] {
            if v > limit {
                return bad(format!("{v} {what} is beyond any model (at most {limit})"));
            }
        }
        if self.heads == 0 || self.kv_heads == 0 || self.layers == 0 || self.vocab == 0 {
            return bad(format!(
                "{} heads, {} KV heads, {} layers, vocabulary {}: all must be at least 1",
                self.heads, self.kv_heads, self.layers, self.vocab
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} query heads do not share {} KV heads evenly",
                self.heads, self.kv_heads
            ));
        }
        if !self.hidden.is_multiple_of(self.heads) || !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "hidden size {} is not {} heads of an even size",
                self.hidden, self.heads
            ));
        }
        Ok(self)
    }

    /// Reads the `llama` (or `mistral`, `qwen2`) keys of a GGUF file.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| Error::missing_key("general.architecture"))?
            .clone();
        if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2") {
            return Err(ErrorKind::UnsupportedArchitecture { arch }.into());
        }
        let get = |k: &str| -> Result<&gguf_file::Value> {
            let key = format!("{arch}.{k}");
            ct.metadata.get(&key).ok_or_else(|| Error::missing_key(key))
        };
        let u = |k: &str| -> Result<usize> {
            get(k)?
                .to_u32()
                .map(|v| v as usize)
                .map_err(|_| Error::missing_key(format!("{arch}.{k}")))
        };
        let f = |k: &str| -> Result<f32> {
            get(k)?
                .to_f32()
                .map_err(|_| Error::missing_key(format!("{arch}.{k}")))
        };
        let vocab = match ct.metadata.get("tokenizer.ggml.tokens") {
            Some(gguf_file::Value::Array(a)) => a.len(),
            _ => ct
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| Error::missing_key("tokenizer.ggml.tokens"))?,
        };
        let heads = u("attention.head_count")?;
        LlamaConfig {
            hidden: u("embedding_length")?,
            intermediate: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads: u("attention.head_count_kv").unwrap_or(heads),
            vocab,
            rms_eps: f("attention.layer_norm_rms_epsilon")? as f64,
            rope_theta: f("rope.freq_base").unwrap_or(10_000.0),
            context: u("context_length")?,
            activation: Activation::Silu,
            // llama.cpp's converter permutes llama (and mistral) q/k rows for the interleaved
            // pairing; qwen2 files keep the checkpoint's rows and llama.cpp rotates them in
            // the half-split (NEOX) pairing.
            rope_interleaved: arch != "qwen2",
            attention_bias: arch == "qwen2",
        }
        .checked()
    }

    /// Reads an HF `config.json` (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`).
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: HashMap<String, serde_json::Value> =
            serde_json::from_str(&text).map_err(|e| Error::format(path, e.to_string()))?;
        if let Some(archs) = v.get("architectures").and_then(|a| a.as_array()) {
            let ok = archs.iter().filter_map(|a| a.as_str()).any(|a| {
                matches!(
                    a,
                    "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
                )
            });
            if !ok {
                let arch = archs
                    .iter()
                    .filter_map(|a| a.as_str())
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ErrorKind::UnsupportedArchitecture { arch }.into());
            }
        }
        let u = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| Error::missing_key(k))
        };
        let heads = u("num_attention_heads")?;
        let act = v
            .get("hidden_act")
            .and_then(|a| a.as_str())
            .unwrap_or("silu");
        let qwen = v.get("model_type").and_then(|m| m.as_str()) == Some("qwen2");
        LlamaConfig {
            hidden: u("hidden_size")?,
            intermediate: u("intermediate_size")?,
            layers: u("num_hidden_layers")?,
            heads,
            kv_heads: u("num_key_value_heads").unwrap_or(heads),
            vocab: u("vocab_size")?,
            rms_eps: v
                .get("rms_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-6),
            rope_theta: v
                .get("rope_theta")
                .and_then(|x| x.as_f64())
                .unwrap_or(10_000.0) as f32,
            context: u("max_position_embeddings")?,
            activation: activation_from_name(act)?,
            rope_interleaved: false,
            attention_bias: qwen || v.get("attention_bias").and_then(|b| b.as_bool()) == Some(true),
        }
        .checked()
    }
}

/// Maps an HF `hidden_act` name to an activation; unknown names are a typed error.
pub fn activation_from_name(name: &str) -> Result<Activation> {
    name.parse().map_err(|_| {
        ErrorKind::UnknownActivation {
            name: name.to_string(),
        }
        .into()
    })
}
