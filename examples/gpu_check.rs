//! The GPU tier measured on one FFN layer of a 7B model's shape (hidden 4096, 11008 neurons,
//! f16, SiLU): run by `scripts/gpu-check.sh` on a machine with a GPU (build with `--features
//! cuda`). Prints a table and one JSON line per measurement.
//!
//! - `bandwidth`: the tier's kernels reading 10/50/100% of the layer's neurons, one row (a
//!   decoded token), against the device's measured copy bandwidth.
//! - `hybrid`: one FFN step with the GPU holding 0/25/50/100% of the neurons (the hottest) and
//!   the CPU computing the rest, against all-CPU and against the dense FFN on the GPU (candle).
//! - `cache`: a 25% placement with and without a cache of another 25%, over tokens whose cold
//!   neurons repeat from token to token.
//! - `hot_neurons`: the default sparse mode's hot neurons (`HotNeurons`) on a Q4_K layer, and
//!   one split step against the CPU alone.
//!
//! Active sets follow the skew of ReLU-family models: the hottest 20% of the neurons fire for
//! 80% of the tokens, the rest for 5%, and 70% of a token's cold neurons fire again at the next.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use powerinfer::{
    predict::ActiveSet, predict::Oracle, tier::cuda_device, tier::CudaTier, tier::FastTier,
    tier::LayerPlacement, tier::TierBudget, tier::TierCall, Activation, FfnSpec, FfnWeights,
    HybridFfn, HybridOptions, NeuronBundles, WeightDType,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const HIDDEN: usize = 4096;
const INTER: usize = 11008;

fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Active sets with the skew and the token-to-token repetition described in the module docs.
struct Tokens {
    rng: StdRng,
    cold: Vec<u32>,
}

impl Tokens {
    fn next(&mut self) -> Vec<u32> {
        let hot = INTER / 5;
        let mut set: Vec<u32> = (0..hot as u32)
            .filter(|_| self.rng.random_bool(0.8))
            .collect();
        let target = ((INTER - hot) as f64 * 0.05) as usize;
        let mut cold: Vec<u32> = self
            .cold
            .iter()
            .copied()
            .filter(|_| self.rng.random_bool(0.7))
            .collect();
        while cold.len() < target {
            cold.push(self.rng.random_range(hot as u32..INTER as u32));
        }
        cold.sort_unstable();
        cold.dedup();
        self.cold = cold.clone();
        set.extend(cold);
        set
    }
}

struct Layer {
    bundles: NeuronBundles,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

fn layer() -> Res<Layer> {
    let mut rng = StdRng::seed_from_u64(1);
    let s = 1.0 / (HIDDEN as f32).sqrt();
    let t = |rng: &mut StdRng, r: usize, c: usize| {
        Tensor::from_vec(random(rng, r * c, s), (r, c), &Device::Cpu)
    };
    let (gate, up, down) = (
        t(&mut rng, INTER, HIDDEN)?,
        t(&mut rng, INTER, HIDDEN)?,
        t(&mut rng, HIDDEN, INTER)?,
    );
    let spec = FfnSpec::gated(HIDDEN, INTER, Activation::Silu)?;
    let bundles =
        NeuronBundles::from_weights(spec, FfnWeights::gated(&gate, &up, &down), WeightDType::F16)?;
    Ok(Layer {
        bundles,
        gate,
        up,
        down,
    })
}

fn json(v: serde_json::Value) {
    println!("{v}");
}

/// Device-to-device copy bandwidth (bytes read + written per second), median of 10 copies of
/// 1 GiB timed with CUDA events.
fn copy_bandwidth(dev: &candle_core::CudaDevice) -> Res<f64> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let n = 1usize << 30;
    let src = dev.alloc_zeros::<u8>(n)?;
    let mut dst = dev.alloc_zeros::<u8>(n)?;
    let stream = dev.cuda_stream();
    let mut times = Vec::new();
    for _ in 0..12 {
        let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        stream.memcpy_dtod(&src, &mut dst)?;
        let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        times.push(f64::from(a.elapsed_ms(&b)?) * 1e-3);
    }
    Ok(2.0 * n as f64 / median(times[2..].to_vec()))
}

fn bandwidth(dev: &candle_core::CudaDevice, l: &Layer, copy: f64) -> Res<()> {
    println!("\n(b) kernel bandwidth, {HIDDEN}x{INTER} f16, 1 row, every listed neuron active");
    println!(
        "{:>6} {:>9} {:>11} {:>10} {:>10} {:>10}",
        "hot", "MB read", "kernels us", "GB/s", "of copy", "call us"
    );
    let budget = TierBudget::new(u64::MAX)?;
    let x = random(&mut StdRng::seed_from_u64(3), HIDDEN, 1.0);
    for frac in [0.1, 0.5, 1.0] {
        let k = (INTER as f64 * frac) as usize;
        let hot: Vec<u32> = (0..k as u32).collect();
        let tier = CudaTier::new(dev, &l.bundles, &hot, 0, &budget)?;
        let mut set = ActiveSet::new();
        set.reset(1, INTER);
        set.fill_all();
        let call = TierCall {
            x: &x,
            rows: 1,
            neurons: &hot,
            set: &set,
            rule: None,
        };
        let mut out = vec![0f32; HIDDEN];
        for _ in 0..5 {
            tier.launch(&call)?;
            tier.finish(&mut out)?;
        }
        let reps = 50;
        tier.time_kernels(true);
        let t = Instant::now();
        for _ in 0..reps {
            tier.launch(&call)?;
            tier.finish(&mut out)?;
        }
        let call_s = t.elapsed().as_secs_f64() / reps as f64;
        let kern_s = tier.kernel_ms() * 1e-3 / reps as f64;
        let bytes = (k * 3 * HIDDEN * 2) as f64;
        let gbs = bytes / kern_s;
        println!(
            "{:>5.0}% {:>9.1} {:>11.1} {:>10.0} {:>9.0}% {:>10.1}",
            frac * 100.0,
            bytes / 1e6,
            kern_s * 1e6,
            gbs / 1e9,
            100.0 * gbs / copy,
            call_s * 1e6
        );
        json(
            serde_json::json!({"check": "bandwidth", "hot": frac, "bytes": bytes,
            "kernel_us": kern_s * 1e6, "call_us": call_s * 1e6, "gbs": gbs / 1e9,
            "copy_gbs": copy / 1e9, "of_copy": gbs / copy}),
        );
    }
    Ok(())
}

/// (f) The default sparse mode's hot neurons (`HotNeurons`, candle's CUDA quantized matmul) on
/// a Q4_K layer of the same shape: one decoded row at 10/50/100% of the neurons hot, the whole
/// call (copy in, the products, copy out and the wait) against the device's copy bandwidth;
/// then one split FFN step (`InputSparseFfn::from_qtensors_split`, the CPU computing the cold
/// neurons meanwhile) at 0/25/50/100% hot against the unsplit FFN on the CPU.
fn hot_neurons(dev: &candle_core::CudaDevice, copy: f64, threads: usize) -> Res<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    use powerinfer::{layout::Layout, tier::HotNeurons, InputSparseFfn};
    println!(
        "\n(f) hot neurons on the device, {HIDDEN}x{INTER} Q4_K (down's hot columns Q8_0), 1 row"
    );
    let mut rng = StdRng::seed_from_u64(11);
    let q = |rng: &mut StdRng, r: usize, c: usize| -> Res<QTensor> {
        let t = Tensor::from_vec(random(rng, r * c, 0.02), (r, c), &Device::Cpu)?;
        Ok(QTensor::quantize(&t, GgmlDType::Q4K)?)
    };
    let (g, u, d) = (
        q(&mut rng, INTER, HIDDEN)?,
        q(&mut rng, INTER, HIDDEN)?,
        q(&mut rng, HIDDEN, INTER)?,
    );
    let spec = FfnSpec::gated(HIDDEN, INTER, Activation::Silu)?;
    let device = Device::Cuda(dev.clone());
    let x = random(&mut rng, HIDDEN, 1.0);
    let time = |f: &mut dyn FnMut() -> Res<()>| -> Res<f64> {
        for _ in 0..5 {
            f()?;
        }
        let mut v = Vec::new();
        for _ in 0..30 {
            let t = Instant::now();
            f()?;
            v.push(t.elapsed().as_secs_f64());
        }
        Ok(median(v))
    };
    println!(
        "{:>6} {:>9} {:>10} {:>10} {:>10}",
        "hot", "MB", "call us", "GB/s", "of copy"
    );
    for frac in [0.1, 0.5, 1.0] {
        let k = ((INTER as f64 * frac) as usize / 32 * 32).min(INTER);
        let k = if frac == 1.0 { INTER } else { k };
        let ids: Vec<u32> = (0..k as u32).collect();
        let hot = HotNeurons::new(&spec, Some(&g), &u, &d, &ids, &device)?;
        let mut out = vec![0f32; HIDDEN];
        let s = time(&mut || {
            out.fill(0.0);
            hot.finish(hot.launch(&x, 1)?, &mut out)?;
            Ok(())
        })?;
        let gbs = hot.bytes() as f64 / s;
        println!(
            "{:>5.0}% {:>9.1} {:>10.1} {:>10.0} {:>9.0}%",
            frac * 100.0,
            hot.bytes() as f64 / 1e6,
            s * 1e6,
            gbs / 1e9,
            100.0 * gbs / copy
        );
        json(
            serde_json::json!({"check": "hot_neurons", "hot": frac, "bytes": hot.bytes(),
            "call_us": s * 1e6, "gbs": gbs / 1e9, "of_copy": gbs / copy,
            "launches": "3 quantized matmuls, the activation and product, 2 copies; 1 wait"}),
        );
    }
    let layouts = [Layout::Rows, Layout::Rows, Layout::Columns];
    let cpu = InputSparseFfn::from_qtensors_as(spec, Some(&g), &u, &d, threads, None, layouts)?;
    let mut out = vec![0f32; HIDDEN];
    let base = time(&mut || Ok(cpu.forward_f32(&x, 1, &mut out)?))?;
    println!(
        "split step, {threads} CPU threads: all on the CPU {:.0} us",
        base * 1e6
    );
    for frac in [0.25, 0.5, 1.0] {
        let k = if frac == 1.0 {
            INTER
        } else {
            (INTER as f64 * frac) as usize / 32 * 32
        };
        let ids: Vec<u32> = (0..k as u32).collect();
        let f = InputSparseFfn::from_qtensors_split(
            spec,
            Some(&g),
            &u,
            &d,
            threads,
            None,
            layouts,
            &ids,
            &device,
        )?;
        let s = time(&mut || Ok(f.forward_f32(&x, 1, &mut out)?))?;
        println!(
            "  {:>3.0}% hot: {:.0} us ({:.2}x the CPU's)",
            frac * 100.0,
            s * 1e6,
            base / s
        );
        json(
            serde_json::json!({"check": "split_step", "hot": frac, "us": s * 1e6,
            "cpu_us": base * 1e6, "threads": threads}),
        );
    }
    Ok(())
}

/// Median ms of one FFN step of `ffn` over `tokens` (after 4 warm-ups).
fn step_ms(ffn: &mut HybridFfn, sets: &[Vec<u32>], x: &[f32]) -> Res<f64> {
    let mut out = vec![0f32; HIDDEN];
    let mut times = Vec::new();
    for (i, s) in sets.iter().enumerate() {
        ffn.set_predictor(Oracle::new(vec![s.clone()]));
        let t = Instant::now();
        ffn.forward_f32(x, 1, &mut out)?;
        if i >= 4 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

fn hybrid(dev: &candle_core::CudaDevice, l: &Layer, threads: usize) -> Res<()> {
    println!("\n(c) one FFN step (1 row, ~24% of neurons active), {threads} CPU threads");
    let mut tokens = Tokens {
        rng: StdRng::seed_from_u64(5),
        cold: Vec::new(),
    };
    let sets: Vec<Vec<u32>> = (0..36).map(|_| tokens.next()).collect();
    let x = random(&mut StdRng::seed_from_u64(4), HIDDEN, 1.0);
    let opts = HybridOptions {
        threads,
        ..Default::default()
    };
    let per = CudaTier::neuron_bytes(&l.bundles);
    let mut rows = Vec::new();
    for frac in [0.0, 0.25, 0.5, 1.0] {
        let k = (INTER as f64 * frac) as usize;
        let hot: Vec<u32> = (0..k as u32).collect();
        let mut ffn = HybridFfn::new(l.bundles.clone(), opts.clone())?
            .with_placement(LayerPlacement::new(INTER, hot.clone(), None)?)?;
        if k > 0 {
            let budget = TierBudget::new(per * k as u64 + CudaTier::work_bytes(&l.bundles, k))?;
            ffn.attach_tier(Box::new(CudaTier::new(dev, &l.bundles, &hot, 0, &budget)?))?;
        }
        let ms = step_ms(&mut ffn, &sets, &x)?;
        rows.push((format!("GPU {:.0}%", frac * 100.0), ms));
    }
    // The dense FFN on the GPU: candle's f16 matmuls (cuBLAS), every neuron.
    let cuda = Device::Cuda(dev.clone());
    let to = |t: &Tensor| t.to_dtype(DType::F16).and_then(|t| t.to_device(&cuda));
    let (g, u, d) = (to(&l.gate)?, to(&l.up)?, to(&l.down)?);
    let xt = Tensor::from_vec(x.clone(), (1, HIDDEN), &Device::Cpu)?
        .to_dtype(DType::F16)?
        .to_device(&cuda)?;
    let mut times = Vec::new();
    for i in 0..36 {
        let t = Instant::now();
        let h = (candle_nn::ops::silu(&xt.matmul(&g.t()?)?)? * xt.matmul(&u.t()?)?)?;
        let y = h.matmul(&d.t()?)?;
        cuda.synchronize()?;
        std::hint::black_box(y);
        if i >= 4 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    rows.push(("dense on the GPU".into(), median(times)));
    let cpu = rows[0].1;
    for (name, ms) in &rows {
        println!("{name:>18}: {ms:>8.3} ms  ({:.2}x all-CPU)", cpu / ms);
        json(
            serde_json::json!({"check": "hybrid", "row": name, "ms": ms, "speedup_vs_cpu": cpu / ms}),
        );
    }
    Ok(())
}

fn cache(dev: &candle_core::CudaDevice, l: &Layer, threads: usize) -> Res<()> {
    println!("\n(d) the neuron cache: 25% placed, plus 0 or 25% cache slots, 64 tokens");
    let hot: Vec<u32> = (0..(INTER / 4) as u32).collect();
    let x = random(&mut StdRng::seed_from_u64(6), HIDDEN, 1.0);
    for slots in [0, INTER / 4] {
        let mut tokens = Tokens {
            rng: StdRng::seed_from_u64(7),
            cold: Vec::new(),
        };
        let sets: Vec<Vec<u32>> = (0..68).map(|_| tokens.next()).collect();
        let mut ffn = HybridFfn::new(
            l.bundles.clone(),
            HybridOptions {
                threads,
                ..Default::default()
            },
        )?
        .with_placement(LayerPlacement::new(INTER, hot.clone(), None)?)?;
        let budget = TierBudget::new(u64::MAX)?;
        ffn.attach_tier(Box::new(CudaTier::new(
            dev, &l.bundles, &hot, slots, &budget,
        )?))?;
        let ms = step_ms(&mut ffn, &sets, &x)?;
        let c = ffn
            .fast_tier()
            .map(|t| t.take_counters())
            .unwrap_or_default();
        let looked = (c.hits + c.misses).max(1) as f64;
        let per_token = |v: u64| v as f64 / sets.len() as f64;
        println!(
            "{:>6} slots: {ms:>7.3} ms/step, hit rate {:>5.1}%, {:>7.1} KB copied per token, {:.0} evictions per token",
            slots, 100.0 * c.hits as f64 / looked, per_token(c.bytes_copied) / 1e3, per_token(c.evictions)
        );
        json(
            serde_json::json!({"check": "cache", "slots": slots, "ms": ms,
            "hit_rate": c.hits as f64 / looked, "bytes_copied_per_token": per_token(c.bytes_copied)}),
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let dev = match cuda_device(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            std::process::exit(2);
        }
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    let t = Instant::now();
    let l = layer()?;
    println!("layer built in {:.1} s", t.elapsed().as_secs_f64());
    let copy = copy_bandwidth(&dev)?;
    println!(
        "device copy bandwidth (read + write): {:.0} GB/s",
        copy / 1e9
    );
    json(serde_json::json!({"check": "copy", "gbs": copy / 1e9}));
    bandwidth(&dev, &l, copy)?;
    hybrid(&dev, &l, threads)?;
    cache(&dev, &l, threads)?;
    hot_neurons(&dev, copy, threads)?;
    Ok(())
}
