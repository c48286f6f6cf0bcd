//! The input-sparse FFN split by neuron (`InputSparseFfn::from_qtensors_split`): the hot
//! neurons on a candle device (here `Device::Cpu`, the reference the GPU is checked against),
//! the cold ones on the CPU under the rule. Oracles: the output is, bit for bit, the CPU's part
//! (the dense `QLinear` products over the cold rows on the masked input, and over `h` with the
//! hot neurons 0, masked) plus the device's part alone; the device's part is the dense FFN over
//! the hot neurons, written out in f64 on the file's dequantized weights, within 8-bit input
//! quantization and down's hot columns quantized again. Over random block types, shapes, hot sets, thresholds,
//! layouts, activations and thread counts, plus edge shapes and bad input.

mod common;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;
use common::*;
use powerinfer::layers::QLinear;
use powerinfer::layout::Layout;
use powerinfer::tier::{hot_count, hot_neuron_bytes, hot_neurons, HotNeurons, HOT_GROUP};
use powerinfer::{Activation, FfnSpec, InputScore, InputSparseFfn, InputThresholds};
use proptest::prelude::*;
use rand::{rngs::StdRng, seq::index::sample, SeedableRng};

struct Case {
    spec: FfnSpec,
    q: [QTensor; 3],
    w: [Vec<f32>; 3],
}

impl Case {
    fn new(dt: GgmlDType, h: usize, n: usize, act: Activation, seed: u64) -> Case {
        let spec = FfnSpec::gated(h, n, act).unwrap();
        let w = Weights::random(&spec, seed);
        let q =
            [w.gate.as_ref().unwrap(), &w.up, &w.down].map(|t| QTensor::quantize(t, dt).unwrap());
        let w = [0, 1, 2].map(|i| flat(&q[i].dequantize(&Device::Cpu).unwrap()));
        Case { spec, q, w }
    }

    fn split(&self, hot: &[u32], threads: usize, layouts: [Layout; 3]) -> InputSparseFfn {
        let [g, u, d] = &self.q;
        InputSparseFfn::from_qtensors_split(
            self.spec,
            Some(g),
            u,
            d,
            threads,
            None,
            layouts,
            hot,
            &Device::Cpu,
        )
        .unwrap()
    }

    /// The oracle for one row.
    fn reference(&self, x: &[f32], hot: &[u32], t: InputThresholds) -> Vec<f64> {
        let (h, n) = (self.spec.hidden(), self.spec.intermediate());
        let act = self.spec.activation();
        let dot = |w: &[f32], r: usize, x: &[f32]| -> f64 {
            (0..h)
                .map(|i| f64::from(w[r * h + i]) * f64::from(x[i]))
                .sum()
        };
        let (xg, xu) = (mask(x, None, t.gate), mask(x, None, t.up));
        let mut hv = vec![0f64; n];
        for (j, v) in hv.iter_mut().enumerate() {
            let is_hot = hot.binary_search(&(j as u32)).is_ok();
            let (xg, xu) = if is_hot { (x, x) } else { (&xg[..], &xu[..]) };
            let g = dot(&self.w[0], j, xg) as f32;
            let u = dot(&self.w[1], j, xu) as f32;
            let a = f64::from(act.gated(g, u));
            *v = if is_hot || a.abs() > f64::from(t.down) {
                a
            } else {
                0.0
            };
        }
        (0..h)
            .map(|i| {
                (0..n)
                    .map(|j| f64::from(self.w[2][i * n + j]) * hv[j])
                    .sum()
            })
            .collect()
    }
}

/// A dense product over the rows `ids` of `t` (none when empty).
fn cold_rows(t: &QTensor, ids: &[u32]) -> Option<QLinear> {
    if ids.is_empty() {
        return None;
    }
    let (_, cols) = t.shape().dims2().unwrap();
    let rb = cols / t.dtype().block_size() * t.dtype().type_size();
    let data = t.data().unwrap();
    let rows: Vec<u8> = ids
        .iter()
        .flat_map(|&j| data[j as usize * rb..(j as usize + 1) * rb].iter().copied())
        .collect();
    let q = qtensor_from_ggml(t.dtype(), &rows, vec![ids.len(), cols], &Device::Cpu).unwrap();
    Some(QLinear::new(&q, None, 1).unwrap())
}

/// The largest difference from `want` over the largest `|want|`.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((f64::from(g) - w).abs()));
    diff / scale
}

/// `count` random neurons of `n`, increasing.
fn random_hot(rng: &mut StdRng, n: usize, count: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = sample(rng, n, count)
        .into_iter()
        .map(|j| j as u32)
        .collect();
    ids.sort_unstable();
    ids
}

const TYPES: [GgmlDType; 4] = [
    GgmlDType::Q4_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// Within input quantization (the CPU's and candle's, 8 bits a value) and down's hot columns
/// quantized again as Q8_0: a neuron sent to the wrong side, or lost, moves the output by far
/// more (each is about 1/sqrt(n) of it).
const TOL: f64 = 0.03;

#[allow(clippy::too_many_arguments)]
fn check(
    dt: GgmlDType,
    hb: usize,
    groups: usize,
    hot_groups: usize,
    act: Activation,
    t: [f32; 3],
    threads: usize,
    layout_mask: usize,
    rows: usize,
    seed: u64,
) {
    // Down's rows are whole blocks of neurons.
    let (h, n) = (
        dt.block_size() * hb,
        dt.block_size().max(HOT_GROUP) * groups,
    );
    let case = Case::new(dt, h, n, act, seed);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let hot = random_hot(&mut rng, n, (HOT_GROUP * hot_groups).min(n));
    let layouts = [0, 1, 2].map(|i| match layout_mask >> i & 1 {
        0 => Layout::Columns,
        _ => Layout::Rows,
    });
    let mut f = case.split(&hot, threads, layouts);
    let th = InputThresholds {
        gate: t[0],
        up: t[1],
        down: t[2],
    };
    // Rows ignore their thresholds.
    let kept = |i: usize| {
        if layouts[i] == Layout::Rows {
            0.0
        } else {
            t[i]
        }
    };
    let eff = InputThresholds {
        gate: kept(0),
        up: kept(1),
        down: kept(2),
    };
    f.set_rule(InputScore::Magnitude, th).unwrap();
    assert_eq!(f.layouts(), layouts);
    assert_eq!(f.hot().unwrap().ids(), &hot[..]);
    assert!(f.dense_rows().is_none());
    let x = flat(&tensor(&mut rng, &[rows, h], 1.0));
    let mut out = vec![f32::NAN; rows * h];
    f.forward_f32(&x, rows, &mut out).unwrap();
    // The device's part alone (the same code on the same device: the same bits).
    let [g, u, d] = &case.q;
    let alone = HotNeurons::new(&case.spec, Some(g), u, d, &hot, &Device::Cpu).unwrap();
    let mut hot_out = vec![0f32; rows * h];
    alone
        .finish(alone.launch(&x, rows).unwrap(), &mut hot_out)
        .unwrap();
    // The CPU's part: the dense QLinear products over the cold rows of gate and up on the
    // masked input, `h` scattered over every neuron (the hot ones 0), the dense down product
    // over it masked; the split's column kernels give these bits.
    let cold: Vec<u32> = (0..n as u32)
        .filter(|j| hot.binary_search(j).is_err())
        .collect();
    let (gl, ul) = (cold_rows(g, &cold), cold_rows(u, &cold));
    let dl = QLinear::new(d, None, 1).unwrap();
    let nc = cold.len();
    let (mut gv, mut uv, mut y) = (vec![0f32; nc], vec![0f32; nc], vec![0f32; h]);
    for (r, xr) in x.chunks(h).enumerate() {
        let mut hv = vec![0f32; n];
        if nc > 0 {
            let (gl, ul) = (gl.as_ref().unwrap(), ul.as_ref().unwrap());
            let xg = quantized_for(gl, &mask(xr, None, eff.gate));
            let xu = quantized_for(ul, &mask(xr, None, eff.up));
            gl.forward_quantized(&[xg], &mut gv, &mut Vec::new())
                .unwrap();
            ul.forward_quantized(&[xu], &mut uv, &mut Vec::new())
                .unwrap();
            for (k, &j) in cold.iter().enumerate() {
                hv[j as usize] = act.gated(gv[k], uv[k]);
            }
            let hq = quantized_for(&dl, &mask(&hv, None, eff.down));
            dl.forward_quantized(&[hq], &mut y, &mut Vec::new())
                .unwrap();
        } else {
            y.fill(0.0);
        }
        let want: Vec<u32> = y
            .iter()
            .zip(&hot_out[r * h..(r + 1) * h])
            .map(|(&c, &v)| (c + v).to_bits())
            .collect();
        let got: Vec<u32> = out[r * h..(r + 1) * h]
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(
            got,
            want,
            "{dt:?} {h}x{n}, {} hot, {act:?}, {t:?}, {threads} threads, {layouts:?}, row {r} of \
             {rows}: not the cold part plus the hot part",
            hot.len()
        );
        // The hot part is the dense FFN over the hot neurons.
        let cold_off = InputThresholds {
            gate: 0.0,
            up: 0.0,
            down: f32::MAX,
        };
        let e = rel(
            &hot_out[r * h..(r + 1) * h],
            &case.reference(xr, &hot, cold_off),
        );
        assert!(
            e < TOL,
            "{dt:?} {h}x{n}, {} hot, {act:?}: hot part {e}",
            hot.len()
        );
    }
    // A prompt's rows are each row alone.
    if rows > 1 {
        let mut one = vec![0f32; h];
        for (xr, o) in x.chunks(h).zip(out.chunks(h)) {
            f.forward_f32(xr, 1, &mut one).unwrap();
            let d = o
                .iter()
                .zip(&one)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let s = one.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            assert!(
                d <= 1e-5 * s,
                "{dt:?} {h}x{n}: a prompt row differs from itself alone by {d}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn split_is_hot_dense_plus_cold_sparse(
        kind in 0..TYPES.len(),
        hb in 1usize..3,
        groups in 1usize..4,
        hot_groups in 1usize..12,
        gelu in any::<bool>(),
        t in prop::array::uniform3(prop_oneof![Just(0.0f32), 0.0f32..0.8]),
        threads in 1usize..4,
        mask in 0usize..8,
        rows in 1usize..4,
        seed in any::<u64>(),
    ) {
        let act = if gelu { Activation::GeluTanh } else { Activation::Silu };
        check(TYPES[kind], hb, groups, hot_groups, act, t, threads, mask, rows, seed);
    }
}

#[test]
fn edge_shapes() {
    // One group hot of one; every neuron hot (down is the file's, nothing on the CPU); one hot
    // group of many; SIMD widths +-1 are not possible for the neuron count (whole groups), so
    // the hidden size takes the odd block counts.
    for (dt, hb, groups, hot) in [
        (GgmlDType::Q8_0, 1, 1, 1),
        (GgmlDType::Q4_0, 3, 2, 2),
        (GgmlDType::Q4K, 1, 1, 8),
        (GgmlDType::Q4K, 1, 2, 1),
        (GgmlDType::Q6K, 2, 1, 7),
        (GgmlDType::Q8_0, 15, 3, 1),
        (GgmlDType::Q8_0, 17, 3, 2),
    ] {
        for t in [[0.0; 3], [0.3, 0.3, 0.1]] {
            check(dt, hb, groups, hot, Activation::Silu, t, 2, 0, 2, 7);
        }
    }
    // Every neuron hot, a count that is not whole groups (down's blocks run along its rows, so
    // Q4_0/Q8_0 take any multiple of 32 only; 16-neuron odd counts need a float file): the CPU
    // holds nothing.
    let case = Case::new(GgmlDType::Q8_0, 32, 32, Activation::Silu, 3);
    let all: Vec<u32> = (0..32).collect();
    let f = case.split(&all, 1, [Layout::Columns; 3]);
    let x = flat(&tensor(&mut StdRng::seed_from_u64(1), &[1, 32], 1.0));
    let mut out = vec![0f32; 32];
    f.forward_f32(&x, 1, &mut out).unwrap();
    let e = rel(&out, &case.reference(&x, &all, InputThresholds::default()));
    assert!(e < TOL, "all hot: {e}");
}

#[test]
fn bad_hot_sets_are_typed_errors() {
    let case = Case::new(GgmlDType::Q8_0, 64, 96, Activation::Silu, 5);
    let [g, u, d] = &case.q;
    let build = |hot: &[u32]| {
        InputSparseFfn::from_qtensors_split(
            case.spec,
            Some(g),
            u,
            d,
            1,
            None,
            [Layout::Columns; 3],
            hot,
            &Device::Cpu,
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    let group: Vec<u32> = (0..32).collect();
    let mut unsorted = group.clone();
    unsorted.swap(0, 1);
    let mut out_of_range = group.clone();
    out_of_range[31] = 96;
    for (hot, says) in [
        (&[][..], "nonzero multiple of 32"),
        (&group[..31], "31 of 96"),
        (&unsorted[..], "strictly increasing"),
        (&out_of_range[..], "neuron 96 of 96"),
    ] {
        let e = build(hot);
        assert!(e.contains(says), "{e}");
    }
    // A wrong shape names the tensor.
    let spec = FfnSpec::gated(64, 128, Activation::Silu).unwrap();
    let e = HotNeurons::new(&spec, Some(g), u, d, &group, &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("up_proj.weight"), "{e}");
    // NaN in the input is refused, not computed.
    let f = case.split(&group, 1, [Layout::Columns; 3]);
    let mut x = vec![0.5f32; 64];
    x[3] = f32::NAN;
    assert!(f.forward_f32(&x, 1, &mut vec![0.0; 64]).is_err());
}

#[test]
fn hot_neurons_are_the_largest_and_counts_fit_the_budget() {
    let h_abs = [0.5, 3.0, 0.0, 3.0, 1.0];
    assert_eq!(hot_neurons(&h_abs, 2), vec![1, 3]);
    assert_eq!(hot_neurons(&h_abs, 3), vec![1, 3, 4]);
    assert_eq!(hot_neurons(&h_abs, 9), vec![0, 1, 2, 3, 4]);
    assert!(hot_neurons(&h_abs, 0).is_empty());
    // A 4096-wide layer of 11008 neurons with 2304-byte Q4_K rows: 9 KiB a hot neuron.
    let per = hot_neuron_bytes(2304, 4096);
    assert_eq!(per, 2 * 2304 + 4096 / 32 * 34);
    let file = 3 * 11008 * 2304;
    assert_eq!(hot_count(0, 11008, 4096, 2304, file), 0);
    assert_eq!(hot_count(per as u64 * 33, 11008, 4096, 2304, file), 32);
    assert_eq!(hot_count(file as u64, 11008, 4096, 2304, file), 11008);
    let c = hot_count(file as u64 - 1, 11008, 4096, 2304, file);
    assert!(
        c % HOT_GROUP == 0 && c < 11008 && c as u64 * per as u64 <= file as u64,
        "{c}"
    );
    // The budget's neurons go to the device: their output is the hot part alone.
    let case = Case::new(GgmlDType::Q4K, 256, 256, Activation::Silu, 9);
    let [g, u, d] = &case.q;
    let hot: Vec<u32> = (16..48).collect();
    let t = HotNeurons::new(&case.spec, Some(g), u, d, &hot, &Device::Cpu).unwrap();
    assert_eq!(t.bytes(), 2 * 32 * 144 + 256 * 34);
    let x = flat(&tensor(&mut StdRng::seed_from_u64(2), &[1, 256], 1.0));
    let mut out = vec![0f32; 256];
    t.finish(t.launch(&x, 1).unwrap(), &mut out).unwrap();
    // The reference with every cold neuron dropped (a down threshold no `h` passes).
    let cold_off = InputThresholds {
        gate: 0.0,
        up: 0.0,
        down: f32::MAX,
    };
    let e = rel(&out, &case.reference(&x, &hot, cold_off));
    assert!(e < TOL, "{e}");
}
