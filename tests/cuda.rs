//! The CUDA tier against the CPU tier (feature `cuda`). On a machine without a GPU (or driver)
//! every test prints one `skipped:` line and passes, unless `POWERINFER_REQUIRE_GPU=1` is set:
//! then a missing device fails it (`scripts/gpu-check.sh` sets it, so a broken CUDA setup on
//! the GPU machine is a failure, not a skip). The host-side parts (device layouts, budgets) are
//! unit tests in `src/cuda`.
#![cfg(feature = "cuda")]

mod common;

use candle_core::Module;
use common::*;
use powerinfer::{
    predict::Oracle, tier::cuda_device, tier::CudaTier, tier::LayerPlacement, tier::TierBudget,
    Activation, ErrorKind, FfnSpec, GateFirst, HybridFfn, HybridOptions, NeuronBundles,
    WeightDType,
};
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The device, or `None` after printing why the test is skipped (to stderr itself, past the
/// test harness's capture, so the line shows in every run). Panics instead under
/// `POWERINFER_REQUIRE_GPU=1`.
fn device(test: &str) -> Option<candle_core::CudaDevice> {
    use std::io::Write;
    match cuda_device(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("POWERINFER_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("{test}: POWERINFER_REQUIRE_GPU=1 and {e}")
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped {test}: {e}");
            None
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    hidden: usize,
    inter: usize,
    rows: usize,
    act: Activation,
    gated: bool,
    dtype: WeightDType,
    hot_frac: f64,
    active_frac: f64,
    rule: Option<f32>,
    slots: usize,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=300, 1usize..=200, 1usize..=40),
        (0usize..5, any::<bool>(), 0usize..5),
        (
            0.0..1.0f64,
            0.0..1.0f64,
            prop_oneof![Just(None), (0.0..0.5f32).prop_map(Some)],
        ),
        (0usize..64, any::<u64>()),
    )
        .prop_map(
            |(
                (hidden, inter, rows),
                (a, gated, d),
                (hot_frac, active_frac, rule),
                (slots, seed),
            )| {
                let act = ACTIVATIONS[a];
                let dtype = [
                    WeightDType::F32,
                    WeightDType::F16,
                    WeightDType::BF16,
                    WeightDType::Q4_1,
                    WeightDType::Q8_0,
                ][d];
                let hidden = if dtype.quant().is_some() {
                    hidden.div_ceil(32) * 32
                } else {
                    hidden
                };
                Case {
                    hidden,
                    inter,
                    rows,
                    act,
                    gated: gated || act == Activation::DRelu,
                    dtype,
                    hot_frac,
                    active_frac,
                    rule,
                    slots,
                    seed,
                }
            },
        )
}

/// A case's data, drawn from its seed: the weights, the placed hot neurons, the rows' active sets
/// (for the `Oracle`) and the input rows (`rows * hidden`, row-major).
struct Data {
    spec: FfnSpec,
    w: Weights,
    hot: Vec<u32>,
    sets: Vec<Vec<u32>>,
    x: Vec<f32>,
}

fn data(c: &Case) -> Data {
    let spec = FfnSpec::new(c.hidden, c.inter, c.act, c.gated).unwrap();
    let w = Weights::random(&spec, c.seed);
    let mut rng = StdRng::seed_from_u64(c.seed ^ 7);
    let hot: Vec<u32> = (0..c.inter as u32)
        .filter(|_| rng.random_bool(c.hot_frac))
        .collect();
    let sets: Vec<Vec<u32>> = (0..c.rows)
        .map(|_| {
            (0..c.inter as u32)
                .filter(|_| rng.random_bool(c.active_frac))
                .collect()
        })
        .collect();
    let x = flat(&tensor(&mut rng, &[c.rows, c.hidden], 1.0));
    Data {
        spec,
        w,
        hot,
        sets,
        x,
    }
}

/// How far (at least) a case's threshold is put from every score range that could straddle it
/// (see [`untie`]): slack on top of the bounds of [`dot_range`] and [`score_range`], far above
/// the threshold's own rounding to f32 (below 3e-8 under 0.5).
const CLEAR: f64 = 1.0 / 65536.0;

/// A threshold rule is a hard cutoff: a neuron counts in a row only if its score (`act(g)` for
/// gated ReLU/dReLU, `relu(u)` ungated ReLU, `|h|` otherwise) exceeds `t`, and a kept neuron adds
/// `h` (of size about `t`) times its down row while a dropped one adds nothing. The CPU tier and
/// the device compute the score differently (quantized storage: the CPU dots the rows against
/// the input quantized to 8 bits, the device dots f16 copies of the rows against the f32 input;
/// float storage: other summation orders), so a score that close to `t` is kept on one side and
/// dropped on the other: an output difference of about `t * |down|`, a legitimate decision at
/// the cutoff, not a rounding error the tolerance should absorb (the first GPU run, on an H200,
/// hit one: `h200_case`). So before comparing, a case's threshold is moved off such near-ties
/// (`untie`): no (row, neuron) score range may straddle it. A case without a rule, or whose
/// threshold is clear already, is unchanged; `untied(untied(c)) == untied(c)`, so the case a
/// failure prints reruns as is.
fn untied(c: &Case) -> Case {
    let Some(t) = c.rule else {
        return c.clone();
    };
    Case {
        rule: Some(untie(t, &score_ranges(c, &data(c)))),
        ..c.clone()
    }
}

/// Per (row, neuron), `[r * inter + i]`: `(lo, hi)`, a range that holds the rule's score both as
/// the CPU tier computes it and as the device does (the case's biases are zero). The dots come
/// from [`dot_range`] as (centre, radius); the score then follows from interval arithmetic:
/// ReLU is monotone; a smooth `act` moves by at most `L = 1.2 >= sup |act'|` (SiLU 1.100, GELU
/// and GELU-tanh 1.129) times the dot's radius, plus `2^-18 * (|act| + |v|)` for the CPU's
/// (std, libm) and the device's (CUDA libdevice) f32 `exp`/`erf`/`tanh` differing by a few ulp
/// (the `|v|` part covers the cancellation in `1 + erf` for negative `v`); the product `act(g) *
/// u` adds the usual first-order terms and its own f32 rounding.
fn score_ranges(c: &Case, d: &Data) -> Vec<(f64, f64)> {
    let b = NeuronBundles::from_weights(d.spec, d.w.view(), c.dtype).unwrap();
    let (gate, up, _) = b.to_dense_f32().unwrap();
    let (gate, up) = (gate.map(|g| flat(&g)), flat(&up));
    let h = c.hidden;
    let mut out = Vec::with_capacity(c.rows * c.inter);
    for x in d.x.chunks_exact(h) {
        let inp = cpu_input(c.dtype, x);
        for i in 0..c.inter {
            let row = |w: &[f32]| dot_range(c.dtype, &w[i * h..(i + 1) * h], x, &inp);
            out.push(score_range(c.act, gate.as_deref().map(row), row(&up)));
        }
    }
    out
}

/// The input row as the CPU tier's dots see it. Quantized storage: quantized to 8 bits per
/// 32-value block (the kernels' `QuantizedRow`): the values `xq`, and per block the error of the
/// input sum Q4_1's min term uses, `s_b - d_b * sum_b` (`s_b = f16(f16(sum_b) * d_b)`, see
/// `QuantizedRow`). Float storage: `x` itself, no blocks.
struct CpuInput {
    xq: Vec<f32>,
    s_err: Vec<f64>,
}

fn cpu_input(dtype: WeightDType, x: &[f32]) -> CpuInput {
    let mut xq = x.to_vec();
    let mut s_err = Vec::new();
    if dtype.quant().is_some() {
        let q = quantized(x);
        q.dequantize(&mut xq);
        s_err = (0..q.blocks())
            .map(|b| {
                let (d, sum, s) = q.block(b).unwrap();
                f64::from(s) - f64::from(d) * f64::from(sum)
            })
            .collect();
    }
    CpuInput { xq, s_err }
}

/// `w . x` (`w` a stored row, dequantized) as (centre, radius) of a range holding both sides'
/// f32 results. Each side is first computed exactly, in f64, on the values it uses:
/// - the CPU tier: `w . xq` against its 8-bit input ([`cpu_input`]), and for Q4_1 the min term
///   as it takes it, `m_b * s_b` (`m_b` is the block's smallest stored weight: its 4-bit value
///   is 0). So the 8-bit input's error (up to half a step `amax_b / 127` per value, ~1e-3 on
///   these dots) is taken as it is: a worst-case bound, `sum_j |w_j| amax_b / 254`, is ~10x
///   larger and leaves large cases no threshold clear of ties;
/// - the device: `f16(w) . x` for quantized storage (it holds the rows in f16), `w . x` for
///   float storage.
///
/// The radius is half their distance plus each side's f32 rounding: `n` products summed in any
/// order (SIMD lanes, warp lanes, integer blocks scaled per block) are within `gamma_{n+1} *
/// sum_j |terms|` (`gamma_k ~ k * 2^-24`) of exact; taken as `(n + 8) * 2^-24 * size`, with
/// `size = sum_j |w_j| max(|x_j|, |xq_j|)` (`|f16(w)| <= (1 + 2^-11) |w|`, and the `+ 8` covers
/// the rows' f32 dequantization and the block scalings), plus `|m_b| sum_b |xq_j|` for Q4_1,
/// whose block terms are `(w_j - m_b) xq_j` and `m_b s_b`.
fn dot_range(dtype: WeightDType, w: &[f32], x: &[f32], inp: &CpuInput) -> (f64, f64) {
    let quant = dtype.quant().is_some();
    let (mut cpu, mut gpu, mut size) = (0f64, 0f64, 0f64);
    for ((&w, &x), &xq) in w.iter().zip(x).zip(&inp.xq) {
        let wd = if quant {
            half::f16::from_f32(w).to_f32()
        } else {
            w
        };
        cpu += f64::from(w) * f64::from(xq);
        gpu += f64::from(wd) * f64::from(x);
        size += f64::from(w).abs() * f64::from(x.abs().max(xq.abs()));
    }
    if dtype == WeightDType::Q4_1 {
        for ((wb, xb), &e) in w.chunks(32).zip(inp.xq.chunks(32)).zip(&inp.s_err) {
            let m = f64::from(wb.iter().fold(f32::INFINITY, |a, &v| a.min(v)));
            cpu += m * e;
            size += m.abs() * xb.iter().map(|&v| f64::from(v).abs()).sum::<f64>();
        }
    }
    let eps = (w.len() + 8) as f64 * 2f64.powi(-24) * size;
    ((cpu + gpu) / 2.0, (cpu - gpu).abs() / 2.0 + eps)
}

/// The score's range from the dots' ranges (see [`score_ranges`]).
fn score_range(act: Activation, g: Option<(f64, f64)>, u: (f64, f64)) -> (f64, f64) {
    const L: f64 = 1.2;
    if act.exact_zeros() {
        // Gated: the gate alone decides; ungated: relu(u).
        let (c, r) = g.unwrap_or(u);
        return ((c - r).max(0.0), (c + r).max(0.0));
    }
    let a = |(c, r): (f64, f64)| {
        let v = f64::from(act.apply(c as f32));
        (v, L * r + 2f64.powi(-18) * (v.abs() + c.abs()))
    };
    let (h, dh) = match g {
        Some(g) => {
            let (ag, dag) = a(g);
            let h = ag * u.0;
            let dh = dag * (u.0.abs() + u.1) + ag.abs() * u.1 + 2f64.powi(-22) * h.abs();
            (h, dh)
        }
        None => a(u),
    };
    ((h.abs() - dh).max(0.0), h.abs() + dh)
}

/// `t` if no score range that can straddle a threshold (`lo < hi`; ReLU's `[0, 0]` of clearly
/// negative pre-activations cannot) comes within [`CLEAR`] of it; else the middle of the nearer
/// of the two gaps around the cluster of such ranges (each widened by `CLEAR`) that holds `t`,
/// so the case moves as little as it can while every neuron is kept, or dropped, on both sides.
/// Scores are dense near 0 and thin out at the top, so a large quantized case may move by ~0.1
/// (to where a few hundred (row, neuron) pairs remain kept); above the highest cluster, where
/// every neuron is dropped, it moves only when that is nearer.
fn untie(t: f32, ranges: &[(f64, f64)]) -> f32 {
    let mut r: Vec<(f64, f64)> = ranges
        .iter()
        .filter(|(lo, hi)| lo < hi)
        .map(|&(lo, hi)| (lo - CLEAR, hi + CLEAR))
        .collect();
    r.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut clusters: Vec<(f64, f64)> = Vec::new();
    for (lo, hi) in r {
        match clusters.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => clusters.push((lo, hi)),
        }
    }
    let t64 = f64::from(t);
    let Some(k) = clusters.iter().position(|&(lo, hi)| lo <= t64 && t64 <= hi) else {
        return t;
    };
    let (lo, hi) = clusters[k];
    // A threshold must be >= 0. Widened ranges start at >= -CLEAR and end above 0, so every gap
    // lies above 0 but the one below the first cluster, which exists when that starts above 0.
    let below = match k {
        0 => (lo > 0.0).then_some((0.0, lo)),
        _ => Some((clusters[k - 1].1, lo)),
    };
    let above = clusters
        .get(k + 1)
        .map_or((hi, hi + 2.0 * CLEAR), |next| (hi, next.0));
    let gap = match below {
        Some(b) if t64 - b.1 <= above.0 - t64 => b,
        _ => above,
    };
    ((gap.0 + gap.1) / 2.0) as f32
}

/// The block with the GPU tier and the same block on the CPU alone: outputs agree (f16/bf16
/// rows: 1e-3 of the output's scale; f32: 1e-5; quantized rows are f16 on the device and the
/// CPU quantizes the input to 8 bits: 2e-2), never NaN although the host output starts as NaN
/// and the device buffers start as NaN, on the first call and on the second (cache filled). A
/// threshold rule is first moved off near-ties ([`untied`]), so the tolerance covers rounding
/// only, not decisions at the cutoff.
fn check(dev: &candle_core::CudaDevice, c: &Case) -> Result<(), TestCaseError> {
    let c = &untied(c);
    let Data {
        spec,
        w,
        hot,
        sets,
        x: xs,
    } = data(c);
    let build = || {
        let b = NeuronBundles::from_weights(spec, w.view(), c.dtype).unwrap();
        let f = HybridFfn::new(
            b,
            HybridOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap()
        .with_placement(LayerPlacement::new(c.inter, hot.clone(), None).unwrap())
        .unwrap();
        match c.rule {
            Some(t) => f.with_predictor(GateFirst::new(t).unwrap()),
            None => f.with_predictor(Oracle::new(sets.clone())),
        }
    };
    let cpu = build();
    let mut gpu = build();
    if hot.is_empty() && c.slots == 0 {
        return Ok(());
    }
    let budget = TierBudget::new(u64::MAX).unwrap();
    let tier = CudaTier::new(dev, gpu.bundles(), &hot, c.slots, &budget).unwrap();
    gpu.attach_tier(Box::new(tier)).unwrap();
    let mut want = vec![0f32; xs.len()];
    cpu.forward_f32(&xs, c.rows, &mut want).unwrap();
    let scale = want.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
    let tol = match c.dtype {
        WeightDType::F32 => 1e-5,
        WeightDType::F16 | WeightDType::BF16 => 1e-3,
        _ => 2e-2,
    };
    for call in 0..2 {
        let mut got = vec![f32::NAN; xs.len()];
        gpu.forward_f32(&xs, c.rows, &mut got).unwrap();
        prop_assert!(gpu.fast_tier().is_some(), "the tier failed: {c:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            prop_assert!(g.is_finite(), "call {call}: NaN at {i} for {c:?}");
            prop_assert!(
                (g - w).abs() <= tol * scale,
                "call {call}: {g} vs {w} at {i} for {c:?}"
            );
        }
    }
    // The same bits on a repeated call with the same tier contents (deterministic kernels).
    let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
    gpu.forward_f32(&xs, c.rows, &mut a).unwrap();
    gpu.forward_f32(&xs, c.rows, &mut b).unwrap();
    if c.slots == 0 {
        prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    Ok(())
}

#[test]
fn cuda_tier_equals_the_cpu_tier() {
    let Some(dev) = device("cuda_tier_equals_the_cpu_tier") else {
        return;
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        ..ProptestConfig::default()
    });
    runner.run(&case(), |c| check(&dev, &c)).unwrap();
}

/// The case `cuda_tier_equals_the_cpu_tier` failed on in the first GPU run (an H200), shrunk:
/// call 1 (the first with cached neurons on the GPU) gave 0.10995079 against the CPU's
/// 0.09082807 at output 192 (row 6). Neuron 2's pre-activation in row 6 is 0.2376758 (exact),
/// 0.2385607 on the CPU (8-bit input: kept) and 0.2376641 on the device (f16 rows: dropped),
/// either side of the threshold 0.23772301: a tie at the cutoff, which [`untied`] now moves off.
fn h200_case() -> Case {
    Case {
        hidden: 32,
        inter: 105,
        rows: 9,
        act: Activation::Relu,
        gated: false,
        dtype: WeightDType::Q4_1,
        hot_frac: 0.0,
        active_frac: 0.0,
        rule: Some(0.237_723_01),
        slots: 4,
        seed: 3_856_872_144_595_962_634,
    }
}

/// The H200 case, deterministically (its threshold moved off the tie by `check`).
#[test]
fn cuda_h200_threshold_tie_case() {
    let Some(dev) = device("cuda_h200_threshold_tie_case") else {
        return;
    };
    check(&dev, &h200_case()).unwrap();
}

/// Each (row, neuron) rule score as the CPU tier's reference computes it (quantized storage:
/// the integer dot of the GGUF row against the 8-bit input, `naive_row`; float storage: an f32
/// dot) and as the device's arithmetic does (f16 rows for quantized storage, f32 dots), in
/// `score_ranges`' order.
fn reference_scores(c: &Case, d: &Data) -> Vec<[f32; 2]> {
    use candle_core::quantized::{GgmlDType, QTensor};
    let b = NeuronBundles::from_weights(d.spec, d.w.view(), c.dtype).unwrap();
    let (gate, up, _) = b.to_dense_f32().unwrap();
    let (gate, up) = (gate.map(|g| flat(&g)), flat(&up));
    let h = c.hidden;
    // Quantized storage: the block type, and the GGUF rows `from_weights` stored (gate, up).
    let kind = match c.dtype {
        WeightDType::Q4_0 => Some(GgmlDType::Q4_0),
        WeightDType::Q4_1 => Some(GgmlDType::Q4_1),
        WeightDType::Q8_0 => Some(GgmlDType::Q8_0),
        _ => None,
    };
    let gguf = |t: &candle_core::Tensor| {
        kind.map(|k| {
            QTensor::quantize(t, k)
                .unwrap()
                .data()
                .unwrap()
                .into_owned()
        })
    };
    let (gate_q, up_q) = (d.w.gate.as_ref().and_then(gguf), gguf(&d.w.up));
    let rb = c.dtype.row_bytes(h);
    let score = |g: Option<f32>, u: f32| match g {
        _ if c.act.exact_zeros() => c.act.apply(g.unwrap_or(u)),
        Some(g) => c.act.gated(g, u).abs(),
        None => c.act.ungated(u).abs(),
    };
    let mut out = Vec::with_capacity(c.rows * c.inter);
    for x in d.x.chunks_exact(h) {
        let xq = kind.map(|_| quantized(x));
        for i in 0..c.inter {
            let cpu = |w: &[f32], q: &Option<Vec<u8>>| match (kind, q, &xq) {
                (Some(k), Some(q), Some(xq)) => naive_row(k, &q[i * rb..(i + 1) * rb], xq),
                _ => w[i * h..(i + 1) * h]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum(),
            };
            let dev = |w: &[f32]| -> f32 {
                let w = w[i * h..(i + 1) * h].iter();
                match kind {
                    Some(_) => w
                        .zip(x)
                        .map(|(a, b)| half::f16::from_f32(*a).to_f32() * b)
                        .sum(),
                    None => w.zip(x).map(|(a, b)| a * b).sum(),
                }
            };
            let cpu_score = score(gate.as_deref().map(|g| cpu(g, &gate_q)), cpu(&up, &up_q));
            let dev_score = score(gate.as_deref().map(dev), dev(&up));
            out.push([cpu_score, dev_score]);
        }
    }
    out
}

/// The ranges hold both sides' reference scores, and the moved threshold is at least
/// `CLEAR / 2` off every range that can straddle it (and stays put when untied again).
fn check_untied(c: &Case) -> Result<(), TestCaseError> {
    let d = data(c);
    let ranges = score_ranges(c, &d);
    for (k, (&(lo, hi), s)) in ranges.iter().zip(reference_scores(c, &d)).enumerate() {
        for v in s.map(f64::from) {
            prop_assert!(
                lo <= v && v <= hi,
                "score {v} outside [{lo}, {hi}] at row {}, neuron {} for {c:?}",
                k / c.inter,
                k % c.inter
            );
        }
    }
    let u = untied(c);
    let t = f64::from(u.rule.unwrap());
    prop_assert!(t >= 0.0 && t.is_finite());
    for &(lo, hi) in &ranges {
        prop_assert!(
            lo >= hi || t + CLEAR / 2.0 < lo || t - CLEAR / 2.0 > hi,
            "threshold {t} within [{lo}, {hi}] for {u:?}"
        );
    }
    prop_assert_eq!(untied(&u).rule, u.rule);
    Ok(())
}

/// CPU only: the H200 case's threshold lies in the score range of (row 6, neuron 2), where the
/// CPU and the device computed the scores either side of it; `untied` moves it off.
#[test]
fn h200_case_was_a_threshold_tie() {
    let c = h200_case();
    let d = data(&c);
    let t = c.rule.unwrap();
    let (lo, hi) = score_ranges(&c, &d)[6 * c.inter + 2];
    assert!(lo <= f64::from(t) && f64::from(t) < hi, "[{lo}, {hi}]");
    let [cpu, dev] = reference_scores(&c, &d)[6 * c.inter + 2];
    assert!(cpu > t && dev <= t, "{cpu} {dev}");
    assert_ne!(untied(&c).rule, c.rule);
    check_untied(&c).unwrap();
}

/// CPU only: `untied` on random cases with a threshold rule (every storage type and activation).
#[test]
fn threshold_ties_are_moved_off() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    });
    let with_rule = (case(), 0.0..0.5f32).prop_map(|(c, t)| Case { rule: Some(t), ..c });
    runner.run(&with_rule, |c| check_untied(&c)).unwrap();
}

/// Edge shapes: hidden and intermediate of 1, odd sizes, a warp +-1, rows across the
/// kernels' 16-row blocks and at the tier's limit.
#[test]
fn cuda_edge_shapes() {
    let Some(dev) = device("cuda_edge_shapes") else {
        return;
    };
    for &hidden in &[1usize, 31, 32, 33, 257] {
        for &inter in &[1usize, 63, 64, 65] {
            for &rows in &[1usize, 15, 16, 17, 64] {
                let c = Case {
                    hidden,
                    inter,
                    rows,
                    act: Activation::Silu,
                    gated: true,
                    dtype: WeightDType::F16,
                    hot_frac: 0.5,
                    active_frac: 0.7,
                    rule: None,
                    slots: 3,
                    seed: (hidden * 1000 + inter * 10 + rows) as u64,
                };
                check(&dev, &c).unwrap();
            }
        }
    }
}

/// A GPU tier reserves its rows and buffers under the budget, refuses more, and gives the
/// bytes back when dropped; batches above its row limit run on the CPU, exactly.
#[test]
fn cuda_budget_and_limits() {
    let Some(dev) = device("cuda_budget_and_limits") else {
        return;
    };
    let spec = FfnSpec::gated(128, 256, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 1);
    let b = NeuronBundles::from_weights(spec, w.view(), WeightDType::F16).unwrap();
    let hot: Vec<u32> = (0..128).collect();
    let need = CudaTier::neuron_bytes(&b) * 128 + CudaTier::work_bytes(&b, 128);
    let budget = TierBudget::new(need).unwrap();
    let tier = CudaTier::new(&dev, &b, &hot, 0, &budget).unwrap();
    assert_eq!(budget.used(), need);
    let e = CudaTier::new(&dev, &b, &[200], 0, &budget).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Budget { .. }), "{e}");
    drop(tier);
    assert_eq!(budget.used(), 0);
    let mut ffn = HybridFfn::new(b, HybridOptions::default())
        .unwrap()
        .with_placement(LayerPlacement::new(256, hot.clone(), None).unwrap())
        .unwrap();
    let cpu_out = {
        let mut rng = StdRng::seed_from_u64(2);
        let x = tensor(&mut rng, &[powerinfer::tier::CUDA_MAX_ROWS + 1, 128], 1.0);
        (ffn.forward(&x).unwrap(), x)
    };
    ffn.attach_tier(Box::new(
        CudaTier::new(&dev, ffn.bundles(), &hot, 0, &budget).unwrap(),
    ))
    .unwrap();
    let y = ffn.forward(&cpu_out.1).unwrap();
    assert_eq!(
        bits(&y),
        bits(&cpu_out.0),
        "a batch above the limit runs on the CPU"
    );
    assert_eq!(ffn.fast_tier().unwrap().take_counters().calls, 0);
}
