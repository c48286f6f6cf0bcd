//! FFN description, neuron-major weight bundles, and the dense reference forward.
//!
//! Owns the one conversion from the usual `[out, in]` linear weights to the neuron-major layout in
//! which a sparse step reads only the bytes it uses: for neuron `i`, the gate row, the up row and
//! the down column (row `i` of `down^T`) sit next to each other. It must not compute anything on the
//! hot path; kernels live in `cpu`.

use candle_core::{DType, Tensor, WithDType};
use half::{bf16, f16};

use crate::activation::Activation;
use crate::cpu::{
    dequantize_row, dequantize_split_row, quantize_row_q8_0, split_row, BundleData, BundleLayout,
    BundleView, QuantKind, QK,
};
use crate::error::{Error, ErrorKind, Result};

mod dtype;

pub use dtype::WeightDType;

/// Shape and kind of one FFN block. Built only through its checking constructors, so every
/// value holds: both sizes at least 1, dReLU only gated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FfnSpec {
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    pub(crate) activation: Activation,
    pub(crate) gated: bool,
}

impl FfnSpec {
    /// Model (hidden) size: the length of the input and output rows.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Number of FFN neurons (intermediate size).
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// `down(act(gate x) * up x)` when true, `down(act(up x))` when false.
    pub fn is_gated(&self) -> bool {
        self.gated
    }

    /// A gated FFN, `down(act(gate x) * up x)` (Llama, Mistral, Qwen, SmolLM), checked: both
    /// sizes at least 1.
    pub fn gated(hidden: usize, intermediate: usize, activation: Activation) -> Result<Self> {
        Self::new(hidden, intermediate, activation, true)
    }

    /// An ungated FFN, `down(act(up x))` (OPT, Falcon), checked: both sizes at least 1, no dReLU.
    pub fn ungated(hidden: usize, intermediate: usize, activation: Activation) -> Result<Self> {
        Self::new(hidden, intermediate, activation, false)
    }

    /// A checked spec whose gating is data (e.g. read from a file): both sizes at least 1,
    /// dReLU only gated. Prefer [`FfnSpec::gated`] / [`FfnSpec::ungated`] in code.
    pub fn new(
        hidden: usize,
        intermediate: usize,
        activation: Activation,
        gated: bool,
    ) -> Result<Self> {
        if hidden == 0 {
            return Err(Error::config("hidden", "must be at least 1"));
        }
        if intermediate == 0 {
            return Err(Error::config("intermediate", "must be at least 1"));
        }
        if activation == Activation::DRelu && !gated {
            return Err(Error::config("activation", "dReLU needs a gated FFN"));
        }
        Ok(FfnSpec {
            hidden,
            intermediate,
            activation,
            gated,
        })
    }

    /// Rows stored per neuron: gate, up, down (3) or up, down (2).
    pub fn rows_per_neuron(&self) -> usize {
        if self.gated {
            3
        } else {
            2
        }
    }

    /// Bytes of one neuron's weights in `dtype` (what placing it in a tier costs). Quantized
    /// storage keeps gate and up rows in `dtype` and the down row in Q8_0.
    pub fn neuron_bytes(&self, dtype: WeightDType) -> usize {
        let elem = match dtype {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::BF16 => 2,
            _ => 1,
        };
        self.layout(dtype).stride() * elem
    }

    /// Where each row of a neuron's bundle lies in `dtype` storage.
    pub(crate) fn layout(&self, dtype: WeightDType) -> BundleLayout {
        BundleLayout::new(self.hidden, self.gated, dtype.quant())
    }
}

/// The FFN weights of one layer, neuron-major: neuron `i` owns the contiguous slice
/// `[gate_i | up_i | down^T_i]` (or `[up_i | down^T_i]` ungated), each `hidden` long.
///
/// Built once at load; the `[out, in]` source tensors can be dropped afterwards, so the weights are
/// held once.
#[derive(Debug, Clone)]
pub struct NeuronBundles {
    spec: FfnSpec,
    pub(crate) data: BundleData,
    /// Per-neuron gate bias (gated FFNs with biases).
    pub(crate) gate_bias: Option<Vec<f32>>,
    /// Per-neuron up (or `fc1`) bias.
    pub(crate) up_bias: Option<Vec<f32>>,
    /// Output (down or `fc2`) bias, `hidden` long.
    pub(crate) down_bias: Option<Vec<f32>>,
}

/// The source tensors of one FFN in the usual linear layout (`weight` is `[out, in]`).
#[derive(Debug, Clone, Copy)]
pub struct FfnWeights<'a> {
    /// `[intermediate, hidden]`; `None` for ungated FFNs.
    pub gate: Option<&'a Tensor>,
    /// `[intermediate, hidden]` (`fc1` for ungated models).
    pub up: &'a Tensor,
    /// `[hidden, intermediate]` (`fc2` for ungated models).
    pub down: &'a Tensor,
    /// `[intermediate]`.
    pub gate_bias: Option<&'a Tensor>,
    /// `[intermediate]`.
    pub up_bias: Option<&'a Tensor>,
    /// `[hidden]`.
    pub down_bias: Option<&'a Tensor>,
}

impl<'a> FfnWeights<'a> {
    /// Gated weights without biases (Llama, Mistral, Qwen, SmolLM).
    pub fn gated(gate: &'a Tensor, up: &'a Tensor, down: &'a Tensor) -> Self {
        FfnWeights {
            gate: Some(gate),
            up,
            down,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
        }
    }

    /// Ungated weights without biases: `fc1` is `up`, `fc2` is `down`.
    pub fn ungated(fc1: &'a Tensor, fc2: &'a Tensor) -> Self {
        FfnWeights {
            gate: None,
            up: fc1,
            down: fc2,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
        }
    }
}

fn check_shape(t: &Tensor, name: &str, expected: &[usize]) -> Result<()> {
    if t.dims() != expected {
        let exp: Vec<Option<usize>> = expected.iter().map(|&d| Some(d)).collect();
        return Err(Error::shape(name, &exp, t.dims()));
    }
    Ok(())
}

/// All of `t` as a flat f32 vector, checked finite.
fn finite_f32(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    WeightDType::from_candle(t.dtype(), name)?;
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::non_finite(name, i));
    }
    Ok(v)
}

fn bias(t: Option<&Tensor>, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
    t.map(|t| {
        check_shape(t, name, &[len])?;
        finite_f32(t, name)
    })
    .transpose()
}

impl NeuronBundles {
    /// Converts `[out, in]` weights into neuron-major bundles stored as `dtype`.
    ///
    /// Checks every shape against `spec`, the dtypes (f32, f16, bf16) and that all values are
    /// finite; the error names the offending tensor.
    pub fn from_weights(spec: FfnSpec, w: FfnWeights<'_>, dtype: WeightDType) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        match (spec.gated, w.gate) {
            (true, None) => {
                return Err(ErrorKind::MissingTensor {
                    name: "gate_proj.weight".into(),
                }
                .into())
            }
            (false, Some(_)) => {
                return Err(Error::config(
                    "gated",
                    "spec is ungated but a gate tensor was given",
                ))
            }
            _ => {}
        }
        let mut sources: Vec<(&Tensor, &str)> = Vec::with_capacity(3);
        if let Some(g) = w.gate {
            check_shape(g, "gate_proj.weight", &[n, h])?;
            sources.push((g, "gate_proj.weight"));
        }
        check_shape(w.up, "up_proj.weight", &[n, h])?;
        check_shape(w.down, "down_proj.weight", &[h, n])?;
        sources.push((w.up, "up_proj.weight"));
        let down_t = w.down.t()?.contiguous()?;
        sources.push((&down_t, "down_proj.weight"));

        let data = match dtype {
            WeightDType::F32 => BundleData::F32(interleave::<f32>(&spec, &sources)?),
            WeightDType::F16 => BundleData::F16(interleave::<f16>(&spec, &sources)?),
            WeightDType::BF16 => BundleData::BF16(interleave::<bf16>(&spec, &sources)?),
            q => {
                let kind = q
                    .quant()
                    .ok_or_else(|| Error::config("storage", "not a quantized type"))?;
                check_quant_width(&spec, q)?;
                let mut rows: Vec<Vec<u8>> = Vec::with_capacity(sources.len());
                for (t, name) in &sources[..sources.len() - 1] {
                    finite_f32(t, name)?;
                    let qt = candle_core::quantized::QTensor::quantize(t, ggml(kind))?;
                    rows.push(qt.data()?.into_owned());
                }
                let down = finite_f32(&down_t, "down_proj.weight")?;
                BundleData::Quant {
                    kind,
                    bytes: interleave_quant(&spec, kind, &rows, &down)?,
                }
            }
        };
        Ok(NeuronBundles {
            spec,
            data,
            gate_bias: bias(w.gate_bias, "gate_proj.bias", n)?,
            up_bias: bias(w.up_bias, "up_proj.bias", n)?,
            down_bias: bias(w.down_bias, "down_proj.bias", h)?,
        })
    }

    /// The spec these weights were built for.
    pub fn spec(&self) -> &FfnSpec {
        &self.spec
    }

    /// The bundles as the kernels read them.
    pub(crate) fn view(&self) -> BundleView<'_> {
        BundleView {
            data: &self.data,
            layout: self.spec.layout(self.dtype()),
            hidden: self.spec.hidden,
            intermediate: self.spec.intermediate,
            activation: self.spec.activation,
            gate_bias: self.gate_bias.as_deref(),
            up_bias: self.up_bias.as_deref(),
        }
    }

    /// Builds quantized bundles from GGUF tensors as a file holds them (`[out, in]`, candle's
    /// `QTensor`): gate and up rows keep their Q4_0 / Q4_1 / Q8_0 blocks byte for byte; the down
    /// matrix is transposed and re-quantized per row to Q8_0. Other block types are dequantized
    /// and stored as Q8_0.
    pub fn from_qtensors(
        spec: FfnSpec,
        gate: Option<&candle_core::quantized::QTensor>,
        up: &candle_core::quantized::QTensor,
        down: &candle_core::quantized::QTensor,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        if spec.gated != gate.is_some() {
            return Err(Error::config(
                "gated",
                "gate tensor must be given exactly for gated specs",
            ));
        }
        let kind = match up.dtype() {
            candle_core::quantized::GgmlDType::Q4_0 => QuantKind::Q4_0,
            candle_core::quantized::GgmlDType::Q4_1 => QuantKind::Q4_1,
            _ => QuantKind::Q8_0,
        };
        let q = match kind {
            QuantKind::Q4_0 => WeightDType::Q4_0,
            QuantKind::Q4_1 => WeightDType::Q4_1,
            QuantKind::Q8_0 => WeightDType::Q8_0,
        };
        check_quant_width(&spec, q)?;
        let mut rows = Vec::new();
        for (t, name) in gate
            .map(|g| (g, "gate_proj.weight"))
            .into_iter()
            .chain([(up, "up_proj.weight")])
        {
            if t.shape().dims() != [n, h] {
                return Err(Error::shape(name, &[Some(n), Some(h)], t.shape().dims()));
            }
            let same = ggml(kind) == t.dtype();
            let bytes = if same {
                t.data()?.into_owned()
            } else {
                let f = t.dequantize(&candle_core::Device::Cpu)?;
                candle_core::quantized::QTensor::quantize(&f, ggml(kind))?
                    .data()?
                    .into_owned()
            };
            check_quant_finite(kind, &bytes, h, name)?;
            rows.push(bytes);
        }
        if down.shape().dims() != [h, n] {
            return Err(Error::shape(
                "down_proj.weight",
                &[Some(h), Some(n)],
                down.shape().dims(),
            ));
        }
        let down_t = down
            .dequantize(&candle_core::Device::Cpu)?
            .t()?
            .contiguous()?;
        let down = finite_f32(&down_t, "down_proj.weight")?;
        Ok(NeuronBundles {
            spec,
            data: BundleData::Quant {
                kind,
                bytes: interleave_quant(&spec, kind, &rows, &down)?,
            },
            gate_bias: None,
            up_bias: None,
            down_bias: None,
        })
    }

    /// The storage dtype.
    pub fn dtype(&self) -> WeightDType {
        match &self.data {
            BundleData::F32(_) => WeightDType::F32,
            BundleData::F16(_) => WeightDType::F16,
            BundleData::BF16(_) => WeightDType::BF16,
            BundleData::Quant { kind, .. } => match kind {
                QuantKind::Q4_0 => WeightDType::Q4_0,
                QuantKind::Q4_1 => WeightDType::Q4_1,
                QuantKind::Q8_0 => WeightDType::Q8_0,
            },
        }
    }

    /// The bundles of `neurons`, in that order, as a block of their own: what a fast tier copies
    /// into its memory. Neuron `k` of the result is neuron `neurons[k]` of `self`, with its gate
    /// and up biases; the down bias stays here (the caller adds it once per call). Indices may
    /// repeat (spare cache slots start as copies); an out-of-range index is a typed error, an
    /// empty list a `Config` error.
    pub fn select(&self, neurons: &[u32]) -> Result<NeuronBundles> {
        let n = self.spec.intermediate;
        if let Some(&i) = neurons.iter().find(|&&i| i as usize >= n) {
            return Err(ErrorKind::NeuronOutOfRange {
                layer: None,
                neuron: i as usize,
                intermediate: n,
            }
            .into());
        }
        let spec = FfnSpec::new(
            self.spec.hidden,
            neurons.len(),
            self.spec.activation,
            self.spec.gated,
        )
        .map_err(|_| Error::config("neurons", "a selection needs at least one neuron"))?;
        let stride = self.spec.layout(self.dtype()).stride();
        fn gather<T: Copy>(src: &[T], stride: usize, neurons: &[u32]) -> Vec<T> {
            let mut out = Vec::with_capacity(neurons.len() * stride);
            for &i in neurons {
                out.extend_from_slice(&src[i as usize * stride..][..stride]);
            }
            out
        }
        let data = match &self.data {
            BundleData::F32(w) => BundleData::F32(gather(w, stride, neurons)),
            BundleData::F16(w) => BundleData::F16(gather(w, stride, neurons)),
            BundleData::BF16(w) => BundleData::BF16(gather(w, stride, neurons)),
            BundleData::Quant { kind, bytes } => BundleData::Quant {
                kind: *kind,
                bytes: gather(bytes, stride, neurons),
            },
        };
        let pick = |b: &Option<Vec<f32>>| {
            b.as_ref()
                .map(|b| neurons.iter().map(|&i| b[i as usize]).collect())
        };
        Ok(NeuronBundles {
            spec,
            data,
            gate_bias: pick(&self.gate_bias),
            up_bias: pick(&self.up_bias),
            down_bias: None,
        })
    }

    /// Overwrites neuron `slot` of this block (made by [`NeuronBundles::select`] from `src`)
    /// with neuron `neuron` of `src`: a cache fill. Blocks of another storage or row size, or an
    /// index out of range, are a `Config` error and copy nothing.
    pub(crate) fn copy_neuron(
        &mut self,
        slot: usize,
        src: &NeuronBundles,
        neuron: usize,
    ) -> Result<()> {
        let stride = self.spec.layout(self.dtype()).stride();
        let fits = self.dtype() == src.dtype()
            && stride == src.spec.layout(src.dtype()).stride()
            && slot < self.spec.intermediate
            && neuron < src.spec.intermediate;
        if !fits {
            return Err(Error::config(
                "cache fill",
                format!(
                    "neuron {neuron} of a {:?} {:?} block into slot {slot} of a {:?} {:?} block",
                    src.dtype(),
                    src.spec,
                    self.dtype(),
                    self.spec
                ),
            ));
        }
        let (d, s) = (
            slot * stride..(slot + 1) * stride,
            neuron * stride..(neuron + 1) * stride,
        );
        match (&mut self.data, &src.data) {
            (BundleData::F32(a), BundleData::F32(b)) => a[d].copy_from_slice(&b[s]),
            (BundleData::F16(a), BundleData::F16(b)) => a[d].copy_from_slice(&b[s]),
            (BundleData::BF16(a), BundleData::BF16(b)) => a[d].copy_from_slice(&b[s]),
            (BundleData::Quant { bytes: a, .. }, BundleData::Quant { bytes: b, .. }) => {
                a[d].copy_from_slice(&b[s])
            }
            // Same `dtype()` means the same variant (checked above).
            _ => return Ok(()),
        }
        for (a, b) in [
            (&mut self.gate_bias, &src.gate_bias),
            (&mut self.up_bias, &src.up_bias),
        ] {
            if let (Some(a), Some(b)) = (a.as_mut(), b.as_ref()) {
                a[slot] = b[neuron];
            }
        }
        Ok(())
    }

    /// Bytes held by the weights and biases.
    pub fn weight_bytes(&self) -> usize {
        let n = self.spec.intermediate * self.spec.neuron_bytes(self.dtype());
        let b = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        n + b(&self.gate_bias) + b(&self.up_bias) + b(&self.down_bias)
    }

    /// The weights back in the usual layout, as f32 tensors `(gate, up, down)` (`gate` is `None`
    /// ungated). For tests and references; allocates a full copy.
    pub fn to_dense_f32(&self) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let s = &self.spec;
        let (h, n, r) = (s.hidden, s.intermediate, s.rows_per_neuron());
        let all: Vec<f32> = match &self.data {
            BundleData::F32(v) => v.clone(),
            BundleData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            BundleData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            BundleData::Quant { kind, bytes } => {
                let lay = s.layout(self.dtype());
                let mut out = vec![0f32; n * r * h];
                for (i, b) in bytes.chunks_exact(lay.stride()).enumerate() {
                    for k in 0..r {
                        let (src, kd) = if k < r - 1 {
                            (&b[k * lay.row..(k + 1) * lay.row], *kind)
                        } else {
                            (&b[lay.down_at()..], QuantKind::Q8_0)
                        };
                        dequantize_split_row(
                            kd,
                            src,
                            &mut out[(i * r + k) * h..(i * r + k + 1) * h],
                        );
                    }
                }
                out
            }
        };
        let dev = candle_core::Device::Cpu;
        let t = Tensor::from_vec(all, (n, r, h), &dev)?;
        let gate = if s.gated {
            Some(t.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?)
        } else {
            None
        };
        let up = t.narrow(1, r - 2, 1)?.squeeze(1)?.contiguous()?;
        let down = t.narrow(1, r - 1, 1)?.squeeze(1)?.t()?.contiguous()?;
        Ok((gate, up, down))
    }
}

fn ggml(kind: QuantKind) -> candle_core::quantized::GgmlDType {
    match kind {
        QuantKind::Q4_0 => candle_core::quantized::GgmlDType::Q4_0,
        QuantKind::Q4_1 => candle_core::quantized::GgmlDType::Q4_1,
        QuantKind::Q8_0 => candle_core::quantized::GgmlDType::Q8_0,
    }
}

fn check_quant_width(spec: &FfnSpec, q: WeightDType) -> Result<()> {
    if !spec.hidden.is_multiple_of(QK) {
        return Err(Error::config(
            "storage",
            format!(
                "{q:?} needs hidden ({}) to be a multiple of {QK}",
                spec.hidden
            ),
        ));
    }
    Ok(())
}

/// Rejects quantized rows whose scales decode to NaN or infinity (a corrupt file).
fn check_quant_finite(kind: QuantKind, bytes: &[u8], h: usize, name: &str) -> Result<()> {
    let mut row = vec![0f32; h];
    for (r, src) in bytes.chunks_exact(kind.row_bytes(h)).enumerate() {
        dequantize_row(kind, src, &mut row);
        if let Some(j) = row.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite(name, r * h + j));
        }
    }
    Ok(())
}

/// Neuron-major quantized bundles: for neuron `i`, its row of each matrix in `rows` (raw blocks,
/// `[intermediate, hidden]` each) then its down row (`down_t`, f32 `[intermediate, hidden]`)
/// re-quantized to Q8_0, every row in the split layout (`crate::cpu::split_row`: scales, then values).
fn interleave_quant(
    spec: &FfnSpec,
    kind: QuantKind,
    rows: &[Vec<u8>],
    down_t: &[f32],
) -> Result<Vec<u8>> {
    let h = spec.hidden;
    let lay = BundleLayout::new(h, spec.gated, Some(kind));
    let mut out = vec![0u8; spec.intermediate * lay.stride()];
    let mut down = vec![0u8; lay.down];
    for (i, b) in out.chunks_exact_mut(lay.stride()).enumerate() {
        for (k, m) in rows.iter().enumerate() {
            let (lo, hi) = (k * lay.row, (k + 1) * lay.row);
            split_row(kind, &m[i * lay.row..(i + 1) * lay.row], &mut b[lo..hi])?;
        }
        quantize_row_q8_0(&down_t[i * h..(i + 1) * h], &mut down);
        split_row(QuantKind::Q8_0, &down, &mut b[lay.down_at()..])?;
    }
    Ok(out)
}

/// Reads the sources (each `[intermediate, hidden]`, in bundle order) into one neuron-major vector.
fn interleave<T: WithDType>(spec: &FfnSpec, sources: &[(&Tensor, &str)]) -> Result<Vec<T>> {
    let (h, n, r) = (spec.hidden, spec.intermediate, sources.len());
    let mut out = vec![T::zero(); n * r * h];
    for (k, (t, name)) in sources.iter().enumerate() {
        let v = finite_f32(t, name)?;
        for i in 0..n {
            let dst = &mut out[(i * r + k) * h..(i * r + k + 1) * h];
            for (d, s) in dst.iter_mut().zip(&v[i * h..(i + 1) * h]) {
                *d = T::from_f64(*s as f64);
            }
        }
    }
    Ok(out)
}

/// The tensors of a candle-transformers MLP under `vb` (`gate_proj`, `up_proj`, `down_proj`; or
/// `up_proj`, `down_proj`; or `fc1`, `fc2`; each `.weight` with an optional `.bias`), handed to
/// `build` with the spec they give: sizes from up (`[intermediate, hidden]`), gated when
/// `gate_proj` is there. A missing tensor is [`ErrorKind::MissingTensor`] with its full name.
pub(crate) fn with_mlp_tensors<T>(
    activation: Activation,
    vb: &candle_nn::VarBuilder,
    build: impl FnOnce(FfnSpec, FfnWeights<'_>) -> Result<T>,
) -> Result<T> {
    let names: &[&str] = if vb.contains_tensor("gate_proj.weight") {
        &["gate_proj", "up_proj", "down_proj"]
    } else if vb.contains_tensor("up_proj.weight") {
        &["up_proj", "down_proj"]
    } else {
        &["fc1", "fc2"]
    };
    let gated = names.len() == 3;
    let full = |name: &str| match vb.prefix() {
        p if p.is_empty() => name.to_string(),
        p => format!("{p}.{name}"),
    };
    let get = |name: &str| -> Result<Tensor> {
        if !vb.contains_tensor(name) {
            return Err(ErrorKind::MissingTensor { name: full(name) }.into());
        }
        Ok(vb.get_unchecked(name)?)
    };
    let opt = |name: &str| -> Result<Option<Tensor>> {
        match vb.contains_tensor(name) {
            true => Ok(Some(vb.get_unchecked(name)?)),
            false => Ok(None),
        }
    };
    let w: Vec<Tensor> = names
        .iter()
        .map(|n| get(&format!("{n}.weight")))
        .collect::<Result<_>>()?;
    let b: Vec<Option<Tensor>> = names
        .iter()
        .map(|n| opt(&format!("{n}.bias")))
        .collect::<Result<_>>()?;
    let k = usize::from(gated);
    let (intermediate, hidden) = match *w[k].dims() {
        [n, h] => (n, h),
        ref d => {
            let up_name = full(&format!("{}.weight", names[k]));
            return Err(Error::shape(&up_name, &[None, None], d));
        }
    };
    let spec = FfnSpec::new(hidden, intermediate, activation, gated)?;
    build(
        spec,
        FfnWeights {
            gate: gated.then(|| &w[0]),
            up: &w[k],
            down: &w[k + 1],
            gate_bias: if gated { b[0].as_ref() } else { None },
            up_bias: b[k].as_ref(),
            down_bias: b[k + 1].as_ref(),
        },
    )
}

/// The dense FFN written with candle ops: the oracle every fast path is tested against.
///
/// `x` is `[.., hidden]`; weights as in [`FfnWeights`]. Computes in the tensors' own dtype.
pub fn dense_reference(
    x: &Tensor,
    spec: &FfnSpec,
    w: FfnWeights<'_>,
) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let rows = x.elem_count() / spec.hidden.max(1);
    let x2 = x.reshape((rows, spec.hidden))?;
    let lin = |w: &Tensor, b: Option<&Tensor>| -> candle_core::Result<Tensor> {
        let y = x2.matmul(&w.t()?)?;
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    };
    let up = lin(w.up, w.up_bias)?;
    let h = match w.gate {
        Some(g) => {
            let g = lin(g, w.gate_bias)?;
            match spec.activation {
                Activation::DRelu => (g.relu()? * up.relu()?)?,
                a => (g.apply(&a.to_candle())? * up)?,
            }
        }
        None => up.apply(&spec.activation.to_candle())?,
    };
    let mut y = h.matmul(&w.down.t()?)?;
    if let Some(b) = w.down_bias {
        y = y.broadcast_add(b)?;
    }
    let mut out_dims = dims;
    if let Some(last) = out_dims.last_mut() {
        *last = spec.hidden;
    }
    y.reshape(out_dims)
}
