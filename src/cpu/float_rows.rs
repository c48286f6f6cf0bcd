//! Float weights kept row-major for dense products: the layout an input-sparse FFN gives a float
//! matrix whose input it does not skip ([`crate::layout::Layout::Rows`]). Nothing skips: a
//! product reads every byte once, row by row. f32 rows run the `gemm` crate's matrix-vector product, the one
//! candle's f32 `matmul` runs for a token; f16 and bf16 rows (which `gemm` does not take with
//! an f32 input) run the four-row dot kernels with the rows two groups ahead prefetched to L2.
//!
//! Measured on SmolLM2's FFN, one thread, every layer in turn (the candle adapter's `mlp_swap`
//! bench): by column, f32 read at about half the read bandwidth while candle's `Linear` read at
//! 84-88%; the four-row dot kernels reached 57-69% on f32 (the prefetch took them from 27.8 to
//! about 20 ms a token), `gemm`'s product 89%. On bf16 the dot kernels read at 55-64%, candle at
//! 27-35%.

use std::ops::Range;

use half::{bf16, f16};

use super::column_matrix::{ColumnStorage, CHUNK};
use super::kernels::{Kernels, RowElem};
use crate::error::{Error, Result};

#[derive(Clone)]
enum RowData {
    F32(Aligned<f32>),
    F16(Aligned<f16>),
    BF16(Aligned<bf16>),
}

/// Bytes of a cache line: where the weights start.
const LINE: usize = 64;

/// Values that start on a cache line. A large `Vec` starts 16 bytes past a page, so every
/// 64-byte load of its rows would straddle two lines; aligning made no difference that the
/// `mlp_swap` bench could see on the machine measured, and costs one line of memory.
#[derive(Clone)]
struct Aligned<E> {
    buf: Vec<E>,
    start: usize,
    len: usize,
}

impl<E: Copy + Default> Aligned<E> {
    fn from_fn(len: usize, f: impl Fn(usize) -> E) -> Self {
        let mut buf = vec![E::default(); len + LINE / std::mem::size_of::<E>()];
        let start = buf.as_ptr().align_offset(LINE).min(buf.len() - len);
        for (i, v) in buf[start..start + len].iter_mut().enumerate() {
            *v = f(i);
        }
        Aligned { buf, start, len }
    }
}

impl<E> std::ops::Deref for Aligned<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// A `rows x cols` float matrix stored row-major, in f32, f16 or bf16.
#[derive(Clone)]
pub struct FloatRows {
    rows: usize,
    cols: usize,
    data: RowData,
    /// `||W[:, c]||_2` per column (of the stored values), for WINA's calibration.
    norms: Vec<f32>,
}

impl std::fmt::Debug for FloatRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FloatRows")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("storage", &self.storage())
            .finish()
    }
}

impl FloatRows {
    /// The row-major f32 matrix `w` (`rows x cols`) stored as `storage` (f32, f16 or bf16;
    /// values rounded to it). Empty sizes and non-finite weights are refused.
    pub fn from_f32(storage: ColumnStorage, rows: usize, cols: usize, w: &[f32]) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Err(Error::config(
                "float rows",
                format!("{rows} x {cols}: both sizes must be at least 1"),
            ));
        }
        if w.len() != rows * cols {
            return Err(Error::shape(
                "float rows weights",
                &[Some(rows * cols)],
                &[w.len()],
            ));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite("float rows", i));
        }
        let data = match storage {
            ColumnStorage::F32 => RowData::F32(Aligned::from_fn(w.len(), |i| w[i])),
            ColumnStorage::F16 => RowData::F16(Aligned::from_fn(w.len(), |i| f16::from_f32(w[i]))),
            ColumnStorage::BF16 => {
                RowData::BF16(Aligned::from_fn(w.len(), |i| bf16::from_f32(w[i])))
            }
            ColumnStorage::Quant(_) => {
                return Err(Error::config(
                    "storage",
                    "float rows hold f32, f16 or bf16; GGUF blocks are packed rows",
                ))
            }
        };
        let mut sq = vec![0f64; cols];
        let mut m = FloatRows {
            rows,
            cols,
            data,
            norms: Vec::new(),
        };
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row(r, &mut row);
            for (s, &v) in sq.iter_mut().zip(&row) {
                *s += f64::from(v) * f64::from(v);
            }
        }
        m.norms = sq.into_iter().map(|s| s.sqrt() as f32).collect();
        Ok(m)
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// How the weights are stored.
    pub fn storage(&self) -> ColumnStorage {
        match self.data {
            RowData::F32(_) => ColumnStorage::F32,
            RowData::F16(_) => ColumnStorage::F16,
            RowData::BF16(_) => ColumnStorage::BF16,
        }
    }

    /// `||W[:, c]||_2` per column, of the stored weights.
    pub fn column_norms(&self) -> &[f32] {
        &self.norms
    }

    /// Bytes of the stored weights (what a product reads).
    pub fn bytes(&self) -> usize {
        match &self.data {
            RowData::F32(v) => 4 * v.len(),
            RowData::F16(v) => 2 * v.len(),
            RowData::BF16(v) => 2 * v.len(),
        }
    }

    /// Row `r` as f32 (`out` holds `cols`). For tests and references.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            RowData::F32(v) => out.copy_from_slice(&v[span]),
            RowData::F16(v) => out
                .iter_mut()
                .zip(&v[span])
                .for_each(|(o, w)| *o = w.to_f32()),
            RowData::BF16(v) => out
                .iter_mut()
                .zip(&v[span])
                .for_each(|(o, w)| *o = w.to_f32()),
        }
    }

    /// Drops share `t` of `n` of the weights from every cache ([`crate::cpu::evict_share`]).
    pub(crate) fn evict_share(&self, t: usize, n: usize) -> bool {
        use crate::cpu::evict_share as ev;
        match &self.data {
            RowData::F32(v) => ev(&v[..], t, n),
            RowData::F16(v) => ev(&v[..], t, n),
            RowData::BF16(v) => ev(&v[..], t, n),
        }
    }

    /// `out = W x` for the output rows of `chunks` ([`CHUNK`] rows each; `out` holds
    /// `chunks.len() * CHUNK` values, rows past the matrix's left as they are; `x` holds
    /// `cols`).
    pub fn product(&self, k: &Kernels, chunks: Range<usize>, x: &[f32], out: &mut [f32]) {
        let rows = chunks.start * CHUNK..(chunks.end * CHUNK).min(self.rows);
        match &self.data {
            RowData::F32(w) => gemv_f32(&w[..], self.cols, rows, x, out),
            RowData::F16(w) => product(k, &w[..], self.cols, rows, x, out),
            RowData::BF16(w) => product(k, &w[..], self.cols, rows, x, out),
        }
    }

    /// [`FloatRows::product`] for `n` inputs at once (`xs`: `n x cols`, row-major): chunk `c`
    /// (counted from `chunks.start`) of input `j` into `out[(c * n + j) * CHUNK..][..CHUNK]`,
    /// each input's result its own product's bit for bit (a prompt's row is what decoding it
    /// alone gives). Each chunk's rows are read from DRAM once and from L2 for the other inputs.
    pub fn product_rows(
        &self,
        k: &Kernels,
        chunks: Range<usize>,
        xs: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let cols = self.cols;
        for (i, c) in chunks.enumerate() {
            let o = &mut out[i * n * CHUNK..(i + 1) * n * CHUNK];
            for (j, o) in o.chunks_exact_mut(CHUNK).enumerate() {
                self.product(k, c..c + 1, &xs[j * cols..(j + 1) * cols], o);
            }
        }
    }
}

/// `out[r - rows.start] = w[r] . x` for `r` in `rows` by the `gemm` crate's matrix-vector
/// product (one row at a time, eight accumulators; what candle's f32 `matmul` runs for one
/// token), on this thread.
fn gemv_f32(w: &[f32], cols: usize, rows: Range<usize>, x: &[f32], out: &mut [f32]) {
    let m = rows.len();
    if m == 0 {
        return;
    }
    let (w, x, out) = (
        &w[rows.start * cols..rows.end * cols],
        &x[..cols],
        &mut out[..m],
    );
    // SAFETY: `w` holds `m` rows of `cols` (row stride `cols`, column stride 1), `x` holds the
    // `cols` x 1 right-hand side and `out` the `m` x 1 destination (row stride 1), all within
    // the slices just taken; the destination is not read (`read_dst` false) and is not aliased
    // by the inputs (a `&mut` borrow).
    unsafe {
        gemm::gemm(
            m,
            1,
            cols,
            out.as_mut_ptr(),
            m as isize,
            1,
            false,
            w.as_ptr(),
            1,
            cols as isize,
            x.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Groups of four rows the product prefetches ahead.
const AHEAD: usize = 2;

/// `out[r - rows.start] = w[r] . x` for `r` in `rows` (`w` row-major, `cols` wide): four rows
/// per kernel call, the last 0-3 one at a time.
fn product<E: RowElem>(
    k: &Kernels,
    w: &[E],
    cols: usize,
    rows: Range<usize>,
    x: &[f32],
    out: &mut [f32],
) {
    let (dot, dot4) = (k.dot::<E>(), k.dot4::<E>());
    let row = |r: usize| &w[r * cols..(r + 1) * cols];
    let x = &x[..cols];
    let mut r = rows.start;
    while r + 4 <= rows.end {
        // The rows AHEAD groups on towards L2: one core's loads alone keep too few lines in
        // flight to reach the read bandwidth.
        let ahead = (r + 4 * AHEAD) * cols;
        if let Some(next) = w.get(ahead..(ahead + 4 * cols).min(rows.end * cols)) {
            crate::cpu::prefetch_l2(next);
        }
        let y = dot4(std::array::from_fn(|j| row(r + j)), x);
        out[r - rows.start..][..4].copy_from_slice(&y);
        r += 4;
    }
    for r in r..rows.end {
        out[r - rows.start] = dot(row(r), x);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::needless_range_loop)]
    use super::*;

    /// Every storage, shapes around the four-row step and the chunk, against the plain sum.
    #[test]
    fn products_are_the_row_sums() {
        let k = Kernels::detect().unwrap();
        for storage in [ColumnStorage::F32, ColumnStorage::F16, ColumnStorage::BF16] {
            for (rows, cols) in [(1, 1), (3, 7), (4, 8), (5, 17), (63, 33), (64, 64), (65, 9)] {
                let w: Vec<f32> = (0..rows * cols)
                    .map(|i| ((i * 37 % 19) as f32 - 9.0) / 8.0)
                    .collect();
                let x: Vec<f32> = (0..cols)
                    .map(|i| ((i * 11 % 7) as f32 - 3.0) / 4.0)
                    .collect();
                let m = FloatRows::from_f32(storage, rows, cols, &w).unwrap();
                let chunks = rows.div_ceil(CHUNK);
                let mut out = vec![f32::NAN; chunks * CHUNK];
                m.product(&k, 0..chunks, &x, &mut out);
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    m.row(r, &mut row);
                    let want: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                    let got = out[r];
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{storage:?} {rows}x{cols} row {r}: {got} vs {want}"
                    );
                }
                assert!(
                    out[rows..].iter().all(|v| v.is_nan()),
                    "rows past the matrix written"
                );
                // Three inputs at once: each one's chunks are its product's, bit for bit.
                let xs: Vec<f32> = (0..3 * cols)
                    .map(|i| ((i * 5 % 13) as f32 - 6.0) / 5.0)
                    .collect();
                let mut all = vec![f32::NAN; 3 * chunks * CHUNK];
                m.product_rows(&k, 0..chunks, &xs, 3, &mut all);
                for j in 0..3 {
                    let mut one = vec![0f32; chunks * CHUNK];
                    m.product(&k, 0..chunks, &xs[j * cols..(j + 1) * cols], &mut one);
                    for r in 0..rows {
                        let (c, i) = (r / CHUNK, r % CHUNK);
                        let got = all[(c * 3 + j) * CHUNK + i];
                        let want = one[r];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{storage:?} {rows}x{cols} input {j} row {r}"
                        );
                    }
                }
            }
        }
        assert!(FloatRows::from_f32(ColumnStorage::F32, 0, 3, &[]).is_err());
        assert!(FloatRows::from_f32(ColumnStorage::F32, 1, 2, &[1.0, f32::NAN]).is_err());
        assert!(FloatRows::from_f32(ColumnStorage::F32, 2, 2, &[1.0]).is_err());
    }
}
