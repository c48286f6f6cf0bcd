//! Loading llama-family models: GGUF files (FFN kept in its GGUF quantization for the dense
//! path) and HF safetensors directories (`config.json` + `*.safetensors`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, VarBuilder};
use powerinfer::layout::{Layout, LayoutPlanner, Layouts};
use powerinfer::{
    cpu::ColumnStorage, All, FfnSpec, FfnWeights, GateFirst, HybridFfn, HybridOptions,
    InputSparseFfn, NeuronBundles, Neurons, Sparsity, WeightDType,
};

use crate::config::LlamaConfig;
use crate::error::{Error, ErrorKind, Result};

use crate::gguf::GgufFile;
use crate::model::{
    Attention, Decoder, DenseFfn, Embed, Execution, Ffn, GemmaNorms, KernelFfn, Layer, Linear,
    Llama, Projection, RmsNorm, TokenEmbedding,
};
use crate::tokenizer::TextTokenizer;

/// How each layer's FFN is built.
#[derive(Debug, Clone)]
pub enum FfnMode {
    /// The dense candle FFN (the reference), on the weights as stored (GGUF: candle's quantized
    /// matmul, which quantizes activations to 8 bits).
    Dense,
    /// The dense candle FFN on weights dequantized to f32: the exact oracle for the hybrid FFN.
    DenseF32,
    /// Dense FFN and attention projections dequantized to f32, so long prompts run through
    /// candle's f32 GEMM: the fastest way to push calibration text through a model
    /// ([`crate::Llama::probe_ffn`], `powerinfer analyze`). Costs 4 bytes per weight.
    Analysis,
    /// The dense FFN on the file's blocks through powerinfer's integer kernels, and the whole
    /// model on the fused decoder (no candle op per token, one thread pool of `threads`). Needs a
    /// GGUF file whose projections, FFN and LM head are Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K
    /// or Q6_K; anything else is a typed error naming the tensor.
    Fused {
        /// Threads of the pool (the calling thread included).
        threads: usize,
    },
    /// `powerinfer::InputSparseFfn` on the file's blocks (column-major, exact) and the whole
    /// model on the fused decoder, like [`FfnMode::Fused`]. Without an artifact every threshold
    /// starts at 0 (the dense result); set a rule later with [`crate::Llama::set_input_rule`],
    /// calibrated with [`crate::Llama::record_input_scores`].
    InputSparse {
        /// Threads of the pool (the calling thread included).
        threads: usize,
        /// The attention projections (q/k/v stacked, o) on input-sparse columns too
        /// (`powerinfer::layers::InputSparseLinear`, GGUF only); their thresholds start at 0, set with
        /// [`crate::Llama::set_attention_rule`].
        attention: bool,
        /// Up kept as the file's rows instead of columns, for the CHESS rule (gate first, then
        /// up and down only for the neurons it keeps; GGUF only; up then has no input
        /// threshold): set it with [`crate::Llama::set_chess_rules`].
        up_rows: bool,
        /// A `.powerinfer` artifact (format version 2) whose calibrated input rule is installed
        /// while loading, after checking it was made from this model file.
        artifact: Option<PathBuf>,
        /// How each FFN matrix is stored: every one by column (`Layouts::Columns`), or by
        /// column only where its column product measured faster than the dense rows at the
        /// fractions the rule is expected to drop (`Layouts::Measured`; with an artifact, its
        /// rule's fractions), the others as the dense decoder's rows, never masked.
        /// [`crate::Llama::layout_decisions`] says what was measured and chosen. With an
        /// artifact and `Layouts::Measured`, a layer whose three matrices all stay rows runs
        /// the dense FFN ([`crate::Llama::run_rows_dense`]); without one, call that once the
        /// rule is calibrated and set.
        layouts: Layouts,
    },
    /// `powerinfer::HybridFfn`.
    Hybrid {
        /// Storage of the neuron-major weights. `None`: as the file stores them (GGUF Q4_0, Q4_1
        /// and Q8_0 blocks kept byte for byte, down rows re-quantized to Q8_0; other files f16).
        storage: Option<WeightDType>,
        /// Which neurons run: [`Neurons::All`], [`Neurons::GateFirst`] (one threshold for every
        /// layer), or [`Neurons::Predictors`] (the artifact is read, checked against the model
        /// file, and its predictors and placement installed in every layer while loading).
        predictor: Neurons,
        /// Threads, SIMD level, prefill policy.
        options: HybridOptions,
        /// Run the attention projections and the LM head through powerinfer's quantized kernels
        /// (`QLinear`, GGUF Q4_0 / Q4_1 / Q8_0) instead of candle's matmul (which has no SIMD
        /// path for some block types, Q4_1 among them). When every projection and the LM head
        /// allow it, the whole model runs on the fused decoder ([`crate::Llama::is_fused`]);
        /// otherwise the projections that allow it use `QLinear` inside candle's ops.
        powerinfer_linears: bool,
    },
}

impl FfnMode {
    /// The FFN type a [`Sparsity`] names, on `threads` threads, with the defaults of the rest:
    /// [`Sparsity::Neurons`] is [`FfnMode::Hybrid`] (storage as the file stores it, powerinfer's
    /// linear layers), [`Sparsity::Input`] is [`FfnMode::InputSparse`] (attention dense, up by
    /// column). An artifact it names is installed while loading.
    ///
    /// ```
    /// use powerinfer_candle::FfnMode;
    ///
    /// let mode = FfnMode::sparse("input:smollm2.powerinfer".parse()?, 2);
    /// assert!(matches!(mode, FfnMode::InputSparse { threads: 2, artifact: Some(_), .. }));
    /// # Ok::<(), powerinfer::Error>(())
    /// ```
    pub fn sparse(sparsity: Sparsity, threads: usize) -> Self {
        match sparsity {
            Sparsity::Neurons(predictor) => FfnMode::Hybrid {
                storage: None,
                predictor,
                options: HybridOptions {
                    threads,
                    ..HybridOptions::default()
                },
                powerinfer_linears: true,
            },
            Sparsity::Input(artifact) => FfnMode::InputSparse {
                threads,
                attention: false,
                up_rows: false,
                artifact,
                layouts: Layouts::Measured {
                    drop: crate::InputRuleOptions::default().fractions(),
                },
            },
        }
    }

    /// The hybrid FFN with `GateFirst` at `threshold`, native storage, default options.
    pub fn gate_first(threshold: f32) -> Self {
        FfnMode::Hybrid {
            storage: None,
            predictor: Neurons::GateFirst(threshold),
            options: HybridOptions::default(),
            powerinfer_linears: true,
        }
    }
}

/// The hybrid FFN of layer `layer`: `bundles` builds its weights in the storage asked for.
fn hybrid_ffn(
    cfg: &LlamaConfig,
    mode: &FfnMode,
    layer: usize,
    bundles: impl FnOnce(FfnSpec, Option<WeightDType>) -> Result<NeuronBundles>,
) -> Result<Ffn> {
    let FfnMode::Hybrid {
        storage,
        predictor,
        options,
        ..
    } = mode
    else {
        return Err(powerinfer::Error::from(powerinfer::ErrorKind::Config {
            setting: "ffn".into(),
            reason: "hybrid FFN requested in dense mode".into(),
        })
        .into());
    };
    let spec = FfnSpec::gated(cfg.hidden, cfg.intermediate, cfg.activation)?;
    let opts = HybridOptions {
        layer: Some(layer),
        ..options.clone()
    };
    let ffn = HybridFfn::new(bundles(spec, *storage)?, opts)?;
    Ok(Ffn::Hybrid(Box::new(match predictor {
        // An artifact's predictors replace `All` once every layer is built.
        Neurons::All | Neurons::Predictors { .. } => ffn.with_predictor(All),
        Neurons::GateFirst(threshold) => ffn.with_predictor(GateFirst::new(*threshold)?),
    })))
}

/// Neuron-major bundles from `[out, in]` float tensors.
fn float_bundles(spec: FfnSpec, storage: WeightDType, w: [Tensor; 3]) -> Result<NeuronBundles> {
    let [g, u, d] = w;
    Ok(NeuronBundles::from_weights(
        spec,
        FfnWeights::gated(&g, &u, &d),
        storage,
    )?)
}

fn norm(w: Tensor, eps: f64) -> Result<RmsNorm> {
    RmsNorm::new(w, eps as f32)
}

/// Whether our integer kernels take this GGUF block type.
fn packable(t: GgmlDType) -> bool {
    powerinfer::cpu::BlockKind::from_ggml(t).is_some()
}

/// The tensors the fused decoder needs as `QLinear`s: the first one whose block type our kernels
/// do not take, if any (`ffn`: the FFN's too).
fn unpackable(gguf: &GgufFile, cfg: &LlamaConfig, ffn: bool) -> Option<(String, GgmlDType)> {
    let head = if gguf.content.tensor_infos.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let mut names = vec![head.to_string()];
    for l in 0..cfg.layers {
        let mut parts = vec!["attn_q", "attn_k", "attn_v", "attn_output"];
        if ffn {
            parts.extend(["ffn_gate", "ffn_up", "ffn_down"]);
        }
        names.extend(parts.iter().map(|n| format!("blk.{l}.{n}.weight")));
    }
    names.into_iter().find_map(|n| {
        let t = gguf.content.tensor_infos.get(&n)?.ggml_dtype;
        (!packable(t)).then_some((n, t))
    })
}

/// Loads a llama-family GGUF file with each layer's FFN built as `mode` says.
pub fn load_gguf(gguf: &mut GgufFile, mode: &FfnMode) -> Result<Llama> {
    let model = build_gguf(gguf, mode);
    powerinfer::cpu::release_freed_memory();
    let path = gguf.path.clone();
    install_artifact(model?, mode, &path)
}

/// With an artifact in `mode`: reads it, checks it was made from `model_path`, and installs its
/// predictors and placement ([`Neurons::Predictors`]) or its input rule
/// ([`FfnMode::InputSparse`]) in every layer.
fn install_artifact(mut model: Llama, mode: &FfnMode, model_path: &Path) -> Result<Llama> {
    match mode {
        FfnMode::Hybrid {
            predictor:
                Neurons::Predictors {
                    artifact,
                    predictor_sparsity,
                },
            ..
        } => {
            let a = crate::load_artifact(artifact, model_path)?;
            model.use_artifact(&a, *predictor_sparsity)?;
        }
        FfnMode::InputSparse {
            artifact: Some(artifact),
            ..
        } => {
            let a = crate::load_artifact(artifact, model_path)?;
            let rule = a.meta.input_rule.as_ref().ok_or_else(|| {
                powerinfer::Error::config(
                    "artifact",
                    format!(
                        "{} has no input rule (format version 1); rerun `powerinfer analyze`",
                        artifact.display()
                    ),
                )
            })?;
            model.apply_input_rule(rule)?;
            if matches!(
                mode,
                FfnMode::InputSparse {
                    layouts: Layouts::Measured { .. },
                    ..
                }
            ) {
                model.run_rows_dense()?;
            }
        }
        _ => {}
    }
    Ok(model)
}

/// The layout planner an input-sparse mode asks for: the fractions it expects dropped are its
/// artifact's rule's when it names an artifact (read here unchecked; the check against the model
/// comes with installing it).
fn layout_planner(mode: &FfnMode) -> Result<Option<LayoutPlanner>> {
    let FfnMode::InputSparse {
        threads,
        artifact,
        layouts: Layouts::Measured { drop },
        ..
    } = mode
    else {
        return Ok(None);
    };
    let drop = match artifact {
        Some(a) => match powerinfer::Artifact::load(a)?.meta.input_rule {
            Some(rule) => rule.allocation,
            None => *drop,
        },
        None => *drop,
    };
    Ok(Some(LayoutPlanner::new(drop, *threads, None)?))
}

fn build_gguf(gguf: &mut GgufFile, mode: &FfnMode) -> Result<Llama> {
    let cfg = gguf_config(gguf)?;
    let (fused, ours) = gguf_plan(gguf, &cfg, mode)?;
    let planner = layout_planner(mode)?;
    // Grown as layers load: `cfg.layers` comes from the file and is not trusted for a capacity.
    let mut layers = Vec::new();
    for l in 0..cfg.layers {
        let ffn = gguf_ffn(gguf, &cfg, mode, l, planner.as_ref())?;
        layers.push(gguf_layer(gguf, &cfg, mode, l, fused, ours, ffn)?);
    }
    // The layers' temporaries are freed; give them back before the largest tensor is read.
    powerinfer::cpu::release_freed_memory();
    let norm_w = norm(gguf.dequantized("output_norm.weight")?, 0.0)?;
    let (trunk, lm_head) = gguf_trunk(gguf, &cfg, fused)?;
    let mut model = finish(cfg, trunk, layers, norm_w, lm_head)?;
    model.layout_decisions = planner.map(|p| p.decisions()).unwrap_or_default();
    Ok(model)
}

/// The file's hyper-parameters, PowerInfer's adjustments, and a llama 3.x file's RoPE factors.
fn gguf_config(gguf: &mut GgufFile) -> Result<LlamaConfig> {
    let mut cfg = gguf_config_header(gguf)?;
    if gguf.content.tensor_infos.contains_key("rope_freqs.weight") {
        let f = gguf.dequantized("rope_freqs.weight")?.flatten_all()?;
        let f = f.to_vec1::<f32>()?;
        if f.len() != cfg.head_dim() / 2 || f.iter().any(|v| !v.is_finite() || *v <= 0.0) {
            return Err(Error::format(
                &gguf.path,
                format!(
                    "`rope_freqs.weight` holds {} factors, expected {} positive ones",
                    f.len(),
                    cfg.head_dim() / 2
                ),
            ));
        }
        cfg.rope_factors = Some(f);
    }
    Ok(cfg)
}

/// What a model file runs on, read from its header alone (no tensor is loaded), so a caller
/// picks the mode before loading instead of loading one and falling back on its error. Each
/// field is `None` where the file runs there, or the reason it does not (the same words a load
/// in that mode fails with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Support {
    /// The fused decoder: [`FfnMode::Fused`], and [`FfnMode::InputSparse`] on a GGUF file. It
    /// needs a GGUF file whose projections, FFN and LM head are in block types our kernels take.
    pub fused: Option<String>,
    /// candle's ops around the FFN ([`FfnMode::Dense`], [`FfnMode::DenseF32`],
    /// [`FfnMode::Analysis`]): every llama, mistral and qwen2 file, not Gemma 3.
    pub candle: Option<String>,
    /// The input-sparse FFN with its defaults (`FfnMode::sparse(Sparsity::Input(..), ..)`): a
    /// GGUF file on the fused decoder, or a safetensors checkpoint as f16 columns.
    pub input_sparse: Option<String>,
}

impl Support {
    /// Reads the header of `path` (a `.gguf` file, or a directory with `config.json`).
    pub fn of(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let cfg = read_config(path)?;
            return Ok(Support {
                fused: Some(SAFETENSORS_NOT_FUSED.into()),
                candle: cfg.gemma3.as_ref().map(|_| GEMMA3_FUSED_ONLY.into()),
                input_sparse: None,
            });
        }
        let gguf = GgufFile::open(path)?;
        let cfg = gguf_config_header(&gguf)?;
        let fused = not_fused(&gguf, &cfg);
        Ok(Support {
            candle: cfg.gemma3.as_ref().map(|_| GEMMA3_FUSED_ONLY.into()),
            input_sparse: fused.clone(),
            fused,
        })
    }
}

/// A model's configuration from its header alone, as the loader reads it before any tensor: a
/// GGUF file's metadata (with PowerInfer's adjustments), or a directory's `config.json`.
pub fn read_config(path: &Path) -> Result<LlamaConfig> {
    match path.is_dir() {
        true => LlamaConfig::from_hf_json(&path.join("config.json")),
        false => gguf_config_header(&GgufFile::open(path)?),
    }
}

/// Why a safetensors checkpoint has no fused decoder.
const SAFETENSORS_NOT_FUSED: &str =
    "needs a GGUF file of quantized blocks (this is a safetensors checkpoint)";
/// Why a Gemma 3 file has no candle-ops model.
const GEMMA3_FUSED_ONLY: &str = "Gemma 3 runs on the fused decoder only: FfnMode::Fused, or \
     FfnMode::Hybrid with powerinfer_linears (and a storage its FFN blocks allow, e.g. f16)";

/// The header's config as [`gguf_config`] adjusts it, without reading any tensor.
fn gguf_config_header(gguf: &GgufFile) -> Result<LlamaConfig> {
    let mut cfg = LlamaConfig::from_gguf(&gguf.content)?;
    adjust_config(gguf, &mut cfg);
    Ok(cfg)
}

/// Why the fused decoder cannot run this GGUF file: the first tensor it needs whose block type
/// our kernels do not take.
fn not_fused(gguf: &GgufFile, cfg: &LlamaConfig) -> Option<String> {
    unpackable(gguf, cfg, true).map(|(name, t)| {
        format!(
            "tensor `{name}` is {t:?}; the fused decoder takes Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, \
             Q4_K, Q5_K and Q6_K"
        )
    })
}

/// Where the model runs: the fused decoder's thread count when every projection (and for
/// `Fused` and `InputSparse` the FFN) is on our kernels, and the thread count of powerinfer's
/// linear layers inside candle's ops otherwise (`FfnMode::Hybrid` with `powerinfer_linears`).
fn gguf_plan(
    gguf: &GgufFile,
    cfg: &LlamaConfig,
    mode: &FfnMode,
) -> Result<(Option<usize>, Option<usize>)> {
    let fused = match mode {
        FfnMode::Fused { threads } | FfnMode::InputSparse { threads, .. } => {
            if *threads == 0 {
                return Err(powerinfer::Error::config("threads", "must be at least 1").into());
            }
            if let Some(why) = not_fused(gguf, cfg) {
                return Err(powerinfer::Error::config("fused decoder", why).into());
            }
            Some(*threads)
        }
        FfnMode::Hybrid {
            powerinfer_linears: true,
            options,
            ..
        } if unpackable(gguf, cfg, false).is_none() => Some(options.threads),
        _ => None,
    };
    let ours = match mode {
        FfnMode::Hybrid {
            powerinfer_linears: true,
            options,
            ..
        } => Some(options.threads),
        _ => None,
    };
    if cfg.gemma3.is_some() && fused.is_none() {
        return Err(powerinfer::Error::config("gemma3", GEMMA3_FUSED_ONLY).into());
    }
    Ok((fused, ours))
}

/// Layer `l` as `mode` builds it (see [`gguf_plan`] for `fused` and `ours`).
fn gguf_layer(
    gguf: &mut GgufFile,
    cfg: &LlamaConfig,
    mode: &FfnMode,
    l: usize,
    fused: Option<usize>,
    ours: Option<usize>,
    ffn: Ffn,
) -> Result<Layer> {
    let p = format!("blk.{l}");
    let deq = |g: &mut GgufFile, n: &str| g.dequantized(&format!("{p}.{n}.weight"));
    let attn = gguf_attention(gguf, &p, mode, fused, ours)?;
    let gemma = match cfg.gemma3 {
        Some(_) => Some(GemmaNorms {
            q: norm(deq(gguf, "attn_q_norm")?, cfg.rms_eps)?,
            k: norm(deq(gguf, "attn_k_norm")?, cfg.rms_eps)?,
            post_attn: norm(deq(gguf, "post_attention_norm")?, cfg.rms_eps)?,
            post_ffn: norm(deq(gguf, "post_ffw_norm")?, cfg.rms_eps)?,
        }),
        None => None,
    };
    Ok(Layer {
        attn_norm: norm(deq(gguf, "attn_norm")?, cfg.rms_eps)?,
        attn,
        ffn_norm: norm(deq(gguf, "ffn_norm")?, cfg.rms_eps)?,
        ffn,
        gemma,
        kv: None,
    })
}

/// A dense f32 linear layer `{p}.{n}` (weights dequantized, optional bias).
fn f32_linear(g: &mut GgufFile, p: &str, n: &str) -> Result<Linear> {
    Ok(Linear::Candle {
        w: QMatMul::Tensor(g.dequantized(&format!("{p}.{n}.weight"))?),
        b: g.bias(&format!("{p}.{n}"))?,
    })
}

/// The attention projections of the layer with prefix `p`: the fused decoder's stacked q/k/v
/// and o (rows, or input-sparse columns), or four linear layers for candle's ops.
fn gguf_attention(
    gguf: &mut GgufFile,
    p: &str,
    mode: &FfnMode,
    fused: Option<usize>,
    ours: Option<usize>,
) -> Result<Attention> {
    let lin = |g: &mut GgufFile, n: &str| match mode {
        FfnMode::Analysis => f32_linear(g, p, n),
        _ => Linear::from_gguf(g, &format!("{p}.{n}"), ours),
    };
    let qkv = ["attn_q", "attn_k", "attn_v"];
    Ok(match (fused, mode) {
        (
            Some(t),
            FfnMode::InputSparse {
                attention: true, ..
            },
        ) => Attention::Fused {
            qkv: Projection::Columns(Box::new(gguf.stacked_columns(p, &qkv, t)?)),
            o: Projection::Columns(Box::new(gguf.stacked_columns(p, &["attn_output"], t)?)),
        },
        (Some(t), _) => Attention::Fused {
            qkv: Projection::Rows(Arc::new(gguf.stacked(p, &qkv, t)?)),
            o: Projection::Rows(Arc::new(gguf.stacked(p, &["attn_output"], t)?)),
        },
        (None, _) => Attention::Ops {
            q: lin(gguf, "attn_q")?,
            k: lin(gguf, "attn_k")?,
            v: lin(gguf, "attn_v")?,
            o: lin(gguf, "attn_output")?,
        },
    })
}

/// Layer `l`'s FFN as `mode` says (`planner`: the input-sparse layouts' measurements).
fn gguf_ffn(
    gguf: &mut GgufFile,
    cfg: &LlamaConfig,
    mode: &FfnMode,
    l: usize,
    planner: Option<&LayoutPlanner>,
) -> Result<Ffn> {
    let p = format!("blk.{l}");
    let t = |g: &mut GgufFile, n: &str| g.tensor(&format!("{p}.{n}.weight"));
    let deq = |g: &mut GgufFile, n: &str| g.dequantized(&format!("{p}.{n}.weight"));
    Ok(match mode {
        FfnMode::Dense => Ffn::Dense(DenseFfn {
            gate: Linear::from_gguf(gguf, &format!("{p}.ffn_gate"), None)?,
            up: Linear::from_gguf(gguf, &format!("{p}.ffn_up"), None)?,
            down: Linear::from_gguf(gguf, &format!("{p}.ffn_down"), None)?,
            act: cfg.activation,
        }),
        FfnMode::DenseF32 | FfnMode::Analysis => Ffn::Dense(DenseFfn {
            gate: f32_linear(gguf, &p, "ffn_gate")?,
            up: f32_linear(gguf, &p, "ffn_up")?,
            down: f32_linear(gguf, &p, "ffn_down")?,
            act: cfg.activation,
        }),
        FfnMode::Fused { threads } => Ffn::Kernels(Box::new(KernelFfn {
            gate_up: gguf.stacked(&p, &["ffn_gate", "ffn_up"], *threads)?,
            down: gguf.stacked(&p, &["ffn_down"], *threads)?,
            act: cfg.activation,
        })),
        FfnMode::InputSparse {
            threads, up_rows, ..
        } => {
            let (gate, up) = (t(gguf, "ffn_gate")?, t(gguf, "ffn_up")?);
            let down = t(gguf, "ffn_down")?;
            let (h, n) = (cfg.hidden, cfg.intermediate);
            let spec = FfnSpec::gated(h, n, cfg.activation)?;
            Ffn::InputSparse(Box::new(if *up_rows {
                InputSparseFfn::from_qtensors_up_rows(spec, &gate, &up, &down, *threads, None)?
            } else {
                let layouts = match planner {
                    Some(p) => p.ffn_layouts(&spec, Some(&gate), &up, &down)?,
                    None => [Layout::Columns; 3],
                };
                let (g, t) = (Some(&gate), *threads);
                InputSparseFfn::from_qtensors_as(spec, g, &up, &down, t, None, layouts)?
            }))
        }
        FfnMode::Hybrid { .. } => hybrid_ffn(cfg, mode, l, |spec, storage| match storage {
            None => {
                let (gate, up) = (t(gguf, "ffn_gate")?, t(gguf, "ffn_up")?);
                let down = t(gguf, "ffn_down")?;
                Ok(NeuronBundles::from_qtensors(spec, Some(&gate), &up, &down)?)
            }
            Some(s) => {
                let w = [
                    deq(gguf, "ffn_gate")?,
                    deq(gguf, "ffn_up")?,
                    deq(gguf, "ffn_down")?,
                ];
                float_bundles(spec, s, w)
            }
        })?,
    })
}

/// The embedding and the LM head: on the fused decoder, the LM head on our kernels packed
/// straight from the file (a tied embedding reads its rows, held once); on candle's ops, the
/// embedding's rows dequantized per token where our kernels read its blocks.
fn gguf_trunk(
    gguf: &mut GgufFile,
    cfg: &LlamaConfig,
    fused: Option<usize>,
) -> Result<(Trunk, Linear)> {
    let tied = !gguf.content.tensor_infos.contains_key("output.weight");
    let head_name = if tied {
        "token_embd.weight"
    } else {
        "output.weight"
    };
    if let Some(t) = fused {
        let packed =
            |g: &mut GgufFile, n: &str| -> Result<Option<Arc<powerinfer::layers::QLinear>>> {
                match g.packed(n)? {
                    Some(w) => Ok(Some(Arc::new(powerinfer::layers::QLinear::from_packed(
                        w, None, t,
                    )?))),
                    None => Ok(None),
                }
            };
        let head = packed(gguf, head_name)?.ok_or_else(|| {
            powerinfer::Error::config("fused decoder", format!("`{head_name}` is not packable"))
        })?;
        let embed = match tied {
            true => Embed::Packed(Arc::clone(&head)),
            false => match packed(gguf, "token_embd.weight")? {
                Some(e) => Embed::Packed(e),
                None => Embed::F32(
                    gguf.dequantized("token_embd.weight")?
                        .flatten_all()?
                        .to_vec1::<f32>()?,
                ),
            },
        };
        let lm_head = Linear::Powerinfer(Arc::clone(&head));
        return Ok((Trunk::Fused { embed, head }, lm_head));
    }
    let embed_q = Arc::new(gguf.tensor("token_embd.weight")?);
    let embed = match powerinfer::cpu::BlockKind::from_ggml(embed_q.dtype()) {
        Some(kind) => TokenEmbedding::Rows {
            w: Arc::clone(&embed_q),
            kind,
            hidden: cfg.hidden,
        },
        None => TokenEmbedding::Table(Embedding::new(
            embed_q.dequantize(&Device::Cpu)?,
            cfg.hidden,
        )),
    };
    let lm_head = match tied {
        true => Linear::Candle {
            w: QMatMul::from_arc(embed_q)?,
            b: None,
        },
        false => Linear::quantized(gguf.tensor("output.weight")?, None)?,
    };
    Ok((Trunk::Candle(embed), lm_head))
}

/// What runs around the layers: candle's embedding, or the fused decoder's embedding and LM head.
enum Trunk {
    Candle(TokenEmbedding),
    Fused {
        embed: Embed,
        head: Arc<powerinfer::layers::QLinear>,
    },
}

fn finish(
    cfg: LlamaConfig,
    trunk: Trunk,
    layers: Vec<Layer>,
    norm_: RmsNorm,
    lm_head: Linear,
) -> Result<Llama> {
    let norm_ = RmsNorm {
        eps: cfg.rms_eps as f32,
        ..norm_
    };
    let exec = match trunk {
        // The decoder grows its own RoPE tables with its KV cache.
        Trunk::Fused { embed, head } => {
            Execution::Fused(Box::new(Decoder::new(&cfg, embed, head, norm_.wv.clone())?))
        }
        Trunk::Candle(embed) => {
            let positions = cfg.context.min(crate::model::MAX_POSITIONS);
            let (cos, sin) =
                crate::model::rope_tables(&cfg, cfg.rope_theta, positions, &Device::Cpu)?;
            Execution::Candle { embed, cos, sin }
        }
    };
    Ok(Llama {
        exec,
        config: cfg,
        layers,
        norm: norm_,
        lm_head,
        timings: None,
        logits_copy: Vec::new(),
        layout_decisions: Vec::new(),
        rows_dense: Vec::new(),
        prefetch_depth: 0,
    })
}

/// Loads an HF safetensors checkpoint directory (`config.json` and `*.safetensors`).
pub fn load_safetensors(dir: &Path, mode: &FfnMode) -> Result<Llama> {
    let model = build_safetensors(dir, mode);
    powerinfer::cpu::release_freed_memory();
    let model = model?;
    install_artifact(model, mode, dir)
}

fn build_safetensors(dir: &Path, mode: &FfnMode) -> Result<Llama> {
    let cfg = LlamaConfig::from_hf_json(&dir.join("config.json"))?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::format(dir, "no *.safetensors file"));
    }
    // SAFETY: the files are memory-mapped read-only; like every mmap loader we rely on them not
    // being modified while the model is loaded.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }
        .map_err(|e| Error::format(dir, e.to_string()))?;
    let get = |name: &str| -> Result<Tensor> {
        if !vb.contains_tensor(name) {
            return Err(ErrorKind::MissingTensor { name: name.into() }.into());
        }
        Ok(vb.get_unchecked(name)?)
    };
    let lin = |name: &str, bias: bool| -> Result<Linear> {
        let w = get(&format!("{name}.weight"))?;
        let b = if bias {
            Some(get(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok(Linear::Candle {
            w: QMatMul::Tensor(w),
            b,
        })
    };
    if let FfnMode::Fused { .. } = mode {
        return Err(powerinfer::Error::config("fused decoder", SAFETENSORS_NOT_FUSED).into());
    }
    let embed = get("model.embed_tokens.weight")?;
    // Grown as layers load: `cfg.layers` comes from the file and is not trusted for a capacity.
    let mut layers = Vec::new();
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        let ab = cfg.attention_bias;
        let mlp = format!("{p}.mlp");
        let ffn = match mode {
            FfnMode::Dense | FfnMode::DenseF32 | FfnMode::Analysis | FfnMode::Fused { .. } => {
                Ffn::Dense(DenseFfn {
                    gate: lin(&format!("{mlp}.gate_proj"), false)?,
                    up: lin(&format!("{mlp}.up_proj"), false)?,
                    down: lin(&format!("{mlp}.down_proj"), false)?,
                    act: cfg.activation,
                })
            }
            // Float checkpoints: column-major f16 weights, candle ops around the FFN.
            FfnMode::InputSparse {
                attention: true, ..
            }
            | FfnMode::InputSparse { up_rows: true, .. } => {
                return Err(powerinfer::Error::config(
                    "input-sparse attention and the up-rows layout",
                    "need a GGUF file (this is a safetensors checkpoint)",
                )
                .into())
            }
            FfnMode::InputSparse { threads, .. } => {
                let w = |n: &str| get(&format!("{mlp}.{n}_proj.weight"));
                let (g, u, d) = (w("gate")?, w("up")?, w("down")?);
                let spec = FfnSpec::gated(cfg.hidden, cfg.intermediate, cfg.activation)?;
                Ffn::InputSparse(Box::new(InputSparseFfn::from_weights(
                    spec,
                    FfnWeights::gated(&g, &u, &d),
                    ColumnStorage::F16,
                    *threads,
                    None,
                )?))
            }
            FfnMode::Hybrid { .. } => hybrid_ffn(&cfg, mode, l, |spec, storage| {
                let w = |n: &str| get(&format!("{mlp}.{n}_proj.weight"));
                let storage = storage.unwrap_or(WeightDType::F16);
                float_bundles(spec, storage, [w("gate")?, w("up")?, w("down")?])
            })?,
        };
        layers.push(Layer {
            attn_norm: norm(get(&format!("{p}.input_layernorm.weight"))?, cfg.rms_eps)?,
            attn: Attention::Ops {
                q: lin(&format!("{p}.self_attn.q_proj"), ab)?,
                k: lin(&format!("{p}.self_attn.k_proj"), ab)?,
                v: lin(&format!("{p}.self_attn.v_proj"), ab)?,
                o: lin(&format!("{p}.self_attn.o_proj"), false)?,
            },
            ffn_norm: norm(
                get(&format!("{p}.post_attention_layernorm.weight"))?,
                cfg.rms_eps,
            )?,
            ffn,
            gemma: None,
            kv: None,
        });
    }
    let lm_head = if vb.contains_tensor("lm_head.weight") {
        get("lm_head.weight")?
    } else {
        embed.clone()
    };
    let norm_w = get("model.norm.weight")?;
    let embed = TokenEmbedding::Table(Embedding::new(embed, cfg.hidden));
    finish(
        cfg,
        Trunk::Candle(embed),
        layers,
        norm(norm_w, 0.0)?,
        Linear::Candle {
            w: QMatMul::Tensor(lm_head),
            b: None,
        },
    )
}

/// PowerInfer runs every `PWRI` llama file with a ReLU FFN (`LLM_FFN_RELU` in its
/// `llm_build_ffn_sparse` call); the file has no activation key.
fn adjust_config(gguf: &GgufFile, cfg: &mut LlamaConfig) {
    if gguf.magic == powerinfer::format::GgufMagic::PowerInfer {
        cfg.activation = powerinfer::Activation::Relu;
    }
}

/// Opens a model: a `.gguf` file, or a directory with `config.json`, `*.safetensors` and
/// `tokenizer.json`. Returns the model and its tokenizer.
pub fn open(path: &Path, mode: &FfnMode) -> Result<(Llama, TextTokenizer)> {
    if path.is_dir() {
        Ok((load_safetensors(path, mode)?, TextTokenizer::open(path)?))
    } else {
        let mut gguf = GgufFile::open(path)?;
        // Architecture and hyper-parameters first: an unsupported model says so before anything
        // else about it is read.
        LlamaConfig::from_gguf(&gguf.content)?;
        let tok = TextTokenizer::from_gguf(&gguf.content)?;
        let model = load_gguf(&mut gguf, mode)?;
        Ok((model, tok))
    }
}
