//! One matrix of the input-sparse FFN, column-major, and one product's input.
//!
//! GGUF weights of every block type the dense decoder runs are the file's blocks laid out as
//! [`ColumnBlocks`] (skip unit: one input channel). Its SIMD kernel needs AVX-512 VNNI with VBMI
//! and BITALG; on other tiers Q4_0, Q4_1 and Q8_0 blocks take the older [`ColumnMatrix`] layout,
//! which has AVX2 kernels (the portable column-block product is 7-8x slower than the dense
//! decoder there), and the other types the portable product, with a warning (on
//! Qwen2.5-Coder-0.5B at the AVX2 tier its FFN takes 337 ms per token against dense's 25). Float weights are a
//! [`ColumnMatrix`] in f32, f16 or bf16.
//!
//! A GGUF matrix whose sparse product would not beat the dense one at the fraction of channels
//! the rule keeps ([`super::plan`]) is stored as the dense decoder's packed rows instead
//! ([`Layout::Rows`]): its product reads every column and its input is never masked, since
//! skipping channels would save no time and cost accuracy.

use std::ops::Range;

use candle_core::quantized::QTensor;

use crate::cpu::{
    dequantize_blocks, gemm, ActiveChannels, ActiveColumns, BlockKind, ColumnBlocks, ColumnMatrix,
    FloatRows, Kernels, PackedRows, Pool, QuantizedRow, CHUNK, PACK, SLAB_ROWS,
};
use crate::error::{Error, Result};

/// Slab rows for a block-column matrix of `rows` rows dispatched with `copies - 1` others of its
/// shape on `threads` threads by chunks of [`CHUNK`] rows: one slab per thread's share.
pub(super) fn slab_rows(rows: usize, copies: usize, threads: usize) -> usize {
    ColumnBlocks::thread_slab_rows(rows, copies, threads, CHUNK)
}

/// A matrix `[rows, cols]` (`y = W x`, `x` of `cols` values) stored by input column.
pub(super) enum Columns {
    /// The file's blocks, with each column's Euclidean norm (WINA's factor).
    Blocks { m: ColumnBlocks, norms: Vec<f32> },
    /// Floats, or Q4_0 / Q4_1 / Q8_0 blocks on tiers without a column-block SIMD kernel.
    Matrix(ColumnMatrix),
    /// The file's blocks as the dense decoder's packed rows ([`Layout::Rows`]), with each
    /// column's norm (the score of WINA's calibration). With `masked` its input is masked like
    /// a column layout's (for measuring the rule's whole effect on quality): it still reads
    /// every byte.
    Rows {
        m: PackedRows,
        norms: Vec<f32>,
        masked: bool,
    },
    /// Float weights row-major ([`Layout::Rows`]), read whole by the four-row dot kernels;
    /// `masked` as for [`Columns::Rows`].
    FloatRows { m: FloatRows, masked: bool },
}

/// How one GGUF matrix of an input-sparse layer is stored, and so what its products read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// By input channel: a product reads only the channels its masked input keeps.
    Columns,
    /// The dense decoder's packed rows: a product reads the whole matrix, over the unmasked
    /// input (its threshold is not applied: skipping would save nothing).
    Rows,
}

impl Layout {
    /// `columns` or `rows`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Columns => "columns",
            Layout::Rows => "rows",
        }
    }
}

impl std::fmt::Debug for Columns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Columns::Blocks { m, .. } => write!(f, "{} blocks", m.kind()),
            Columns::Matrix(m) => write!(f, "{:?}", m.storage()),
            Columns::Rows { m, .. } => write!(f, "{} rows", m.kind()),
            Columns::FloatRows { m, .. } => write!(f, "{:?} rows", m.storage()),
        }
    }
}

impl Columns {
    /// A GGUF tensor `[rows, cols]` (any block type of [`BlockKind`]) laid out by column for
    /// `k`'s tier.
    pub(super) fn from_qtensor(
        t: &QTensor,
        name: &str,
        rows: usize,
        cols: usize,
        k: &Kernels,
    ) -> Result<Self> {
        Self::from_qtensor_as(t, name, rows, cols, k, Layout::Columns, SLAB_ROWS)
    }

    /// [`Columns::from_qtensor`] in `layout`, block columns in slabs of `slab_rows` rows
    /// ([`ColumnBlocks::thread_slab_rows`]).
    pub(super) fn from_qtensor_as(
        t: &QTensor,
        name: &str,
        rows: usize,
        cols: usize,
        k: &Kernels,
        layout: Layout,
        slab_rows: usize,
    ) -> Result<Self> {
        let (kind, data) = blocks(t, name, rows, cols)?;
        match layout {
            Layout::Columns => Self::from_blocks(kind, rows, cols, &data, name, k, slab_rows),
            Layout::Rows => Self::rows_from_blocks(kind, rows, cols, &data, name),
        }
    }

    /// `rows` rows of `cols` weights in GGUF's block layout as packed rows ([`Layout::Rows`]).
    pub(super) fn rows_from_blocks(
        kind: BlockKind,
        rows: usize,
        cols: usize,
        data: &[u8],
        name: &str,
    ) -> Result<Self> {
        let m = PackedRows::pack(kind, rows, cols, data)
            .map_err(|e| Error::config(name, e.to_string()))?;
        Ok(Columns::Rows {
            norms: column_norms(kind, cols, data),
            m,
            masked: false,
        })
    }

    /// Whether products take the masked input: always by column, as rows only when
    /// [`Columns::set_masked`] says so.
    pub(super) fn reads_mask(&self) -> bool {
        !matches!(
            self,
            Columns::Rows { masked: false, .. } | Columns::FloatRows { masked: false, .. }
        )
    }

    /// Rows: whether their input is masked (nothing for the column layouts, always masked).
    pub(super) fn set_masked(&mut self, on: bool) {
        if let Columns::Rows { masked, .. } | Columns::FloatRows { masked, .. } = self {
            *masked = on;
        }
    }

    /// How the matrix is stored.
    pub(super) fn layout(&self) -> Layout {
        match self {
            Columns::Rows { .. } | Columns::FloatRows { .. } => Layout::Rows,
            _ => Layout::Columns,
        }
    }

    /// `rows` rows of `cols` weights in GGUF's row-major block layout, laid out by column for
    /// `k`'s tier (errors name the matrix `name`), block columns in slabs of `slab_rows` rows.
    pub(super) fn from_blocks(
        kind: BlockKind,
        rows: usize,
        cols: usize,
        data: &[u8],
        name: &str,
        k: &Kernels,
        slab_rows: usize,
    ) -> Result<Self> {
        let named = |e: Error| Error::config(name, e.to_string());
        match kind.quant_kind() {
            Some(q) if !k.has_column_blocks_simd() => {
                return ColumnMatrix::from_blocks(q, rows, cols, data)
                    .map(Columns::Matrix)
                    .map_err(named)
            }
            _ => {}
        }
        if !k.has_column_blocks_simd() {
            static SLOW: std::sync::Once = std::sync::Once::new();
            SLOW.call_once(|| {
                tracing::warn!(
                    "input-sparse matrices other than Q4_0, Q4_1 and Q8_0 (here {kind}) on the \
                     {} tier run the portable column-block product, about 10x slower than the \
                     dense decoder (its SIMD kernel needs AVX-512 VNNI with VBMI and BITALG)",
                    k.tier()
                )
            });
        }
        let m =
            ColumnBlocks::from_blocks_in_slabs(kind, rows, cols, data, slab_rows).map_err(named)?;
        Ok(Columns::Blocks {
            norms: column_norms(kind, cols, data),
            m,
        })
    }

    pub(super) fn rows(&self) -> usize {
        match self {
            Columns::Blocks { m, .. } => m.rows(),
            Columns::Matrix(m) => m.rows(),
            Columns::Rows { m, .. } => m.rows(),
            Columns::FloatRows { m, .. } => m.rows(),
        }
    }

    pub(super) fn cols(&self) -> usize {
        match self {
            Columns::Blocks { m, .. } => m.cols(),
            Columns::Matrix(m) => m.cols(),
            Columns::Rows { m, .. } => m.cols(),
            Columns::FloatRows { m, .. } => m.cols(),
        }
    }

    /// Output chunks of [`CHUNK`] rows: how the pool splits a product.
    pub(super) fn chunks(&self) -> usize {
        self.rows().div_ceil(CHUNK)
    }

    /// Drops share `t` of `n` of the matrix's bytes from every cache ([`crate::cpu::evict`]);
    /// `false` where the target cannot.
    pub(super) fn evict_share(&self, t: usize, n: usize) -> bool {
        match self {
            Columns::Blocks { m, .. } => crate::cpu::evict_share(m.data(), t, n),
            Columns::Rows { m, .. } => crate::cpu::evict_share(m.data(), t, n),
            Columns::Matrix(m) => m.evict_share(t, n),
            Columns::FloatRows { m, .. } => m.evict_share(t, n),
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Columns::Blocks { m, .. } => m.bytes(),
            Columns::Matrix(m) => m.bytes(),
            Columns::Rows { m, .. } => m.bytes(),
            Columns::FloatRows { m, .. } => m.bytes(),
        }
    }

    /// Each column's Euclidean norm.
    pub(super) fn norms(&self) -> &[f32] {
        match self {
            Columns::Blocks { norms, .. } | Columns::Rows { norms, .. } => norms,
            Columns::Matrix(m) => m.column_norms(),
            Columns::FloatRows { m, .. } => m.column_norms(),
        }
    }

    /// The block type, for block matrices.
    pub(super) fn kind(&self) -> Option<BlockKind> {
        match self {
            Columns::Blocks { m, .. } => Some(m.kind()),
            Columns::Rows { m, .. } => Some(m.kind()),
            Columns::Matrix(_) | Columns::FloatRows { .. } => None,
        }
    }

    /// Whether one [`Input`] made for `self` also serves `other`.
    pub(super) fn same_input(&self, other: &Columns) -> bool {
        let quant = |c: &Columns| matches!(c, Columns::Matrix(m) if m.quant().is_some());
        self.kind() == other.kind()
            && quant(self) == quant(other)
            && self.layout() == other.layout()
    }

    /// Bytes a product over `i` reads (`i` made for this matrix).
    pub(super) fn bytes_read(&self, i: &Input) -> usize {
        self.bytes_of(&i.channels, &i.columns)
    }

    /// Bytes row `r` of `i` reads on its own (what decoding it alone reads).
    pub(super) fn row_bytes_read(&self, i: &Inputs, r: usize) -> usize {
        self.bytes_of(&i.channels[r], &i.columns[r])
    }

    fn bytes_of(&self, channels: &ActiveChannels, columns: &ActiveColumns) -> usize {
        match self {
            Columns::Blocks { m, .. } => m.bytes_read(channels),
            Columns::Matrix(m) => m.bytes_read(columns.columns().len(), columns.blocks()),
            Columns::Rows { m, .. } => m.bytes(),
            Columns::FloatRows { m, .. } => m.bytes(),
        }
    }

    /// Bytes a product over an input with no zero reads.
    pub(super) fn dense_bytes(&self) -> usize {
        match self {
            Columns::Blocks { m, .. } => m.bytes(),
            Columns::Matrix(m) => m.bytes_read(m.cols(), m.cols().div_ceil(crate::cpu::QK)),
            Columns::Rows { m, .. } => m.bytes(),
            Columns::FloatRows { m, .. } => m.bytes(),
        }
    }

    /// `out = W x` for the output rows of `chunks` (`out` holds `chunks.len() * CHUNK`
    /// values; rows past the matrix's are left as they are), `x` made for this matrix.
    pub(super) fn product(&self, k: &Kernels, chunks: Range<usize>, x: &Input, out: &mut [f32]) {
        match self {
            Columns::Blocks { m, .. } => {
                let per = CHUNK / crate::cpu::UNIT_ROWS;
                let units = chunks.start * per..chunks.end * per;
                k.column_blocks_q8(m, units, &x.q, &x.channels, out);
            }
            Columns::Matrix(m) => {
                crate::cpu::column_product(k, m, chunks, &x.x, &x.q, x.columns.columns(), out)
            }
            Columns::Rows { m, .. } => {
                let per = CHUNK / PACK;
                let groups = chunks.start * per..chunks.end * per;
                gemm(k, m, groups, std::slice::from_ref(&x.q), out);
            }
            Columns::FloatRows { m, .. } => m.product(k, chunks, &x.x, out),
        }
    }

    /// [`Columns::product`] for every row of `xs` at once (made for this matrix), into `out` by
    /// chunk: chunk `c` (counted from `chunks.start`) of row `r` is `out[(c * rows + r) *
    /// CHUNK..][..CHUNK]`. Block matrices read each kept channel of any row once per tile of
    /// rows (the rows' union); each row's result is its own product's bit for bit.
    pub(super) fn product_rows(
        &self,
        k: &Kernels,
        chunks: Range<usize>,
        xs: &Inputs,
        out: &mut [f32],
    ) {
        let n = xs.rows;
        match self {
            Columns::Blocks { m, .. } => {
                let per = CHUNK / crate::cpu::UNIT_ROWS;
                let units = chunks.start * per..chunks.end * per;
                k.column_blocks_rows_q8(m, units, &xs.q[..n], &xs.union, per, out);
            }
            Columns::Matrix(m) => {
                let cols = m.cols();
                for (i, c) in chunks.enumerate() {
                    for r in 0..n {
                        let (x, q) = (&xs.x[r * cols..(r + 1) * cols], &xs.q[r]);
                        let o = &mut out[(i * n + r) * CHUNK..][..CHUNK];
                        let active = xs.columns[r].columns();
                        crate::cpu::column_product(k, m, c..c + 1, x, q, active, o);
                    }
                }
            }
            Columns::Rows { m, .. } => rows_product(k, m, chunks, &xs.q[..n], out),
            Columns::FloatRows { m, .. } => m.product_rows(k, chunks, &xs.x, n, out),
        }
    }
}

/// Input rows per pass of [`rows_product`] over a chunk of packed rows.
const ROWS_TILE: usize = 32;

/// [`Columns::product_rows`] on packed rows: per chunk of output rows and tile of [`ROWS_TILE`]
/// input rows one kernel call (the chunk's weights read once per tile), its group-major output
/// moved into the chunked order. Allocation-free (the tile is on the stack).
fn rows_product(
    k: &Kernels,
    m: &PackedRows,
    chunks: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let n = xs.len();
    let per = CHUNK / PACK;
    let mut tile = [0f32; ROWS_TILE * CHUNK];
    for (i, c) in chunks.enumerate() {
        for r0 in (0..n).step_by(ROWS_TILE) {
            let rs = &xs[r0..n.min(r0 + ROWS_TILE)];
            let t = &mut tile[..rs.len() * CHUNK];
            gemm(k, m, c * per..(c + 1) * per, rs, t);
            // `t` is by group, then row: group `g` of row `r` at `(g * rows + r) * PACK`.
            for (j, v) in t.chunks_exact(PACK).enumerate() {
                let (g, r) = (j / rs.len(), j % rs.len());
                let at = (i * n + r0 + r) * CHUNK + g * PACK;
                out[at..at + PACK].copy_from_slice(v);
            }
        }
    }
}

/// Where value `j` of row `r` (of `rows`) lies in a [`Columns::product_rows`] output that starts
/// at chunk `c0` of the buffer.
pub(super) fn chunked_at(c0: usize, rows: usize, r: usize, j: usize) -> usize {
    ((c0 + j / CHUNK) * rows + r) * CHUNK + j % CHUNK
}

/// A GGUF tensor `[rows, cols]`'s block type and bytes, checked: the shape, and a block type of
/// [`BlockKind`].
pub(super) fn blocks<'a>(
    t: &'a QTensor,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<(BlockKind, std::borrow::Cow<'a, [u8]>)> {
    if t.shape().dims() != [rows, cols] {
        return Err(Error::shape(
            name,
            &[Some(rows), Some(cols)],
            t.shape().dims(),
        ));
    }
    let kind = BlockKind::from_ggml(t.dtype()).ok_or_else(|| {
        Error::config(
            "storage",
            format!(
                "tensor `{name}` is {:?}; input-sparse layers keep Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, \
                 Q4_K, Q5_K and Q6_K blocks",
                t.dtype()
            ),
        )
    })?;
    Ok((kind, t.data()?))
}

/// The Euclidean norm of each of the `cols` columns of row-major blocks `data`.
fn column_norms(kind: BlockKind, cols: usize, data: &[u8]) -> Vec<f32> {
    let mut sq = vec![0f64; cols];
    let mut row = vec![0f32; cols];
    for w in data.chunks_exact(kind.row_bytes(cols)) {
        dequantize_blocks(kind, w, &mut row);
        for (s, &v) in sq.iter_mut().zip(&row) {
            *s += f64::from(v) * f64::from(v);
        }
    }
    sq.into_iter().map(|s| s.sqrt() as f32).collect()
}

/// One product's input: the masked row, its quantized form and the channels it keeps.
#[derive(Debug, Default)]
pub(super) struct Input {
    x: Vec<f32>,
    q: QuantizedRow,
    columns: ActiveColumns,
    channels: ActiveChannels,
}

/// `x` with the entries whose score is at most `t` zeroed (`weight`: per-entry factor of the
/// score, `None` for `|x|`) into `out` (as long as `x`); the whole row if `m` is stored as
/// rows and not [`Columns::set_masked`].
fn mask(m: &Columns, x: &[f32], weight: Option<&[f32]>, t: f32, out: &mut [f32]) {
    if !m.reads_mask() {
        out.copy_from_slice(x);
        return;
    }
    match weight {
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = if v.abs() > t { v } else { 0.0 };
            }
        }
        Some(w) => {
            for ((o, &v), &n) in out.iter_mut().zip(x).zip(w) {
                *o = if v.abs() * n > t { v } else { 0.0 };
            }
        }
    }
}

/// The masked row `x` quantized as `m`'s block type takes it (nothing for float matrices).
fn quantize_row(m: &Columns, x: &[f32], q: &mut QuantizedRow) {
    match m {
        Columns::Blocks { m, .. } => {
            let inputs = m.kind().inputs();
            if inputs.k {
                q.quantize_for(x, inputs);
            } else {
                q.quantize_values(x);
            }
        }
        Columns::Matrix(m) if m.quant().is_some() => q.quantize_values(x),
        Columns::Matrix(_) | Columns::FloatRows { .. } => {}
        Columns::Rows { m, .. } => q.quantize_for(x, m.kind().inputs()),
    }
}

/// The kept channels (block matrices) or columns (the others) of a row quantized by
/// [`quantize_row`]; nothing for packed rows, which read every column.
fn active_of(
    m: &Columns,
    x: &[f32],
    q: &QuantizedRow,
    columns: &mut ActiveColumns,
    channels: &mut ActiveChannels,
) {
    match m {
        Columns::Blocks { m, .. } => channels.of(m.kind(), q),
        Columns::Matrix(m) if m.quant().is_some() => columns.of_quantized(q),
        Columns::Matrix(_) => columns.of_f32(x),
        Columns::Rows { .. } | Columns::FloatRows { .. } => {}
    }
}

/// [`quantize_row`] and [`active_of`].
fn quantize(
    m: &Columns,
    x: &[f32],
    q: &mut QuantizedRow,
    columns: &mut ActiveColumns,
    channels: &mut ActiveChannels,
) {
    quantize_row(m, x, q);
    active_of(m, x, q, columns, channels);
}

impl Input {
    /// `x` with the entries whose score is at most `t` zeroed (`weight`: per-entry factor of the
    /// score, `None` for `|x|`), made for `m`: quantized as its block type takes it.
    pub(super) fn mask(&mut self, x: &[f32], weight: Option<&[f32]>, t: f32, m: &Columns) {
        self.x.resize(x.len(), 0.0);
        mask(m, x, weight, t, &mut self.x);
        quantize(
            m,
            &self.x,
            &mut self.q,
            &mut self.columns,
            &mut self.channels,
        );
    }

    /// The whole row (no mask) quantized for row-major blocks of `kind`: CHESS's up rows.
    pub(super) fn whole(&mut self, x: &[f32], kind: BlockKind) {
        self.x.clear();
        self.x.extend_from_slice(x);
        self.q.quantize_for(x, kind.inputs());
    }

    /// The quantized row.
    pub(super) fn quantized(&self) -> &QuantizedRow {
        &self.q
    }
}

/// Several rows' inputs to one product ([`Columns::product_rows`]): each row masked and
/// quantized as [`Input`] does, and the union of their kept channels. Buffers are reused.
#[derive(Debug, Default)]
pub(super) struct Inputs {
    rows: usize,
    /// The masked rows, `rows * cols`.
    x: Vec<f32>,
    q: Vec<QuantizedRow>,
    columns: Vec<ActiveColumns>,
    channels: Vec<ActiveChannels>,
    union: ActiveChannels,
}

impl Inputs {
    /// [`Input::mask`] for each row of `x` (`rows * m.cols()` values), the rows shared among
    /// `pool`'s threads (each row alone: the bits do not depend on the thread count).
    pub(super) fn mask(
        &mut self,
        x: &[f32],
        weight: Option<&[f32]>,
        t: f32,
        m: &Columns,
        pool: &Pool,
    ) {
        let cols = m.cols();
        let rows = x.len() / cols.max(1);
        self.rows = rows;
        self.x.resize(rows * cols, 0.0);
        if self.q.len() < rows {
            self.q.resize_with(rows, Default::default);
            self.columns.resize_with(rows, Default::default);
            self.channels.resize_with(rows, Default::default);
        }
        let Inputs {
            x: xm,
            q,
            columns,
            channels,
            ..
        } = self;
        let xm = &mut xm[..rows * cols];
        pool.run_chunks(xm, rows, cols, &|r, part| {
            for (xr, o) in x[r.start * cols..]
                .chunks_exact(cols)
                .zip(part.chunks_exact_mut(cols))
            {
                mask(m, xr, weight, t, o);
            }
        });
        let xm = &*xm;
        let row = |r: usize| &xm[r * cols..(r + 1) * cols];
        pool.run_chunks(&mut q[..rows], rows, 1, &|r, part| {
            for (i, q) in r.zip(part) {
                quantize_row(m, row(i), q);
            }
        });
        let q = &q[..rows];
        pool.run_chunks(&mut channels[..rows], rows, 1, &|r, part| {
            let mut none = ActiveColumns::default();
            for (i, c) in r.zip(part) {
                active_of(m, row(i), &q[i], &mut none, c);
            }
        });
        if matches!(m, Columns::Matrix(_)) {
            pool.run_chunks(&mut columns[..rows], rows, 1, &|r, part| {
                let mut none = ActiveChannels::default();
                for (i, c) in r.zip(part) {
                    active_of(m, row(i), &q[i], c, &mut none);
                }
            });
        }
        if let (Some(kind), Layout::Columns) = (m.kind(), m.layout()) {
            self.union.union_of(kind, &self.channels[..rows]);
        }
    }
}
