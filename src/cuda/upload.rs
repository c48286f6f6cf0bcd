//! What a layer's neurons look like in device memory, built on the host: float bundles as they
//! are, quantized bundles dequantized to f16 (the kernels read f32, f16 and bf16 rows).

use half::{bf16, f16};

use crate::cpu::{dequantize_split_row, BundleData, BundleLayout, QuantKind};
use crate::error::Result;
use crate::ffn::{FfnSpec, NeuronBundles};

/// The element type of a layer's rows on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceDType {
    F32,
    F16,
    BF16,
}

impl DeviceDType {
    /// The device type for `bundles`: its own for float storage, f16 for quantized storage.
    pub fn of(bundles: &NeuronBundles) -> Self {
        match bundles.data {
            BundleData::F32(_) => DeviceDType::F32,
            BundleData::BF16(_) => DeviceDType::BF16,
            BundleData::F16(_) | BundleData::Quant { .. } => DeviceDType::F16,
        }
    }

    pub fn size(self) -> usize {
        match self {
            DeviceDType::F32 => 4,
            DeviceDType::F16 | DeviceDType::BF16 => 2,
        }
    }

    /// The names of the `gate_up` and `down` kernels for rows of this type.
    pub fn kernels(self) -> [&'static str; 2] {
        match self {
            DeviceDType::F32 => ["gate_up_f32", "down_f32"],
            DeviceDType::F16 => ["gate_up_f16", "down_f16"],
            DeviceDType::BF16 => ["gate_up_bf16", "down_bf16"],
        }
    }
}

/// Rows of some neurons in the device's element type, bundle after bundle.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HostRows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// Elements of one neuron's bundle on the device: gate (if gated), up and down rows.
pub(crate) fn stride(bundles: &NeuronBundles) -> usize {
    bundles.spec().rows_per_neuron() * bundles.spec().hidden
}

/// Bytes one neuron takes on the device: its rows plus its gate and up biases (always stored,
/// zero where the layer has none).
pub(crate) fn neuron_bytes(bundles: &NeuronBundles) -> u64 {
    (stride(bundles) * DeviceDType::of(bundles).size() + 8) as u64
}

/// The rows of `neurons` (in order) as the device stores them.
/// Out-of-range indices are `select`'s typed error.
pub(crate) fn rows(bundles: &NeuronBundles, neurons: &[u32]) -> Result<HostRows> {
    if neurons.is_empty() {
        return Ok(match DeviceDType::of(bundles) {
            DeviceDType::F32 => HostRows::F32(Vec::new()),
            DeviceDType::F16 => HostRows::F16(Vec::new()),
            DeviceDType::BF16 => HostRows::BF16(Vec::new()),
        });
    }
    let picked = bundles.select(neurons)?;
    let (spec, dtype) = (*picked.spec(), picked.dtype());
    Ok(match picked.data {
        BundleData::F32(v) => HostRows::F32(v),
        BundleData::F16(v) => HostRows::F16(v),
        BundleData::BF16(v) => HostRows::BF16(v),
        BundleData::Quant { kind, bytes } => {
            HostRows::F16(dequantized(&spec, spec.layout(dtype), kind, &bytes))
        }
    })
}

/// Quantized bundles (gate/up rows of `kind`, the down row in Q8_0, split layout, `lay` apart)
/// as f16 rows.
fn dequantized(spec: &FfnSpec, lay: BundleLayout, kind: QuantKind, bytes: &[u8]) -> Vec<f16> {
    let h = spec.hidden;
    let count = bytes.len() / lay.stride();
    let mut out = Vec::with_capacity(count * spec.rows_per_neuron() * h);
    let mut row = vec![0f32; h];
    for k in 0..count {
        let bundle = &bytes[lay.bundle(k)];
        let mut parts: Vec<(QuantKind, &[u8])> = Vec::with_capacity(3);
        if spec.gated {
            parts.push((kind, &bundle[..lay.row]));
        }
        parts.push((kind, &bundle[lay.up_at()..lay.up_at() + lay.row]));
        parts.push((QuantKind::Q8_0, &bundle[lay.down_at()..]));
        for (q, r) in parts {
            dequantize_split_row(q, r, &mut row);
            out.extend(row.iter().map(|&v| f16::from_f32(v)));
        }
    }
    out
}

/// Gate and up biases of `neurons` (zeros where the layer has none).
pub(crate) fn biases(bundles: &NeuronBundles, neurons: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let pick = |b: &Option<Vec<f32>>| -> Vec<f32> {
        neurons
            .iter()
            .map(|&i| b.as_ref().map_or(0.0, |b| b[i as usize]))
            .collect()
    };
    (pick(&bundles.gate_bias), pick(&bundles.up_bias))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Activation, WeightDType};
    use candle_core::{Device, Tensor};

    /// Device rows hold each neuron's gate, up and down rows as `to_dense_f32` gives them
    /// (exactly for float storage, to f16 rounding for quantized storage).
    #[test]
    fn rows_are_the_bundles_rows() {
        let spec = FfnSpec::gated(64, 10, Activation::Silu).unwrap();
        let t = |r: usize, c: usize, s: f32| {
            let v: Vec<f32> = (0..r * c)
                .map(|i| ((i * 7919 % 113) as f32 / 56.0 - 1.0) * s)
                .collect();
            Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()
        };
        let (g, u, d) = (t(10, 64, 1.0), t(10, 64, 0.5), t(64, 10, 0.25));
        for dtype in [
            WeightDType::F32,
            WeightDType::BF16,
            WeightDType::Q4_1,
            WeightDType::Q8_0,
        ] {
            let w = crate::FfnWeights::gated(&g, &u, &d);
            let b = NeuronBundles::from_weights(spec, w, dtype).unwrap();
            let (gd, ud, dd) = b.to_dense_f32().unwrap();
            let (gd, ud) = (
                gd.unwrap().to_vec2::<f32>().unwrap(),
                ud.to_vec2::<f32>().unwrap(),
            );
            let dd = dd.t().unwrap().to_vec2::<f32>().unwrap();
            let neurons = [7u32, 2, 9];
            let got: Vec<f32> = match rows(&b, &neurons).unwrap() {
                HostRows::F32(v) => v,
                HostRows::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
                HostRows::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            };
            assert_eq!(got.len(), 3 * stride(&b));
            for (k, &i) in neurons.iter().enumerate() {
                let i = i as usize;
                let want: Vec<f32> = [&gd[i], &ud[i], &dd[i]]
                    .into_iter()
                    .flatten()
                    .copied()
                    .collect();
                for (a, w) in got[k * stride(&b)..(k + 1) * stride(&b)].iter().zip(&want) {
                    assert!(
                        (a - w).abs() <= 1e-3 * w.abs().max(1e-2),
                        "{dtype:?}: {a} vs {w}"
                    );
                }
            }
        }
        let b = NeuronBundles::from_weights(
            spec,
            crate::FfnWeights::gated(&g, &u, &d),
            WeightDType::F16,
        )
        .unwrap();
        assert!(rows(&b, &[10]).is_err());
        assert_eq!(biases(&b, &[1, 2]), (vec![0.0; 2], vec![0.0; 2]));
        assert_eq!(neuron_bytes(&b), (3 * 64 * 2 + 8) as u64);
    }
}
