//! Your own candle 0.11 model with the input-sparse FFN swapped in.
//!
//! A llama-family decoder written the way a candle user writes one (`candle_nn::Linear`,
//! `RmsNorm`, `Embedding`, a causal mask, `rope_i`), loaded from a `VarBuilder` with Hugging Face
//! tensor names. The one line that differs from a dense model is the MLP:
//!
//! ```text
//! mlp: Mlp::Sparse(InputSparseFfn::load(Activation::Silu, vb.pp("mlp"), opts)?),
//! ```
//!
//! It runs SmolLM2-135M-Instruct (fetched into the cache on first use; the GGUF file's tensors are
//! dequantized to f32 under HF names, as a safetensors checkpoint would give them) three ways:
//! candle's dense MLP; the swap with the default options (every input kept, each matrix
//! row-major on our dense kernels: the dense result); and the FFN stored by column
//! (`layouts: Some([Layout::Columns; 3])`) after calibrating TEAL's rule on a speech
//! (`record_scores`, `InputScores::thresholds`, `set_rule`). It prints each one's greedy text and
//! the time its MLPs took. Run: `cargo run --release -p powerinfer-candle --example own_model`.
//! The test command runs its test (`[[example]] test = true`).

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm, VarBuilder};
use powerinfer::{
    input_rule::split_target, layout::Layout, Activation, InputScore, InputSparseFfn,
    InputSparseOptions,
};
use powerinfer::{InputScores, WeightTraffic};

/// The hyper-parameters the model reads.
#[derive(Clone, Copy)]
struct Config {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    intermediate: usize,
    vocab: usize,
    rope_theta: f32,
    eps: f64,
}

/// The MLP: candle's dense one, or powerinfer's input-sparse FFN.
enum Mlp {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Sparse(Box<InputSparseFfn>),
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Dense { gate, up, down } => {
                (candle_nn::ops::silu(&gate.forward(x)?)? * up.forward(x)?)?.apply(down)
            }
            Mlp::Sparse(ffn) => ffn.forward(x),
        }
    }
}

struct Layer {
    attn_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: RmsNorm,
    mlp: Mlp,
}

/// Which MLP a model's layers take.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// candle's dense MLP.
    Dense,
    /// `InputSparseFfn::load` with the default options.
    Swap,
    /// `InputSparseFfn::load` by column, for a rule calibrated after loading.
    Columns,
}

struct Model {
    cfg: Config,
    /// Time spent in the MLPs since the last `take_mlp_time`.
    mlp_time: std::cell::Cell<std::time::Duration>,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    head: Linear,
    cos: Tensor,
    sin: Tensor,
}

impl Model {
    fn load(cfg: Config, vb: VarBuilder, kind: Kind) -> std::result::Result<Self, Error> {
        let (h, hd) = (cfg.hidden, cfg.hidden / cfg.heads);
        let m = vb.pp("model");
        let embed = embedding(cfg.vocab, h, m.pp("embed_tokens"))?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = m.pp(format!("layers.{l}"));
            let a = p.pp("self_attn");
            let mlp = if kind != Kind::Dense {
                // The swap: the MLP's three tensors become one input-sparse FFN.
                let opts = InputSparseOptions {
                    threads: 2,
                    layouts: (kind == Kind::Columns).then_some([Layout::Columns; 3]),
                    ..Default::default()
                };
                Mlp::Sparse(Box::new(InputSparseFfn::load(
                    Activation::Silu,
                    p.pp("mlp"),
                    opts,
                )?))
            } else {
                let f = p.pp("mlp");
                Mlp::Dense {
                    gate: linear_no_bias(h, cfg.intermediate, f.pp("gate_proj"))?,
                    up: linear_no_bias(h, cfg.intermediate, f.pp("up_proj"))?,
                    down: linear_no_bias(cfg.intermediate, h, f.pp("down_proj"))?,
                }
            };
            layers.push(Layer {
                attn_norm: rms_norm(h, cfg.eps, p.pp("input_layernorm"))?,
                q: linear_no_bias(h, cfg.heads * hd, a.pp("q_proj"))?,
                k: linear_no_bias(h, cfg.kv_heads * hd, a.pp("k_proj"))?,
                v: linear_no_bias(h, cfg.kv_heads * hd, a.pp("v_proj"))?,
                o: linear_no_bias(cfg.heads * hd, h, a.pp("o_proj"))?,
                ffn_norm: rms_norm(h, cfg.eps, p.pp("post_attention_layernorm"))?,
                mlp,
            });
        }
        let norm = rms_norm(h, cfg.eps, m.pp("norm"))?;
        // Tied embeddings (SmolLM2).
        let head = Linear::new(embed.embeddings().clone(), None);
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let inv = Tensor::new(inv, vb.device())?.unsqueeze(0)?;
        let pos = Tensor::arange(0u32, 512, vb.device())?
            .to_dtype(DType::F32)?
            .unsqueeze(1)?;
        let freqs = pos.matmul(&inv)?;
        Ok(Model {
            mlp_time: Default::default(),
            cos: freqs.cos()?,
            sin: freqs.sin()?,
            cfg,
            embed,
            layers,
            norm,
            head,
        })
    }

    /// The logits of the last position of `tokens` (the whole sequence recomputed: no KV cache,
    /// to keep the example short).
    fn forward(&self, tokens: &[u32]) -> Result<Tensor> {
        let (t, dev) = (tokens.len(), self.cos.device());
        let (heads, kv, hd) = (
            self.cfg.heads,
            self.cfg.kv_heads,
            self.cfg.hidden / self.cfg.heads,
        );
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), dev)?;
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let mut x = self
            .embed
            .forward(&Tensor::new(tokens, dev)?.unsqueeze(0)?)?;
        for l in &self.layers {
            let h = l.attn_norm.forward(&x)?;
            let split = |lin: &Linear, n: usize| -> Result<Tensor> {
                lin.forward(&h)?
                    .reshape((1, t, n, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let q = candle_nn::rotary_emb::rope_i(&split(&l.q, heads)?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope_i(&split(&l.k, kv)?, &cos, &sin)?;
            let v = split(&l.v, kv)?;
            // Each KV head serves heads / kv query heads.
            let rep = |x: Tensor| -> Result<Tensor> {
                Tensor::cat(&vec![&x; heads / kv], 2)?.reshape((1, heads, t, hd))
            };
            let (k, v) = (rep(k)?, rep(v)?);
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let y = candle_nn::ops::softmax_last_dim(&att)?.matmul(&v)?;
            let y = y.transpose(1, 2)?.reshape((1, t, heads * hd))?;
            x = (x + l.o.forward(&y)?)?;
            let h = l.ffn_norm.forward(&x)?;
            let t = std::time::Instant::now();
            let y = l.mlp.forward(&h)?;
            self.mlp_time.set(self.mlp_time.get() + t.elapsed());
            x = (&x + y)?;
        }
        let last = self.norm.forward(&x.narrow(1, t - 1, 1)?)?;
        self.head.forward(&last)?.flatten_all()
    }

    /// The MLPs' time since the last call, in ms.
    fn take_mlp_ms(&self) -> f64 {
        self.mlp_time.take().as_secs_f64() * 1e3
    }

    /// Greedy continuation of `prompt` by `n` tokens.
    fn greedy(&self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let next = self.forward(&ids)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
            ids.push(next);
        }
        Ok(ids[prompt.len()..].to_vec())
    }

    fn sparse_ffns(&mut self) -> impl Iterator<Item = &mut InputSparseFfn> {
        self.layers.iter_mut().filter_map(|l| match &mut l.mlp {
            Mlp::Sparse(f) => Some(&mut **f),
            Mlp::Dense { .. } => None,
        })
    }

    /// TEAL's rule dropping `target` of the FFN inputs on average (down 1.5 times as many),
    /// calibrated per layer on `text`.
    fn calibrate(&mut self, text: &[u32], target: f64) -> std::result::Result<(), Error> {
        self.sparse_ffns().for_each(|f| f.record_scores());
        self.forward(text)?;
        let fractions = split_target(target, 1.5);
        let scores: Vec<InputScores> = self.sparse_ffns().filter_map(|f| f.take_scores()).collect();
        for (f, s) in self.sparse_ffns().zip(&scores) {
            let t = s.thresholds(fractions).ok_or("no scores were recorded")?;
            f.set_rule(InputScore::Magnitude, t)?;
        }
        Ok(())
    }

    /// The FFN weight bytes read since the last call, against dense.
    fn traffic(&mut self) -> WeightTraffic {
        let mut all = WeightTraffic::default();
        self.sparse_ffns().for_each(|f| all.add(&f.take_traffic()));
        all
    }
}

type Error = Box<dyn std::error::Error>;

/// SmolLM2's GGUF file as an f32 `VarBuilder` with Hugging Face names, and its config.
fn smollm2() -> std::result::Result<
    (
        Config,
        VarBuilder<'static>,
        powerinfer_candle::TextTokenizer,
    ),
    Error,
> {
    let path = powerinfer_data::smollm2(&mut |m| eprintln!("{m}"))?;
    let mut file = std::fs::File::open(&path)?;
    let ct = gguf_file::Content::read(&mut file)?;
    let meta = |k: &str| -> std::result::Result<&gguf_file::Value, Error> {
        ct.metadata
            .get(&format!("llama.{k}"))
            .ok_or_else(|| format!("no llama.{k}").into())
    };
    let cfg = Config {
        hidden: meta("embedding_length")?.to_u32()? as usize,
        heads: meta("attention.head_count")?.to_u32()? as usize,
        kv_heads: meta("attention.head_count_kv")?.to_u32()? as usize,
        layers: meta("block_count")?.to_u32()? as usize,
        intermediate: meta("feed_forward_length")?.to_u32()? as usize,
        vocab: ct
            .tensor_infos
            .get("token_embd.weight")
            .and_then(|t| t.shape.dims().first().copied())
            .ok_or("no token_embd.weight")?,
        rope_theta: meta("rope.freq_base")?.to_f32()?,
        eps: meta("attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
    };
    let hf = |name: &str| -> String {
        let Some(rest) = name.strip_prefix("blk.") else {
            return match name {
                "token_embd.weight" => "model.embed_tokens.weight".into(),
                "output_norm.weight" => "model.norm.weight".into(),
                other => other.into(),
            };
        };
        let (l, t) = rest.split_once('.').unwrap_or((rest, ""));
        let t = match t {
            "attn_norm.weight" => "input_layernorm.weight",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            other => other,
        };
        format!("model.layers.{l}.{t}")
    };
    let dev = Device::Cpu;
    let mut tensors = std::collections::HashMap::new();
    for name in ct.tensor_infos.keys() {
        let t = ct.tensor(&mut file, name, &dev)?.dequantize(&dev)?;
        tensors.insert(hf(name), t);
    }
    let tok = powerinfer_candle::TextTokenizer::from_gguf(&ct)?;
    Ok((
        cfg,
        VarBuilder::from_tensors(tensors, DType::F32, &dev),
        tok,
    ))
}

/// What a run shows: the three continuations, what the calibrated rule skipped and each one's
/// MLP time over its greedy steps (ms).
struct Run {
    dense: Vec<u32>,
    every_input: Vec<u32>,
    every_input_max_diff: f32,
    calibrated: Vec<u32>,
    skipped: f64,
    ms: [f64; 3],
}

fn run(
    prompt: &str,
    tokens: usize,
) -> std::result::Result<(Run, powerinfer_candle::TextTokenizer), Error> {
    let (cfg, vb, tok) = smollm2()?;
    let dense = Model::load(cfg, vb.clone(), Kind::Dense)?;
    let swap = Model::load(cfg, vb.clone(), Kind::Swap)?;
    let mut sparse = Model::load(cfg, vb, Kind::Columns)?;
    let ids = tok.encode_sequence(prompt)?;
    let diff = (dense.forward(&ids)? - swap.forward(&ids)?)?
        .abs()?
        .max(D::Minus1)?
        .to_scalar::<f32>()?;
    // Warm: the first pass touches every weight once (page faults, caches).
    for m in [&dense, &swap, &sparse] {
        m.forward(&ids)?;
        m.take_mlp_ms();
    }
    let d = dense.greedy(&ids, tokens)?;
    let dense_ms = dense.take_mlp_ms();
    let e = swap.greedy(&ids, tokens)?;
    let swap_ms = swap.take_mlp_ms();
    let speeches = powerinfer_data::speeches(
        &powerinfer_data::sotu(&mut |m| eprintln!("{m}"))?,
        1995..=1995,
    )?;
    let calib = tok.encode_sequence(&std::fs::read_to_string(&speeches[0])?)?;
    sparse.calibrate(&calib[..256.min(calib.len())], 0.28)?;
    sparse.traffic();
    sparse.take_mlp_ms();
    let c = sparse.greedy(&ids, tokens)?;
    let sparse_ms = sparse.take_mlp_ms();
    let skipped = sparse.traffic().skipped();
    let run = Run {
        dense: d,
        every_input: e,
        every_input_max_diff: diff,
        calibrated: c,
        skipped,
        ms: [dense_ms, swap_ms, sparse_ms],
    };
    Ok((run, tok))
}

fn main() -> std::result::Result<(), Error> {
    let prompt = "The capital of France is";
    let steps = 16;
    let (r, tok) = run(prompt, steps)?;
    println!(
        "candle dense MLP:          {prompt}{}",
        tok.decode(&r.dense)?
    );
    println!(
        "the swap, default options: {prompt}{} (logits within {:.2e} of dense)",
        tok.decode(&r.every_input)?,
        r.every_input_max_diff
    );
    println!(
        "by column, TEAL 28%:       {prompt}{} ({:.1}% of the FFN weight bytes skipped)",
        tok.decode(&r.calibrated)?,
        r.skipped * 100.0
    );
    // No KV cache here: each step runs the MLPs over the whole sequence (a prompt's batch),
    // on 2 threads for ours and candle's thread count (RAYON_NUM_THREADS) for its own.
    let [d, s, c] = r.ms;
    println!(
        "MLP time over the {steps} steps: candle {d:.1} ms, the swap {s:.1} ms ({:.2}x), by column \
         with the rule {c:.1} ms ({:.2}x)",
        d / s,
        d / c
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Keeping every input is the dense MLP (same greedy tokens, logits within f32 rounding);
    /// the calibrated rule skips bytes and keeps the first tokens.
    #[test]
    fn the_swapped_model_runs_on_candle_0_11() {
        let (r, _) = super::run("The capital of France is", 8).unwrap();
        assert_eq!(r.every_input, r.dense);
        assert!(r.every_input_max_diff < 1e-3, "{}", r.every_input_max_diff);
        assert!((0.1..0.5).contains(&r.skipped), "skipped {}", r.skipped);
        assert_eq!(r.calibrated[..2], r.dense[..2]);
    }
}
