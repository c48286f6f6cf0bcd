//! The planner, the placement and the FFN forward.

use candle_core::{Device, Tensor};
use powerinfer::{
    predict::Oracle, tier::plan_placement, tier::LayerPlacement, tier::TierBudget, Activation,
    FfnSpec, FfnWeights, GateFirst, HybridFfn, HybridOptions, NeuronBundles, WeightDType,
};

use crate::bytes::Bytes;

/// A value from a byte: mostly ordinary, sometimes NaN, an infinity or negative.
fn odd_value(v: u8) -> f64 {
    match v {
        255 => f64::NAN,
        254 => f64::INFINITY,
        253 => -1.0,
        v => v as f64 / 252.0,
    }
}

/// `plan_placement` over 1-4 layers of 1-40 neurons with arbitrary frequencies (NaN, infinite,
/// negative), neuron sizes (zero too) and budget: a typed error, or a plan that never passes
/// the budget, with each layer's hot set sorted, distinct and in range. Arbitrary ids given to
/// `LayerPlacement::new` make a sorted, distinct, in-range set or a typed error.
pub fn placement(data: &[u8]) {
    let mut b = Bytes::new(data);
    let layers = 1 + b.below(4);
    let n = 1 + b.below(40);
    let per: Vec<u64> = (0..layers).map(|_| u64::from(b.u8())).collect();
    let budget = u64::from(b.u16()) * (1 + u64::from(b.u8()));
    let freqs: Vec<Vec<f64>> = (0..layers)
        .map(|_| (0..n).map(|_| odd_value(b.u8())).collect())
        .collect();
    if let Ok(p) = plan_placement(&freqs, &per, budget) {
        assert_eq!(p.layers.len(), layers);
        let used: u64 = p
            .layers
            .iter()
            .zip(&per)
            .map(|(l, &c)| l.hot().len() as u64 * c)
            .sum();
        assert!(
            used <= budget,
            "{used} bytes placed under a budget of {budget}"
        );
        for l in &p.layers {
            check_set(l.hot(), n);
        }
    }
    let ids: Vec<u32> = b
        .rest()
        .iter()
        .map(|&v| u32::from(v) % (n as u32 + 3))
        .collect();
    if let Ok(l) = LayerPlacement::new(n, ids, None) {
        check_set(l.hot(), n);
    }
}

fn check_set(hot: &[u32], n: usize) {
    assert!(
        hot.windows(2).all(|w| w[0] < w[1]),
        "not sorted or repeated: {hot:?}"
    );
    assert!(
        hot.iter().all(|&i| (i as usize) < n),
        "out of range: {hot:?}"
    );
}

/// Deterministic weights in [-scale, scale) from `seed`.
fn weights(seed: u64, dims: (usize, usize), scale: f32) -> Tensor {
    let mut s = seed | 1;
    let v: Vec<f32> = (0..dims.0 * dims.1)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).expect("weights")
}

/// `HybridFfn` on an arbitrary layer (shape, activation, gating, storage including the GGUF
/// block types, threads), predictor (every neuron, a given set whose ids may be out of range,
/// a threshold rule), placement, reference fast tier with cache slots, and input (NaN and
/// infinities too). Non-finite input, and a set with an id out of range, are typed errors;
/// otherwise the output equals the dense FFN on the same stored weights restricted to the
/// set, within the storage's rounding (threshold rules: finite output).
pub fn forward(data: &[u8]) {
    let mut b = Bytes::new(data);
    let dtypes = [
        WeightDType::F32,
        WeightDType::F16,
        WeightDType::BF16,
        WeightDType::Q8_0,
        WeightDType::Q4_0,
        WeightDType::Q4_1,
    ];
    let dtype = dtypes[b.below(dtypes.len())];
    let quant = dtype.quant().is_some();
    let hidden = if quant {
        32 * (1 + b.below(2))
    } else {
        1 + b.below(40)
    };
    let n = 1 + b.below(48);
    let acts = [
        Activation::Relu,
        Activation::DRelu,
        Activation::Silu,
        Activation::Gelu,
        Activation::GeluTanh,
    ];
    let act = acts[b.below(acts.len())];
    let gated = act == Activation::DRelu || b.u8() & 1 == 0;
    let rows = b.below(4);
    let threads = 1 + b.below(3);
    let seed = b.u64();
    let predictor = b.below(3);
    let tier = b.u8();
    let (g, u) = (
        weights(seed, (n, hidden), 1.0 / (hidden as f32).sqrt()),
        weights(seed ^ 0x9e37, (n, hidden), 1.0 / (hidden as f32).sqrt()),
    );
    let d = weights(seed ^ 0x7f4a, (hidden, n), 1.0 / (n as f32).sqrt());
    let (spec, w) = if gated {
        (
            FfnSpec::gated(hidden, n, act),
            FfnWeights::gated(&g, &u, &d),
        )
    } else {
        (
            FfnSpec::ungated(hidden, n, act),
            FfnWeights::ungated(&u, &d),
        )
    };
    let spec = spec.expect("a valid spec");
    let bundles = NeuronBundles::from_weights(spec, w, dtype).expect("bundles");
    let opts = HybridOptions {
        threads,
        ..Default::default()
    };
    let mut ffn = HybridFfn::new(bundles, opts).expect("block");
    // The set: ids from the input, `n` and above out of range.
    let set: Vec<u32> = (0..b.below(n + 2)).map(|_| b.below(n + 2) as u32).collect();
    let mut kept = vec![true; n];
    let mut bad_set = false;
    match predictor {
        0 => {}
        1 => {
            kept = vec![false; n];
            for &i in &set {
                match kept.get_mut(i as usize) {
                    Some(k) => *k = true,
                    None => bad_set = true,
                }
            }
            ffn.set_predictor(Oracle::new(vec![set.clone()]));
        }
        _ => ffn.set_predictor(GateFirst::new(f32::from(b.u8()) / 64.0).expect("rule")),
    }
    let hot: Vec<u32> = set
        .iter()
        .copied()
        .filter(|&i| (i as usize) < n && i % 2 == 0)
        .collect();
    let mut hot = hot;
    hot.sort_unstable();
    hot.dedup();
    ffn.set_placement(LayerPlacement::new(n, hot, None).expect("placement"))
        .expect("placement fits");
    if tier & 1 == 1 {
        let budget = TierBudget::new(u64::MAX).expect("budget");
        let slots = (tier >> 1) as usize % (n + 1);
        let res = ffn.attach_reference_tier(&budget, slots, 1);
        // A tier with nothing to hold is refused; any other attaches.
        assert_eq!(
            res.is_err(),
            ffn.placement().hot().is_empty() && slots == 0,
            "{res:?}"
        );
    }
    let x: Vec<f32> = (0..rows * hidden)
        .map(|_| match b.u8() {
            255 => f32::NAN,
            254 => f32::INFINITY,
            253 => f32::NEG_INFINITY,
            v => (f32::from(v) - 126.0) / 32.0,
        })
        .collect();
    let finite = x.iter().all(|v| v.is_finite());
    let xt = Tensor::from_vec(x.clone(), (rows, hidden), &Device::Cpu).expect("input");
    // A wrong output length is a typed error.
    let mut short = vec![0f32; (rows * hidden).saturating_sub(1)];
    if rows > 0 {
        assert!(ffn.forward_f32(&x, rows, &mut short).is_err());
    } else {
        ffn.forward_f32(&x, 0, &mut []).expect("an empty batch");
    }
    let res = ffn.forward_tensor(&xt);
    if rows == 0 {
        res.expect("an empty batch");
        return;
    }
    if !finite {
        assert!(res.is_err(), "non-finite input accepted");
        return;
    }
    if bad_set {
        assert!(res.is_err(), "a neuron id out of range accepted");
        return;
    }
    let y: Vec<f32> = res
        .expect("a valid call")
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("output values");
    assert!(y.iter().all(|v| v.is_finite()), "non-finite output {y:?}");
    if predictor == 2 {
        return;
    }
    let (gw, uw, dw) = ffn.bundles().to_dense_f32().expect("stored weights");
    let uw: Vec<f32> = uw.flatten_all().and_then(|t| t.to_vec1()).expect("up");
    let dw: Vec<f32> = dw.flatten_all().and_then(|t| t.to_vec1()).expect("down");
    let gw: Option<Vec<f32>> = gw.map(|g| g.flatten_all().and_then(|t| t.to_vec1()).expect("gate"));
    let dot = |w: &[f32], i: usize, xr: &[f32]| -> f32 {
        w[i * hidden..(i + 1) * hidden]
            .iter()
            .zip(xr)
            .map(|(a, b)| a * b)
            .sum()
    };
    // Quantized layers multiply by the input quantized as ggml does (blocks of 32 with scale
    // max/127): each input value moves by at most its block's max / 254, so a product moves by
    // at most sum_k |w_k| * blockmax(k) / 254, and `h` by what that does through the activation
    // (slope at most 1.13). Float layers differ only by rounding.
    let blockmax: Vec<f32> = x
        .chunks(32)
        .flat_map(|c| {
            let m = c.iter().fold(0f32, |a, v| a.max(v.abs()));
            std::iter::repeat_n(m, c.len())
        })
        .collect();
    let qerr = |w: &[f32], i: usize, r: usize| -> f64 {
        if !quant {
            return 0.0;
        }
        let m = &blockmax[r * hidden..(r + 1) * hidden];
        w[i * hidden..(i + 1) * hidden]
            .iter()
            .zip(m)
            .map(|(a, b)| f64::from(a.abs() * b))
            .sum::<f64>()
            / 254.0
            * 1.01
    };
    for r in 0..rows {
        let xr = &x[r * hidden..(r + 1) * hidden];
        let mut want = vec![0f64; hidden];
        let mut scale = vec![0f64; hidden];
        let mut bound = vec![0f64; hidden];
        for i in (0..n).filter(|&i| kept[i]) {
            let up = dot(&uw, i, xr);
            let du = qerr(&uw, i, r);
            let (h, dh) = match &gw {
                Some(gw) => {
                    let g = dot(gw, i, xr);
                    let dg = qerr(gw, i, r);
                    let a = f64::from(act.apply(g).abs());
                    let dh = 1.13 * dg * (f64::from(up.abs()) + du) + a * du;
                    (act.gated(g, up), dh)
                }
                None => (act.apply(up), 1.13 * du),
            };
            for j in 0..hidden {
                let dj = f64::from(dw[j * n + i]);
                let c = f64::from(h) * dj;
                want[j] += c;
                scale[j] += c.abs();
                bound[j] += dh * dj.abs();
            }
        }
        for j in 0..hidden {
            let got = f64::from(y[r * hidden + j]);
            assert!(
                (got - want[j]).abs() <= bound[j] + 1e-3 * scale[j] + 1e-5,
                "{dtype:?} {act:?} gated {gated}, {rows}x{hidden} -> {n} neurons, predictor {predictor}: row {r}, column {j}: {got} against {} (bound {}, scale {})",
                want[j],
                bound[j],
                scale[j]
            );
        }
    }
}

/// Hostile neuron indices, batch sizes, thresholds and inputs against the placement, the
/// predictors and the FFN (the first fuzz target): every outcome is a value or a typed error.
pub fn hostile_indices(data: &[u8]) {
    const H: usize = 17;
    const N: usize = 33;
    if data.len() < 4 {
        return;
    }
    let (head, rest) = data.split_at(4);
    let rows = (head[0] % 5) as usize;
    let act = [
        Activation::Relu,
        Activation::DRelu,
        Activation::Silu,
        Activation::Gelu,
    ][head[1] as usize % 4];
    let dtype = [WeightDType::F32, WeightDType::F16, WeightDType::BF16][head[2] as usize % 3];
    let ids: Vec<u32> = rest.chunks(2).map(|c| u32::from(c[0]) % 64).collect();
    let _ = LayerPlacement::new(N, ids.clone(), Some(1));
    let freqs: Vec<f64> = rest
        .iter()
        .map(|&b| {
            if b == 255 {
                f64::NAN
            } else {
                f64::from(b) - 10.0
            }
        })
        .collect();
    let _ = plan_placement(&[freqs], &[u64::from(head[3])], u64::from(head[3]) * 3);
    let (g, u, d) = (
        weights(3, (N, H), 0.25),
        weights(5, (N, H), 0.25),
        weights(7, (H, N), 0.25),
    );
    let spec = FfnSpec::gated(H, N, act).expect("spec");
    let opts = HybridOptions {
        threads: 1 + head[3] as usize % 3,
        ..Default::default()
    };
    let Ok(ffn) = HybridFfn::from_weights(spec, FfnWeights::gated(&g, &u, &d), dtype, opts) else {
        return;
    };
    let ffn = match LayerPlacement::new(N, ids.clone(), None) {
        Ok(p) => ffn.with_placement(p).expect("a valid placement fits"),
        Err(_) => ffn,
    };
    let x: Vec<f32> = (0..rows * H)
        .map(
            |i| match rest.get(i % rest.len().max(1)).copied().unwrap_or(0) {
                254 => f32::NAN,
                253 => f32::INFINITY,
                b => f32::from(b) / 64.0 - 2.0,
            },
        )
        .collect();
    let mut out = vec![0f32; rows * H];
    let ffn = if head[0] & 0x80 != 0 {
        ffn.with_predictor(GateFirst::new(f32::from(head[1]) / 128.0).expect("rule"))
    } else {
        let sets = ids.chunks(3).map(|c| c.to_vec()).collect::<Vec<_>>();
        ffn.with_predictor(Oracle::new(sets))
    };
    let _ = ffn.forward_f32(&x, rows, &mut out);
    if let Ok(t) = Tensor::from_vec(x, (rows, H), &Device::Cpu) {
        let _ = ffn.forward_tensor(&t);
    }
}
