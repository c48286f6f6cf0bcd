//! PowerInfer's own files: the `PWRI`-magic GGUF model (with per-layer predictors `blk.N.fc1` /
//! `blk.N.fc2`, the transposed down projection `blk.N.ffn_down_t` and the key
//! `powerinfer.sparse_threshold`) and the `.gpuidx` placement file (`blk.N.gpu_idx`,
//! `blk.N.gpu_bucket`).
//!
//! This module only reads and checks those files and maps them onto the engine's types
//! ([`LowRank`], [`PreNormLowRank`], [`LayerPlacement`]); it runs nothing. Format facts, with the
//! lines of PowerInfer they come from, are in the README section "PowerInfer files".
//!
//! - A `PWRI` file is a GGUF v3 file whose first four bytes were overwritten with `PWRI` after
//!   writing (PowerInfer `convert.py`, end of `main`); every other byte follows GGUF. candle's
//!   reader checks the magic, so [`read_gguf`] shows it `GGUF` and reads the rest unchanged.
//! - A `.gpuidx` file is the same kind of file holding GGML `I32` tensors, a type candle does not
//!   know; [`read_gpuidx`] parses it with its own bounds-checked reader.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, ErrorKind, Result};
use crate::place::LayerPlacement;
use crate::predict::{ActiveSet, LowRank, PredictInput, Predictor};

/// PowerInfer's magic for its sparse-model GGUF files (`GGUF_POWERINFER_MAGIC` in its `ggml.h`).
pub const POWERINFER_MAGIC: [u8; 4] = *b"PWRI";
/// The standard GGUF magic.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Metadata key of the predictor threshold (f32).
pub const SPARSE_THRESHOLD_KEY: &str = "powerinfer.sparse_threshold";
/// The threshold PowerInfer uses when the file has no [`SPARSE_THRESHOLD_KEY`] (and no
/// `LLAMA_SPARSE_PRED_THRESHOLD` environment override): a neuron runs when its score is `>= 0`.
pub const POWERINFER_DEFAULT_THRESHOLD: f32 = 0.0;

/// GGML type number of `I32` in PowerInfer's ggml (`GGML_TYPE_I32`, after `Q8_K` = 15, I8, I16).
const GGML_TYPE_I32: u32 = 18;

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

fn io_error(file: &str, what: &str, e: std::io::Error) -> Error {
    ErrorKind::Format {
        file: file.to_string(),
        reason: format!("{what}: {e}"),
    }
    .into()
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
/// `PWRI`, and checks that every tensor's data lies inside the stream. `file` names the source
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
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let info = &content.tensor_infos[name];
        let elems = info.shape.elem_count() as u64;
        let block = info.ggml_dtype.block_size() as u64;
        let bytes = elems / block * info.ggml_dtype.type_size() as u64;
        let end = content
            .tensor_data_offset
            .saturating_add(info.offset)
            .saturating_add(bytes);
        if end > len {
            return Err(ErrorKind::Truncated {
                file: file.to_string(),
                what: format!("tensor `{name}`"),
                needed: end,
                len,
            }
            .into());
        }
    }
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

/// Per-row RMS of the pre-norm input, set by the host before each FFN call; shared between the
/// host and a [`PreNormLowRank`]. Reuses its buffer (no allocation once a batch size was seen).
#[derive(Debug, Clone, Default)]
pub struct RowRms(Arc<Mutex<Vec<f32>>>);

impl RowRms {
    /// An empty handle.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `sqrt(mean(u_r^2) + eps)` for each row `r` of the next call.
    pub fn set(&self, rms: &[f32]) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.clear();
        g.extend_from_slice(rms);
    }
}

/// PowerInfer's llama predictor where the FFN input is normed: PowerInfer computes
/// `score = fc2 relu(fc1 u)` on the residual stream `u` *before* the FFN's RMSNorm, and runs
/// neuron `i` when `score_i >= threshold`; the FFN (and so a [`Predictor`]) sees
/// `n = norm_weight * u / rms(u)`.
///
/// Since `relu` and `fc2` are positively homogeneous, `score(u) = rms(u) * fc2 relu(fc1' n)` with
/// `fc1' = fc1 diag(1 / norm_weight)`. So:
/// - at threshold 0 (PowerInfer's default) the rule is exact without knowing `rms(u)`;
/// - at any other threshold the host must hand over `rms(u)` per row through [`RowRms`]
///   ([`PreNormLowRank::with_row_rms`]); without it `predict` is a typed error.
///
/// A zero in `norm_weight` makes `u` unrecoverable and is rejected at construction.
pub struct PreNormLowRank {
    /// `fc1 diag(1 / norm_weight)` and `fc2`, scored as a plain `LowRank` on the normed input.
    inner: LowRank,
    threshold: f32,
    rms: Option<RowRms>,
}

impl std::fmt::Debug for PreNormLowRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreNormLowRank")
            .field("inner", &self.inner)
            .field("threshold", &self.threshold)
            .field("row_rms", &self.rms.is_some())
            .finish()
    }
}

impl PreNormLowRank {
    /// From `fc1: [rank, hidden]`, `fc2: [intermediate, rank]`, the FFN norm's weight `[hidden]`
    /// and the threshold.
    pub fn new(fc1: &Tensor, fc2: &Tensor, norm_weight: &Tensor, threshold: f32) -> Result<Self> {
        // LowRank checks shapes, dtypes, finiteness and the threshold the same way.
        let lr = LowRank::new(fc1, fc2, threshold)?;
        let (hidden, _) = lr.dims();
        if norm_weight.dims() != [hidden] {
            return Err(Error::shape(
                "ffn_norm.weight",
                &[Some(hidden)],
                norm_weight.dims(),
            ));
        }
        let w = norm_weight.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if let Some(k) = w.iter().position(|&x| x == 0.0 || !x.is_finite()) {
            return Err(Error::config(
                "ffn_norm.weight",
                format!(
                    "element {k} is {}: the pre-norm input cannot be recovered",
                    w[k]
                ),
            ));
        }
        let mut f1 = fc1.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for row in f1.chunks_mut(hidden) {
            for (a, &s) in row.iter_mut().zip(&w) {
                *a /= s;
            }
        }
        if let Some(i) = f1.iter().position(|x| !x.is_finite()) {
            return Err(Error::non_finite("fc1.weight / ffn_norm.weight", i));
        }
        let f1 = Tensor::from_vec(f1, (lr.rank(), hidden), &candle_core::Device::Cpu)?;
        Ok(PreNormLowRank {
            inner: LowRank::new(&f1, fc2, threshold)?,
            threshold,
            rms: None,
        })
    }

    /// Takes `rms(u)` per row from `rms` (needed for a non-zero threshold).
    pub fn with_row_rms(mut self, rms: RowRms) -> Self {
        self.rms = Some(rms);
        self
    }

    /// The threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// Whether the threshold needs the host's [`RowRms`] (it is not 0).
    pub fn needs_row_rms(&self) -> bool {
        self.threshold != 0.0
    }
}

impl Predictor for PreNormLowRank {
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        if self.threshold == 0.0 {
            // rms(u) > 0 does not change the sign: exact without it.
            return self.inner.score_rows(input, set, |set, r, i, s| {
                if s >= 0.0 {
                    set.insert(r, i)?;
                }
                Ok(())
            });
        }
        let handle = self.rms.as_ref().ok_or_else(|| {
            Error::config(
                "row_rms",
                "a non-zero PowerInfer threshold needs the pre-norm RMS of each row \
                 (PreNormLowRank::with_row_rms)",
            )
        })?;
        let rms = handle.0.lock().unwrap_or_else(|e| e.into_inner());
        if rms.len() != input.rows {
            return Err(ErrorKind::LayerCount {
                what: "row_rms values per batch row".into(),
                expected: input.rows,
                got: rms.len(),
            }
            .into());
        }
        let t = self.threshold;
        self.inner.score_rows(input, set, |set, r, i, s| {
            if rms[r] * s >= t {
                set.insert(r, i)?;
            }
            Ok(())
        })
    }

    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
}

/// A bounds-checked little-endian cursor over a whole file.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    file: &'a str,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.b.len() => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            _ => Err(ErrorKind::Truncated {
                file: self.file.to_string(),
                what: what.to_string(),
                needed: (self.at as u64).saturating_add(n as u64),
                len: self.b.len() as u64,
            }
            .into()),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| self.format(format!("{what}: length {n} too large")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.format(format!("{what}: not UTF-8")))
    }

    fn format(&self, reason: impl Into<String>) -> Error {
        ErrorKind::Format {
            file: self.file.to_string(),
            reason: reason.into(),
        }
        .into()
    }
}

/// A metadata value of a `.gpuidx` file, as far as this reader needs it.
enum Meta {
    U64(u64),
    Other,
}

/// Byte size of a fixed-size GGUF value type (`None` for string and array).
fn value_size(t: u32) -> Option<usize> {
    match t {
        0 | 1 | 7 => Some(1), // u8, i8, bool
        2 | 3 => Some(2),     // u16, i16
        4..=6 => Some(4),     // u32, i32, f32
        10..=12 => Some(8),   // u64, i64, f64
        _ => None,
    }
}

fn read_value(c: &mut Cursor<'_>, t: u32, key: &str) -> Result<Meta> {
    if let Some(n) = value_size(t) {
        let s = c.take(n, &format!("value of `{key}`"))?;
        return Ok(match n {
            1 => Meta::U64(s[0] as u64),
            2 => Meta::U64(u16::from_le_bytes([s[0], s[1]]) as u64),
            4 => Meta::U64(u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as u64),
            _ => {
                let mut a = [0u8; 8];
                a.copy_from_slice(s);
                Meta::U64(u64::from_le_bytes(a))
            }
        });
    }
    match t {
        8 => {
            c.string(&format!("value of `{key}`"))?;
            Ok(Meta::Other)
        }
        9 => {
            let et = c.u32(&format!("array type of `{key}`"))?;
            let n = c.len(&format!("array length of `{key}`"))?;
            if let Some(sz) = value_size(et) {
                let bytes = n
                    .checked_mul(sz)
                    .ok_or_else(|| c.format(format!("array `{key}` too large")))?;
                c.take(bytes, &format!("array `{key}`"))?;
            } else if et == 8 {
                for _ in 0..n {
                    c.string(&format!("array `{key}`"))?;
                }
            } else {
                return Err(c.format(format!("array `{key}` has element type {et}")));
            }
            Ok(Meta::Other)
        }
        _ => Err(c.format(format!("key `{key}` has unknown value type {t}"))),
    }
}

struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

/// Reads PowerInfer's `.gpuidx` placement file into one [`LayerPlacement`] per layer.
///
/// The file is GGUF-layout (magic `PWRI` as `powerinfer-py` writes it, or `GGUF`), version 2 or
/// 3, with exactly two GGML `I32` tensors per layer in this order: `blk.N.gpu_idx`
/// (`[intermediate]`, 1 = the neuron lives on the GPU, 0 = CPU) and `blk.N.gpu_bucket` (the
/// sorted indices of the GPU neurons). PowerInfer's loader takes them by position (tensor `2N`
/// and `2N+1`); this reader also requires the names to match those positions. `gpu_idx` and
/// `gpu_bucket` must agree (same set, no repeats); `generic.gpu_index.block_count`, when
/// present, must equal `layers`. `split.vram_capacity` is not needed and not checked.
pub fn read_gpuidx(path: &Path, layers: usize, intermediate: usize) -> Result<Vec<LayerPlacement>> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| io_error(&name, "read", e))?;
    parse_gpuidx(&bytes, &name, layers, intermediate)
}

/// [`read_gpuidx`] on the bytes of a file; `file` names it in errors.
pub fn parse_gpuidx(
    bytes: &[u8],
    file: &str,
    layers: usize,
    intermediate: usize,
) -> Result<Vec<LayerPlacement>> {
    let mut c = Cursor {
        b: bytes,
        at: 0,
        file,
    };
    let m = c.take(4, "magic")?;
    let magic = [m[0], m[1], m[2], m[3]];
    if magic != POWERINFER_MAGIC && magic != GGUF_MAGIC {
        return Err(ErrorKind::BadMagic {
            file: file.to_string(),
            got: magic,
        }
        .into());
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(c.format(format!("GGUF version {version}, expected 2 or 3")));
    }
    let n_tensors = c.len("tensor count")?;
    let n_kv = c.len("metadata count")?;
    // Every key and tensor takes at least 8 bytes: bound the counts by the file before looping.
    if n_tensors.saturating_add(n_kv) > bytes.len() / 8 {
        return Err(ErrorKind::Truncated {
            file: file.to_string(),
            what: format!("{n_kv} metadata entries and {n_tensors} tensor infos"),
            needed: (n_tensors.saturating_add(n_kv) as u64).saturating_mul(8),
            len: bytes.len() as u64,
        }
        .into());
    }
    let mut alignment = 32u64;
    let mut block_count = None;
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let t = c.u32(&format!("type of `{key}`"))?;
        let v = read_value(&mut c, t, &key)?;
        match (key.as_str(), v) {
            ("general.alignment", Meta::U64(a)) if t == 4 => alignment = a,
            ("generic.gpu_index.block_count", Meta::U64(n)) => block_count = Some(n),
            _ => {}
        }
    }
    if alignment == 0 {
        return Err(c.format("general.alignment is 0"));
    }
    if let Some(n) = block_count {
        if n != layers as u64 {
            return Err(ErrorKind::LayerCount {
                what: "generic.gpu_index.block_count (layers in the .gpuidx file)".into(),
                expected: layers,
                got: n as usize,
            }
            .into());
        }
    }
    let mut infos = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let nd = c.u32(&format!("dims of `{name}`"))?;
        if nd > 4 {
            return Err(c.format(format!("tensor `{name}` has {nd} dimensions")));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(c.u64(&format!("shape of `{name}`"))?);
        }
        let ggml_type = c.u32(&format!("type of `{name}`"))?;
        let offset = c.u64(&format!("offset of `{name}`"))?;
        infos.push(RawTensor {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    if infos.len() != 2 * layers {
        return Err(ErrorKind::LayerCount {
            what: "tensors in the .gpuidx file (gpu_idx and gpu_bucket per layer)".into(),
            expected: 2 * layers,
            got: infos.len(),
        }
        .into());
    }
    let data = (c.at as u64).div_ceil(alignment) * alignment;
    let read_i32 = |t: &RawTensor| -> Result<Vec<i32>> {
        if t.ggml_type != GGML_TYPE_I32 {
            return Err(ErrorKind::TensorType {
                tensor: t.name.clone(),
                got: format!("GGML type {}", t.ggml_type),
                expected: format!("I32 (GGML type {GGML_TYPE_I32})"),
            }
            .into());
        }
        let n = match t.dims.as_slice() {
            [n] => *n,
            d => {
                let got: Vec<usize> = d.iter().map(|&x| x as usize).collect();
                return Err(Error::shape(&t.name, &[None], &got));
            }
        };
        let start = data.saturating_add(t.offset);
        let end = start.saturating_add(n.saturating_mul(4));
        if end > bytes.len() as u64 {
            return Err(ErrorKind::Truncated {
                file: file.to_string(),
                what: format!("tensor `{}`", t.name),
                needed: end,
                len: bytes.len() as u64,
            }
            .into());
        }
        Ok(bytes[start as usize..end as usize]
            .chunks_exact(4)
            .map(|s| i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
            .collect())
    };
    let mut out = Vec::with_capacity(layers);
    for l in 0..layers {
        let (ti, tb) = (&infos[2 * l], &infos[2 * l + 1]);
        for (t, want) in [
            (ti, format!("blk.{l}.gpu_idx")),
            (tb, format!("blk.{l}.gpu_bucket")),
        ] {
            if t.name != want {
                if !infos.iter().any(|x| x.name == want) {
                    return Err(ErrorKind::MissingTensor { name: want }.into());
                }
                return Err(c.format(format!(
                    "tensor `{}` stands where PowerInfer reads `{want}` (it takes them by position)",
                    t.name
                )));
            }
        }
        let flags = read_i32(ti)?;
        if flags.len() != intermediate {
            return Err(Error::shape(
                &ti.name,
                &[Some(intermediate)],
                &[flags.len()],
            ));
        }
        if let Some((i, v)) = flags.iter().enumerate().find(|(_, &v)| v != 0 && v != 1) {
            return Err(c.format(format!("`{}`[{i}] is {v}, expected 0 or 1", ti.name)));
        }
        let bucket = read_i32(tb)?;
        let mut hot = Vec::with_capacity(bucket.len());
        for (k, &v) in bucket.iter().enumerate() {
            if v < 0 {
                return Err(c.format(format!(
                    "`{}`[{k}] is {v}, a negative neuron index",
                    tb.name
                )));
            }
            if v as usize >= intermediate {
                return Err(ErrorKind::NeuronOutOfRange {
                    layer: Some(l),
                    neuron: v as usize,
                    intermediate,
                }
                .into());
            }
            hot.push(v as u32);
        }
        let placement = LayerPlacement::new(intermediate, hot, Some(l))?;
        for (i, &f) in flags.iter().enumerate() {
            if (f == 1) != placement.is_hot(i) {
                return Err(ErrorKind::GpuIndexMismatch {
                    layer: l,
                    neuron: i,
                    flagged_not_listed: f == 1,
                }
                .into());
            }
        }
        out.push(placement);
    }
    Ok(out)
}
