//! [`WeightDType`]: the storage types of the neuron-major weights, their names and row sizes.

use candle_core::DType;

use crate::cpu::QuantKind;
use crate::error::{Error, ErrorKind, Result};

impl std::fmt::Display for WeightDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightDType {
    type Err = Error;

    /// Reads a [`WeightDType::name`] (case-insensitive); anything else is a
    /// [`ErrorKind::Config`] error listing the names.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|d| d.name() == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|d| d.name()).collect();
                Error::config(
                    "storage dtype",
                    format!("`{s}` is not one of {}", names.join(", ")),
                )
            })
    }
}

/// Storage dtype of the neuron-major weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// GGUF Q4_0 gate/up rows, Q8_0 down rows (hidden must be a multiple of 32).
    Q4_0,
    /// GGUF Q4_1 gate/up rows, Q8_0 down rows.
    Q4_1,
    /// GGUF Q8_0 rows.
    Q8_0,
}

impl WeightDType {
    /// Every storage dtype, in the order of [`WeightDType::name`]'s table.
    pub const ALL: [WeightDType; 6] = [
        WeightDType::F32,
        WeightDType::F16,
        WeightDType::BF16,
        WeightDType::Q4_0,
        WeightDType::Q4_1,
        WeightDType::Q8_0,
    ];

    /// The lowercase name (`f32`, `f16`, `bf16`, `q4_0`, `q4_1`, `q8_0`): what [`Display`] prints
    /// and [`FromStr`] reads.
    ///
    /// [`Display`]: std::fmt::Display
    /// [`FromStr`]: std::str::FromStr
    pub fn name(self) -> &'static str {
        match self {
            WeightDType::F32 => "f32",
            WeightDType::F16 => "f16",
            WeightDType::BF16 => "bf16",
            WeightDType::Q4_0 => "q4_0",
            WeightDType::Q4_1 => "q4_1",
            WeightDType::Q8_0 => "q8_0",
        }
    }

    /// Bytes of a row of `n` weights (`n` a multiple of 32 for the quantized types).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            WeightDType::F32 => 4 * n,
            WeightDType::F16 | WeightDType::BF16 => 2 * n,
            q => q.quant().map_or(0, |k| k.row_bytes(n)),
        }
    }

    /// The GGUF block type, for quantized storage.
    pub fn quant(self) -> Option<QuantKind> {
        match self {
            WeightDType::Q4_0 => Some(QuantKind::Q4_0),
            WeightDType::Q4_1 => Some(QuantKind::Q4_1),
            WeightDType::Q8_0 => Some(QuantKind::Q8_0),
            _ => None,
        }
    }

    /// The storage of down rows: Q8_0 when quantized, else the same dtype.
    pub fn down(self) -> WeightDType {
        if self.quant().is_some() {
            WeightDType::Q8_0
        } else {
            self
        }
    }

    /// The storage dtype for a candle dtype, or a typed error naming `tensor`.
    pub fn from_candle(dtype: DType, tensor: &str) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(WeightDType::F32),
            DType::F16 => Ok(WeightDType::F16),
            DType::BF16 => Ok(WeightDType::BF16),
            got => Err(ErrorKind::DType {
                tensor: tensor.to_string(),
                got,
            }
            .into()),
        }
    }
}
