//! [`Neurons`]: which neurons a model's sparse FFN layers compute, as a setting that the candle
//! loader, the mistral.rs feature and the CLI share (and parse from one string form).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Which neurons each sparse FFN layer computes.
///
/// The string form (what [`FromStr`] reads and [`Display`](fmt::Display) writes): `all`,
/// `gate-first:T`, `input`, `input:ARTIFACT`, or an artifact path.
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
    Artifact {
        /// The `.powerinfer` file.
        path: PathBuf,
        /// Score thresholds for this FFN sparsity instead of the stored target-recall ones.
        predictor_sparsity: Option<f64>,
    },
    /// The input-sparse FFN on the file's exact weights ([`crate::InputSparseFfn`]): with an
    /// artifact (format version 2), its calibrated TEAL/WINA rule, checked against the model
    /// file; without one, every input kept (the dense FFN's result).
    Input(Option<PathBuf>),
}

impl Neurons {
    /// Trained predictors from `path` at their stored thresholds.
    pub fn artifact(path: impl Into<PathBuf>) -> Self {
        Neurons::Artifact {
            path: path.into(),
            predictor_sparsity: None,
        }
    }
}

impl FromStr for Neurons {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: String| Error::config("neurons", reason);
        match s {
            "" => Err(bad(
                "empty; expected all, gate-first:T, input, input:ARTIFACT or a path".into(),
            )),
            "all" => Ok(Neurons::All),
            "input" => Ok(Neurons::Input(None)),
            _ => {
                if let Some(p) = s.strip_prefix("input:") {
                    if p.is_empty() {
                        return Err(bad("`input:` names no artifact".into()));
                    }
                    Ok(Neurons::Input(Some(PathBuf::from(p))))
                } else if let Some(t) = s.strip_prefix("gate-first:") {
                    let v: f32 = t
                        .parse()
                        .map_err(|_| bad(format!("`{t}` is not a threshold (in `{s}`)")))?;
                    if !(v.is_finite() && v >= 0.0) {
                        return Err(bad(format!("threshold {v} must be finite and >= 0")));
                    }
                    Ok(Neurons::GateFirst(v))
                } else {
                    Ok(Neurons::artifact(s))
                }
            }
        }
    }
}

impl fmt::Display for Neurons {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Neurons::All => f.write_str("all"),
            Neurons::GateFirst(t) => write!(f, "gate-first:{t}"),
            Neurons::Input(None) => f.write_str("input"),
            Neurons::Input(Some(p)) => write!(f, "input:{}", p.display()),
            Neurons::Artifact { path, .. } => write!(f, "{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_forms_round_trip() {
        for (s, n) in [
            ("all", Neurons::All),
            ("gate-first:0.25", Neurons::GateFirst(0.25)),
            ("input", Neurons::Input(None)),
            (
                "input:/a/m.powerinfer",
                Neurons::Input(Some("/a/m.powerinfer".into())),
            ),
            ("/a/m.powerinfer", Neurons::artifact("/a/m.powerinfer")),
        ] {
            assert_eq!(s.parse::<Neurons>().unwrap(), n, "{s}");
            assert_eq!(n.to_string(), s);
        }
    }

    #[test]
    fn bad_forms_are_config_errors_naming_the_value() {
        for (s, named) in [
            ("", "empty"),
            ("input:", "names no artifact"),
            ("gate-first:abc", "`abc` is not a threshold"),
            ("gate-first:-1", "must be finite"),
            ("gate-first:NaN", "must be finite"),
        ] {
            let e = s.parse::<Neurons>().unwrap_err();
            assert!(
                matches!(e.kind(), crate::ErrorKind::Config { setting, .. } if setting == "neurons"),
                "{s}: {e}"
            );
            assert!(e.to_string().contains(named), "{s}: {e}");
        }
    }
}
