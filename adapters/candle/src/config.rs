//! Llama-family hyper-parameters, from GGUF metadata or an HF `config.json`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use powerinfer::Activation;

use crate::error::{Error, ErrorKind, Result};

/// What a Gemma 3 decoder adds to the llama layout: norms of q and k per head, norms of the
/// attention and FFN outputs before their residual adds, the embedding scaled by
/// `sqrt(hidden)`, and local layers that attend to a sliding window with their own RoPE base.
/// (The GGUF file's norm weights already hold Gemma's `1 + w`.)
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3 {
    /// Positions a local layer attends to (itself included).
    pub window: usize,
    /// Per layer: local (sliding window, `rope_theta_local`) or global.
    pub local: Vec<bool>,
    /// RoPE base of the local layers.
    pub rope_theta_local: f32,
}

/// Hyper-parameters of a llama-family decoder (Llama, Mistral, Qwen2, SmolLM, Gemma 3).
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
    /// Dimension of one attention head (`hidden / heads` unless the file says otherwise).
    pub head_dim: usize,
    /// Scale of the attention scores (`1 / sqrt(head_dim)` unless the model says otherwise).
    pub attention_scale: f32,
    /// Factor applied to the token embeddings (1, Gemma: `sqrt(hidden)`).
    pub embedding_scale: f32,
    /// Gemma 3's additions, for a `gemma3` file.
    pub gemma3: Option<Gemma3>,
    /// Per pair of head dimensions, the factor dividing RoPE's frequency (a llama 3.x GGUF
    /// file's `rope_freqs.weight`: its long-context scaling).
    pub rope_factors: Option<Vec<f32>>,
}

impl LlamaConfig {
    /// Dimension of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
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
        // Only Gemma's attention is wider or narrower than the model.
        let width_ok = self.gemma3.is_some() || self.head_dim * self.heads == self.hidden;
        if !width_ok
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.head_dim > 1 << 12
        {
            return bad(format!(
                "head dimension {} (hidden size {}, {} heads) is not a positive even size that \
                 the heads fill the hidden size with",
                self.head_dim, self.hidden, self.heads
            ));
        }
        if let Some(g) = &self.gemma3 {
            if g.local.len() != self.layers || g.window == 0 {
                return bad(format!(
                    "sliding window {} over {} of {} layers",
                    g.window,
                    g.local.len(),
                    self.layers
                ));
            }
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
        if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2" | "gemma3") {
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
        // What would change the model's arithmetic and is not implemented: refused by name.
        for k in [
            "rope.scaling.type",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        ] {
            if let Ok(v) = get(k) {
                let value = format!("{v:?}");
                let harmless = k == "rope.scaling.type"
                    && matches!(v.to_string().map(|s| s.as_str()), Ok("none"));
                if !harmless {
                    let key = format!("{arch}.{k}");
                    return Err(ErrorKind::UnsupportedKey { key, value }.into());
                }
            }
        }
        let vocab = match ct.metadata.get("tokenizer.ggml.tokens") {
            Some(gguf_file::Value::Array(a)) => a.len(),
            _ => ct
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| Error::missing_key("tokenizer.ggml.tokens"))?,
        };
        let (hidden, heads) = (u("embedding_length")?, u("attention.head_count")?);
        let head_dim = u("attention.key_length").unwrap_or(hidden / heads.max(1));
        if u("attention.value_length").is_ok_and(|v| v != head_dim) {
            return Err(ErrorKind::UnsupportedKey {
                key: format!("{arch}.attention.value_length"),
                value: format!("{} (keys: {head_dim})", u("attention.value_length")?),
            }
            .into());
        }
        let layers = u("block_count")?;
        let gemma3 = match arch.as_str() {
            // llama.cpp's rule: every sixth layer global (or the file's pattern), the others
            // local with base 10000 unless the file says otherwise.
            "gemma3" => {
                let window = u("attention.sliding_window")?;
                let period = u("attention.sliding_window_pattern").unwrap_or(6).max(1);
                Some(Gemma3 {
                    window,
                    local: (0..layers.min(1 << 12))
                        .map(|l| l % period < period - 1)
                        .collect(),
                    rope_theta_local: f("rope.freq_base_swa").unwrap_or(10_000.0),
                })
            }
            _ => None,
        };
        let gemma = gemma3.is_some();
        LlamaConfig {
            hidden,
            intermediate: u("feed_forward_length")?,
            layers,
            heads,
            kv_heads: u("attention.head_count_kv").unwrap_or(heads),
            vocab,
            rms_eps: f("attention.layer_norm_rms_epsilon")? as f64,
            rope_theta: f("rope.freq_base").unwrap_or(10_000.0),
            context: u("context_length")?,
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            // llama.cpp's converter permutes llama (and mistral) q/k rows for the interleaved
            // pairing; qwen2 and gemma3 files keep the checkpoint's rows and llama.cpp rotates
            // them in the half-split (NEOX) pairing.
            rope_interleaved: !matches!(arch.as_str(), "qwen2" | "gemma3"),
            attention_bias: arch == "qwen2",
            head_dim,
            // llama.cpp (after gemma_pytorch): Gemma 3 27B scales by its hidden size per head.
            attention_scale: match (gemma, layers) {
                (true, 62) => 1.0 / ((hidden / heads.max(1)).max(1) as f32).sqrt(),
                _ => 1.0 / (head_dim as f32).sqrt(),
            },
            embedding_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            gemma3,
            rope_factors: None,
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
        let (hidden, heads) = (u("hidden_size")?, u("num_attention_heads")?);
        let act = v
            .get("hidden_act")
            .and_then(|a| a.as_str())
            .unwrap_or("silu");
        let qwen = v.get("model_type").and_then(|m| m.as_str()) == Some("qwen2");
        LlamaConfig {
            hidden,
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
            head_dim: hidden / heads.max(1),
            attention_scale: 1.0 / ((hidden / heads.max(1)).max(1) as f32).sqrt(),
            embedding_scale: 1.0,
            gemma3: None,
            rope_factors: None,
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
