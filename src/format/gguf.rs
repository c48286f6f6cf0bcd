//! PowerInfer's own files: the `PWRI`-magic GGUF model (with per-layer predictors `blk.N.fc1` /
//! `blk.N.fc2`, the transposed down projection `blk.N.ffn_down_t` and the key
//! `powerinfer.sparse_threshold`) and the `.gpuidx` placement file (`blk.N.gpu_idx`,
//! `blk.N.gpu_bucket`).
//!
//! This module only reads and checks those files and maps them onto the engine's types
//! ([`LowRank`], [`PreNormLowRank`], [`LayerPlacement`]); it runs nothing. Format facts, with the
//! lines of PowerInfer they come from, are in `docs/powerinfer-files.md`.
//!
//! - A `PWRI` file is a GGUF v3 file whose first four bytes were overwritten with `PWRI` after
//!   writing (PowerInfer `convert.py`, end of `main`); every other byte follows GGUF. candle's
//!   reader checks the magic, so [`read_gguf`] shows it `GGUF` and reads the rest unchanged.
//! - A `.gpuidx` file is the same kind of file holding GGML `I32` tensors, a type candle does not
//!   know; [`read_gpuidx`] parses it with its own bounds-checked reader.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, ErrorKind, Result};
use crate::predict::{LowRank, PreNormLowRank};

/// PowerInfer's magic for its sparse-model GGUF files (`GGUF_POWERINFER_MAGIC` in its `ggml.h`).
pub const POWERINFER_MAGIC: [u8; 4] = *b"PWRI";
/// The standard GGUF magic.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Metadata key of the predictor threshold (f32).
pub const SPARSE_THRESHOLD_KEY: &str = "powerinfer.sparse_threshold";
/// The threshold PowerInfer uses when the file has no [`SPARSE_THRESHOLD_KEY`] (and no
/// `LLAMA_SPARSE_PRED_THRESHOLD` environment override): a neuron runs when its score is `>= 0`.
pub const POWERINFER_DEFAULT_THRESHOLD: f32 = 0.0;

/// Which magic a GGUF-layout file starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufMagic {
    /// `GGUF`: a plain (dense) GGUF file.
    Gguf,
    /// `PWRI`: PowerInfer's marker for sparse-inference files.
    PowerInfer,
}

/// Presents the first four bytes of a stream as `GGUF`, everything else unchanged.
struct AsGguf<'a, R> {
    inner: &'a mut R,
    pos: u64,
}

impl<R: Read> Read for AsGguf<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for (k, b) in buf[..n].iter_mut().enumerate() {
            let at = self.pos + k as u64;
            if at < 4 {
                *b = GGUF_MAGIC[at as usize];
            } else {
                break;
            }
        }
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Seek> Seek for AsGguf<'_, R> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        self.pos = self.inner.seek(to)?;
        Ok(self.pos)
    }
}

pub(super) fn io_error(file: &str, what: &str, e: std::io::Error) -> Error {
    Error::io(file, what, e)
}

fn is_eof(e: &candle_core::Error) -> bool {
    match e {
        candle_core::Error::Io(io) => io.kind() == std::io::ErrorKind::UnexpectedEof,
        candle_core::Error::WithBacktrace { inner, .. } => is_eof(inner),
        candle_core::Error::Context { inner, .. } => is_eof(inner),
        _ => false,
    }
}

/// Reads the header, metadata and tensor index of a GGUF-layout file whose magic is `GGUF` or
/// `PWRI`. Every size the header declares is checked against the stream first (strings, arrays,
/// dimensions, element counts; tensor data aligned, in order, not overlapping, inside the
/// stream), so a hostile file is a typed error before anything of its declared size is
/// allocated. `file` names the source
/// in errors. The reader is left at an unspecified position; tensors are then read with
/// `content.tensor(reader, ..)` on the same reader (they never touch the magic).
pub fn read_gguf<R: Read + Seek>(
    reader: &mut R,
    file: &str,
) -> Result<(GgufMagic, gguf_file::Content)> {
    let len = reader
        .seek(SeekFrom::End(0))
        .map_err(|e| io_error(file, "seek", e))?;
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|e| io_error(file, "seek", e))?;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match reader.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(file, "reading the magic", e)),
        }
    }
    if got < 4 {
        return Err(ErrorKind::Truncated {
            file: file.to_string(),
            what: "magic".into(),
            needed: 4,
            len,
        }
        .into());
    }
    let kind = match magic {
        GGUF_MAGIC => GgufMagic::Gguf,
        POWERINFER_MAGIC => GgufMagic::PowerInfer,
        got => {
            return Err(ErrorKind::BadMagic {
                file: file.to_string(),
                got,
            }
            .into())
        }
    };
    // Every declared size checked against the file before candle allocates what it declares.
    super::gguf_check::check_header(reader, file, len)?;
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|e| io_error(file, "seek", e))?;
    let mut patched = AsGguf {
        inner: reader,
        pos: 0,
    };
    let content = gguf_file::Content::read(&mut patched).map_err(|e| -> Error {
        if is_eof(&e) {
            ErrorKind::Truncated {
                file: file.to_string(),
                what: "header (metadata or tensor index)".into(),
                needed: 0,
                len,
            }
            .into()
        } else {
            ErrorKind::Format {
                file: file.to_string(),
                reason: format!("GGUF header: {e}"),
            }
            .into()
        }
    })?;
    Ok((kind, content))
}

/// A PowerInfer model file (`PWRI` magic, or a plain GGUF) opened for reading its predictors.
///
/// The model's own weights are read by the host (the candle adapter's loader); this type reads
/// what is PowerInfer's: the threshold, `blk.N.fc1.weight` / `blk.N.fc2.weight` and
/// `blk.N.ffn_down_t.weight`.
#[derive(Debug)]
pub struct PowerInferFile {
    /// Parsed header, metadata and tensor index.
    pub content: gguf_file::Content,
    magic: GgufMagic,
    path: PathBuf,
    file: std::fs::File,
}

impl PowerInferFile {
    /// Opens and checks a file (magic, header, every tensor inside the file).
    pub fn open(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let mut file = std::fs::File::open(path).map_err(|e| io_error(&name, "open", e))?;
        let (magic, content) = read_gguf(&mut file, &name)?;
        Ok(PowerInferFile {
            content,
            magic,
            path: path.to_path_buf(),
            file,
        })
    }

    /// The file's magic: [`GgufMagic::PowerInfer`] marks a file PowerInfer runs sparse.
    pub fn magic(&self) -> GgufMagic {
        self.magic
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn arch_u32(&self, key: &str) -> Result<Option<usize>> {
        let arch = match self.content.metadata.get("general.architecture") {
            Some(gguf_file::Value::String(a)) => a.clone(),
            Some(_) => return Err(self.format("`general.architecture` is not a string")),
            None => return Ok(None),
        };
        let full = format!("{arch}.{key}");
        match self.content.metadata.get(&full) {
            None => Ok(None),
            Some(v) => v
                .to_u32()
                .map(|v| Some(v as usize))
                .map_err(|_| self.format(format!("`{full}` is not a u32"))),
        }
    }

    fn format(&self, reason: impl Into<String>) -> Error {
        ErrorKind::Format {
            file: self.name(),
            reason: reason.into(),
        }
        .into()
    }

    /// Number of layers (`{arch}.block_count`).
    pub fn layers(&self) -> Result<usize> {
        self.arch_u32("block_count")?.ok_or_else(|| {
            self.format("missing key `{arch}.block_count` (or `general.architecture`)")
        })
    }

    /// The predictor threshold: `powerinfer.sparse_threshold` (f32; an f64 is accepted too), or
    /// [`POWERINFER_DEFAULT_THRESHOLD`] when absent. Non-finite values are an error.
    pub fn threshold(&self) -> Result<f32> {
        let t = match self.content.metadata.get(SPARSE_THRESHOLD_KEY) {
            None => return Ok(POWERINFER_DEFAULT_THRESHOLD),
            Some(gguf_file::Value::F32(v)) => *v,
            Some(gguf_file::Value::F64(v)) => *v as f32,
            Some(v) => {
                return Err(self.format(format!(
                    "`{SPARSE_THRESHOLD_KEY}` has type {:?}, expected f32",
                    v.value_type()
                )))
            }
        };
        if !t.is_finite() {
            return Err(Error::config(
                SPARSE_THRESHOLD_KEY,
                format!("{t} is not finite"),
            ));
        }
        Ok(t)
    }

    /// Whether layer 0 has predictor tensors (`blk.0.fc1.weight`).
    pub fn has_predictors(&self) -> bool {
        self.content.tensor_infos.contains_key("blk.0.fc1.weight")
    }

    /// Reads a tensor as stored, or a typed error naming it.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(ErrorKind::MissingTensor { name: name.into() }.into());
        }
        let file = self.name();
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| -> Error {
                ErrorKind::Format {
                    file,
                    reason: format!("tensor `{name}`: {e}"),
                }
                .into()
            })
    }

    fn matrix_f32(&mut self, name: &str) -> Result<Tensor> {
        let q = self.tensor(name)?;
        let dims = q.shape().dims().to_vec();
        if dims.len() != 2 || dims.contains(&0) {
            return Err(Error::shape(name, &[None, None], &dims));
        }
        Ok(q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
    }

    /// Layer `layer`'s predictor weights as f32 `[out, in]` tensors, checked against each other
    /// and against the file's `embedding_length` / `feed_forward_length` where present:
    /// `fc1: [rank, hidden]`, `fc2: [intermediate, rank]`. Any GGML type candle dequantizes is
    /// accepted (PowerInfer writes f16 or f32, its quantizer Q4_0 or Q5_0).
    pub fn predictor_weights(&mut self, layer: usize) -> Result<(Tensor, Tensor)> {
        let n1 = format!("blk.{layer}.fc1.weight");
        let n2 = format!("blk.{layer}.fc2.weight");
        let hidden = self.arch_u32("embedding_length")?;
        let inter = self.arch_u32("feed_forward_length")?;
        let fc1 = self.matrix_f32(&n1)?;
        let fc2 = self.matrix_f32(&n2)?;
        let (rank, h) = fc1.dims2()?;
        if hidden.is_some_and(|x| x != h) {
            return Err(Error::shape(&n1, &[None, hidden], fc1.dims()));
        }
        let (n, r2) = fc2.dims2()?;
        if r2 != rank || inter.is_some_and(|x| x != n) {
            return Err(Error::shape(&n2, &[inter, Some(rank)], fc2.dims()));
        }
        Ok((fc1, fc2))
    }

    /// Layer `layer`'s predictor as a [`LowRank`] with the file's threshold, applied to whatever
    /// input it is given. PowerInfer's llama feeds its predictors the residual stream *before*
    /// the FFN norm; for a model whose FFN sees the normed input use
    /// [`PowerInferFile::pre_norm_predictor`].
    pub fn predictor(&mut self, layer: usize) -> Result<LowRank> {
        let t = self.threshold()?;
        let (fc1, fc2) = self.predictor_weights(layer)?;
        LowRank::new(&fc1, &fc2, t).map_err(|e| rename(e, layer))
    }

    /// Layer `layer`'s predictor for an FFN that receives `rms_norm(u) * norm_weight` while the
    /// predictor was trained on `u` (PowerInfer's llama). See [`PreNormLowRank`].
    pub fn pre_norm_predictor(
        &mut self,
        layer: usize,
        norm_weight: &Tensor,
    ) -> Result<PreNormLowRank> {
        let t = self.threshold()?;
        let (fc1, fc2) = self.predictor_weights(layer)?;
        PreNormLowRank::new(&fc1, &fc2, norm_weight, t).map_err(|e| rename(e, layer))
    }

    /// Layer `layer`'s down projection from `blk.N.ffn_down_t.weight` (stored transposed,
    /// neuron-major), returned as the usual `[hidden, intermediate]` f32 tensor.
    pub fn down_from_transposed(&mut self, layer: usize) -> Result<Tensor> {
        let name = format!("blk.{layer}.ffn_down_t.weight");
        let hidden = self.arch_u32("embedding_length")?;
        let inter = self.arch_u32("feed_forward_length")?;
        let t = self.matrix_f32(&name)?;
        let (n, h) = t.dims2()?;
        if hidden.is_some_and(|x| x != h) || inter.is_some_and(|x| x != n) {
            return Err(Error::shape(&name, &[inter, hidden], t.dims()));
        }
        Ok(t.t()?.contiguous()?)
    }
}

/// Gives a predictor error the file's tensor names instead of the generic ones.
fn rename(e: Error, layer: usize) -> Error {
    match e.kind() {
        ErrorKind::Shape {
            tensor,
            expected,
            got,
        } if tensor.starts_with("predictor.") => {
            let t = tensor.replacen("predictor.", &format!("blk.{layer}."), 1);
            Error::shape(&t, expected, got)
        }
        ErrorKind::NonFinite { tensor, index } if tensor.starts_with("predictor.") => {
            let t = tensor.replacen("predictor.", &format!("blk.{layer}."), 1);
            Error::non_finite(&t, *index)
        }
        _ => e,
    }
}
