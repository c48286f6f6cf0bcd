//! A bounds-checking walk over a GGUF header before candle reads it.
//!
//! candle's reader trusts the lengths a file declares: a string length of 2^60 becomes
//! `vec![0u8; 2^60]`, an array length a `Vec::with_capacity` of that many values, a dimension
//! count a vector of that many dimensions, and arrays nested in arrays recurse without a limit.
//! A hostile or corrupted file would abort the process (allocation failure or stack overflow)
//! instead of returning an error. This walk reads the same fields without allocating what they
//! declare, and refuses, with a typed error naming the field, every length that cannot fit in the
//! bytes left in the file (`Truncated`: a cut file and a lying length look the same), nesting deeper than [`MAX_NESTING`], more than [`MAX_DIMS`]
//! dimensions, element counts that overflow, rows that are not whole blocks, and tensor data
//! that is misaligned, out of order, overlapping or past the end of the file. What passes can
//! be read by candle with allocations bounded by a small multiple of the file's size.

use std::io::{BufReader, Read, Seek, SeekFrom};

use candle_core::quantized::GgmlDType;

use crate::error::{ErrorKind, Result};

/// Arrays nested in arrays deeper than this are refused (GGUF writers nest none).
pub const MAX_NESTING: usize = 4;
/// Tensors with more dimensions than this are refused (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u64 = 4;
/// `general.alignment` when the file does not set it.
const DEFAULT_ALIGNMENT: u64 = 32;

struct Walk<R> {
    r: BufReader<R>,
    pos: u64,
    len: u64,
    file: String,
    /// Version 1 stores lengths and counts as u32.
    v1: bool,
}

impl<R: Read + Seek> Walk<R> {
    fn format(&self, reason: String) -> crate::error::Error {
        ErrorKind::Format {
            file: self.file.clone(),
            reason,
        }
        .into()
    }

    fn truncated(&self, what: &str, needed: u64) -> crate::error::Error {
        ErrorKind::Truncated {
            file: self.file.clone(),
            what: what.to_string(),
            needed,
            len: self.len,
        }
        .into()
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if self.len - self.pos < N as u64 {
            return Err(self.truncated(what, self.pos + N as u64));
        }
        self.r
            .read_exact(&mut b)
            .map_err(|e| crate::error::Error::io(&self.file, "reading the GGUF header", e))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes::<4>(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes::<8>(what)?))
    }

    /// A count or length: u32 in version 1, u64 after.
    fn count(&mut self, what: &str) -> Result<u64> {
        if self.v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    /// Skips `n` bytes of `what`, which must lie in the file.
    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        if n > self.len - self.pos {
            return Err(self.truncated(what, self.pos.saturating_add(n)));
        }
        self.r
            .seek_relative(n as i64)
            .map_err(|e| crate::error::Error::io(&self.file, "seeking in the GGUF header", e))?;
        self.pos += n;
        Ok(())
    }

    /// A string: its length must fit in what is left. Returns it when `keep` (short keys).
    fn string(&mut self, what: &str, keep: bool) -> Result<Option<String>> {
        let n = self.count(what)?;
        if n > self.len - self.pos {
            return Err(self.truncated(what, self.pos.saturating_add(n)));
        }
        if keep && n <= 256 {
            let mut v = vec![0u8; n as usize];
            self.r
                .read_exact(&mut v)
                .map_err(|e| crate::error::Error::io(&self.file, "reading the GGUF header", e))?;
            self.pos += n;
            return Ok(Some(String::from_utf8_lossy(&v).into_owned()));
        }
        self.skip(n, what)?;
        Ok(None)
    }

    /// A metadata value of type `ty`; returns it where it is an integer of at most 32 bits (for
    /// `general.alignment`, which candle reads from any of those types).
    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Option<i64>> {
        Ok(match ty {
            0 => Some(i64::from(self.bytes::<1>(what)?[0])),
            1 => Some(i64::from(i8::from_le_bytes(self.bytes::<1>(what)?))),
            2 => Some(i64::from(u16::from_le_bytes(self.bytes::<2>(what)?))),
            3 => Some(i64::from(i16::from_le_bytes(self.bytes::<2>(what)?))),
            4 => Some(i64::from(self.u32(what)?)),
            5 => Some(i64::from(i32::from_le_bytes(self.bytes::<4>(what)?))),
            6 => {
                self.skip(4, what)?;
                None
            }
            7 => {
                let [b] = self.bytes::<1>(what)?;
                if b > 1 {
                    return Err(self.format(format!("{what} is a bool of value {b}")));
                }
                None
            }
            8 => {
                self.string(what, false)?;
                None
            }
            9 => {
                self.array(what, depth)?;
                None
            }
            10..=12 => {
                self.skip(8, what)?;
                None
            }
            t => return Err(self.format(format!("{what} has unknown value type {t}"))),
        })
    }

    fn array(&mut self, what: &str, depth: usize) -> Result<()> {
        if depth >= MAX_NESTING {
            return Err(self.format(format!("{what} nests arrays deeper than {MAX_NESTING}")));
        }
        let elem = self.u32(what)?;
        let n = self.count(what)?;
        // The fewest bytes an element takes (a string or an array: its header).
        let len_bytes = if self.v1 { 4 } else { 8 };
        let least = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => len_bytes,
            9 => 4 + len_bytes,
            t => return Err(self.format(format!("{what} has unknown element type {t}"))),
        };
        if n.saturating_mul(least) > self.len - self.pos {
            let needed = self.pos.saturating_add(n.saturating_mul(least));
            return Err(self.truncated(&format!("{what} ({n} elements)"), needed));
        }
        match elem {
            7..=9 => {
                for _ in 0..n {
                    self.value(elem, what, depth + 1)?;
                }
                Ok(())
            }
            _ => self.skip(n * least, what),
        }
    }
}

/// Walks the header of a GGUF-layout stream of `len` bytes (the magic already checked) and
/// refuses every declared size that does not fit it; see the module docs.
pub(super) fn check_header<R: Read + Seek>(reader: &mut R, file: &str, len: u64) -> Result<()> {
    reader
        .seek(SeekFrom::Start(4))
        .map_err(|e| crate::error::Error::io(file, "seek", e))?;
    let mut w = Walk {
        r: BufReader::new(reader),
        pos: 4,
        len,
        file: file.to_string(),
        v1: false,
    };
    let version = w.u32("version")?;
    if !(1..=3).contains(&version) {
        return Err(w.format(format!("GGUF version {version} (1 to 3 are known)")));
    }
    w.v1 = version == 1;
    let tensors = w.count("tensor count")?;
    let kvs = w.count("metadata count")?;
    // A metadata pair takes at least a key length, a value type and a byte; a tensor a name
    // length, a dimension count, a type and an offset.
    let left = len - w.pos;
    let (kv_least, tensor_least) = if w.v1 { (9, 20) } else { (13, 24) };
    let least = kvs
        .saturating_mul(kv_least)
        .saturating_add(tensors.saturating_mul(tensor_least));
    if least > left {
        let what = format!("header ({kvs} metadata pairs, {tensors} tensors)");
        return Err(w.truncated(&what, w.pos.saturating_add(least)));
    }
    let mut alignment = DEFAULT_ALIGNMENT;
    for k in 0..kvs {
        let key = w.string(&format!("metadata key {k}"), true)?;
        let ty = w.u32("metadata value type")?;
        let what = match &key {
            Some(key) => format!("metadata `{key}`"),
            None => format!("metadata value {k}"),
        };
        let v = w.value(ty, &what, 0)?;
        if key.as_deref() == Some("general.alignment") {
            match v {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => alignment = a as u64,
                Some(a) => {
                    return Err(w.format(format!(
                        "general.alignment is {a}, not a positive power of two"
                    )))
                }
                None => return Err(w.format("general.alignment is not an integer".into())),
            }
        }
    }
    let mut infos = Vec::new();
    for t in 0..tensors {
        let name = w
            .string(&format!("tensor {t}'s name"), true)?
            .unwrap_or_else(|| format!("tensor {t}"));
        let dims = w.u32(&format!("`{name}`'s dimension count"))?;
        if u64::from(dims) > MAX_DIMS {
            return Err(w.format(format!(
                "tensor `{name}` has {dims} dimensions (at most {MAX_DIMS})"
            )));
        }
        let mut shape = Vec::with_capacity(dims as usize);
        for _ in 0..dims {
            shape.push(w.count(&format!("`{name}`'s dimensions"))?);
        }
        let ty = w.u32(&format!("`{name}`'s type"))?;
        let dtype = ggml_dtype(ty).ok_or_else(|| {
            w.format(format!(
                "tensor `{name}` has type {ty}, which candle cannot read"
            ))
        })?;
        let offset = w.u64(&format!("`{name}`'s offset"))?;
        let elems = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| usize::try_from(n).is_ok())
            .ok_or_else(|| w.format(format!("tensor `{name}` has {shape:?} elements: too many")))?;
        let block = dtype.block_size() as u64;
        // ggml stores the first dimension (a row) as whole blocks.
        if shape.first().is_some_and(|&d| d % block != 0) {
            return Err(w.format(format!(
                "tensor `{name}`: rows of {} values are not whole {dtype:?} blocks of {block}",
                shape[0]
            )));
        }
        let bytes = (elems / block)
            .checked_mul(dtype.type_size() as u64)
            .ok_or_else(|| w.format(format!("tensor `{name}` is too large")))?;
        infos.push((name, offset, bytes));
    }
    // The data section starts at the next multiple of the alignment.
    let data = w.pos.div_ceil(alignment).saturating_mul(alignment);
    let mut end = 0u64;
    for (name, offset, bytes) in infos {
        if offset % alignment != 0 {
            return Err(w.format(format!(
                "tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}"
            )));
        }
        if offset < end {
            return Err(w.format(format!(
                "tensor `{name}` starts at data offset {offset}, inside or before the previous tensor (which ends at {end})"
            )));
        }
        end = offset.saturating_add(bytes);
        let at = data.saturating_add(end);
        if at > len {
            return Err(w.truncated(&format!("tensor `{name}`"), at));
        }
    }
    Ok(())
}

/// The GGML types candle reads, by their number in the file.
fn ggml_dtype(ty: u32) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match ty {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        9 => Q8_1,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        15 => Q8K,
        30 => BF16,
        _ => return None,
    })
}
