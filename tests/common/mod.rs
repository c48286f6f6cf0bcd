//! Shared test helpers: seeded weights, the masked dense reference, tolerant comparison.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use powerinfer::cpu::QuantizedRow;
use powerinfer::{dense_reference, Activation, FfnSpec, FfnWeights, NeuronBundles, WeightDType};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub const ACTIVATIONS: [Activation; 5] = [
    Activation::Relu,
    Activation::DRelu,
    Activation::Silu,
    Activation::Gelu,
    Activation::GeluTanh,
];
pub const DTYPES: [WeightDType; 3] = [WeightDType::F32, WeightDType::F16, WeightDType::BF16];

/// Uniform values in `[-scale, scale)` from a seed.
pub fn values(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

pub fn tensor(rng: &mut StdRng, dims: &[usize], scale: f32) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(rng, n, scale), dims, &Device::Cpu).unwrap()
}

/// Weights of a random FFN in the usual `[out, in]` layout (f32).
pub struct Weights {
    pub gate: Option<Tensor>,
    pub up: Tensor,
    pub down: Tensor,
}

impl Weights {
    pub fn random(spec: &FfnSpec, seed: u64) -> Weights {
        let mut rng = StdRng::seed_from_u64(seed);
        let (h, n) = (spec.hidden(), spec.intermediate());
        let s = 1.0 / (h as f32).sqrt();
        Weights {
            gate: spec.is_gated().then(|| tensor(&mut rng, &[n, h], s)),
            up: tensor(&mut rng, &[n, h], s),
            down: tensor(&mut rng, &[h, n], 1.0 / (n as f32).sqrt()),
        }
    }

    pub fn view(&self) -> FfnWeights<'_> {
        match &self.gate {
            Some(g) => FfnWeights::gated(g, &self.up, &self.down),
            None => FfnWeights::ungated(&self.up, &self.down),
        }
    }
}

/// Dense FFN with per-row neuron masks (`mask[r][i]` false removes neuron i from row r), written
/// with candle ops in f32 on the exact stored weights.
pub fn masked_reference(
    x: &Tensor,
    spec: &FfnSpec,
    b: &NeuronBundles,
    mask: Option<&[Vec<bool>]>,
) -> Tensor {
    let (gate, up, down) = b.to_dense_f32().unwrap();
    let x = x.to_dtype(DType::F32).unwrap();
    let rows = x.elem_count() / spec.hidden();
    let x2 = x.reshape((rows, spec.hidden())).unwrap();
    let u = x2.matmul(&up.t().unwrap()).unwrap();
    let h = match &gate {
        Some(g) => {
            let g = x2.matmul(&g.t().unwrap()).unwrap();
            match spec.activation() {
                Activation::DRelu => (g.relu().unwrap() * u.relu().unwrap()).unwrap(),
                a => (g.apply(&a.to_candle()).unwrap() * u).unwrap(),
            }
        }
        None => u.apply(&spec.activation().to_candle()).unwrap(),
    };
    let h = match mask {
        Some(m) => {
            let flat: Vec<f32> = m
                .iter()
                .flat_map(|r| r.iter().map(|&b| if b { 1.0 } else { 0.0 }))
                .collect();
            let m = Tensor::from_vec(flat, (rows, spec.intermediate()), &Device::Cpu).unwrap();
            (h * m).unwrap()
        }
        None => h,
    };
    h.matmul(&down.t().unwrap())
        .unwrap()
        .reshape(x.dims())
        .unwrap()
}

/// The plain dense reference on the stored weights (for unmasked comparisons).
pub fn dense(x: &Tensor, spec: &FfnSpec, b: &NeuronBundles) -> Tensor {
    let (gate, up, down) = b.to_dense_f32().unwrap();
    let w = match &gate {
        Some(g) => FfnWeights::gated(g, &up, &down),
        None => FfnWeights::ungated(&up, &down),
    };
    dense_reference(&x.to_dtype(DType::F32).unwrap(), spec, w).unwrap()
}

/// All elements as f32, flattened.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// All elements' f32 bit patterns, for bit-exact comparisons.
pub fn bits(t: &Tensor) -> Vec<u32> {
    flat(t).iter().map(|v| v.to_bits()).collect()
}

/// Max |a - b| relative to max |b| (with a floor so all-zero references compare absolutely).
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// The weights are used exactly as stored, so only the input/output dtype sets the tolerance.
pub fn tolerance(input: DType) -> f32 {
    if input == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

pub fn h16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Row `r` of GGUF blocks dotted with `x`, from the block layout: the exact integer sum per block,
/// then ggml's scaling in ggml's order (Q4_1 not fused; Q4_0/Q8_0 one fused multiply-add).
pub fn naive_row(
    kind: candle_core::quantized::GgmlDType,
    row: &[u8],
    x: &powerinfer::cpu::QuantizedRow,
) -> f32 {
    let bb = match kind {
        candle_core::quantized::GgmlDType::Q4_0 => 18,
        candle_core::quantized::GgmlDType::Q4_1 => 20,
        _ => 34,
    };
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        let xq = &x.values()[32 * b..32 * (b + 1)];
        let (dx, _, s) = x.block(b).unwrap();
        let d = h16(blk);
        let w: Vec<i32> = match kind {
            candle_core::quantized::GgmlDType::Q8_0 => {
                blk[2..].iter().map(|&v| v as i8 as i32).collect()
            }
            _ => {
                let qs = if kind == candle_core::quantized::GgmlDType::Q4_1 {
                    &blk[4..]
                } else {
                    &blk[2..]
                };
                let off = if kind == candle_core::quantized::GgmlDType::Q4_0 {
                    8
                } else {
                    0
                };
                (0..32)
                    .map(|j| if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 } as i32 - off)
                    .collect()
            }
        };
        let sum: i32 = w.iter().zip(xq).map(|(a, b)| a * *b as i32).sum();
        acc = match kind {
            candle_core::quantized::GgmlDType::Q4_1 => {
                acc + ((sum as f32 * d) * dx + h16(&blk[2..]) * s)
            }
            _ => (sum as f32).mul_add(d * dx, acc),
        };
    }
    acc
}

/// `x` with the entries whose score `|x_i|` (times `w[i]` when given) is at most `t` set to 0.
pub fn mask(x: &[f32], w: Option<&[f32]>, t: f32) -> Vec<f32> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let s = v.abs() * w.map_or(1.0, |w| w[i]);
            if s > t {
                v
            } else {
                0.0
            }
        })
        .collect()
}

/// Every block type the dense decoder runs.
pub const KINDS: [candle_core::quantized::GgmlDType; 8] = {
    use candle_core::quantized::GgmlDType::*;
    [Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4K, Q5K, Q6K]
};

/// `x` quantized as the kernels quantize an input row.
pub fn quantized(x: &[f32]) -> QuantizedRow {
    let mut q = QuantizedRow::default();
    q.quantize(x);
    q
}

/// `x` quantized as `l` takes its input (any block type).
pub fn quantized_for(l: &powerinfer::layers::QLinear, x: &[f32]) -> QuantizedRow {
    let mut q = QuantizedRow::default();
    q.quantize_for(x, l.inputs());
    q
}

/// `rows` rows of `cols` weights: random bytes, f16 fields finite in `[-scale, scale)`.
pub fn random_rows(
    kind: powerinfer::cpu::BlockKind,
    rows: usize,
    cols: usize,
    rng: &mut StdRng,
) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * kind.row_bytes(cols))
        .map(|_| rng.random())
        .collect();
    let scale = 1.0 / (cols as f32).sqrt();
    for blk in w.chunks_exact_mut(kind.block_bytes()) {
        for &at in kind.half_offsets() {
            let v = half::f16::from_f32(rng.random_range(-scale..scale));
            blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    w
}
