//! Column-major GGUF blocks of every block type the dense decoder runs, for input-sparse
//! products `y = W x` that read only the input channels (columns) whose quantized value is
//! nonzero. What skips: one input channel's column per zero input (`Kernels::column_blocks_q8`,
//! against a Q8 or Q8_K input).
//!
//! A `rows x cols` matrix is stored in slabs of [`SLAB_ROWS`] rows (rows padded to
//! [`UNIT_ROWS`]), each slab a matrix of its own, so that a product over one slab's rows reads
//! its kept channels as one forward stream with gaps. A slab is stored block by block (32
//! columns, 256 for the K-quants). A block holds its per-row scale planes (one f16 value per row
//! of the slab: Q4_0/Q5_0/Q8_0 `d`, Q4_1/Q5_1 `d, m`, Q4_K/Q5_K `d, dmin`, Q6_K `d`), then its
//! scale groups (32 columns, 16 for Q6_K) in order. A group holds its per-row sub-block planes
//! (Q4_K/Q5_K: the 6-bit scale and minimum as one byte each, `sc` then `m`; Q6_K: the `i8`
//! scale) and then its columns. A column is one contiguous run over the slab's rows: per 32
//! rows, one *unit* of
//! - 16 bytes of nibbles: byte `l` holds row `l` in its low nibble and row `l + 16` in its high
//!   nibble;
//! - Q5 types: a `u32` of the rows' fifth bits (bit `l`: row `l`); Q6_K: that, then one of the
//!   sixth bits;
//! - Q8_0 instead: 32 bytes, one per row, offset by 128 (`w ^ 0x80`).
//!
//! Values are stored unsigned: `u = q + offset` with ggml's offsets (Q4_0 8, Q5_0 16, Q8_0 128,
//! Q6_K 32, none for the types with a minimum), which come back out as `offset * sum(x)` over
//! the group. Every weight keeps the file's value; only the K-quants' packed 6-bit scales are
//! widened to a byte each (Q4_K 148 bytes per 256 weights instead of 144, Q5_K 180 instead of
//! 176).
//!
//! The skip unit is one channel because the channels of an activation are small or large
//! independently of each other: a fixed grouping of channels into skip units (even after sorting
//! each scale group's channels by their mean magnitude) drops 4-5 times the input's energy at
//! the same sparsity (Qwen2.5-Coder-0.5B, 40%: 12.8% of `x`'s energy against 2.7%). A skipped
//! channel is one run per slab never read (16 bytes per 32 rows for the 4-bit types), a group
//! without a kept channel skips its planes too, and a block without one is not touched. The
//! SIMD kernel gathers four kept channels of a group at a time into the operand of `vpdpbusd`
//! (16 rows x 4 channels per vector, see `x86`).
//!
//! The product is exact per row and group in integers and scaled in the dense kernel's order
//! ([`crate::cpu::dot_row`]): over an input whose skipped channels are zero, it equals the dense
//! product of that input bit for bit, on every tier and row split. Several input rows (a prompt)
//! go through one batched product over the union of their channels ([`ColumnBlocksRowsFn`]): a
//! channel where a row is zero adds nothing to its sums, so each row's result is its own product's
//! bit for bit.

use std::ops::Range;

use super::blocks::{self, h16, BlockKind};
use super::quant::{QuantizedRow, QK, QK_K};
use crate::error::{Error, Result};

#[cfg(target_arch = "x86_64")]
pub(crate) mod row_x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Rows per unit of a column: rows are padded to a multiple of it, and threads split the rows
/// by units.
pub const UNIT_ROWS: usize = 32;

/// Rows per slab. A slab's integer sums fit the kernels' per-thread arrays (64 KiB each, in L2),
/// and one slab's kept channels are read as one forward stream with gaps. Longer runs stream DRAM
/// better: on Qwen2.5-1.5B's gate (8960 rows, 60% of the channels kept) 8192-row slabs read
/// 73-75% of the dense kernel's GB/s, 4096-row slabs 70-72%, 2048-row slabs less; 16384 rows
/// hold every FFN matrix of the 0.5-7B models in one slab (at 8192, the gate's last 768 rows
/// were a slab of 384-byte runs).
pub const SLAB_ROWS: usize = 16384;

/// Bytes past the last unit that a kernel may read (and ignore).
const SLACK: usize = 32;

/// A cache line: the layout starts on one (the allocation holds this many bytes more).
const LINE: usize = 64;

/// How a block type sits in the column layout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Format {
    /// Bits per stored value (4, 5, 6 or 8).
    pub bits: u32,
    /// Bytes of one unit (32 rows of a column).
    pub unit: usize,
    /// Columns per scale group.
    pub group: usize,
    /// ggml's offset of the stored integers.
    pub offset: i32,
    /// f16 planes per block.
    pub heads: usize,
    /// Byte planes per group.
    pub planes: usize,
}

pub(crate) const fn format(kind: BlockKind) -> Format {
    let (bits, offset) = match kind {
        BlockKind::Q4_0 => (4, 8),
        BlockKind::Q4_1 | BlockKind::Q4K => (4, 0),
        BlockKind::Q5_0 => (5, 16),
        BlockKind::Q5_1 | BlockKind::Q5K => (5, 0),
        BlockKind::Q6K => (6, 32),
        BlockKind::Q8_0 => (8, 128),
    };
    let unit = match bits {
        4 => 16,
        5 => 20,
        6 => 24,
        _ => 32,
    };
    let (group, heads, planes) = match kind {
        BlockKind::Q4_1 | BlockKind::Q5_1 => (QK, 2, 0),
        BlockKind::Q4K | BlockKind::Q5K => (QK, 2, 2),
        BlockKind::Q6K => (16, 1, 1),
        _ => (QK, 1, 0),
    };
    Format {
        bits,
        unit,
        group,
        offset,
        heads,
        planes,
    }
}

/// A `rows x cols` matrix of GGUF blocks stored column-major for input-sparse products (see
/// the module docs).
pub struct ColumnBlocks {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    /// `rows` rounded up to a multiple of [`UNIT_ROWS`].
    pad: usize,
    /// Rows per slab (a multiple of [`UNIT_ROWS`], at most [`SLAB_ROWS`]).
    slab_rows: usize,
    /// The slabs, one after another, from `data[start]`: the first byte on a cache line, so
    /// the kernels' 32-byte loads of a run never straddle two lines (every run starts on a
    /// multiple of 16 bytes from it).
    data: Vec<u8>,
    start: usize,
}

impl Clone for ColumnBlocks {
    fn clone(&self) -> Self {
        let mut m = ColumnBlocks {
            data: Vec::new(),
            start: 0,
            ..*self
        };
        let n = self.bytes();
        m.alloc(n);
        m.data_mut()[..n].copy_from_slice(&self.data()[..n]);
        m
    }
}

impl std::fmt::Debug for ColumnBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColumnBlocks")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Where the parts of a slab's blocks, groups and columns lie (byte offsets into the slab).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Offsets {
    pub pad: usize,
    /// Bytes of one column's run.
    pub column: usize,
    pub group: usize,
    pub head: usize,
    pub block: usize,
    pub groups_per_block: usize,
    /// Columns per group.
    pub columns: usize,
}

impl Offsets {
    fn new(kind: BlockKind, pad: usize) -> Self {
        let f = format(kind);
        let column = pad / UNIT_ROWS * f.unit;
        let group = f.planes * pad + f.group * column;
        let head = 2 * f.heads * pad;
        let groups_per_block = kind.block_elems() / f.group;
        debug_assert!(groups_per_block.is_power_of_two() && f.group.is_power_of_two());
        Offsets {
            pad,
            column,
            group,
            head,
            block: head + groups_per_block * group,
            groups_per_block,
            columns: f.group,
        }
    }

    /// Where head plane `h` of block `b` starts.
    pub fn head(&self, b: usize, h: usize) -> usize {
        b * self.block + 2 * h * self.pad
    }

    /// Where byte plane `p` of group `g` (counted over the whole row) starts.
    #[inline(always)]
    pub fn plane(&self, g: usize, p: usize) -> usize {
        // Powers of two (1, 8 or 16 groups per block): shifts, not divisions, as the kernels
        // find each kept channel's run with this.
        let shift = self.groups_per_block.trailing_zeros();
        let (b, j) = (g >> shift, g & (self.groups_per_block - 1));
        b * self.block + self.head + j * self.group + p * self.pad
    }

    /// Where column `c`'s run starts.
    #[inline(always)]
    pub fn column(&self, c: usize, planes: usize) -> usize {
        // 32 or 16 columns per group.
        let shift = self.columns.trailing_zeros();
        self.plane(c >> shift, planes) + (c & (self.columns - 1)) * self.column
    }
}

/// Writes value `u` (unsigned, `bits` wide) of row `l` (of 32) into a column's `unit`.
fn put(bits: u32, unit: &mut [u8], l: usize, u: u8) {
    if bits == 8 {
        unit[l] = u;
        return;
    }
    unit[l % 16] |= (u & 0xF) << (4 * (l / 16));
    for bit in 4..bits {
        let at = 16 + 4 * (bit as usize - 4) + l / 8;
        unit[at] |= (u >> bit & 1) << (l % 8);
    }
}

impl ColumnBlocks {
    /// Lays out `rows` rows of `cols` weights given in GGUF's row-major block layout (`src` holds
    /// `rows * kind.row_bytes(cols)` bytes; `cols` a positive multiple of the block size). A
    /// non-finite scale or minimum is a typed error naming its row.
    pub fn from_blocks(kind: BlockKind, rows: usize, cols: usize, src: &[u8]) -> Result<Self> {
        Self::from_blocks_in_slabs(kind, rows, cols, src, SLAB_ROWS)
    }

    /// [`ColumnBlocks::from_blocks`] in slabs of `slab_rows` rows (a positive multiple of
    /// [`UNIT_ROWS`], at most [`SLAB_ROWS`]): with one slab per thread's share of the rows
    /// ([`ColumnBlocks::thread_slab_rows`]), each thread reads its kept channels as one forward
    /// stream of its own instead of every thread a piece of each channel's run.
    pub fn from_blocks_in_slabs(
        kind: BlockKind,
        rows: usize,
        cols: usize,
        src: &[u8],
        slab_rows: usize,
    ) -> Result<Self> {
        if slab_rows == 0 || !slab_rows.is_multiple_of(UNIT_ROWS) || slab_rows > SLAB_ROWS {
            return Err(Error::shape(
                "column blocks slab rows (a positive multiple of 32, at most SLAB_ROWS)",
                &[None],
                &[slab_rows],
            ));
        }
        if cols == 0 || !cols.is_multiple_of(kind.block_elems()) {
            return Err(Error::shape(
                "column blocks columns (a positive multiple of the block size)",
                &[None],
                &[cols],
            ));
        }
        let rb = kind.row_bytes(cols);
        if src.len() != rows * rb {
            return Err(Error::shape(
                "column blocks bytes (rows * row bytes)",
                &[Some(rows * rb)],
                &[src.len()],
            ));
        }
        let bb = kind.block_bytes();
        if let Some(at) = src.chunks_exact(bb).enumerate().find_map(|(i, blk)| {
            let bad = kind
                .half_offsets()
                .iter()
                .find(|&&at| !h16(blk, at).is_finite());
            bad.map(|&at| i * bb + at)
        }) {
            return Err(Error::non_finite("column blocks scales", at));
        }
        let pad = rows.div_ceil(UNIT_ROWS) * UNIT_ROWS;
        let mut m = ColumnBlocks {
            kind,
            rows,
            cols,
            pad,
            slab_rows,
            data: Vec::new(),
            start: 0,
        };
        let slabs = m.slabs();
        // Slack: the SIMD kernel reads a 5- or 6-bit unit as 32 bytes, past the last unit's end.
        let len: usize = (0..slabs).map(|s| m.slab(s).1.block * m.blocks()).sum();
        m.alloc(len);
        let f = format(kind);
        let heads: &[usize] = match kind {
            BlockKind::Q6K => &[208],
            _ => &[0, 2][..f.heads],
        };
        let elems = kind.block_elems();
        // One unit of rows at a time: a block's values for 32 rows, then each column's unit
        // written whole (row by row, every weight would touch another column's cache line).
        let mut ints = vec![0i32; UNIT_ROWS * QK_K];
        // Where each column's run starts in the current slab: no division per weight.
        let mut runs = Vec::with_capacity(cols);
        for (t, tile) in src.chunks(UNIT_ROWS * rb).enumerate() {
            let r0 = t * UNIT_ROWS;
            let (base, o) = m.slab(r0 / slab_rows);
            if r0.is_multiple_of(slab_rows) {
                runs.clear();
                runs.extend((0..cols).map(|c| o.column(c, f.planes)));
            }
            let (r0, data) = (r0 % slab_rows, &mut m.data_mut()[base..]);
            let at = r0 / UNIT_ROWS * f.unit;
            let n = tile.len() / rb;
            for b in 0..cols / elems {
                for (l, row) in tile.chunks_exact(rb).enumerate() {
                    let (blk, r) = (&row[b * bb..(b + 1) * bb], r0 + l);
                    for (h, &at) in heads.iter().enumerate() {
                        data[o.head(b, h) + 2 * r..][..2].copy_from_slice(&blk[at..at + 2]);
                    }
                    for j in 0..o.groups_per_block {
                        let g = b * o.groups_per_block + j;
                        match kind {
                            BlockKind::Q4K | BlockKind::Q5K => {
                                let (sc, mn) = blocks::scale_min_k4(j, &blk[4..16]);
                                data[o.plane(g, 0) + r] = sc as u8;
                                data[o.plane(g, 1) + r] = mn as u8;
                            }
                            BlockKind::Q6K => data[o.plane(g, 0) + r] = blk[192 + j],
                            _ => {}
                        }
                    }
                    blocks::block_ints(kind, blk, &mut ints[l * elems..(l + 1) * elems]);
                }
                for (i, &run) in runs[b * elems..(b + 1) * elems].iter().enumerate() {
                    let unit = &mut data[run + at..run + at + f.unit];
                    for l in 0..n {
                        put(f.bits, unit, l, (ints[l * elems + i] + f.offset) as u8);
                    }
                }
            }
        }
        Ok(m)
    }

    /// Slab rows that give each of `threads` threads a slab of its own when a dispatch splits
    /// `copies` matrices of `rows` rows among them by chunks of `chunk` rows, one matrix after
    /// the other (as [`crate::cpu::Pool::run_chunks`] does): a thread's share of chunks, or
    /// [`SLAB_ROWS`] when a share holds a whole matrix.
    pub fn thread_slab_rows(rows: usize, copies: usize, threads: usize, chunk: usize) -> usize {
        let chunks = rows.div_ceil(chunk.max(1)) * copies.max(1);
        let share = chunks.div_ceil(threads.max(1)) * chunk.max(1);
        if share >= rows {
            return SLAB_ROWS;
        }
        share.div_ceil(UNIT_ROWS).clamp(1, SLAB_ROWS / UNIT_ROWS) * UNIT_ROWS
    }

    /// Rows per slab.
    pub fn slab_rows(&self) -> usize {
        self.slab_rows
    }

    /// Units per slab.
    pub(crate) fn slab_units(&self) -> usize {
        self.slab_rows / UNIT_ROWS
    }

    /// Slabs of [`ColumnBlocks::slab_rows`] rows (the last one shorter).
    pub(crate) fn slabs(&self) -> usize {
        self.pad.div_ceil(self.slab_rows)
    }

    /// Where slab `s` starts in the data, and its offsets.
    pub(crate) fn slab(&self, s: usize) -> (usize, Offsets) {
        let sr = self.slab_rows;
        let full = Offsets::new(self.kind, sr).block * self.blocks();
        let rows = self.pad.saturating_sub(s * sr).min(sr);
        (s * full, Offsets::new(self.kind, rows))
    }

    /// Blocks per row.
    fn blocks(&self) -> usize {
        self.cols / self.kind.block_elems()
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

    /// Units of [`UNIT_ROWS`] rows: the granularity at which threads split the rows.
    pub fn units(&self) -> usize {
        self.pad / UNIT_ROWS
    }

    /// Bytes of the layout (held: `SLACK` and a cache line more).
    pub fn bytes(&self) -> usize {
        self.data.len() - LINE - SLACK
    }

    /// Bytes a product over `active` reads: its columns, and the planes of the groups and
    /// blocks they fall in.
    pub fn bytes_read(&self, active: &ActiveChannels) -> usize {
        // Per slab the same counts; the slabs' rows add up to `pad`.
        let f = format(self.kind);
        active.channels.len() * self.pad / UNIT_ROWS * f.unit
            + active.groups * f.planes * self.pad
            + active.blocks * 2 * f.heads * self.pad
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.data[self.start..]
    }

    fn data_mut(&mut self) -> &mut [u8] {
        &mut self.data[self.start..]
    }

    /// Zeroed room for `len` bytes of slabs (and [`SLACK`]) from a cache line's start.
    fn alloc(&mut self, len: usize) {
        self.data = vec![0u8; len + SLACK + LINE];
        self.start = self.data.as_ptr().align_offset(LINE).min(LINE);
    }
}

/// The input channels whose quantized value is nonzero, with the number of distinct scale
/// groups and blocks they fall in: what a [`ColumnBlocks`] product reads.
#[derive(Debug, Clone, Default)]
pub struct ActiveChannels {
    pub(crate) channels: Vec<u32>,
    pub(crate) groups: usize,
    pub(crate) blocks: usize,
    /// [`ActiveChannels::union_of`]'s bit set, reused.
    seen: Vec<u64>,
}

impl ActiveChannels {
    /// The nonzero channels of `x` (quantized for `kind`: [`QuantizedRow::quantize_for`] with
    /// `kind.inputs()`).
    pub fn of(&mut self, kind: BlockKind, x: &QuantizedRow) {
        let q = if kind.inputs().k { &x.k.q } else { &x.q };
        self.channels.clear();
        let nonzero = q.iter().enumerate().filter(|(_, &v)| v != 0);
        self.channels.extend(nonzero.map(|(c, _)| c as u32));
        self.count(kind);
    }

    /// The union of `sets` (each from [`ActiveChannels::of`] for a matrix of `kind`): the
    /// channels a product over several rows reads ([`crate::cpu::Kernels::column_blocks_rows_q8`]).
    pub fn union_of<'a>(&mut self, kind: BlockKind, sets: impl IntoIterator<Item = &'a Self>) {
        // A bit per channel, then the set bits in order: no sort of rows x channels entries.
        self.seen.clear();
        for s in sets {
            for &c in &s.channels {
                let w = c as usize / 64;
                if w >= self.seen.len() {
                    self.seen.resize(w + 1, 0);
                }
                self.seen[w] |= 1 << (c % 64);
            }
        }
        self.channels.clear();
        for (w, &bits) in self.seen.iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                self.channels.push((64 * w) as u32 + b.trailing_zeros());
                b &= b - 1;
            }
        }
        self.count(kind);
    }

    /// Counts the distinct groups and blocks of the channels.
    fn count(&mut self, kind: BlockKind) {
        self.groups = runs(&self.channels, format(kind).group).count();
        self.blocks = runs(&self.channels, kind.block_elems()).count();
    }

    /// The active channels, ascending.
    pub fn channels(&self) -> &[u32] {
        &self.channels
    }

    /// Distinct scale groups among them.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Distinct blocks among them.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// The product's kernel: rows of units `units` of `m` against `x` over the `active` channels
/// into `out` (`units.len() * 32` values, overwritten). `active` must hold every channel where
/// `x` is nonzero (as [`ActiveChannels::of`] makes it); arguments that do not fit are cut to
/// what fits.
pub(crate) type ColumnBlocksFn =
    fn(&ColumnBlocks, Range<usize>, &QuantizedRow, &ActiveChannels, &mut [f32]);

/// What a product may compute: `units` cut to the matrix and to `out`, or `None` when `x` does
/// not hold the matrix's input (a row quantized for another block type, or too short).
pub(crate) fn clamp(
    m: &ColumnBlocks,
    units: Range<usize>,
    x: &QuantizedRow,
    out: &[f32],
) -> Option<Range<usize>> {
    let end = units
        .end
        .min(m.units())
        .min(units.start + out.len() / UNIT_ROWS);
    holds(m, x).then_some(units.start.min(end)..end)
}

/// Whether `x` holds `m`'s input: quantized for its block type, `m.cols()` values.
fn holds(m: &ColumnBlocks, x: &QuantizedRow) -> bool {
    match m.kind.inputs().k {
        true => x.k.blocks() * QK_K == m.cols && x.k.q.len() == m.cols,
        false => x.blocks() * QK == m.cols && x.q.len() == m.cols && x.sum.len() * QK == m.cols,
    }
}

/// The batched product's kernel: [`ColumnBlocksFn`] for every row of `xs` over the union of
/// their active channels (`active` must hold every channel where some row is nonzero, as
/// [`ActiveChannels::union_of`] makes it), into `out` in pieces of `per` units: unit `u` (counted
/// from `units.start`) of row `r` starts at `(u / per) * rows * per * 32 + r * per * 32 + (u %
/// per) * 32`. Arguments that do not fit are cut to what fits (whole pieces of `out`).
pub(crate) type ColumnBlocksRowsFn =
    fn(&ColumnBlocks, Range<usize>, &[QuantizedRow], &ActiveChannels, usize, &mut [f32]);

/// What a batched product may compute: `units` cut to the matrix and to the whole pieces of
/// `out`, or `None` when a row does not hold the matrix's input or `per` is 0.
pub(crate) fn clamp_rows(
    m: &ColumnBlocks,
    units: Range<usize>,
    xs: &[QuantizedRow],
    per: usize,
    out: &[f32],
) -> Option<Range<usize>> {
    let piece = (xs.len() * per * UNIT_ROWS).max(1);
    let end = units
        .end
        .min(m.units())
        .min(units.start + out.len() / piece * per);
    (per > 0 && xs.iter().all(|x| holds(m, x))).then_some(units.start.min(end)..end)
}

/// Where unit `u` (counted from the first) of row `r` of `rows` starts in a batched product's
/// output (see [`ColumnBlocksRowsFn`]).
#[inline(always)]
pub(crate) fn piece_at(u: usize, r: usize, rows: usize, per: usize) -> usize {
    ((u / per * rows + r) * per + u % per) * UNIT_ROWS
}

/// The portable batched product (see [`ColumnBlocksRowsFn`]): [`product_scalar`] per unit and
/// row. A channel where a row is zero adds nothing to its sums, so each row's result is its own
/// product's bit for bit.
pub(crate) fn product_rows_scalar(
    m: &ColumnBlocks,
    units: Range<usize>,
    xs: &[QuantizedRow],
    active: &ActiveChannels,
    per: usize,
    out: &mut [f32],
) {
    let Some(units) = clamp_rows(m, units, xs, per, out) else {
        return;
    };
    for (i, u) in units.enumerate() {
        for (r, x) in xs.iter().enumerate() {
            let at = piece_at(i, r, xs.len(), per);
            product_scalar(m, u..u + 1, x, active, &mut out[at..at + UNIT_ROWS]);
        }
    }
}

/// Splits an ascending channel list into runs of one unit of `per` channels each (a group, a
/// block).
pub(crate) fn runs(channels: &[u32], per: usize) -> impl Iterator<Item = &[u32]> {
    let per = per as u32;
    channels.chunk_by(move |a, b| a / per == b / per)
}

/// The portable product (see [`ColumnBlocksFn`]), the reference of the SIMD kernels and the
/// form tiers without one run: per unit of 32 rows and group, the exact integer sums over the
/// active channels (each channel's unit unpacked to 32 values; loops the compiler vectorizes),
/// scaled as [`crate::cpu::dot_row`]. Allocation-free.
pub(crate) fn product_scalar(
    m: &ColumnBlocks,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveChannels,
    out: &mut [f32],
) {
    let Some(units) = clamp(m, units, x, out) else {
        return;
    };
    let (kind, f) = (m.kind, format(m.kind));
    let k = kind.inputs().k;
    let xq: &[i8] = if k { &x.k.q } else { &x.q };
    let (qpg, qpb) = (f.group, kind.block_elems());
    for (u, acc) in units.clone().zip(out.chunks_exact_mut(UNIT_ROWS)) {
        let (base, o) = m.slab(u / m.slab_units());
        let (data, r0) = (&m.data()[base..], u % m.slab_units() * UNIT_ROWS);
        let at = r0 / UNIT_ROWS * f.unit;
        acc.fill(0.0);
        for block in runs(&active.channels, qpb) {
            let b = block[0] as usize / qpb;
            let (mut sumi, mut summ) = ([0i32; UNIT_ROWS], [0i32; UNIT_ROWS]);
            let mut isum = [0i32; UNIT_ROWS];
            for group in runs(block, qpg) {
                let g = group[0] as usize / qpg;
                isum = [0; UNIT_ROWS];
                for &c in group {
                    let unit = &data[o.column(c as usize, f.planes) + at..][..f.unit];
                    let xv = xq[c as usize] as i32;
                    for (s, v) in isum.iter_mut().zip(unpack(f.bits, unit)) {
                        *s += v as i32 * xv;
                    }
                }
                if !k {
                    continue;
                }
                let sc = &data[o.plane(g, 0) + r0..][..UNIT_ROWS];
                if kind == BlockKind::Q6K {
                    let off = f.offset * x.k.bsum[g] as i32;
                    for l in 0..UNIT_ROWS {
                        sumi[l] += sc[l] as i8 as i32 * (isum[l] - off);
                    }
                } else {
                    let bsum = x.k.bsum[2 * g] as i32 + x.k.bsum[2 * g + 1] as i32;
                    let mn = &data[o.plane(g, 1) + r0..][..UNIT_ROWS];
                    for l in 0..UNIT_ROWS {
                        sumi[l] += sc[l] as i32 * isum[l];
                        summ[l] += mn[l] as i32 * bsum;
                    }
                }
            }
            let head = |h: usize, l: usize| h16(data, o.head(b, h) + 2 * (r0 + l));
            for (l, a) in acc.iter_mut().enumerate() {
                *a = if k {
                    let dx = x.k.d[b];
                    let v = (sumi[l] as f32).mul_add(head(0, l) * dx, *a);
                    match kind {
                        BlockKind::Q6K => v,
                        _ => (-(summ[l] as f32)).mul_add(head(1, l) * dx, v),
                    }
                } else {
                    let s = isum[l] - f.offset * x.sum[b];
                    match kind {
                        BlockKind::Q4_1 | BlockKind::Q5_1 => {
                            *a + ((s as f32 * head(0, l)) * x.d[b] + head(1, l) * x.s[b])
                        }
                        _ => (s as f32).mul_add(head(0, l) * x.d[b], *a),
                    }
                };
            }
        }
    }
}

/// The 32 stored (unsigned) values of one unit, rows in order (the inverse of [`put`]).
#[inline(always)]
fn unpack(bits: u32, unit: &[u8]) -> [u8; UNIT_ROWS] {
    let mut v = [0u8; UNIT_ROWS];
    if bits == 8 {
        v.copy_from_slice(&unit[..UNIT_ROWS]);
        return v;
    }
    for l in 0..16 {
        v[l] = unit[l] & 0xF;
        v[l + 16] = unit[l] >> 4;
    }
    for bit in 4..bits {
        let at = 16 + 4 * (bit as usize - 4);
        let mask = u32::from_le_bytes([unit[at], unit[at + 1], unit[at + 2], unit[at + 3]]);
        for (l, v) in v.iter_mut().enumerate() {
            *v |= (((mask >> l) & 1) as u8) << bit;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout starts on a cache line, also in a clone (another allocation), and holds the
    /// same bytes.
    #[test]
    fn layout_starts_on_a_line() {
        let kind = BlockKind::Q4_0;
        let src = vec![0u8; 40 * kind.row_bytes(64)];
        let m = ColumnBlocks::from_blocks(kind, 40, 64, &src).unwrap();
        let c = m.clone();
        for m in [&m, &c] {
            assert_eq!(m.data().as_ptr() as usize % LINE, 0);
            assert!(m.data().len() >= m.bytes() + SLACK);
        }
        assert_eq!(m.data()[..m.bytes()], c.data()[..c.bytes()]);
    }
}
