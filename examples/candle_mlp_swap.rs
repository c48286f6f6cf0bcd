//! Swapping the MLP of a candle-transformers llama-family model for `HybridFfn`.
//!
//! candle-transformers' `qwen2.rs` (and `mistral.rs`, `llama.rs`) build each layer's MLP as
//! ```text
//! mlp: MLP::new(cfg, vb.pp("mlp"))?,          // gate_proj / up_proj / down_proj + act
//! ```
//! With powerinfer the field becomes a `HybridFfn` and that line becomes
//! ```text
//! mlp: HybridFfn::load(cfg.hidden_act.try_into()?, vb.pp("mlp"), HybridOptions::default())?,
//! ```
//! Both implement `candle_core::Module`, so `xs.apply(&self.mlp)` in the decoder layer is unchanged.
//!
//! This example writes a Qwen2-shaped layer's MLP weights to a safetensors file, loads them the way
//! the model does (mmaped `VarBuilder`, `model.layers.0.mlp` prefix), runs the dense candle MLP and
//! the hybrid one on the same hidden states, and prints how far apart they are and how many neurons
//! the sparse path computed. Run: `cargo run --release --example candle_mlp_swap`.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{linear_no_bias, Activation, Linear, VarBuilder};
use candle_transformers::models::qwen2::Config;
use powerinfer::{tier::LayerPlacement, GateFirst, HybridFfn, HybridOptions};

/// The dense MLP exactly as candle-transformers' qwen2 builds it.
struct DenseMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act_fn: Activation,
}

impl DenseMlp {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: linear_no_bias(i, h, vb.pp("down_proj"))?,
            act_fn: cfg.hidden_act,
        })
    }
}

impl Module for DenseMlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let lhs = xs.apply(&self.gate_proj)?.apply(&self.act_fn)?;
        let rhs = xs.apply(&self.up_proj)?;
        (lhs * rhs)?.apply(&self.down_proj)
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let cfg: Config = serde_json::from_str(
        r#"{"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 768,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "sliding_window": 512, "max_window_layers": 1,
            "tie_word_embeddings": true, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "use_sliding_window": false, "hidden_act": "silu"}"#,
    )?;
    let dev = Device::Cpu;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let p = "model.layers.0.mlp";
    let mut tensors = HashMap::new();
    tensors.insert(
        format!("{p}.gate_proj.weight"),
        (Tensor::randn(0f32, 1.0, (i, h), &dev)? / (h as f64).sqrt())?,
    );
    tensors.insert(
        format!("{p}.up_proj.weight"),
        (Tensor::randn(0f32, 1.0, (i, h), &dev)? / (h as f64).sqrt())?,
    );
    tensors.insert(
        format!("{p}.down_proj.weight"),
        (Tensor::randn(0f32, 1.0, (h, i), &dev)? / (i as f64).sqrt())?,
    );
    let dir = std::env::temp_dir().join(format!("powerinfer-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &file)?;

    // SAFETY: the file is ours and is not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&file], DType::F16, &dev)? };
    let layer = vb.pp("model.layers.0");

    let dense = DenseMlp::new(&cfg, layer.pp("mlp"))?;
    // The one-line swap:
    let hybrid = HybridFfn::load(
        cfg.hidden_act.try_into()?,
        layer.pp("mlp"),
        HybridOptions::default(),
    )?;

    let xs = Tensor::randn(0f32, 1.0, (1, 5, h), &dev)?.to_dtype(DType::F16)?;
    let yd = xs.apply(&dense)?.to_dtype(DType::F32)?;
    let diff = |y: &Tensor| -> Result<f32> {
        let d = (y.to_dtype(DType::F32)? - &yd)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let s = yd.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(d / s)
    };
    println!(
        "dense candle MLP vs HybridFfn (all neurons): rel diff {:.2e}",
        diff(&xs.apply(&hybrid)?)?
    );

    // Exact thresholding of |h_i| (GateFirst), half the neurons placed in the fast tier.
    let hybrid = hybrid
        .with_predictor(GateFirst::new(0.02)?)
        .with_placement(LayerPlacement::new(
            i,
            (0..i as u32).step_by(2).collect(),
            Some(0),
        )?)?;
    // Token by token, as in decode: each token computes only its own active neurons' down rows.
    let mut ys = Vec::new();
    let mut active = 0;
    for t in 0..5 {
        ys.push(xs.narrow(1, t, 1)?.apply(&hybrid)?);
        active += hybrid.last_active();
    }
    let y = Tensor::cat(&ys, 1)?;
    println!(
        "GateFirst |h| > 0.02, decode: {:.1}% of {i} neurons' down rows per token, rel diff {:.2e}",
        100.0 * active as f64 / (5 * i) as f64,
        diff(&y)?
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
