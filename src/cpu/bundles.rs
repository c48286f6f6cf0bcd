//! The neuron-major bundle layout: where gate, up and down of neuron `i` lie in one layer's
//! storage. Defined once here ([`BundleLayout`]) and used by the conversion (`ffn.rs`), the CPU
//! tier and the dense pass.
//!
//! Neuron `i` owns one contiguous bundle: `[gate_i | up_i | down^T_i]` (ungated: `[up_i |
//! down^T_i]`). Float storage holds `hidden` values per row. Quantized storage holds gate and up
//! rows in the file's block type and the down row in Q8_0, each row in the split layout of
//! `split.rs` (the block scales, then the values).

use std::ops::Range;

use half::{bf16, f16};

use super::quant::QuantKind;
use crate::activation::Activation;

/// Neuron-major weights in one of the storage dtypes.
#[derive(Debug, Clone)]
pub(crate) enum BundleData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// Gate/up rows in `kind`, the down row in Q8_0, per neuron back to back.
    Quant {
        kind: QuantKind,
        bytes: Vec<u8>,
    },
}

/// Offsets inside one neuron's bundle, in elements (float storage) or bytes (quantized).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BundleLayout {
    /// Length of a gate or up row.
    pub row: usize,
    /// Length of the down row.
    pub down: usize,
    /// Whether the bundle starts with a gate row.
    pub gated: bool,
}

impl BundleLayout {
    /// The layout for rows of `hidden` weights; `quant` is the gate/up block type of quantized
    /// storage (down rows are then Q8_0).
    pub fn new(hidden: usize, gated: bool, quant: Option<QuantKind>) -> Self {
        match quant {
            Some(k) => BundleLayout {
                row: k.row_bytes(hidden),
                down: QuantKind::Q8_0.row_bytes(hidden),
                gated,
            },
            None => BundleLayout {
                row: hidden,
                down: hidden,
                gated,
            },
        }
    }

    /// Length of one bundle.
    pub fn stride(&self) -> usize {
        (1 + usize::from(self.gated)) * self.row + self.down
    }

    /// Neuron `i`'s whole bundle.
    pub fn bundle(&self, i: usize) -> Range<usize> {
        i * self.stride()..(i + 1) * self.stride()
    }

    /// Offset of the up row inside a bundle.
    pub fn up_at(&self) -> usize {
        usize::from(self.gated) * self.row
    }

    /// Offset of the down row inside a bundle.
    pub fn down_at(&self) -> usize {
        self.stride() - self.down
    }
}

/// One layer's bundles as the kernels read them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BundleView<'a> {
    pub data: &'a BundleData,
    pub layout: BundleLayout,
    pub hidden: usize,
    pub intermediate: usize,
    pub activation: Activation,
    pub gate_bias: Option<&'a [f32]>,
    pub up_bias: Option<&'a [f32]>,
}
