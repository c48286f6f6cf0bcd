//! Writes a llama-family GGUF file as a Hugging Face checkpoint directory: `model.safetensors`
//! (the dequantized weights, f32), `config.json`, `tokenizer.json`, `tokenizer_config.json` (chat
//! template and special tokens from the file). q/k rows are un-permuted from GGUF's interleaved
//! RoPE layout back to the half-split one HF checkpoints use.
//!
//! Used to run the safetensors loaders (here and in the mistral.rs patch) on SmolLM2, which is
//! only available offline as GGUF:
//!
//! `cargo run --release -p powerinfer-candle --example gguf_to_hf -- MODEL.gguf OUT_DIR`

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::Tensor;
use powerinfer_candle::{GgufFile, LlamaConfig, TextTokenizer};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// GGUF `[heads * head_dim, hidden]` rows ordered (head, pair, 2) back to HF's (head, 2, pair).
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, hidden) = w.dims2()?;
    let hd = rows / heads;
    Ok(w.reshape((heads, hd / 2, 2, hidden))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, hidden))?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, out] = args.as_slice() else {
        return Err("usage: gguf_to_hf MODEL.gguf OUT_DIR".into());
    };
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    let mut g = GgufFile::open(model.as_ref())?;
    let cfg = LlamaConfig::from_gguf(&g.content)?;
    if cfg.activation != powerinfer::Activation::Silu {
        return Err("only SiLU llama models are written".into());
    }
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let embed = g.dequantized("token_embd.weight")?;
    t.insert("model.embed_tokens.weight".into(), embed);
    t.insert(
        "model.norm.weight".into(),
        g.dequantized("output_norm.weight")?,
    );
    let tied = !g.content.tensor_infos.contains_key("output.weight");
    if !tied {
        t.insert("lm_head.weight".into(), g.dequantized("output.weight")?);
    }
    let names = [
        ("attn_norm", "input_layernorm"),
        ("ffn_norm", "post_attention_layernorm"),
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"),
    ];
    for l in 0..cfg.layers {
        for (from, to) in names {
            let mut w = g.dequantized(&format!("blk.{l}.{from}.weight"))?;
            if cfg.rope_interleaved && from == "attn_q" {
                w = unpermute(&w, cfg.heads)?;
            }
            if cfg.rope_interleaved && from == "attn_k" {
                w = unpermute(&w, cfg.kv_heads)?;
            }
            t.insert(format!("model.layers.{l}.{to}.weight"), w);
        }
    }
    candle_core::safetensors::save(&t, out.join("model.safetensors"))?;

    let meta_id = |k: &str| g.content.metadata.get(k).and_then(|v| v.to_u32().ok());
    let (bos, eos) = (
        meta_id("tokenizer.ggml.bos_token_id"),
        meta_id("tokenizer.ggml.eos_token_id"),
    );
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;

    let tok = TextTokenizer::from_gguf(&g.content)?;
    tok.inner
        .save(out.join("tokenizer.json"), true)
        .map_err(|e| e.to_string())?;
    let name = |id: Option<u32>| id.and_then(|i| tok.inner.id_to_token(i));
    let template = g
        .content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    let tok_config = serde_json::json!({
        "chat_template": template,
        "bos_token": name(bos),
        "eos_token": name(tok.inner.token_to_id("<|im_end|>")).or_else(|| name(eos)),
        "unk_token": name(meta_id("tokenizer.ggml.unknown_token_id")),
        "pad_token": name(meta_id("tokenizer.ggml.padding_token_id")),
        "add_bos_token": false,
        "model_max_length": cfg.context,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_config)?,
    )?;
    println!("wrote {} ({} tensors)", out.display(), t.len());
    Ok(())
}
