//! Typed flag values: clap parses them, so a bad value is refused with the flag's name before a
//! command runs.

use std::str::FromStr;

use clap::ValueEnum;
use powerinfer::WeightDType;

/// `bench --modes`: the rows of our own engine `bench` runs. The sparse rows carry the names of
/// [`SparseMode`] (and so of the engine's [`powerinfer::Sparsity`] string forms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
    /// candle-transformers' quantized model of the file's architecture (`quantized_llama`,
    /// `quantized_qwen2` or `quantized_gemma3`) on the same file (GGUF only).
    Candle,
    /// Our model on candle's ops with the dense FFN (the reference).
    Reference,
    /// Our fused dense decoder (GGUF only).
    Dense,
    /// The hybrid FFN computing every neuron (`Sparsity::Neurons(Neurons::All)`).
    All,
    /// Exact `|h|` thresholding ([`SparseMode::GateFirst`]; `sparse` is its old name).
    #[value(name = "gate-first", alias = "sparse")]
    GateFirst,
    /// An artifact's trained predictors ([`SparseMode::Predictors`]; needs `--powerinfer`).
    Predictors,
    /// The input-sparse FFN with its calibrated rule ([`SparseMode::Input`]; GGUF only).
    Input,
}

impl BenchMode {
    /// The name `--modes` takes and the table prints.
    pub fn name(self) -> &'static str {
        match self {
            BenchMode::Candle => "candle",
            BenchMode::Reference => "reference",
            BenchMode::Dense => "dense",
            BenchMode::All => "all",
            BenchMode::GateFirst => SparseMode::GateFirst.name(),
            BenchMode::Predictors => SparseMode::Predictors.name(),
            BenchMode::Input => SparseMode::Input.name(),
        }
    }
}

/// `--sparse[=MODE]` of `demo`, `generate` and `eval`: which sparse FFN runs. The names are the
/// engine's [`powerinfer::Sparsity`] string forms (`input`, `gate-first:T`, `predictors:ARTIFACT`);
/// the command fills in what the form's value needs, by calibration (`--target`) or from
/// `--threshold` and `--powerinfer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SparseMode {
    /// `input` where the file has an input-sparse FFN (read from its header before loading),
    /// else `gate-first`, saying why.
    Auto,
    /// The input-sparse FFN (`Sparsity::Input`) under its input rule: the artifact's
    /// (`--powerinfer`) or one calibrated now at `--target`.
    Input,
    /// Exact `|h|` thresholding (`Neurons::GateFirst`) at per-layer thresholds: `--threshold`'s,
    /// the artifact's, or calibrated now for `--target`'s FFN sparsity.
    GateFirst,
    /// The artifact's trained predictors and placement (`Neurons::Predictors`; needs
    /// `--powerinfer`), at score thresholds for `--target` or its stored target-recall ones.
    Predictors,
}

impl SparseMode {
    /// The flag's value, the output's `mode` and the bench row's name.
    pub fn name(self) -> &'static str {
        match self {
            SparseMode::Auto => "auto",
            SparseMode::Input => "input",
            SparseMode::GateFirst => "gate-first",
            SparseMode::Predictors => "predictors",
        }
    }
}

/// `bench --peer`: another engine run on the same file in the same run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Peer {
    /// llama.cpp's `llama-bench`.
    #[value(name = "llama.cpp")]
    LlamaCpp,
}

/// `eval --input-rules`: a rule of the input-sparse sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InputRule {
    /// TEAL: gate, up and down inputs thresholded by `|x|`, the split chosen on calibration text.
    Teal,
    /// WINA: the same on `|x| * ||column||`.
    Wina,
    /// `|h|` on down alone: gate and up read densely.
    H,
    /// CHESS: gate read densely, up rows only for the neurons whose `|act(g_j)| E|u_j|` passes
    /// (a fraction `1.5 s` skipped), `|h|` on down (`1.5 s`).
    Chess,
}

/// `--storage`: `native` (as the file stores the weights) or a [`WeightDType`] name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Storage(pub Option<WeightDType>);

impl FromStr for Storage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "native" {
            return Ok(Storage(None));
        }
        s.parse::<WeightDType>()
            .map(|d| Storage(Some(d)))
            .map_err(|_| format!("expected native, f32, f16, bf16, q4_0, q4_1 or q8_0, not `{s}`"))
    }
}

/// `--budget`: bytes with an optional K/M/G suffix (powers of 1024), or `auto` (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Budget(pub Option<u64>);

impl FromStr for Budget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Budget(None));
        }
        let t = s.trim().to_ascii_uppercase();
        let (num, mult) = match t.as_bytes().last() {
            Some(b'K') => (&t[..t.len() - 1], 1u64 << 10),
            Some(b'M') => (&t[..t.len() - 1], 1 << 20),
            Some(b'G') => (&t[..t.len() - 1], 1 << 30),
            _ => (t.as_str(), 1),
        };
        let v: f64 = num
            .parse()
            .map_err(|_| format!("expected bytes (e.g. 64M) or `auto`, not `{s}`"))?;
        let bytes = v * mult as f64;
        if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
            return Err(format!("`{s}` must be at least 1 byte"));
        }
        Ok(Budget(Some(bytes as u64)))
    }
}

/// `--vram-budget`: a share of the FFN weights' bytes (`25%`) or bytes as [`Budget`] (`64M`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VramBudget {
    /// This share of the bytes the tiered layers' FFN weights take, in `[0, 1]`.
    Share(f64),
    /// Bytes.
    Bytes(u64),
}

impl VramBudget {
    /// The budget in bytes for FFN weights of `ffn_bytes` bytes.
    pub fn bytes(&self, ffn_bytes: u64) -> u64 {
        match *self {
            VramBudget::Share(s) => (ffn_bytes as f64 * s) as u64,
            VramBudget::Bytes(b) => b,
        }
    }
}

impl std::fmt::Display for VramBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VramBudget::Share(s) => write!(f, "{}%", s * 100.0),
            VramBudget::Bytes(b) => write!(f, "{:.1}M", *b as f64 / (1 << 20) as f64),
        }
    }
}

impl FromStr for VramBudget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.trim().strip_suffix('%') {
            let v = fraction(p, 100.0)?;
            return Ok(VramBudget::Share(v / 100.0));
        }
        match s.parse::<Budget>() {
            Ok(Budget(Some(b))) => Ok(VramBudget::Bytes(b)),
            _ => Err(format!(
                "expected a share of the FFN bytes (25%) or bytes (64M), not `{s}`"
            )),
        }
    }
}

/// `--tier`: which fast tier the tier rows use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tier(pub powerinfer_candle::TierKind);

impl Default for Tier {
    fn default() -> Self {
        Tier(if cfg!(feature = "cuda") {
            powerinfer_candle::TierKind::Cuda { ordinal: 0 }
        } else {
            powerinfer_candle::TierKind::Reference { threads: 1 }
        })
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for Tier {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.parse()
            .map(Tier)
            .map_err(|e: powerinfer::Error| e.to_string())
    }
}

/// A share in `[0, 1]` (`--cache`).
pub fn unit_fraction(s: &str) -> Result<f64, String> {
    fraction(s, 1.0)
}

/// A fraction in `[0, hi]`.
fn fraction(s: &str, hi: f64) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if !(0.0..=hi).contains(&v) {
        return Err(format!("{v} is outside [0, {hi}]"));
    }
    Ok(v)
}

/// A sparsity the artifact's stored quantiles reach (`--sweep`).
pub fn quantile_sparsity(s: &str) -> Result<f64, String> {
    fraction(s, powerinfer::analysis::QUANTILE_MAX)
}

/// A share of input entries an input rule drops (`--input-sweep`, `--input-attention`,
/// `--attention-sparsity`).
pub fn input_fraction(s: &str) -> Result<f64, String> {
    fraction(s, 0.95)
}

/// `--target`: `auto` (`None`: the mode chooses) or the sparsity the sparse mode aims at, in
/// [0, 0.95].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target(pub Option<f64>);

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Target(None)),
            f => input_fraction(f).map(|f| Target(Some(f))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_and_budget_parse() {
        assert_eq!("native".parse(), Ok(Storage(None)));
        assert_eq!("q4_1".parse(), Ok(Storage(Some(WeightDType::Q4_1))));
        assert!("q5_k".parse::<Storage>().is_err());
        assert_eq!("auto".parse(), Ok(Budget(None)));
        assert_eq!("16M".parse(), Ok(Budget(Some(16 << 20))));
        assert_eq!("1.5k".parse(), Ok(Budget(Some(1536))));
        assert_eq!("4096".parse(), Ok(Budget(Some(4096))));
        for bad in ["0", "-1M", "M", "1T", "nan", "inf"] {
            assert!(bad.parse::<Budget>().is_err(), "{bad}");
        }
        assert_eq!("25%".parse(), Ok(VramBudget::Share(0.25)));
        assert_eq!("0%".parse(), Ok(VramBudget::Share(0.0)));
        assert_eq!("64M".parse(), Ok(VramBudget::Bytes(64 << 20)));
        assert_eq!(VramBudget::Share(0.5).bytes(1000), 500);
        for bad in ["101%", "-5%", "x%", "0", "auto"] {
            assert!(bad.parse::<VramBudget>().is_err(), "{bad}");
        }
        assert_eq!(quantile_sparsity("0.5"), Ok(0.5));
        assert!(quantile_sparsity("0.99").is_err());
        assert!(input_fraction("x").is_err());
        assert_eq!("auto".parse(), Ok(Target(None)));
        assert_eq!(" 0.28".parse(), Ok(Target(Some(0.28))));
        for bad in ["", "Auto", "0.96", "-0.1", "NaN"] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
        let mode = |s: &str| SparseMode::from_str(s, false);
        assert_eq!(mode("gate-first"), Ok(SparseMode::GateFirst));
        for m in [SparseMode::Auto, SparseMode::Input, SparseMode::Predictors] {
            assert_eq!(mode(m.name()), Ok(m));
        }
        assert!(mode("threshold").is_err());
        // `sparse`, the gate-first row's old name, still selects it.
        assert_eq!(
            BenchMode::from_str("sparse", false),
            Ok(BenchMode::GateFirst)
        );
        assert_eq!(BenchMode::GateFirst.name(), "gate-first");
    }
}
