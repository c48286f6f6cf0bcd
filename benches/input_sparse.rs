//! Input-sparse products and FFN (TEAL/WINA rules on column-major weights) against the dense
//! products on the Llama-7B FFN shape (hidden 4096, intermediate 11008), same process, 1 thread.
//!
//! `cargo bench --bench input_sparse` prints a table and one JSON line per case. For Q4_0 and
//! f16 weights:
//! - `gate_up`: gate and up on one token, dense rows (`QLinear` for Q4_0, four-row `dot` for f16)
//!   against the column product with a fraction of the input channels kept;
//! - `ffn`: the whole FFN, every neuron (`QLinear` gate+up and down; f16: the column FFN with no
//!   threshold) against `InputSparseFfn` at 40% input and 50% `h` sparsity.
//!
//! `floor_ms` is the bytes the step must read over the measured read bandwidth (a dot kernel
//! streaming 1 GiB). Environment: `BENCH_ITERS` (default 15), `POWERINFER_CPU` to force a tier.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use powerinfer::cpu::{ActiveColumns, ColumnMatrix, Kernels, QuantKind, QuantizedRow, CHUNK};
use powerinfer::{
    cpu::ColumnStorage, cpu::SimdLevel, layers::QLinear, Activation, FfnSpec, FfnWeights,
    InputScore, InputSparseFfn,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of `f` over `iters` calls (two warm-up calls first).
fn time_ms(iters: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    f(1);
    median(
        (0..iters)
            .map(|i| {
                let t = Instant::now();
                f(i);
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn line(case: &str, dtype: &str, kept: f64, dense_ms: f64, ours_ms: f64, bytes: usize, bw: f64) {
    let floor = bytes as f64 / (bw * 1e9) * 1e3;
    println!(
        "{case:<8} {dtype:<5} kept {:>4.0}%  dense {dense_ms:>7.3} ms  ours {ours_ms:>7.3} ms  ratio {:>5.2}x  read {:>6.1} MB  floor {floor:>6.3} ms  {:>5.1}% of bandwidth",
        kept * 100.0,
        dense_ms / ours_ms,
        bytes as f64 / 1e6,
        floor / ours_ms * 100.0
    );
    println!(
        "{{\"case\":\"{case}\",\"dtype\":\"{dtype}\",\"kept\":{kept},\"dense_ms\":{dense_ms:.4},\"ours_ms\":{ours_ms:.4},\"ratio\":{:.3},\"bytes\":{bytes},\"floor_ms\":{floor:.4}}}",
        dense_ms / ours_ms
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::var("BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    // `BENCH_SHAPE=smollm2`: SmolLM2-135M's FFN (576 x 1536, Q4_1) over 30 layers instead.
    let small = std::env::var("BENCH_SHAPE").as_deref() == Ok("smollm2");
    let (hidden, inter, layers_n, gdt, qk) = if small {
        (
            576usize,
            1536usize,
            30usize,
            GgmlDType::Q4_1,
            QuantKind::Q4_1,
        )
    } else {
        (4096, 11008, 4, GgmlDType::Q4_0, QuantKind::Q4_0)
    };
    let qname = format!("{gdt:?}").to_lowercase();
    let tier = SimdLevel::from_env()?.unwrap_or_else(SimdLevel::best);
    let k = Kernels::new(tier)?;
    println!(
        "# input-sparse bench: {hidden}x{inter}, 1 token, 1 thread, tier {tier}, median of {iters}"
    );

    // Read bandwidth: one dot kernel streaming 1 GiB.
    let buf = vec![1.0f32; 256 << 20];
    let x1 = vec![1.0f32; hidden];
    let bw_ms = time_ms(5, |_| {
        let s: f32 = buf.chunks_exact(hidden).map(|r| k.dot_f32(r, &x1)).sum();
        std::hint::black_box(s);
    });
    let bw = (buf.len() * 4) as f64 / (bw_ms * 1e-3) / 1e9;
    drop(buf);
    println!("# read bandwidth, 1 thread: {bw:.1} GB/s");
    println!("{{\"bandwidth_gbps\":{bw:.2},\"threads\":1}}");

    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(7);
    let s = 1.0 / (hidden as f64).sqrt();
    let gate = (Tensor::randn(0f32, 1.0, (inter, hidden), &dev)? * s)?;
    let up = (Tensor::randn(0f32, 1.0, (inter, hidden), &dev)? * s)?;
    let down = (Tensor::randn(0f32, 1.0, (hidden, inter), &dev)? * (1.0 / (inter as f64).sqrt()))?;
    // Inputs cycle through 8 rows so no product sees the same mask twice in a row.
    let xs: Vec<Vec<f32>> = (0..8)
        .map(|_| {
            (0..hidden)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect()
        })
        .collect();
    // |x| threshold dropping `frac` of a row (uniform inputs: `2 frac`).
    let masked = |x: &[f32], frac: f32| -> Vec<f32> {
        x.iter()
            .map(|&v| if v.abs() > 2.0 * frac { v } else { 0.0 })
            .collect()
    };

    // ---- GGUF blocks ----
    // Several layers' weights, used in turn, so that every product reads DRAM (one 7B layer's
    // 76 MB would sit in a large L3 and flatter both sides).
    let layers_total = layers_n;
    let spec = FfnSpec::gated(hidden, inter, Activation::Silu)?;
    struct Layer {
        gu_lin: QLinear,
        down_lin: QLinear,
        cg: ColumnMatrix,
        cu: ColumnMatrix,
        ffn: InputSparseFfn,
    }
    let mut layers = Vec::new();
    for l in 0..layers_total {
        let shift = |t: &Tensor| t + 0.001 * l as f64;
        let qg = QTensor::quantize(&shift(&gate)?, gdt)?;
        let qu = QTensor::quantize(&shift(&up)?, gdt)?;
        let qd = QTensor::quantize(&shift(&down)?, gdt)?;
        layers.push(Layer {
            gu_lin: QLinear::stacked(&[&qg, &qu], None, 1)?.with_simd_level(tier)?,
            down_lin: QLinear::stacked(&[&qd], None, 1)?.with_simd_level(tier)?,
            cg: ColumnMatrix::from_blocks(qk, inter, hidden, &qg.data()?)?,
            cu: ColumnMatrix::from_blocks(qk, inter, hidden, &qu.data()?)?,
            ffn: InputSparseFfn::from_qtensors(spec, Some(&qg), &qu, &qd, 1, Some(tier))?,
        });
    }
    let mut gu = vec![0f32; 2 * inter];
    let mut tmp = Vec::new();
    let qrows: Vec<QuantizedRow> = xs
        .iter()
        .map(|x| {
            let mut q = QuantizedRow::default();
            q.quantize(x);
            q
        })
        .collect();
    let dense_gu = time_ms(iters, |i| {
        layers[i % layers_total]
            .gu_lin
            .forward_quantized(std::slice::from_ref(&qrows[i % 8]), &mut gu, &mut tmp)
            .unwrap()
    });
    for kept in [1.0f64, 0.5] {
        let ins: Vec<(Vec<f32>, QuantizedRow, ActiveColumns)> = xs
            .iter()
            .map(|x| {
                let m = masked(x, (1.0 - kept) as f32);
                let mut q = QuantizedRow::default();
                q.quantize(&m);
                let mut a = ActiveColumns::default();
                a.of_quantized(&q);
                (m, q, a)
            })
            .collect();
        let mut out = vec![0f32; layers[0].cg.chunks() * CHUNK];
        let ours = time_ms(iters, |i| {
            let (x, q, a) = &ins[i % 8];
            let l = &layers[i % layers_total];
            k.column_matrix_q8(&l.cg, 0..l.cg.chunks(), x, q, a, &mut out);
            k.column_matrix_q8(&l.cu, 0..l.cu.chunks(), x, q, a, &mut out);
        });
        let a = &ins[0].2;
        let bytes = 2 * layers[0].cg.bytes_read(a.columns().len(), a.blocks());
        line("gate_up", &qname, kept, dense_gu, ours, bytes, bw);
    }
    // The whole FFN, every neuron on QLinear against the input-sparse FFN.
    let mut h = vec![0f32; inter];
    let mut hq = QuantizedRow::default();
    let mut y = vec![0f32; hidden];
    let dense_ffn = time_ms(iters, |i| {
        let l = &layers[i % layers_total];
        l.gu_lin
            .forward_quantized(std::slice::from_ref(&qrows[i % 8]), &mut gu, &mut tmp)
            .unwrap();
        for j in 0..inter {
            h[j] = Activation::Silu.gated(gu[j], gu[inter + j]);
        }
        hq.quantize(&h);
        l.down_lin
            .forward_quantized(std::slice::from_ref(&hq), &mut y, &mut tmp)
            .unwrap();
    });
    let mut ffns: Vec<&mut InputSparseFfn> = layers.iter_mut().map(|l| &mut l.ffn).collect();
    ffn_case(&mut ffns, &qname, &xs, dense_ffn, iters, bw)?;

    if small {
        return Ok(());
    }
    // ---- f16 ----
    let to16 = |t: &Tensor| -> Vec<half::f16> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(half::f16::from_f32)
            .collect()
    };
    let (g16, u16) = (to16(&gate), to16(&up));
    let dense_rows = |x: &[f32], out: &mut [f32]| {
        for (w, o) in [(&g16, 0), (&u16, inter)] {
            for r in (0..inter).step_by(4) {
                let rows: [&[half::f16]; 4] =
                    std::array::from_fn(|j| &w[(r + j) * hidden..(r + j + 1) * hidden]);
                let v = k.dot4_f16(rows, x);
                out[o + r..o + r + 4].copy_from_slice(&v);
            }
        }
    };
    let dense16 = time_ms(iters, |i| dense_rows(&xs[i % 8], &mut gu));
    let w = FfnWeights::gated(&gate, &up, &down);
    let mut ffn16 = InputSparseFfn::from_weights(spec, w, ColumnStorage::F16, 1, Some(tier))?;
    drop(layers);
    {
        let col = |t: &Tensor| -> powerinfer::Result<ColumnMatrix> {
            ColumnMatrix::from_f32(
                ColumnStorage::F16,
                inter,
                hidden,
                &t.flatten_all()?.to_vec1::<f32>()?,
            )
        };
        let (gcol, ucol) = (col(&gate)?, col(&up)?);
        for kept in [1.0f64, 0.5] {
            let ins: Vec<(Vec<f32>, ActiveColumns)> = xs
                .iter()
                .map(|x| {
                    let m = masked(x, (1.0 - kept) as f32);
                    let mut a = ActiveColumns::default();
                    a.of_f32(&m);
                    (m, a)
                })
                .collect();
            let mut out = vec![0f32; gcol.chunks() * CHUNK];
            let none = QuantizedRow::default();
            let ours = time_ms(iters, |i| {
                let (x, a) = &ins[i % 8];
                k.column_matrix_q8(&gcol, 0..gcol.chunks(), x, &none, a, &mut out);
                k.column_matrix_q8(&ucol, 0..ucol.chunks(), x, &none, a, &mut out);
            });
            let bytes = 2 * gcol.bytes_read(ins[0].1.columns().len(), 0);
            line("gate_up", "f16", kept, dense16, ours, bytes, bw);
        }
    }
    let mut y16 = vec![0f32; hidden];
    let dense_ffn16 = time_ms(iters, |i| {
        ffn16.forward_f32(&xs[i % 8], 1, &mut y16).unwrap()
    });
    ffn_case(&mut [&mut ffn16], "f16", &xs, dense_ffn16, iters, bw)?;
    Ok(())
}

/// The FFNs (used in turn) at 40% input and 50% `h` sparsity (thresholds calibrated on the
/// bench inputs) against `dense_ms`.
fn ffn_case(
    ffns: &mut [&mut InputSparseFfn],
    dtype: &str,
    xs: &[Vec<f32>],
    dense_ms: f64,
    iters: usize,
    bw: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let hidden = ffns[0].spec().hidden();
    let mut y = vec![0f32; hidden];
    for ffn in ffns.iter_mut() {
        ffn.record_scores();
        for x in xs {
            ffn.forward_f32(x, 1, &mut y)?;
        }
        let scores = ffn.take_scores().ok_or("no scores")?;
        let t = scores.thresholds([0.4, 0.4, 0.5]).ok_or("no thresholds")?;
        ffn.set_rule(InputScore::Magnitude, t)?;
        ffn.take_traffic();
    }
    let n = ffns.len();
    let ours = time_ms(iters, |i| {
        ffns[i % n].forward_f32(&xs[i % 8], 1, &mut y).unwrap()
    });
    let tr = ffns[0].take_traffic();
    let bytes = (tr.read / tr.rows.max(1)) as usize;
    line("ffn", dtype, 1.0 - tr.skipped(), dense_ms, ours, bytes, bw);
    Ok(())
}
