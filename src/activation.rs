//! FFN activation functions and how each one produces sparsity.
//!
//! Owns the scalar math of `h_i = act(gate_i x) * (up_i x)` (gated) or `h_i = act(up_i x)` (ungated).
//! It must not know about storage, threads or tiers.

use crate::error::{Error, Result};

impl std::fmt::Display for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Activation {
    type Err = Error;

    /// Reads an [`Activation::name`] or a Hugging Face `hidden_act` alias (`swish`,
    /// `gelu_pytorch_tanh`, `gelu_new`); anything else is a [`crate::ErrorKind::Config`] error.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
            _ => Self::ALL
                .into_iter()
                .find(|a| a.name() == s)
                .ok_or_else(|| Error::config("activation", format!("unknown activation `{s}`"))),
        }
    }
}

/// The activation of an FFN block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Activation {
    /// `relu(g) * u` (ReluLLaMA, ProSparse) or `relu(u)` ungated (OPT). Exact zeros.
    Relu,
    /// `relu(g) * relu(u)` (TurboSparse / Bamboo dReLU). Gated only. Exact zeros.
    DRelu,
    /// `silu(g) * u` (SwiGLU: Llama, Mistral, Qwen, SmolLM). Never exactly zero.
    Silu,
    /// `gelu(g) * u` with the exact erf GELU (HF `gelu`). Never exactly zero.
    Gelu,
    /// `gelu(g) * u` with the tanh approximation (HF `gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
}

impl Activation {
    /// Every activation, in the order of [`Activation::name`]'s table.
    pub const ALL: [Activation; 5] = [
        Activation::Relu,
        Activation::DRelu,
        Activation::Silu,
        Activation::Gelu,
        Activation::GeluTanh,
    ];

    /// The name an artifact stores and [`Display`] prints: `relu`, `drelu`, `silu`, `gelu`,
    /// `gelu_tanh`.
    ///
    /// [`Display`]: std::fmt::Display
    pub fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::DRelu => "drelu",
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
        }
    }

    /// True when inactive neurons give exact zeros, so `GateFirst` at threshold 0 is exact.
    pub fn exact_zeros(self) -> bool {
        matches!(self, Activation::Relu | Activation::DRelu)
    }

    /// The activation applied to one pre-activation value.
    #[inline(always)]
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Activation::Relu | Activation::DRelu => v.max(0.0),
            Activation::Silu => v / (1.0 + (-v).exp()),
            Activation::Gelu => 0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2)),
            Activation::GeluTanh => {
                const C: f32 = 0.797_884_6; // sqrt(2/pi)
                0.5 * v * (1.0 + (C * (v + 0.044_715 * v * v * v)).tanh())
            }
        }
    }

    /// The neuron's contribution `h` from its gate and up pre-activations (gated FFN).
    #[inline(always)]
    pub fn gated(self, g: f32, u: f32) -> f32 {
        match self {
            Activation::DRelu => g.max(0.0) * u.max(0.0),
            _ => self.apply(g) * u,
        }
    }

    /// The neuron's contribution `h` from its up pre-activation (ungated FFN).
    #[inline(always)]
    pub fn ungated(self, u: f32) -> f32 {
        self.apply(u)
    }

    /// [`Activation::gated`] over whole rows: `h[j] = gated(gate[j], up[j])` for the shortest
    /// of the three. The activation is matched once, not per value, so each loop is tight
    /// (a decoded token's FFN computes this on one thread between its two products).
    pub fn gated_into(self, gate: &[f32], up: &[f32], h: &mut [f32]) {
        fn each(h: &mut [f32], gate: &[f32], up: &[f32], f: impl Fn(f32, f32) -> f32) {
            for ((h, &g), &u) in h.iter_mut().zip(gate).zip(up) {
                *h = f(g, u);
            }
        }
        match self {
            Activation::Relu => each(h, gate, up, |g, u| Activation::Relu.gated(g, u)),
            Activation::DRelu => each(h, gate, up, |g, u| Activation::DRelu.gated(g, u)),
            Activation::Silu => each(h, gate, up, |g, u| Activation::Silu.gated(g, u)),
            Activation::Gelu => each(h, gate, up, |g, u| Activation::Gelu.gated(g, u)),
            Activation::GeluTanh => each(h, gate, up, |g, u| Activation::GeluTanh.gated(g, u)),
        }
    }

    /// [`Activation::ungated`] over a whole row, matched once as [`Activation::gated_into`].
    pub fn ungated_into(self, up: &[f32], h: &mut [f32]) {
        fn each(h: &mut [f32], up: &[f32], f: impl Fn(f32) -> f32) {
            for (h, &u) in h.iter_mut().zip(up) {
                *h = f(u);
            }
        }
        match self {
            Activation::Relu | Activation::DRelu => each(h, up, |u| Activation::Relu.apply(u)),
            Activation::Silu => each(h, up, |u| Activation::Silu.apply(u)),
            Activation::Gelu => each(h, up, |u| Activation::Gelu.apply(u)),
            Activation::GeluTanh => each(h, up, |u| Activation::GeluTanh.apply(u)),
        }
    }

    /// The same activation as candle-nn names it, for the dense reference.
    pub fn to_candle(self) -> candle_nn::Activation {
        match self {
            Activation::Relu | Activation::DRelu => candle_nn::Activation::Relu,
            Activation::Silu => candle_nn::Activation::Silu,
            Activation::Gelu => candle_nn::Activation::Gelu,
            Activation::GeluTanh => candle_nn::Activation::GeluPytorchTanh,
        }
    }
}

impl TryFrom<candle_nn::Activation> for Activation {
    type Error = Error;

    /// Maps the activations a llama/OPT-family config names; others are a typed error.
    fn try_from(a: candle_nn::Activation) -> Result<Self> {
        match a {
            candle_nn::Activation::Relu => Ok(Activation::Relu),
            candle_nn::Activation::Silu => Ok(Activation::Silu),
            candle_nn::Activation::Gelu => Ok(Activation::Gelu),
            candle_nn::Activation::NewGelu | candle_nn::Activation::GeluPytorchTanh => {
                Ok(Activation::GeluTanh)
            }
            other => Err(Error::config(
                "activation",
                format!("{other:?} is not supported by the sparse FFN"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Activation;

    /// The row forms give the scalar forms' bits, for every activation and row lengths around
    /// SIMD widths (0, 1, odd, 8 and 16 +- 1), on values either side of 0.
    #[test]
    fn row_forms_are_the_scalar_forms() {
        for act in Activation::ALL {
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 33] {
                let g: Vec<f32> = (0..n).map(|i| (i as f32 - 4.0) * 0.7).collect();
                let u: Vec<f32> = (0..n).map(|i| 1.5 - i as f32 * 0.3).collect();
                let mut h = vec![f32::NAN; n];
                act.gated_into(&g, &u, &mut h);
                for j in 0..n {
                    assert_eq!(h[j].to_bits(), act.gated(g[j], u[j]).to_bits(), "{act} {n}");
                }
                act.ungated_into(&u, &mut h);
                for j in 0..n {
                    assert_eq!(h[j].to_bits(), act.ungated(u[j]).to_bits(), "{act} {n}");
                }
            }
        }
    }
}
