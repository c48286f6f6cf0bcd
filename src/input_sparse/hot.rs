//! The hot neurons of an [`InputSparseFfn`](super::InputSparseFfn) on a candle device: the
//! GPU half of the default sparse mode's hybrid.
//!
//! A neuron `j` of a gated FFN is gate's and up's row `j` and down's column `j`, and the FFN is
//! the sum over neurons, `out = sum_j down[:, j] * act(gate_j . x) * (up_j . x)`. So the neurons
//! split into two sets whose partial outputs add: the hot set (the neurons calibration found
//! large, [`hot_neurons`]) is computed densely on the device with candle's quantized matmul,
//! and the cold set on the CPU with the input-sparse kernels, which read only the cold rows of
//! gate and up and only the kept cold columns of down. The device works while the CPU does:
//! [`HotNeurons::launch`] queues the copy of `x` and the three products on the device's stream
//! and returns, and [`HotNeurons::finish`] waits for the result once the CPU's part is done.
//!
//! Gate's and up's hot rows are the file's blocks, byte for byte. Down's hot columns cut
//! across its blocks (a block runs along a row), so they are dequantized and quantized again
//! as Q8_0 (8 bits, one scale per 32 neurons): the only change to a weight, an error of at most
//! half a step of 1/127 of each 32-weight group's largest value. When every neuron is hot, down
//! is the file's tensor unchanged. On `Device::Cpu` the same code runs synchronously: the
//! reference the device's output is checked against.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::{Activation, FfnSpec};

/// Q8_0's block: down's hot columns are a multiple of it (unless every neuron is hot).
pub const HOT_GROUP: usize = 32;

/// The ids of the `count` neurons with the largest `h_abs` (each neuron's summed `|h|` over
/// calibration rows, [`super::InputScores::h_abs`]), in increasing id order; ties go to the
/// lower id. `count` is clamped to the number of neurons.
pub fn hot_neurons(h_abs: &[f64], count: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..h_abs.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        h_abs[b as usize]
            .total_cmp(&h_abs[a as usize])
            .then(a.cmp(&b))
    });
    ids.truncate(count.min(h_abs.len()));
    ids.sort_unstable();
    ids
}

/// Device bytes of one hot neuron of a layer whose gate and up rows take `row_bytes` each and
/// whose model width is `hidden`: two rows plus a Q8_0 column of down.
pub fn hot_neuron_bytes(row_bytes: usize, hidden: usize) -> usize {
    2 * row_bytes + q8_0_bytes(hidden)
}

/// How many of a layer's `intermediate` neurons fit `budget` device bytes: every neuron when
/// the layer's whole FFN (`file_bytes`, gate, up and down at the file's block types) fits, else
/// as many [`hot_neuron_bytes`]-sized neurons as fit, rounded down to [`HOT_GROUP`].
pub fn hot_count(
    budget: u64,
    intermediate: usize,
    hidden: usize,
    row_bytes: usize,
    file_bytes: usize,
) -> usize {
    if budget >= file_bytes as u64 {
        return intermediate;
    }
    let per = hot_neuron_bytes(row_bytes, hidden).max(1) as u64;
    let n = (budget / per) as usize;
    (n - n % HOT_GROUP).min(intermediate - intermediate % HOT_GROUP)
}

fn q8_0_bytes(n: usize) -> usize {
    n / HOT_GROUP * (2 + HOT_GROUP)
}

/// One layer's hot neurons on a device (see the module docs).
pub struct HotNeurons {
    ids: Vec<u32>,
    device: Device,
    gate: Option<QMatMul>,
    up: QMatMul,
    down: QMatMul,
    activation: Activation,
    hidden: usize,
    bytes: usize,
}

impl std::fmt::Debug for HotNeurons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotNeurons")
            .field("neurons", &self.ids.len())
            .field("device", &self.device.location())
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// The rows `ids` of `t` (`[rows, cols]`, GGUF blocks along a row) as a tensor on `device`.
pub(super) fn rows_of(t: &QTensor, name: &str, ids: &[u32], device: &Device) -> Result<QTensor> {
    let (rows, cols) = t.shape().dims2()?;
    let dtype = t.dtype();
    if cols % dtype.block_size() != 0 {
        return Err(Error::config(name, "a row is not a whole number of blocks"));
    }
    let rb = cols / dtype.block_size() * dtype.type_size();
    let data = t.data()?;
    let mut out = Vec::with_capacity(ids.len() * rb);
    for &j in ids {
        let j = j as usize;
        if j >= rows {
            return Err(Error::config(
                name,
                format!("hot neuron {j} of {rows} rows"),
            ));
        }
        out.extend_from_slice(&data[j * rb..(j + 1) * rb]);
    }
    Ok(qtensor_from_ggml(
        dtype,
        &out,
        vec![ids.len(), cols],
        device,
    )?)
}

impl HotNeurons {
    /// The neurons `ids` (increasing, each below `spec`'s intermediate size; a multiple of
    /// [`HOT_GROUP`] of them, or all) of the FFN with GGUF tensors `gate`, `up`, `down`
    /// (`[out, in]`), on `device`.
    pub fn new(
        spec: &FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        ids: &[u32],
        device: &Device,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::config(
                "hot neurons",
                "ids must be strictly increasing",
            ));
        }
        if let Some(&j) = ids.iter().find(|&&j| j as usize >= n) {
            return Err(Error::config("hot neurons", format!("neuron {j} of {n}")));
        }
        let all = ids.len() == n;
        if ids.is_empty() || (!all && !ids.len().is_multiple_of(HOT_GROUP)) {
            return Err(Error::config(
                "hot neurons",
                format!(
                    "{} of {n}: a nonzero multiple of {HOT_GROUP}, or every neuron",
                    ids.len()
                ),
            ));
        }
        for (t, name, dims) in [
            (up, "up_proj.weight", [n, h]),
            (down, "down_proj.weight", [h, n]),
        ] {
            if t.shape().dims() != dims {
                let want = dims.map(Some);
                return Err(Error::shape(name, &want, t.shape().dims()));
            }
        }
        let gate = gate
            .map(|g| rows_of(g, "gate_proj.weight", ids, device))
            .transpose()?;
        let up = rows_of(up, "up_proj.weight", ids, device)?;
        let down = if all {
            qtensor_from_ggml(down.dtype(), &down.data()?, vec![h, n], device)?
        } else {
            let idx = Tensor::new(ids, &Device::Cpu)?;
            let cols = down.dequantize(&Device::Cpu)?.index_select(&idx, 1)?;
            let q = QTensor::quantize(&cols, GgmlDType::Q8_0)?;
            qtensor_from_ggml(GgmlDType::Q8_0, &q.data()?, vec![h, ids.len()], device)?
        };
        let bytes = gate.as_ref().map_or(0, |g| g.storage_size_in_bytes())
            + up.storage_size_in_bytes()
            + down.storage_size_in_bytes();
        let mm = |t: QTensor| QMatMul::from_qtensor(t).map_err(Error::from);
        Ok(HotNeurons {
            ids: ids.to_vec(),
            device: device.clone(),
            gate: gate.map(mm).transpose()?,
            up: mm(up)?,
            down: mm(down)?,
            activation: spec.activation,
            hidden: h,
            bytes,
        })
    }

    /// The hot neurons' ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The device they live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes they take on the device.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues the hot neurons' partial output for `rows` rows of `x` (row-major, `rows *
    /// hidden`) on the device and returns it without waiting.
    pub fn launch(&self, x: &[f32], rows: usize) -> Result<Tensor> {
        let x = Tensor::from_slice(x, (rows, self.hidden), &self.device)?;
        let u = self.up.forward(&x)?;
        let h = match &self.gate {
            Some(g) => {
                let g = g.forward(&x)?;
                let a = match self.activation {
                    Activation::Relu => g.relu()?,
                    Activation::DRelu => {
                        return Ok(self.down.forward(&(g.relu()? * u.relu()?)?)?)
                    }
                    Activation::Silu => g.silu()?,
                    Activation::Gelu => g.gelu_erf()?,
                    Activation::GeluTanh => g.gelu()?,
                };
                (a * u)?
            }
            None => match self.activation {
                Activation::Relu | Activation::DRelu => u.relu()?,
                Activation::Silu => u.silu()?,
                Activation::Gelu => u.gelu_erf()?,
                Activation::GeluTanh => u.gelu()?,
            },
        };
        Ok(self.down.forward(&h)?)
    }

    /// Waits for a [`HotNeurons::launch`]'s result and adds it to `out` (`rows * hidden`).
    pub fn finish(&self, pending: Tensor, out: &mut [f32]) -> Result<()> {
        let y = pending
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if y.len() != out.len() {
            return Err(Error::config(
                "hot output",
                format!("{} values for {}", y.len(), out.len()),
            ));
        }
        if let Some(i) = y.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite("hot neurons' output", i));
        }
        for (o, v) in out.iter_mut().zip(y) {
            *o += v;
        }
        Ok(())
    }
}
