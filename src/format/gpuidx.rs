//! PowerInfer's `.gpuidx` placement file (`blk.N.gpu_idx`, `blk.N.gpu_bucket`): a GGUF-layout
//! file of GGML `I32` tensors, a type candle does not know, parsed here with a bounds-checked
//! reader and mapped onto [`LayerPlacement`]s.

use std::path::Path;

use crate::error::{Error, ErrorKind, Result};
use crate::hybrid::LayerPlacement;

use super::gguf::{io_error, GGUF_MAGIC, POWERINFER_MAGIC};

/// GGML type number of `I32` in PowerInfer's ggml (`GGML_TYPE_I32`, after `Q8_K` = 15, I8, I16).
const GGML_TYPE_I32: u32 = 18;

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
            return Err(Error::count(
                "generic.gpu_index.block_count (layers in the .gpuidx file)",
                layers,
                n as usize,
            ));
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
        return Err(Error::count(
            "tensors in the .gpuidx file (gpu_idx and gpu_bucket per layer)",
            2 * layers,
            infos.len(),
        ));
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
