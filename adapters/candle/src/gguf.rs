//! [`GgufFile`]: a GGUF (or PowerInfer `PWRI`) file opened for reading, checked against
//! truncation before any tensor is read.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use powerinfer::format::GgufMagic;

use crate::error::{Error, ErrorKind, Result};

/// A GGUF file opened for reading: its metadata and where it lives.
#[derive(Debug)]
pub struct GgufFile {
    /// Parsed header, metadata and tensor index.
    pub content: gguf_file::Content,
    /// `GGUF`, or PowerInfer's `PWRI` (a llama file PowerInfer runs sparse: ReLU FFN,
    /// `ffn_down_t`, predictors).
    pub magic: GgufMagic,
    pub(crate) path: std::path::PathBuf,
    pub(crate) file: File,
}

impl GgufFile {
    /// Opens and checks a GGUF file: header, metadata, and that every tensor lies inside the file
    /// (a truncated download is reported here, naming the first tensor cut off).
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let (magic, content) = read_header(&mut file, path)?;
        Ok(GgufFile {
            content,
            magic,
            path: path.to_path_buf(),
            file,
        })
    }

    /// `{name}.bias` dequantized, if the file has it.
    pub fn bias(&mut self, name: &str) -> Result<Option<Tensor>> {
        let bias = format!("{name}.bias");
        if self.content.tensor_infos.contains_key(&bias) {
            Ok(Some(self.dequantized(&bias)?))
        } else {
            Ok(None)
        }
    }

    /// `{prefix}.{part}.weight` for each part (same block type and width), output features
    /// stacked in order, as one powerinfer `QLinear` on `threads` threads; the parts' biases
    /// (zeros where a part has none) stacked the same way.
    pub fn stacked(
        &mut self,
        prefix: &str,
        parts: &[&str],
        threads: usize,
    ) -> Result<powerinfer::layers::QLinear> {
        let (ws, bias) = self.stacked_parts(prefix, parts)?;
        let refs: Vec<_> = ws.iter().collect();
        Ok(powerinfer::layers::QLinear::stacked(
            &refs,
            bias.as_ref(),
            threads,
        )?)
    }

    /// As [`GgufFile::stacked`], as an `InputSparseLinear` (column-major, threshold 0).
    pub fn stacked_columns(
        &mut self,
        prefix: &str,
        parts: &[&str],
        threads: usize,
    ) -> Result<powerinfer::layers::InputSparseLinear> {
        let (ws, bias) = self.stacked_parts(prefix, parts)?;
        let refs: Vec<_> = ws.iter().collect();
        Ok(powerinfer::layers::InputSparseLinear::from_qtensors(
            &refs,
            bias.as_ref(),
            threads,
            None,
        )?)
    }

    /// The parts' weights and their stacked biases (`None` when no part has one).
    fn stacked_parts(
        &mut self,
        prefix: &str,
        parts: &[&str],
    ) -> Result<(Vec<QTensor>, Option<Tensor>)> {
        let mut ws = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for part in parts {
            let name = format!("{prefix}.{part}");
            let w = self.tensor(&format!("{name}.weight"))?;
            biases.push((
                w.shape().dims().first().copied().unwrap_or(0),
                self.bias(&name)?,
            ));
            ws.push(w);
        }
        let bias = if biases.iter().any(|b| b.1.is_some()) {
            let parts = biases
                .into_iter()
                .map(|(n, b)| match b {
                    Some(b) => Ok(b.to_dtype(DType::F32)?),
                    None => Ok(Tensor::zeros(n, DType::F32, &Device::Cpu)?),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&parts, 0)?)
        } else {
            None
        };
        Ok((ws, bias))
    }

    /// A tensor dequantized to f32.
    pub fn dequantized(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.tensor(name)?.dequantize(&Device::Cpu)?)
    }

    /// Reads a tensor, or a typed error naming it.
    pub fn tensor(&mut self, name: &str) -> Result<candle_core::quantized::QTensor> {
        if let Some(t) = down_from_transposed(self, name)? {
            return Ok(t);
        }
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ErrorKind::MissingTensor { name: name.into() }.into());
        };
        // A weight with no elements is never part of a model, and candle's quantized matmul
        // divides by its row count.
        if info.shape.elem_count() == 0 {
            return Err(Error::format(
                &self.path,
                format!(
                    "tensor `{name}` has shape {:?}: no elements",
                    info.shape.dims()
                ),
            ));
        }
        let q = self
            .content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| Error::format(&self.path, format!("tensor `{name}`: {e}")))?;
        check_finite(q.dtype(), &q.data()?, name, 0)?;
        Ok(q)
    }

    /// A matrix packed for powerinfer's kernels straight from the file, 16 rows at a time
    /// (`None` for block types the kernels do not take): a large tensor, such as an embedding or
    /// the LM head, is held once, not three times as while it goes through a candle `QTensor`
    /// and is packed.
    pub fn packed(&mut self, name: &str) -> Result<Option<powerinfer::cpu::PackedRows>> {
        use std::io::{Read, Seek, SeekFrom};
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ErrorKind::MissingTensor { name: name.into() }.into());
        };
        let Some(kind) = powerinfer::cpu::BlockKind::from_ggml(info.ggml_dtype) else {
            return Ok(None);
        };
        let (rows, cols) = match info.shape.dims() {
            &[r, c] if r > 0 && c > 0 => (r, c),
            d => {
                return Err(Error::format(
                    &self.path,
                    format!("tensor `{name}` has shape {d:?}, not a matrix"),
                ))
            }
        };
        let (dtype, at) = (
            info.ggml_dtype,
            self.content.tensor_data_offset + info.offset,
        );
        let (file, path) = (&mut self.file, &self.path);
        file.seek(SeekFrom::Start(at))
            .map_err(|e| Error::io(path, e))?;
        let w = powerinfer::cpu::PackedRows::pack_with(kind, rows, cols, |first, chunk| {
            file.read_exact(chunk)
                .map_err(|e| powerinfer::Error::io(path, "reading", e))?;
            check_finite(dtype, chunk, name, first * cols)
        })?;
        Ok(Some(w))
    }
}

/// Refuses a tensor (whose bytes `data` start at element `first`) holding a NaN or an infinity,
/// which would otherwise turn every output into NaN: float tensors value by value, block types
/// by their f16 scales and minimums (the quants are integers, so a block's values are finite
/// exactly when these are).
fn check_finite(
    dtype: candle_core::quantized::GgmlDType,
    data: &[u8],
    name: &str,
    first: usize,
) -> powerinfer::Result<()> {
    use candle_core::quantized::GgmlDType as T;
    let half = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).is_finite();
    let (bad, per) = match dtype {
        T::F32 => (
            data.chunks_exact(4)
                .position(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
            1,
        ),
        T::F16 => (data.chunks_exact(2).position(|b| !half(b)), 1),
        T::BF16 => (
            data.chunks_exact(2)
                .position(|b| !half::bf16::from_le_bytes([b[0], b[1]]).is_finite()),
            1,
        ),
        t => match powerinfer::cpu::BlockKind::from_ggml(t) {
            Some(k) => (
                data.chunks_exact(k.block_bytes())
                    .position(|b| k.half_offsets().iter().any(|&at| !half(&b[at..]))),
                k.block_elems(),
            ),
            None => (None, 1),
        },
    };
    match bad {
        Some(i) => Err(powerinfer::ErrorKind::NonFinite {
            tensor: name.to_string(),
            index: first + i * per,
        }
        .into()),
        None => Ok(()),
    }
}

/// Reads a GGUF header whose magic is `GGUF` or `PWRI`; file-level problems (magic, truncation,
/// malformed header) are this crate's `Format` error naming the file.
pub(crate) fn read_header(file: &mut File, path: &Path) -> Result<(GgufMagic, gguf_file::Content)> {
    powerinfer::format::read_gguf(file, &path.display().to_string()).map_err(|e| {
        match e.file_problem() {
            Some(problem) => Error::format(path, problem),
            None => e.into(),
        }
    })
}

/// Serves `blk.N.ffn_down.weight` from `blk.N.ffn_down_t.weight` (PowerInfer stores down
/// transposed, `[intermediate, hidden]`) when only the latter is in the file: transposed back to
/// `[hidden, intermediate]`, in f16 if stored f16, else f32 (exact for every source type).
pub(crate) fn down_from_transposed(gguf: &mut GgufFile, name: &str) -> Result<Option<QTensor>> {
    let Some(prefix) = name.strip_suffix(".ffn_down.weight") else {
        return Ok(None);
    };
    let t_name = format!("{prefix}.ffn_down_t.weight");
    if gguf.content.tensor_infos.contains_key(name)
        || !gguf.content.tensor_infos.contains_key(&t_name)
    {
        return Ok(None);
    }
    let q = gguf.tensor(&t_name)?;
    if q.shape().dims().len() != 2 {
        return Err(powerinfer::Error::from(powerinfer::ErrorKind::Shape {
            tensor: t_name,
            expected: vec![None, None],
            got: q.shape().dims().to_vec(),
        })
        .into());
    }
    let keep = if q.dtype() == GgmlDType::F16 {
        GgmlDType::F16
    } else {
        GgmlDType::F32
    };
    let down = q.dequantize(&Device::Cpu)?.t()?.contiguous()?;
    Ok(Some(QTensor::quantize(&down, keep)?))
}
