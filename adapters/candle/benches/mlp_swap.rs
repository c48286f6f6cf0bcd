//! The one-line swap in a candle model, timed: candle's dense MLP against powerinfer's
//! `InputSparseFfn` built from the same weights, every input kept, which is what a candle user
//! gets by changing the MLP type and nothing else.
//!
//! - `f32`, `bf16`: candle's MLP is three `candle_nn::Linear` in that dtype; ours is
//!   `InputSparseFfn::load(act, vb, opts)` from a `VarBuilder` of the same tensors.
//! - `q`: candle's MLP is three `QMatMul` on the GGUF file's own blocks; ours is
//!   `InputSparseFfn::from_qtensors_as` on the same blocks, laid out by a `LayoutPlanner` (with
//!   every input kept: the dense packed rows).
//!
//! Each case decodes one token at a time through every layer's MLP of a real model (the weights
//! are far larger than the caches, so they come from DRAM as in decoding), the two MLPs
//! alternating token by token. It prints the median ms per token of each, their ratio, the
//! bytes each reads and the floor those bytes take at the read bandwidth measured on the same
//! threads, then one JSON line per case. Both sides run on the same thread count:
//!
//! ```text
//! RAYON_NUM_THREADS=2 CANDLE_NUM_THREADS=2 cargo bench -p powerinfer-candle --bench mlp_swap
//! ```
//!
//! candle's matmuls read `RAYON_NUM_THREADS` (f32 and bf16) and `CANDLE_NUM_THREADS` (its
//! quantized pool); ours take `RAYON_NUM_THREADS`. Environment: `BENCH_MODEL` (a name of
//! `powerinfer_data::Model`, fetched into the cache if needed; default SmolLM2),
//! `BENCH_DTYPES` (default `f32,bf16,q`), `BENCH_ITERS` (tokens timed per side, default 15).

use std::collections::HashMap;
use std::time::Instant;

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use powerinfer::layout::LayoutPlanner;
use powerinfer::{Activation, FfnSpec, InputSparseFfn, InputSparseOptions};
use rand::{rngs::StdRng, Rng, SeedableRng};

type Error = Box<dyn std::error::Error>;

/// candle's dense MLP, as a candle model writes it.
enum DenseMlp {
    Float([Linear; 3]),
    Quant([QMatMul; 3]),
}

impl DenseMlp {
    fn forward(&self, act: Activation, x: &Tensor) -> candle_core::Result<Tensor> {
        let (g, u) = match self {
            DenseMlp::Float([g, u, _]) => (g.forward(x)?, u.forward(x)?),
            DenseMlp::Quant([g, u, _]) => (g.forward(x)?, u.forward(x)?),
        };
        let g = match act {
            Activation::GeluTanh => g.gelu()?,
            _ => candle_nn::ops::silu(&g)?,
        };
        let h = (g * u)?;
        match self {
            DenseMlp::Float([_, _, d]) => d.forward(&h),
            DenseMlp::Quant([_, _, d]) => d.forward(&h),
        }
    }
}

/// One layer's FFN tensors as the file holds them.
struct FileLayer {
    gate: QTensor,
    up: QTensor,
    down: QTensor,
}

struct Model {
    name: String,
    act: Activation,
    hidden: usize,
    layers: usize,
    path: std::path::PathBuf,
    content: gguf_file::Content,
}

impl Model {
    fn read() -> Result<Model, Error> {
        let name = std::env::var("BENCH_MODEL").unwrap_or_else(|_| "smollm2".into());
        let which: powerinfer_data::Model = name.parse()?;
        let path = powerinfer_data::model(which, &mut |m| eprintln!("{m}"))?;
        let content = gguf_file::Content::read(&mut std::fs::File::open(&path)?)?;
        let meta = |k: &str| content.metadata.get(k).ok_or(format!("no {k}"));
        let arch = meta("general.architecture")?.to_string()?.clone();
        let act = match arch.as_str() {
            "llama" | "qwen2" => Activation::Silu,
            "gemma3" => Activation::GeluTanh,
            other => return Err(format!("architecture {other}: not one this bench reads").into()),
        };
        Ok(Model {
            name: which.name().into(),
            act,
            hidden: meta(&format!("{arch}.embedding_length"))?.to_u32()? as usize,
            layers: meta(&format!("{arch}.block_count"))?.to_u32()? as usize,
            path,
            content,
        })
    }

    /// Layer `l`'s FFN tensors as the file holds them, read afresh.
    fn layer(&self, l: usize) -> Result<FileLayer, Error> {
        let mut file = std::fs::File::open(&self.path)?;
        let mut t = |n: &str| {
            self.content
                .tensor(&mut file, &format!("blk.{l}.{n}.weight"), &Device::Cpu)
        };
        Ok(FileLayer {
            gate: t("ffn_gate")?,
            up: t("ffn_up")?,
            down: t("ffn_down")?,
        })
    }
}

/// Both MLPs of every layer, for one dtype (`f32`, `bf16` or `q`), ours on `threads` threads,
/// and the bytes of candle's weights.
fn build(
    m: &Model,
    dtype: &str,
    threads: usize,
) -> Result<(Vec<(DenseMlp, InputSparseFfn)>, usize), Error> {
    let dev = Device::Cpu;
    let planner = LayoutPlanner::new([0.0; 3], threads, None)?;
    let mut bytes = 0;
    let mut layers = Vec::with_capacity(m.layers);
    for l in 0..m.layers {
        let f = m.layer(l)?;
        let (n, h) = f.gate.shape().dims2()?;
        if dtype == "q" {
            let spec = FfnSpec::gated(h, n, m.act)?;
            let layouts = planner.ffn_layouts(&spec, Some(&f.gate), &f.up, &f.down)?;
            let (g, u, d) = (&f.gate, &f.up, &f.down);
            let ours =
                InputSparseFfn::from_qtensors_as(spec, Some(g), u, d, threads, None, layouts)?;
            // QMatMul takes its tensors by value: the same blocks, read again.
            let again = m.layer(l)?;
            bytes += [&again.gate, &again.up, &again.down]
                .iter()
                .map(|t| t.storage_size_in_bytes())
                .sum::<usize>();
            let q = QMatMul::from_qtensor;
            let dense = DenseMlp::Quant([q(again.gate)?, q(again.up)?, q(again.down)?]);
            layers.push((dense, ours));
            continue;
        }
        let dt = match dtype {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            other => return Err(format!("dtype {other}: expected f32, bf16 or q").into()),
        };
        let w = |t: &QTensor| -> Result<Tensor, Error> { Ok(t.dequantize(&dev)?.to_dtype(dt)?) };
        let (g, u, d) = (w(&f.gate)?, w(&f.up)?, w(&f.down)?);
        bytes += 3 * n * h * dt.size_in_bytes();
        let tensors = HashMap::from([
            ("gate_proj.weight".to_string(), g.clone()),
            ("up_proj.weight".to_string(), u.clone()),
            ("down_proj.weight".to_string(), d.clone()),
        ]);
        let opts = InputSparseOptions {
            threads,
            ..Default::default()
        };
        // The swap, as a candle model's layer writes it.
        let ours = InputSparseFfn::load(m.act, VarBuilder::from_tensors(tensors, dt, &dev), opts)?;
        let dense = DenseMlp::Float([
            Linear::new(g, None),
            Linear::new(u, None),
            Linear::new(d, None),
        ]);
        layers.push((dense, ours));
    }
    Ok((layers, bytes))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Error> {
    let threads = candle_core::utils::get_num_threads();
    let dtypes = std::env::var("BENCH_DTYPES").unwrap_or_else(|_| "f32,bf16,q".into());
    let iters: usize = std::env::var("BENCH_ITERS").map_or(Ok(15), |v| v.parse())?;
    let m = Model::read()?;
    let bw = powerinfer::cpu::read_bandwidth(threads);
    let gbs = bw.plain.max(bw.prefetching);
    println!(
        "{}: {} layers, {threads} thread(s), read bandwidth {gbs:.1} GB/s",
        m.name, m.layers
    );
    let mut rng = StdRng::seed_from_u64(7);
    for dtype in dtypes.split(',') {
        let (layers, dense_bytes) = build(&m, dtype, threads)?;
        let act_dtype = if dtype == "bf16" {
            DType::BF16
        } else {
            DType::F32
        };
        // A few RMS-normalised inputs, cycled (what a norm hands the MLP; the values do not
        // change what a dense product reads).
        let xs: Vec<Tensor> = (0..4)
            .map(|_| {
                let v: Vec<f32> = (0..m.hidden)
                    .map(|_| rng.random_range(-1.7f32..1.7))
                    .collect();
                Tensor::from_vec(v, (1, m.hidden), &Device::Cpu)?.to_dtype(act_dtype)
            })
            .collect::<candle_core::Result<_>>()?;
        let ours_bytes: usize = layers.iter().map(|(_, o)| o.weight_bytes()).sum();
        let token = |i: usize, dense: bool| -> candle_core::Result<f64> {
            let x = &xs[i % xs.len()];
            let t = Instant::now();
            for (d, o) in &layers {
                let y = if dense {
                    d.forward(m.act, x)?
                } else {
                    o.forward(x)?
                };
                std::hint::black_box(y);
            }
            Ok(t.elapsed().as_secs_f64() * 1e3)
        };
        let (mut td, mut to) = (Vec::new(), Vec::new());
        for i in 0..iters + 2 {
            let (d, o) = (token(i, true)?, token(i, false)?);
            if i >= 2 {
                td.push(d);
                to.push(o);
            }
        }
        let (dm, om) = (median(td), median(to));
        let floor = |b: usize| b as f64 / (gbs * 1e9) * 1e3;
        println!(
            "{dtype:<5} candle {dm:>8.2} ms ({:>6.1} MB, {:>3.0}% of the floor's speed)  \
             ours {om:>8.2} ms ({:>6.1} MB, {:>3.0}%)  candle/ours {:>5.2}x",
            dense_bytes as f64 / 1e6,
            100.0 * floor(dense_bytes) / dm,
            ours_bytes as f64 / 1e6,
            100.0 * floor(ours_bytes) / om,
            dm / om
        );
        println!(
            "{{\"model\":\"{}\",\"dtype\":\"{dtype}\",\"threads\":{threads},\"candle_ms\":{dm:.3},\
             \"ours_ms\":{om:.3},\"ratio\":{:.3},\"candle_bytes\":{dense_bytes},\
             \"ours_bytes\":{ours_bytes},\"gbs\":{gbs:.2}}}",
            m.name,
            dm / om
        );
    }
    Ok(())
}
