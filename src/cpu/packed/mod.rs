//! Row-interleaved GGUF blocks for dense matrix-vector (and small matrix-matrix) products.
//! Nothing skips: a product reads every byte (`Kernels::gemm_packed_q8`, against Q8 or Q8_K
//! inputs).
//!
//! A matrix of `rows x cols` weights in one GGUF block type ([`BlockKind`]: Q4_0, Q4_1, Q8_0,
//! Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is stored in groups of [`PACK`] = 16 rows. For group `g` and
//! block `b` (32 columns, or 256 for the K-quants), one record holds the 16 rows' blocks field
//! by field, in the block's own field order: a 2-byte field (a scale, a minimum) as a plane of
//! 16 halves, a longer one (quants, high bits, packed scales) as chunks of 64 bytes where chunk
//! `c`, lane `l` is the `c`-th 4-byte word of row `16 g + l`'s field. One vector load thus holds
//! 4 consecutive bytes of 16 rows, and one `vpdpbusd` against the broadcast 4 input values of
//! those columns adds 4 products into each row's lane: no horizontal sums, and the input is read
//! once per group. The bytes per weight are the file's; only their order changes. Q8_0 values
//! are stored offset by 128 (`w ^ 0x80`) so they are the unsigned operand, and the offset comes
//! back out as `128 * sum(x)`.
//!
//! Per row and block the integer sum is exact, and the scaling is ggml's, in ggml's order: Q4_1
//! (and Q5_1) `acc += (sum * d_w) * d_x + m_w * s_x` (non-fused, as candle's quantized matmul
//! computes it, so a Q4_1 product is bit-identical to candle's), Q4_0, Q5_0 and Q8_0
//! `acc = fma(sum', d_w * d_x, acc)`, and the K-quants per super-block as `blocks` documents.
//! Every tier gives the same bits as the per-row reference ([`crate::cpu::dot_row`]) on the
//! file's row.
//!
//! Rows past `rows` in the last group are zero (scale 0) and are computed and dropped.

use std::ops::Range;

use super::blocks::{self, BlockKind};
use super::quant::{QuantizedRow, QK, QK_K};
use crate::error::{Error, Result};

/// Rows per interleaved group.
pub const PACK: usize = 16;

/// A `rows x cols` matrix of GGUF blocks in row-interleaved groups (see the module docs).
#[derive(Clone)]
pub struct PackedRows {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedRows")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Where the quants start in a record of 32-weight blocks: after the scale plane, the minimum
/// plane (Q4_1, Q5_1) and the fifth bits (Q5_0, Q5_1: one chunk).
pub(crate) const fn scale_bytes(kind: BlockKind) -> usize {
    match kind {
        BlockKind::Q4_1 => 4 * PACK,
        BlockKind::Q5_0 => 6 * PACK,
        BlockKind::Q5_1 => 8 * PACK,
        _ => 2 * PACK,
    }
}

/// Bytes of one group record (16 rows x one block).
pub(crate) const fn record_bytes(kind: BlockKind) -> usize {
    kind.block_bytes() * PACK
}

/// Where field `f`'s chunk `c`, lane `l` lies in a record.
fn field_offsets(kind: BlockKind) -> impl Iterator<Item = (blocks::Field, usize)> {
    kind.fields().iter().scan(0, |base, &f| {
        let at = *base;
        *base += PACK * f.len;
        Some((f, at))
    })
}

/// Copies row lane `l`'s block `blk` (GGUF bytes) into record `rec`.
fn scatter(kind: BlockKind, blk: &[u8], l: usize, rec: &mut [u8]) {
    for (f, base) in field_offsets(kind) {
        let w = f.word();
        for c in 0..f.len / w {
            let dst = &mut rec[base + PACK * w * c + w * l..][..w];
            dst.copy_from_slice(&blk[f.at + w * c..][..w]);
            if kind == BlockKind::Q8_0 && f.len == QK {
                dst.iter_mut().for_each(|v| *v ^= 0x80);
            }
        }
    }
}

/// The inverse of [`scatter`]: lane `l`'s block of record `rec` as GGUF bytes into `blk`.
fn gather(kind: BlockKind, rec: &[u8], l: usize, blk: &mut [u8]) {
    for (f, base) in field_offsets(kind) {
        let w = f.word();
        for c in 0..f.len / w {
            let dst = &mut blk[f.at + w * c..][..w];
            dst.copy_from_slice(&rec[base + PACK * w * c + w * l..][..w]);
            if kind == BlockKind::Q8_0 && f.len == QK {
                dst.iter_mut().for_each(|v| *v ^= 0x80);
            }
        }
    }
}

/// Packed rows are whole blocks.
fn check_cols(kind: BlockKind, cols: usize) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(kind.block_elems()) {
        return Err(Error::shape(
            match kind.block_elems() {
                QK_K => "packed matrix columns (a multiple of 256 for K-quants)",
                _ => "packed matrix columns (a multiple of 32)",
            },
            &[None],
            &[cols],
        ));
    }
    Ok(())
}

impl PackedRows {
    /// Packs `rows` rows of `cols` weights given in GGUF's row-major block layout (`src` holds
    /// `rows * kind.row_bytes(cols)` bytes; `cols` a positive multiple of the block size).
    pub fn pack(kind: impl Into<BlockKind>, rows: usize, cols: usize, src: &[u8]) -> Result<Self> {
        let kind = kind.into();
        check_cols(kind, cols)?;
        let rb = kind.row_bytes(cols);
        if src.len() != rows * rb {
            return Err(Error::shape(
                "packed matrix bytes (rows * row bytes)",
                &[Some(rows * rb)],
                &[src.len()],
            ));
        }
        Self::pack_with(kind, rows, cols, |first, chunk| {
            chunk.copy_from_slice(&src[first * rb..][..chunk.len()]);
            Ok(())
        })
    }

    /// [`PackedRows::pack`] with the rows read in groups of [`PACK`]: `read(first, chunk)` fills
    /// `chunk` with the bytes of the rows from `first` on (e.g. from a file), so only one group
    /// is held besides the packed matrix.
    pub fn pack_with(
        kind: impl Into<BlockKind>,
        rows: usize,
        cols: usize,
        mut read: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        let kind = kind.into();
        check_cols(kind, cols)?;
        let (rb, bb) = (kind.row_bytes(cols), kind.block_bytes());
        let nb = cols / kind.block_elems();
        let groups = rows.div_ceil(PACK);
        let rec = record_bytes(kind);
        let mut data = vec![0u8; groups * nb * rec];
        let mut chunk = vec![0u8; PACK * rb];
        for g in 0..groups {
            let n = PACK.min(rows - g * PACK);
            let chunk = &mut chunk[..n * rb];
            read(g * PACK, chunk)?;
            for l in 0..n {
                for b in 0..nb {
                    let blk = &chunk[l * rb + b * bb..][..bb];
                    scatter(kind, blk, l, &mut data[(g * nb + b) * rec..][..rec]);
                }
            }
        }
        Ok(PackedRows {
            kind,
            rows,
            cols,
            data,
        })
    }

    /// Packs several matrices with the same block type and width as one, rows stacked in order
    /// (e.g. the q, k and v projections, so one pass computes all three).
    pub fn stack(
        kind: impl Into<BlockKind>,
        cols: usize,
        parts: &[(usize, &[u8])],
    ) -> Result<Self> {
        let kind = kind.into();
        // One part is packed from where it lies: no copy of a whole matrix at load.
        if let [(rows, bytes)] = parts {
            return Self::pack(kind, *rows, cols, bytes);
        }
        let rows = parts.iter().map(|p| p.0).sum();
        let mut src = Vec::with_capacity(rows * kind.row_bytes(cols));
        for (r, bytes) in parts {
            if bytes.len() != r * kind.row_bytes(cols) {
                return Err(Error::shape(
                    "stacked matrix bytes (rows * row bytes)",
                    &[Some(r * kind.row_bytes(cols))],
                    &[bytes.len()],
                ));
            }
            src.extend_from_slice(bytes);
        }
        Self::pack(kind, rows, cols, &src)
    }

    /// The block type.
    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Groups of [`PACK`] rows.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(PACK)
    }

    /// Blocks per row (of 32 columns, or 256 for the K-quants).
    pub fn blocks(&self) -> usize {
        self.cols / self.kind.block_elems()
    }

    /// Bytes held (the file's bytes for these rows, plus the padding of the last group).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// Row `r`'s block `b` as GGUF bytes into `blk` (`block_bytes` long).
    fn block(&self, r: usize, b: usize, blk: &mut [u8]) {
        let (g, l, rec) = (r / PACK, r % PACK, record_bytes(self.kind));
        let at = (g * self.blocks() + b) * rec;
        gather(self.kind, &self.data[at..at + rec], l, blk);
    }

    /// Row `r` dequantized into `out` (`cols` values): an embedding lookup. `None` if `r` is out of
    /// range or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Option<()> {
        if r >= self.rows || out.len() != self.cols {
            return None;
        }
        let mut blk = [0u8; 256];
        let blk = &mut blk[..self.kind.block_bytes()];
        for (b, o) in out.chunks_exact_mut(self.kind.block_elems()).enumerate() {
            self.block(r, b, blk);
            blocks::dequantize_block(self.kind, blk, o);
        }
        Some(())
    }
}

/// Input blocks `x` holds for products with `kind`.
pub(crate) fn input_blocks(kind: BlockKind, x: &QuantizedRow) -> usize {
    if kind.inputs().k {
        x.k.blocks().min(x.k.q.len() / QK_K)
    } else {
        x.blocks().min(x.q.len() / QK)
    }
}

/// The scalar reference of [`gemm`]: every lane's blocks through the per-row block reference.
pub(crate) fn gemm_scalar(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let nx = xs.len();
    let mut blk = [0u8; 256];
    let blk = &mut blk[..p.kind.block_bytes()];
    for (gi, g) in groups.enumerate() {
        for (r, x) in xs.iter().enumerate() {
            let Some(o) = out.get_mut((gi * nx + r) * PACK..(gi * nx + r + 1) * PACK) else {
                return;
            };
            let nb = p.blocks().min(input_blocks(p.kind, x));
            for (l, o) in o.iter_mut().enumerate() {
                let mut acc = 0f32;
                for b in 0..nb {
                    p.block(g * PACK + l, b, blk);
                    acc = blocks::dot_block(p.kind, blk, x, b, acc);
                }
                *o = acc;
            }
        }
    }
}

/// The groups of `p` a kernel may compute into `out` for `nx` input rows: `groups` cut to the
/// matrix and to what `out` holds.
pub(crate) fn clamp_groups(
    p: &PackedRows,
    groups: Range<usize>,
    nx: usize,
    out: &[f32],
) -> Range<usize> {
    let end = groups.end.min(p.groups());
    let fit = if nx == 0 { 0 } else { out.len() / (nx * PACK) };
    let end = end.min(groups.start + fit);
    groups.start.min(end)..end
}

#[cfg(target_arch = "x86_64")]
mod prefetch;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_more;
