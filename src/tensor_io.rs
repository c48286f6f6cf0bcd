//! Candle tensors in and out of the engine's f32 kernels: checks, reading rows as f32 in place
//! where the input already is contiguous f32 (the decode path), and writing results back in the
//! input's dtype. Shared by `HybridFfn` and `QLinear`.

use std::sync::Mutex;

use candle_core::{DType, Device, Storage, Tensor};
use half::{bf16, f16};

use crate::error::{Error, ErrorKind, Result};
use crate::ffn::WeightDType;

/// Checks that `xs` is a CPU tensor of f32, f16 or bf16 with last dimension `width`; returns the
/// number of rows. Errors name `tensor`.
pub(crate) fn check_rows(xs: &Tensor, width: usize, tensor: &str) -> Result<usize> {
    if !xs.device().is_cpu() {
        return Err(ErrorKind::Device {
            tensor: tensor.into(),
            got: format!("{:?}", xs.device()),
        }
        .into());
    }
    WeightDType::from_candle(xs.dtype(), tensor)?;
    if xs.dims().last() != Some(&width) {
        return Err(Error::shape(tensor, &[None, Some(width)], xs.dims()));
    }
    Ok(xs.elem_count() / width)
}

/// Checks an FFN's f32 call: `x` and `out` hold `rows` rows of `width` values, `x` finite.
pub(crate) fn check_f32_rows(x: &[f32], rows: usize, width: usize, out: &[f32]) -> Result<()> {
    check_f32_rows_io(x, rows, width, out, width)
}

/// Checks a layer's f32 call: `x` holds `rows` rows of `input` values, `out` of `output`, `x`
/// finite.
pub(crate) fn check_f32_rows_io(
    x: &[f32],
    rows: usize,
    input: usize,
    out: &[f32],
    output: usize,
) -> Result<()> {
    if x.len() != rows * input {
        return Err(Error::shape(
            "input (rows * width)",
            &[Some(rows * input)],
            &[x.len()],
        ));
    }
    if out.len() != rows * output {
        return Err(Error::shape("output", &[Some(rows * output)], &[out.len()]));
    }
    check_finite(x)
}

/// Refuses NaN and infinite inputs, naming the first one.
pub(crate) fn check_finite(x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::non_finite("input", i)),
        None => Ok(()),
    }
}

/// Runs `f` on all values of `xs` (checked by [`check_rows`]) as f32: contiguous f32 is read in
/// place; f16 and bf16 are widened into `buf`, which is reused.
pub(crate) fn with_f32<R>(
    xs: &Tensor,
    buf: &mut Vec<f32>,
    f: impl FnOnce(&[f32]) -> Result<R>,
) -> Result<R> {
    let xs = if xs.is_contiguous() {
        xs.clone()
    } else {
        xs.contiguous()?
    };
    let (storage, layout) = xs.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(ErrorKind::Device {
            tensor: "input".into(),
            got: format!("{:?}", xs.device()),
        }
        .into());
    };
    let range = layout.start_offset()..layout.start_offset() + xs.elem_count();
    match xs.dtype() {
        DType::F16 => {
            buf.clear();
            buf.extend(cpu.as_slice::<f16>()?[range].iter().map(|v| v.to_f32()));
            f(buf)
        }
        DType::BF16 => {
            buf.clear();
            buf.extend(cpu.as_slice::<bf16>()?[range].iter().map(|v| v.to_f32()));
            f(buf)
        }
        _ => f(&cpu.as_slice::<f32>()?[range]),
    }
}

/// `out` as a CPU tensor of shape `dims` in `dtype` (f32, f16 or bf16).
pub(crate) fn to_tensor(out: Vec<f32>, dims: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(match dtype {
        DType::F16 => Tensor::from_vec(
            out.iter().map(|&v| f16::from_f32(v)).collect(),
            dims,
            &Device::Cpu,
        )?,
        DType::BF16 => Tensor::from_vec(
            out.iter().map(|&v| bf16::from_f32(v)).collect(),
            dims,
            &Device::Cpu,
        )?,
        _ => Tensor::from_vec(out, dims, &Device::Cpu)?,
    })
}

/// A layer's call on a tensor: `xs` `[.., input]` (checked by [`check_rows`]) read as f32
/// through `buf` (the layer's widening buffer; its lock is not held while `f` runs), `f(x, rows,
/// out)` on the rows, and `out` returned as `[.., output]` in `xs`'s dtype.
pub(crate) fn forward_tensor(
    xs: &Tensor,
    input: usize,
    output: usize,
    buf: &Mutex<Vec<f32>>,
    f: impl FnOnce(&[f32], usize, &mut [f32]) -> Result<()>,
) -> Result<Tensor> {
    let rows = check_rows(xs, input, "input")?;
    let mut dims = xs.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = output;
    }
    let mut out = vec![0f32; rows * output];
    if rows > 0 {
        let mut b = std::mem::take(&mut *buf.lock().unwrap_or_else(|e| e.into_inner()));
        let res = with_f32(xs, &mut b, |x| f(x, rows, &mut out));
        *buf.lock().unwrap_or_else(|e| e.into_inner()) = b;
        res?;
    }
    to_tensor(out, &dims, xs.dtype())
}
