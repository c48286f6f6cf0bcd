//! `ActiveSet`: which FFN neurons run for each row of a batch. What a predictor fills and the
//! CPU tier reads; it depends on nothing else in the crate.

use crate::error::{Error, ErrorKind, Result};

/// The neurons to compute, per row of a batch.
///
/// Rows are independent: neuron `i` contributes to row `r` only if it is in row `r`'s set. The
/// FFN computes the union of all rows' sets once and masks per row.
#[derive(Debug, Clone, Default)]
pub struct ActiveSet {
    rows: usize,
    intermediate: usize,
    words: usize,
    all: bool,
    mask: Vec<u64>,
    union: Vec<u32>,
}

impl ActiveSet {
    /// An empty set; sized by [`ActiveSet::reset`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the set for `rows` rows of an FFN with `intermediate` neurons. Reuses buffers.
    pub fn reset(&mut self, rows: usize, intermediate: usize) {
        self.rows = rows;
        self.intermediate = intermediate;
        self.words = intermediate.div_ceil(64);
        self.all = false;
        self.mask.clear();
        self.mask.resize(rows * self.words, 0);
        self.union.clear();
    }

    /// Marks `neuron` active for `row`.
    pub fn insert(&mut self, row: usize, neuron: usize) -> Result<()> {
        if neuron >= self.intermediate {
            return Err(ErrorKind::NeuronOutOfRange {
                layer: None,
                neuron,
                intermediate: self.intermediate,
            }
            .into());
        }
        if row >= self.rows {
            return Err(Error::shape(
                "active set row",
                &[Some(self.rows)],
                &[row + 1],
            ));
        }
        self.mask[row * self.words + neuron / 64] |= 1 << (neuron % 64);
        Ok(())
    }

    /// Marks every neuron active for every row.
    pub fn fill_all(&mut self) {
        self.all = true;
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Neurons in the layer.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// True when every neuron is active for every row.
    pub fn is_all(&self) -> bool {
        self.all
    }

    /// Whether `neuron` is active for `row`; `None` when either is out of range.
    pub fn contains(&self, row: usize, neuron: usize) -> Option<bool> {
        (row < self.rows && neuron < self.intermediate).then(|| self.has(row, neuron))
    }

    /// [`ActiveSet::contains`] for indices the caller keeps in range (the kernels' loops).
    #[inline]
    pub(crate) fn has(&self, row: usize, neuron: usize) -> bool {
        self.all || (self.mask[row * self.words + neuron / 64] >> (neuron % 64)) & 1 == 1
    }

    /// Active neurons of one row; `None` when `row` is out of range.
    pub fn row_count(&self, row: usize) -> Option<usize> {
        if row >= self.rows {
            return None;
        }
        if self.all {
            return Some(self.intermediate);
        }
        Some(
            self.mask[row * self.words..(row + 1) * self.words]
                .iter()
                .map(|w| w.count_ones() as usize)
                .sum(),
        )
    }

    /// Sorted neurons active in at least one row (valid after the FFN has run the predictor).
    pub fn union(&self) -> &[u32] {
        &self.union
    }

    /// Builds the union from the per-row masks. Called by the FFN after prediction.
    pub(crate) fn finish(&mut self) {
        self.union.clear();
        if self.all {
            self.union.extend(0..self.intermediate as u32);
            return;
        }
        for w in 0..self.words {
            let mut bits = (0..self.rows).fold(0u64, |acc, r| acc | self.mask[r * self.words + w]);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                self.union.push((w * 64 + b) as u32);
                bits &= bits - 1;
            }
        }
    }
}
