//! Dense candle FFN vs the sparse kernels on the Llama-7B FFN shape, same process.
//!
//! `cargo bench --bench sparse_ffn` prints a table and one JSON line per case:
//! `{"shape":..,"dtype":..,"active":..,"threads":..,"dense_ms":..,"sparse_ms":..,"ratio":..,"gbps":..}`.
//! `gbps` is the bytes our kernel had to read (active neurons x bundle bytes) over its median time;
//! the machine's read bandwidth is measured first with the same dot kernel streaming a large buffer.
//! Environment: `BENCH_ITERS` (default 15), `BENCH_SHAPE=small` for a quick 1024x2816 run,
//! `BENCH_THREADS` (default "1,2"), `POWERINFER_CPU` to force a SIMD level.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use candle_core::{Device, Tensor};
use powerinfer::cpu::{share, Kernels, Pool};
use powerinfer::{
    cpu::SimdLevel, dense_reference, predict::ActiveSet, predict::PredictInput, Activation,
    FfnSpec, FfnWeights, HybridFfn, HybridOptions, Predictor, WeightDType,
};
use rand::{rngs::StdRng, seq::index::sample, SeedableRng};

/// Cycles through pre-drawn random active sets, one per call, so caches do not flatter.
#[derive(Debug)]
struct Rotating {
    sets: Vec<Vec<u32>>,
    next: AtomicUsize,
}

impl Predictor for Rotating {
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> powerinfer::Result<()> {
        let k = self.next.fetch_add(1, Ordering::Relaxed) % self.sets.len();
        for r in 0..input.rows {
            for &i in &self.sets[k] {
                set.insert(r, i as usize)?;
            }
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_ms(iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    median(
        (0..iters)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// Read bandwidth (GB/s) of the dot kernel streaming `buf` on `threads` threads.
fn bandwidth(buf: &[f32], x: &[f32], threads: usize, k: &Kernels) -> f64 {
    let pool = Pool::shared(threads);
    let rows = buf.len() / x.len();
    let sink = std::sync::Mutex::new(0f32);
    let ms = time_ms(5, || {
        pool.run(&|t| {
            let mut s = 0f32;
            for r in share(rows, t, threads) {
                s += k.dot_f32(&buf[r * x.len()..(r + 1) * x.len()], x);
            }
            *sink.lock().unwrap() += s;
        })
    });
    (buf.len() * 4) as f64 / (ms * 1e-3) / 1e9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::var("BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let (hidden, inter) = match std::env::var("BENCH_SHAPE").as_deref() {
        Ok("small") => (1024, 2816),
        _ => (4096, 11008),
    };
    let threads: Vec<usize> = std::env::var("BENCH_THREADS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let tier = SimdLevel::from_env()?.unwrap_or_else(SimdLevel::best);
    let kernels = Kernels::new(tier)?;
    let shape = format!("{hidden}x{inter}");
    println!(
        "# sparse FFN bench: shape {shape} gated ReLU, 1 token, tier {tier}, median of {iters}"
    );

    // Machine read bandwidth, same kernel, buffer far above L3.
    let buf = vec![1.0f32; 256 << 20];
    let x1 = vec![1.0f32; hidden];
    let mut bw = std::collections::HashMap::new();
    for &t in &threads {
        let g = bandwidth(&buf, &x1, t, &kernels);
        println!("# read bandwidth, {t} thread(s): {g:.1} GB/s");
        println!("{{\"bandwidth_gbps\":{g:.2},\"threads\":{t}}}");
        bw.insert(t, g);
    }
    drop(buf);

    let dev = Device::Cpu;
    let s = 1.0 / (hidden as f32).sqrt();
    let gate = (Tensor::randn(0f32, 1.0, (inter, hidden), &dev)? * s as f64)?;
    let up = (Tensor::randn(0f32, 1.0, (inter, hidden), &dev)? * s as f64)?;
    let down = (Tensor::randn(0f32, 1.0, (hidden, inter), &dev)? * (1.0 / (inter as f64).sqrt()))?;
    let x = Tensor::randn(0f32, 1.0, (1, hidden), &dev)?;
    let spec = FfnSpec::gated(hidden, inter, Activation::Relu)?;
    let w = FfnWeights::gated(&gate, &up, &down);

    let mut rng = StdRng::seed_from_u64(42);
    let fractions = [0.05, 0.10, 0.20, 0.50, 1.00];
    println!(
        "{:<12} {:<5} {:>6} {:>7} {:>10} {:>10} {:>7} {:>7} {:>6}",
        "shape", "dtype", "active", "threads", "dense_ms", "sparse_ms", "ratio", "gbps", "%bw"
    );
    for &t in &threads {
        // candle reads RAYON_NUM_THREADS at every matmul.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
        let dense_ms = time_ms(iters, || {
            dense_reference(&x, &spec, w).unwrap();
        });
        for dtype in [WeightDType::F32, WeightDType::F16] {
            let opts = HybridOptions {
                threads: t,
                simd_level: Some(tier),
                ..Default::default()
            };
            let base = HybridFfn::from_weights(spec, w, dtype, opts)?;
            let bundle_bytes = spec.neuron_bytes(dtype) as f64;
            let mut ffn = base;
            for &frac in &fractions {
                let k = ((inter as f64 * frac).round() as usize).max(1);
                let sets: Vec<Vec<u32>> = (0..8)
                    .map(|_| {
                        let mut v: Vec<u32> = sample(&mut rng, inter, k)
                            .into_iter()
                            .map(|i| i as u32)
                            .collect();
                        v.sort_unstable();
                        v
                    })
                    .collect();
                ffn = ffn.with_predictor(Rotating {
                    sets,
                    next: AtomicUsize::new(0),
                });
                let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
                let mut out = vec![0f32; hidden];
                let sparse_ms = time_ms(iters, || ffn.forward_f32(&xs, 1, &mut out).unwrap());
                let gbps = k as f64 * bundle_bytes / (sparse_ms * 1e-3) / 1e9;
                let ratio = dense_ms / sparse_ms;
                let dt = format!("{dtype:?}").to_lowercase();
                println!(
                    "{shape:<12} {dt:<5} {:>5.0}% {t:>7} {dense_ms:>10.3} {sparse_ms:>10.3} {ratio:>6.2}x {gbps:>7.1} {:>5.0}%",
                    frac * 100.0,
                    100.0 * gbps / bw[&t]
                );
                println!(
                    "{{\"shape\":\"{shape}\",\"dtype\":\"{dt}\",\"active\":{frac},\"threads\":{t},\"dense_ms\":{dense_ms:.4},\"sparse_ms\":{sparse_ms:.4},\"ratio\":{ratio:.3},\"gbps\":{gbps:.2},\"bandwidth_gbps\":{:.2},\"tier\":\"{tier}\"}}",
                    bw[&t]
                );
            }
        }
    }
    Ok(())
}
