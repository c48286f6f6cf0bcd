//! Where decode time goes ([`Timings`], measured by [`Clock`]) and the bytes a decoded token
//! reads ([`DecodeBytes`]).

use std::time::{Duration, Instant};

use candle_core::quantized::QMatMul;

use super::layers::Linear;

/// Where decode time goes, accumulated while [`Llama::timings`](crate::Llama::timings) is enabled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Embedding lookup, norms and residual adds.
    pub other: Duration,
    /// Attention (projections, RoPE, softmax, KV cache).
    pub attention: Duration,
    /// FFN blocks (for the hybrid FFN this includes its predictor).
    pub ffn: Duration,
    /// Final norm and LM head.
    pub lm_head: Duration,
    /// Forward calls timed.
    pub calls: u64,
}

/// Bytes of weights (and KV cache) one decoded token reads, by component: the floor that memory
/// bandwidth puts under decode time. See [`Llama::decode_bytes`](crate::Llama::decode_bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeBytes {
    /// Attention projections (q, k, v, o) of every layer.
    pub attention: usize,
    /// FFN gate and up rows (every neuron: a sparse rule decides on them).
    pub ffn_gate_up: usize,
    /// FFN down rows of every neuron (a sparse FFN reads only its active neurons' share).
    pub ffn_down: usize,
    /// The LM head.
    pub lm_head: usize,
    /// Keys and values of one cached position, all layers (f32).
    pub kv_per_position: usize,
}

impl DecodeBytes {
    /// Bytes one token reads at `positions` cached positions when a share `down_skipped` of the
    /// FFN's down rows is not read.
    pub fn per_token(&self, positions: usize, down_skipped: f64) -> f64 {
        (self.attention + self.ffn_gate_up + self.lm_head) as f64
            + self.ffn_down as f64 * (1.0 - down_skipped.clamp(0.0, 1.0))
            + (self.kv_per_position * positions) as f64
    }
}

pub(super) fn linear_bytes(l: &Linear) -> usize {
    match l {
        Linear::Candle { w, b } => {
            let w = match w {
                QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            };
            w + b.as_ref().map_or(0, |b| b.elem_count() * 4)
        }
        Linear::Powerinfer(l) => l.bytes(),
    }
}

#[derive(Clone, Copy)]
pub(crate) enum Lap {
    Other,
    Attention,
    Ffn,
    LmHead,
}

/// Splits wall time between components when timing is on; free when off.
pub(crate) struct Clock {
    last: Option<Instant>,
    t: Timings,
}

impl Clock {
    pub(crate) fn new(on: bool) -> Self {
        Clock {
            last: on.then(Instant::now),
            t: Timings::default(),
        }
    }

    pub(crate) fn lap(&mut self, what: Lap) {
        let Some(last) = self.last.as_mut() else {
            return;
        };
        let now = Instant::now();
        let d = now - *last;
        *last = now;
        let slot = match what {
            Lap::Other => &mut self.t.other,
            Lap::Attention => &mut self.t.attention,
            Lap::Ffn => &mut self.t.ffn,
            Lap::LmHead => &mut self.t.lm_head,
        };
        *slot += d;
    }

    pub(crate) fn add_to(&self, t: &mut Timings) {
        t.other += self.t.other;
        t.attention += self.t.attention;
        t.ffn += self.t.ffn;
        t.lm_head += self.t.lm_head;
        t.calls += 1;
    }
}
