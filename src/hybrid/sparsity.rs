//! [`Sparsity`]: what a model's sparse FFN layers compute, as one setting that the candle loader,
//! the mistral.rs feature and the CLIs share (and parse from one strict string form).
//!
//! A choice names the FFN type behind it: [`Sparsity::Neurons`] runs the neuron-major
//! [`crate::HybridFfn`] with a [`Neurons`] rule, [`Sparsity::Input`] the column-major
//! [`crate::InputSparseFfn`]. A hybrid FFN cannot be asked to run an input rule: [`Neurons`] has
//! no such variant.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The string forms [`Sparsity`] reads, for error messages.
const FORMS: &str = "all, gate-first:T, predictors:ARTIFACT, input or input:ARTIFACT";

/// What each sparse FFN layer computes, and so which FFN type runs it.
///
/// The string form (what [`FromStr`] reads and [`Display`](fmt::Display) writes):
///
/// | string | value |
/// |---|---|
/// | `all` | `Sparsity::Neurons(Neurons::All)` |
/// | `gate-first:T` | `Sparsity::Neurons(Neurons::GateFirst(T))` |
/// | `predictors:ARTIFACT` | `Sparsity::Neurons(Neurons::Predictors { .. })` |
/// | `input` | `Sparsity::Input(None)` |
/// | `input:ARTIFACT` | `Sparsity::Input(Some(ARTIFACT))` |
///
/// Paths always come after a prefix: any other string is an error naming the forms.
///
/// ```
/// use powerinfer::{Neurons, Sparsity};
///
/// let s: Sparsity = "predictors:smollm2.powerinfer".parse()?;
/// assert_eq!(s, Sparsity::Neurons(Neurons::predictors("smollm2.powerinfer")));
/// assert!("smollm2.powerinfer".parse::<Sparsity>().is_err());
/// # Ok::<(), powerinfer::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Sparsity {
    /// Output sparsity on neuron-major weights ([`crate::HybridFfn`]): the rule says which
    /// neurons run.
    Neurons(Neurons),
    /// Input sparsity on the file's exact weights ([`crate::InputSparseFfn`]): with an artifact
    /// (format version 2), its calibrated TEAL/WINA rule, checked against the model file;
    /// without one, every input kept (the dense FFN's result).
    Input(Option<PathBuf>),
}

/// Which neurons a [`crate::HybridFfn`] layer computes.
#[derive(Debug, Clone, PartialEq)]
pub enum Neurons {
    /// Every neuron, through the sparse kernels (the dense-equivalent setting).
    All,
    /// Exact thresholding: neuron `i` runs when `|act(gate_i) * up_i| > threshold` (ReLU:
    /// `act(gate_i) > threshold`), computed inline ([`crate::GateFirst`]). Threshold 0 is exact
    /// for ReLU models.
    GateFirst(f32),
    /// Trained low-rank predictors and placement from a `.powerinfer` artifact
    /// ([`crate::Artifact`]), checked against the model file it was made from.
    Predictors {
        /// The `.powerinfer` file.
        artifact: PathBuf,
        /// Score thresholds for this FFN sparsity instead of the stored target-recall ones.
        predictor_sparsity: Option<f64>,
    },
}

impl Neurons {
    /// Trained predictors from `artifact` at their stored thresholds.
    pub fn predictors(artifact: impl Into<PathBuf>) -> Self {
        Neurons::Predictors {
            artifact: artifact.into(),
            predictor_sparsity: None,
        }
    }
}

impl Sparsity {
    /// The artifact this choice reads, if any.
    pub fn artifact(&self) -> Option<&std::path::Path> {
        match self {
            Sparsity::Neurons(Neurons::Predictors { artifact, .. }) => Some(artifact),
            Sparsity::Input(p) => p.as_deref(),
            Sparsity::Neurons(_) => None,
        }
    }
}

impl From<Neurons> for Sparsity {
    fn from(n: Neurons) -> Self {
        Sparsity::Neurons(n)
    }
}

impl FromStr for Sparsity {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: String| Error::config("sparsity", reason);
        let path = |p: &str, prefix: &str| match p.is_empty() {
            true => Err(bad(format!("`{prefix}:` names no artifact"))),
            false => Ok(PathBuf::from(p)),
        };
        match s.split_once(':') {
            None if s == "all" => Ok(Sparsity::Neurons(Neurons::All)),
            None if s == "input" => Ok(Sparsity::Input(None)),
            Some(("input", p)) => Ok(Sparsity::Input(Some(path(p, "input")?))),
            Some(("predictors", p)) => Ok(Sparsity::Neurons(Neurons::predictors(path(
                p,
                "predictors",
            )?))),
            Some(("gate-first", t)) => {
                let v: f32 = t
                    .parse()
                    .map_err(|_| bad(format!("`{t}` is not a threshold (in `{s}`)")))?;
                if !(v.is_finite() && v >= 0.0) {
                    return Err(bad(format!("threshold {v} must be finite and >= 0")));
                }
                Ok(Sparsity::Neurons(Neurons::GateFirst(v)))
            }
            _ if s.is_empty() => Err(bad(format!("empty; expected {FORMS}"))),
            _ if s.ends_with(".powerinfer") => Err(bad(format!(
                "`{s}`: an artifact needs a prefix, `predictors:{s}` or `input:{s}`"
            ))),
            _ => Err(bad(format!("`{s}` is none of {FORMS}"))),
        }
    }
}

impl FromStr for Neurons {
    type Err = Error;

    /// The [`Sparsity`] forms of a hybrid FFN: `all`, `gate-first:T`, `predictors:ARTIFACT`.
    fn from_str(s: &str) -> Result<Self> {
        match s.parse()? {
            Sparsity::Neurons(n) => Ok(n),
            Sparsity::Input(_) => Err(Error::config(
                "neurons",
                format!("`{s}` is the input-sparse FFN, not a rule of the hybrid FFN"),
            )),
        }
    }
}

impl fmt::Display for Neurons {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Neurons::All => f.write_str("all"),
            Neurons::GateFirst(t) => write!(f, "gate-first:{t}"),
            Neurons::Predictors { artifact, .. } => {
                write!(f, "predictors:{}", artifact.display())
            }
        }
    }
}

impl fmt::Display for Sparsity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sparsity::Neurons(n) => n.fmt(f),
            Sparsity::Input(None) => f.write_str("input"),
            Sparsity::Input(Some(p)) => write!(f, "input:{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_forms_round_trip() {
        for (s, v) in [
            ("all", Sparsity::Neurons(Neurons::All)),
            ("gate-first:0.25", Neurons::GateFirst(0.25).into()),
            ("input", Sparsity::Input(None)),
            (
                "input:/a/m.powerinfer",
                Sparsity::Input(Some("/a/m.powerinfer".into())),
            ),
            (
                "predictors:/a/m.powerinfer",
                Neurons::predictors("/a/m.powerinfer").into(),
            ),
            // Only the first colon separates: a path may hold more.
            (
                "input:C:/m.powerinfer",
                Sparsity::Input(Some("C:/m.powerinfer".into())),
            ),
        ] {
            assert_eq!(s.parse::<Sparsity>().unwrap(), v, "{s}");
            assert_eq!(v.to_string(), s);
        }
        assert_eq!("all".parse::<Neurons>().unwrap(), Neurons::All);
    }

    #[test]
    fn bad_forms_are_config_errors_naming_the_value() {
        for (s, named) in [
            ("", "empty"),
            ("input:", "names no artifact"),
            ("predictors:", "names no artifact"),
            ("gate-first:abc", "`abc` is not a threshold"),
            ("gate-first:-1", "must be finite"),
            ("gate-first:NaN", "must be finite"),
            (
                "gatefirst:0.1",
                "`gatefirst:0.1` is none of all, gate-first:T",
            ),
            ("ALL", "`ALL` is none of"),
            ("m.powerinfer", "needs a prefix, `predictors:m.powerinfer`"),
        ] {
            let e = s.parse::<Sparsity>().unwrap_err();
            assert!(
                matches!(e.kind(), crate::ErrorKind::Config { setting, .. } if setting == "sparsity"),
                "{s}: {e}"
            );
            assert!(e.to_string().contains(named), "{s}: {e}");
        }
        let e = "input".parse::<Neurons>().unwrap_err();
        assert!(e.to_string().contains("input-sparse FFN"), "{e}");
    }
}
