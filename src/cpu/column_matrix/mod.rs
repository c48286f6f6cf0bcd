//! Column-major matrices for input-sparse products: `y = W x` where most of `x` is zero, reading
//! only the columns of `W` whose input is nonzero. What skips: one column (the weights one input
//! feeds) per zero input (`Kernels::column_matrix_q8`: Q4_0 / Q4_1 / Q8_0 against a Q8 input,
//! floats against f32).
//!
//! A matrix of `rows x cols` weights is stored column by column (column `c` holds `W[:, c]`, the
//! `rows` weights one input feeds), each column padded to a multiple of [`CHUNK`] = 64 rows. A
//! skipped input is one contiguous column that is never read: the skip unit the memory system
//! rewards.
//!
//! GGUF Q4_0 / Q4_1 / Q8_0 matrices keep the file's quantized values exactly; only their order
//! changes. A GGUF block is 32 consecutive inputs of one row with one scale (and, Q4_1, one
//! minimum), so block `b`'s scales are shared by the 32 columns `32 b..32 b + 32`: they move into
//! a scale plane per block (`rows` f16 scales, then for Q4_1 `rows` f16 minimums). The bytes are
//! the file's: a product over a fraction `k` of the columns reads about `k` of the values plus the
//! scale planes of the blocks it touches.
//!
//! Values of a Q4 column come in 32-byte chunks of 64 rows: byte `t` holds row `64 k + t` in its
//! low nibble and row `64 k + 32 + t` in its high nibble. Q8_0 columns hold one `i8` per row.
//!
//! The input is quantized per 32-value block exactly as ggml quantizes a row (`QuantizedRow`), so
//! per row and block the integer sum `sum_c q_w[r][c] q_x[c]` over the nonzero inputs is the
//! dense kernel's exactly, and it is scaled in the dense kernel's order (`packed.rs`): a product
//! keeping every input gives the bits of `PackedRows`'s product. Float matrices (f32, f16, bf16)
//! are products of f32 inputs, four columns per pass over the outputs.

use std::ops::Range;

use half::{bf16, f16};

use super::quant::{dequantize_row, QuantKind, QuantizedRow, QK};
use crate::error::{Error, Result};

/// Rows per chunk: columns are padded to a multiple of it, and threads split the rows by chunks.
pub const CHUNK: usize = 64;

/// Chunks per tile of the AVX-512 kernel: per tile, every active column of a block is read 256
/// bytes (Q4; 512 for Q8_0) at a time, so all of them advance together (many streams in flight,
/// as the hardware prefetcher likes) while each piece is four whole cache lines. Measured: 8
/// beat 4, 16 and 64 on SmolLM2's decode and on the 7B bench.
#[cfg(target_arch = "x86_64")]
const TILE: usize = 8;

/// Columns ahead whose bytes the AVX-512 kernel asks for while it computes.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// Bytes of each column (per tile) the AVX-512 kernel prefetches.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 512;

/// The stored weights of a [`ColumnMatrix`].
#[derive(Clone)]
pub(crate) enum ColumnData {
    /// GGUF blocks: per block the scale plane (`pad` f16 scales, Q4_1 then `pad` f16
    /// minimums), and per column its values.
    Quant {
        kind: QuantKind,
        scales: Vec<u8>,
        values: Vec<u8>,
    },
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// A `rows x cols` matrix stored column-major for input-sparse products (see the module docs).
#[derive(Clone)]
pub struct ColumnMatrix {
    rows: usize,
    cols: usize,
    /// `rows` rounded up to a multiple of [`CHUNK`].
    pad: usize,
    pub(crate) data: ColumnData,
    /// `||W[:, c]||_2` per column (of the stored values), for WINA-style input scores.
    norms: Vec<f32>,
}

impl std::fmt::Debug for ColumnMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColumnMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("storage", &self.storage())
            .finish()
    }
}

/// How a [`ColumnMatrix`] stores its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColumnStorage {
    /// The file's GGUF blocks.
    Quant(QuantKind),
    /// 32-bit floats.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

/// A quantized matrix's parts as the kernels read them.
pub(crate) struct QuantParts<'a> {
    pub kind: QuantKind,
    /// Padded rows.
    pub pad: usize,
    /// Bytes of one column.
    pub cb: usize,
    /// Bytes of one block's scale plane.
    pub pb: usize,
    pub scales: &'a [u8],
    pub values: &'a [u8],
}

/// Bytes of a Q4 or Q8 column of `pad` rows.
fn column_bytes(kind: QuantKind, pad: usize) -> usize {
    match kind {
        QuantKind::Q8_0 => pad,
        _ => pad / 2,
    }
}

/// Bytes of one block's scale plane for `pad` rows.
fn plane_bytes(kind: QuantKind, pad: usize) -> usize {
    match kind {
        QuantKind::Q4_1 => 4 * pad,
        _ => 2 * pad,
    }
}

fn check_dims(rows: usize, cols: usize, quant: bool) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Err(Error::config(
            "column matrix",
            format!("{rows} x {cols}: both sizes must be at least 1"),
        ));
    }
    if quant && !cols.is_multiple_of(QK) {
        return Err(Error::config(
            "column matrix",
            format!("{cols} columns: GGUF blocks need a multiple of {QK}"),
        ));
    }
    Ok(())
}

impl ColumnMatrix {
    /// Drops share `t` of `n` of the matrix's values and scales from every cache
    /// ([`crate::cpu::evict_share`]).
    pub(crate) fn evict_share(&self, t: usize, n: usize) -> bool {
        use crate::cpu::evict_share as ev;
        match &self.data {
            ColumnData::Quant { scales, values, .. } => ev(scales, t, n) && ev(values, t, n),
            ColumnData::F32(v) => ev(v, t, n),
            ColumnData::F16(v) => ev(v, t, n),
            ColumnData::BF16(v) => ev(v, t, n),
        }
    }

    /// The column-major form of a GGUF matrix given as the file stores it: `rows` rows of `cols`
    /// weights in `kind` blocks, row-major (`src` holds `rows * kind.row_bytes(cols)` bytes).
    /// Scales that decode to NaN or infinity are refused (a corrupt file).
    pub fn from_blocks(kind: QuantKind, rows: usize, cols: usize, src: &[u8]) -> Result<Self> {
        check_dims(rows, cols, true)?;
        let rb = kind.row_bytes(cols);
        if src.len() != rows * rb {
            return Err(Error::shape(
                "column matrix bytes",
                &[Some(rows * rb)],
                &[src.len()],
            ));
        }
        let pad = rows.next_multiple_of(CHUNK);
        let nb = cols / QK;
        let (cb, pb) = (column_bytes(kind, pad), plane_bytes(kind, pad));
        let mut scales = vec![0u8; nb * pb];
        let mut values = vec![0u8; cols * cb];
        let mut norms = vec![0f64; cols];
        let mut deq = vec![0f32; cols];
        for (r, row) in src.chunks_exact(rb).enumerate() {
            dequantize_row(kind, row, &mut deq);
            if let Some(j) = deq.iter().position(|v| !v.is_finite()) {
                return Err(Error::non_finite("column matrix", r * cols + j));
            }
            for (n, &v) in norms.iter_mut().zip(&deq) {
                *n += f64::from(v) * f64::from(v);
            }
            for (b, blk) in row.chunks_exact(kind.block_bytes()).enumerate() {
                let plane = &mut scales[b * pb..(b + 1) * pb];
                plane[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                if kind == QuantKind::Q4_1 {
                    plane[2 * pad + 2 * r..2 * pad + 2 * r + 2].copy_from_slice(&blk[2..4]);
                }
                for j in 0..QK {
                    let c = b * QK + j;
                    let col = &mut values[c * cb..(c + 1) * cb];
                    match kind {
                        QuantKind::Q8_0 => col[r] = blk[2 + j],
                        _ => {
                            let qs = &blk[kind.block_bytes() - 16..];
                            let q = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                            let (k, t) = (r / CHUNK, r % CHUNK);
                            let at = k * 32 + t % 32;
                            col[at] |= if t < 32 { q } else { q << 4 };
                        }
                    }
                }
            }
        }
        Ok(ColumnMatrix {
            rows,
            cols,
            pad,
            data: ColumnData::Quant {
                kind,
                scales,
                values,
            },
            norms: norms.into_iter().map(|n| n.sqrt() as f32).collect(),
        })
    }

    /// The column-major form of a row-major f32 matrix `w` (`rows x cols`), stored as `storage`
    /// (f32, f16 or bf16; values rounded to it). Non-finite weights are refused.
    pub fn from_f32(storage: ColumnStorage, rows: usize, cols: usize, w: &[f32]) -> Result<Self> {
        check_dims(rows, cols, false)?;
        if w.len() != rows * cols {
            return Err(Error::shape(
                "column matrix weights",
                &[Some(rows * cols)],
                &[w.len()],
            ));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite("column matrix", i));
        }
        let pad = rows.next_multiple_of(CHUNK);
        fn columns<E: Copy + Default>(
            w: &[f32],
            rows: usize,
            cols: usize,
            pad: usize,
            to: impl Fn(f32) -> E,
        ) -> Vec<E> {
            let mut out = vec![E::default(); cols * pad];
            for (r, row) in w.chunks_exact(cols).enumerate().take(rows) {
                for (c, &v) in row.iter().enumerate() {
                    out[c * pad + r] = to(v);
                }
            }
            out
        }
        let data = match storage {
            ColumnStorage::F32 => ColumnData::F32(columns(w, rows, cols, pad, |v| v)),
            ColumnStorage::F16 => ColumnData::F16(columns(w, rows, cols, pad, f16::from_f32)),
            ColumnStorage::BF16 => ColumnData::BF16(columns(w, rows, cols, pad, bf16::from_f32)),
            ColumnStorage::Quant(_) => {
                return Err(Error::config(
                    "storage",
                    "GGUF blocks come from ColumnMatrix::from_blocks",
                ))
            }
        };
        let mut m = ColumnMatrix {
            rows,
            cols,
            pad,
            data,
            norms: Vec::new(),
        };
        let mut col = vec![0f32; rows];
        m.norms = (0..cols)
            .map(|c| {
                m.column(c, &mut col);
                col.iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    .sqrt() as f32
            })
            .collect();
        Ok(m)
    }

    /// The quantized parts (`None` for float storage).
    pub(crate) fn quant(&self) -> Option<QuantParts<'_>> {
        let ColumnData::Quant {
            kind,
            scales,
            values,
        } = &self.data
        else {
            return None;
        };
        Some(QuantParts {
            kind: *kind,
            pad: self.pad,
            cb: column_bytes(*kind, self.pad),
            pb: plane_bytes(*kind, self.pad),
            scales,
            values,
        })
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored column length: `rows` rounded up to a multiple of [`CHUNK`].
    pub(crate) fn pad(&self) -> usize {
        self.pad
    }

    /// Chunks of [`CHUNK`] rows (the last one padded).
    pub fn chunks(&self) -> usize {
        self.pad / CHUNK
    }

    /// How the weights are stored.
    pub fn storage(&self) -> ColumnStorage {
        match &self.data {
            ColumnData::Quant { kind, .. } => ColumnStorage::Quant(*kind),
            ColumnData::F32(_) => ColumnStorage::F32,
            ColumnData::F16(_) => ColumnStorage::F16,
            ColumnData::BF16(_) => ColumnStorage::BF16,
        }
    }

    /// `||W[:, c]||_2` per column, of the stored weights.
    pub fn column_norms(&self) -> &[f32] {
        &self.norms
    }

    /// Bytes of the stored weights (values and scale planes; padding included).
    pub fn bytes(&self) -> usize {
        match &self.data {
            ColumnData::Quant { scales, values, .. } => scales.len() + values.len(),
            ColumnData::F32(v) => 4 * v.len(),
            ColumnData::F16(v) => 2 * v.len(),
            ColumnData::BF16(v) => 2 * v.len(),
        }
    }

    /// Bytes a product reads when `active` columns are nonzero, in `blocks` distinct 32-column
    /// blocks (the scale planes; ignored for float storage).
    pub fn bytes_read(&self, active: usize, blocks: usize) -> usize {
        match &self.data {
            ColumnData::Quant { kind, .. } => {
                active * column_bytes(*kind, self.pad) + blocks * plane_bytes(*kind, self.pad)
            }
            ColumnData::F32(_) => active * 4 * self.pad,
            ColumnData::F16(_) | ColumnData::BF16(_) => active * 2 * self.pad,
        }
    }

    /// Column `c` as f32 weights (`out` holds `rows`), dequantized. For tests and references.
    pub fn column(&self, c: usize, out: &mut [f32]) {
        let (pad, rows) = (self.pad, self.rows);
        match &self.data {
            ColumnData::F32(v) => out[..rows].copy_from_slice(&v[c * pad..c * pad + rows]),
            ColumnData::F16(v) => {
                for (o, w) in out.iter_mut().zip(&v[c * pad..c * pad + rows]) {
                    *o = w.to_f32();
                }
            }
            ColumnData::BF16(v) => {
                for (o, w) in out.iter_mut().zip(&v[c * pad..c * pad + rows]) {
                    *o = w.to_f32();
                }
            }
            ColumnData::Quant {
                kind,
                scales,
                values,
            } => {
                let (cb, pb) = (column_bytes(*kind, pad), plane_bytes(*kind, pad));
                let col = &values[c * cb..(c + 1) * cb];
                let plane = &scales[(c / QK) * pb..(c / QK + 1) * pb];
                for (r, o) in out.iter_mut().enumerate().take(rows) {
                    let d = f16_at(plane, 2 * r);
                    *o = match kind {
                        QuantKind::Q8_0 => d * (col[r] as i8) as f32,
                        QuantKind::Q4_0 => d * (nibble(col, r) as f32 - 8.0),
                        QuantKind::Q4_1 => d * nibble(col, r) as f32 + f16_at(plane, 2 * (pad + r)),
                    };
                }
            }
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 4-bit value of row `r` in a Q4 column.
fn nibble(col: &[u8], r: usize) -> u8 {
    let (k, t) = (r / CHUNK, r % CHUNK);
    let b = col[k * 32 + t % 32];
    if t < 32 {
        b & 0xF
    } else {
        b >> 4
    }
}

/// The nonzero inputs of a product: the column indices, ascending, and the number of distinct
/// 32-column blocks they fall in.
#[derive(Debug, Clone, Default)]
pub struct ActiveColumns {
    pub(crate) cols: Vec<u32>,
    pub(crate) blocks: usize,
}

impl ActiveColumns {
    /// The columns whose quantized input is nonzero.
    pub fn of_quantized(&mut self, x: &QuantizedRow) {
        self.fill(x.values().iter().map(|&q| q != 0));
    }

    /// The columns whose input is nonzero.
    pub fn of_f32(&mut self, x: &[f32]) {
        self.fill(x.iter().map(|&v| v != 0.0));
    }

    fn fill(&mut self, nonzero: impl Iterator<Item = bool>) {
        self.cols.clear();
        self.blocks = 0;
        let mut last = usize::MAX;
        for (c, nz) in nonzero.enumerate() {
            if nz {
                self.cols.push(c as u32);
                if c / QK != last {
                    last = c / QK;
                    self.blocks += 1;
                }
            }
        }
    }

    /// The active columns, ascending.
    pub fn columns(&self) -> &[u32] {
        &self.cols
    }

    /// Distinct 32-column blocks among them.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// Splits an ascending column list into the runs of one 32-column block each.
fn block_runs(active: &[u32]) -> impl Iterator<Item = &[u32]> {
    active.chunk_by(|a, b| a / QK as u32 == b / QK as u32)
}

/// The quantized product's kernel: rows of chunks `chunks` of `m` against `x` over the `active`
/// columns into `out` (`chunks.len() * CHUNK` values, overwritten).
pub(crate) type ColumnsFn = fn(&ColumnMatrix, Range<usize>, &QuantizedRow, &[u32], &mut [f32]);

/// Scales a block's exact integer sums into the accumulators, in the dense kernel's order.
#[inline(always)]
fn scale_block(
    kind: QuantKind,
    acc: f32,
    s: i32,
    d: f32,
    m: f32,
    x: &QuantizedRow,
    b: usize,
) -> f32 {
    match kind {
        QuantKind::Q4_1 => acc + ((s as f32 * d) * x.d[b] + m * x.s[b]),
        _ => (s as f32).mul_add(d * x.d[b], acc),
    }
}

/// The scalar reference of the quantized product (see [`ColumnsFn`]): per row and block, the
/// exact integer sum over the active columns (Q4_0: `q - 8`; Q4_1: `q`), scaled as `packed.rs`.
pub(crate) fn product_scalar(
    m: &ColumnMatrix,
    chunks: Range<usize>,
    x: &QuantizedRow,
    active: &[u32],
    out: &mut [f32],
) {
    let Some(QuantParts {
        kind,
        cb,
        pb,
        scales,
        values,
        ..
    }) = m.quant()
    else {
        return;
    };
    out.fill(0.0);
    for run in block_runs(active) {
        let b = run[0] as usize / QK;
        let plane = &scales[b * pb..(b + 1) * pb];
        for (i, o) in out.iter_mut().enumerate() {
            let r = chunks.start * CHUNK + i;
            let mut s = 0i32;
            for &c in run {
                let c = c as usize;
                let col = &values[c * cb..(c + 1) * cb];
                let w = match kind {
                    QuantKind::Q8_0 => (col[r] as i8) as i32,
                    QuantKind::Q4_0 => nibble(col, r) as i32 - 8,
                    QuantKind::Q4_1 => nibble(col, r) as i32,
                };
                s += w * x.q[c] as i32;
            }
            let mn = if kind == QuantKind::Q4_1 {
                f16_at(plane, 2 * (m.pad + r))
            } else {
                0.0
            };
            *o = scale_block(kind, *o, s, f16_at(plane, 2 * r), mn, x, b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
