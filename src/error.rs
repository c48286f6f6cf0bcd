//! The engine's error type: one [`Error`] carrying a matchable [`ErrorKind`].
//!
//! Every failure names what was wrong (the tensor, the shape, the neuron, the layer) so a caller can
//! act on it. The engine never panics on bad input; it returns one of these.

use std::fmt;

/// Shorthand for `std::result::Result<T, powerinfer::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

/// An error from the engine. Match on [`Error::kind`].
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
}

/// What went wrong, with the names and numbers needed to find it.
#[derive(Debug)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A tensor had the wrong shape.
    Shape {
        /// Which tensor (e.g. `"gate_proj.weight"`, `"input"`).
        tensor: String,
        /// The expected shape (`None` for "any size" in that dimension).
        expected: Vec<Option<usize>>,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// A tensor had a dtype the engine cannot use there.
    DType {
        /// Which tensor.
        tensor: String,
        /// The dtype that was given.
        got: candle_core::DType,
    },
    /// A tensor lives on a device this path does not serve.
    Device {
        /// Which tensor.
        tensor: String,
        /// The device it lives on, as candle prints it.
        got: String,
    },
    /// A tensor holds a NaN or an infinity.
    NonFinite {
        /// Which tensor.
        tensor: String,
        /// Flat index of the first non-finite element.
        index: usize,
    },
    /// A neuron index is not below the layer's intermediate size.
    NeuronOutOfRange {
        /// The layer (`None` where the context has no layer, e.g. a single FFN).
        layer: Option<usize>,
        /// The offending index.
        neuron: usize,
        /// The layer's intermediate size.
        intermediate: usize,
    },
    /// A neuron index appears twice where a set is required.
    DuplicateNeuron {
        /// The layer, where known.
        layer: Option<usize>,
        /// The repeated index.
        neuron: usize,
    },
    /// A byte budget the planner cannot use (zero, or smaller than any neuron).
    Budget {
        /// The budget given, in bytes.
        budget: u64,
        /// Why it is unusable.
        reason: String,
    },
    /// Two counts or lengths that must agree do not (layers, neurons, rows, values).
    Count {
        /// What was being compared.
        what: String,
        /// Expected count.
        expected: usize,
        /// Count given.
        got: usize,
    },
    /// A configuration value is outside its domain (names the setting).
    Config {
        /// The setting.
        setting: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A weight tensor the loader needs is missing.
    MissingTensor {
        /// The full tensor name that was looked up.
        name: String,
    },
    /// A `.powerinfer` artifact is unreadable, truncated or inconsistent.
    Artifact {
        /// The file.
        path: std::path::PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// An artifact was made for a different model file.
    ArtifactMismatch {
        /// The model the artifact names (file and hash).
        artifact_model: String,
        /// The sha256 of the model file given.
        model_sha256: String,
    },
    /// A file does not start with a magic this reader accepts (`GGUF`, or PowerInfer's `PWRI`).
    BadMagic {
        /// The file.
        file: String,
        /// The first four bytes found.
        got: [u8; 4],
    },
    /// A file ends before something it declares (a header field, a tensor's data).
    Truncated {
        /// The file.
        file: String,
        /// What was cut off (e.g. `"tensor `blk.0.gpu_idx`"`, `"header"`).
        what: String,
        /// Bytes needed to hold it (0 where unknown).
        needed: u64,
        /// Bytes the file has.
        len: u64,
    },
    /// A file is malformed in a way no other kind describes (names the file and the reason).
    Format {
        /// The file.
        file: String,
        /// What was wrong.
        reason: String,
    },
    /// A tensor in a file has a storage type this reader cannot use there.
    TensorType {
        /// Which tensor.
        tensor: String,
        /// The type found (GGML name or number).
        got: String,
        /// The type(s) accepted.
        expected: String,
    },
    /// PowerInfer's two per-layer placement tensors disagree: `gpu_idx` flags a neuron hot that
    /// `gpu_bucket` does not list, or the other way round.
    GpuIndexMismatch {
        /// The layer.
        layer: usize,
        /// The neuron on which they disagree.
        neuron: usize,
        /// True when `gpu_idx` flags it and `gpu_bucket` lacks it; false for the reverse.
        flagged_not_listed: bool,
    },
    /// Reading or writing a file failed in the operating system (not found, permission,
    /// disk full, ...).
    Io {
        /// The file.
        file: String,
        /// What was being done (e.g. `"open"`, `"reading the header"`, `"writing"`).
        op: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A fast tier (a GPU, or the reference tier) failed, or was used against its protocol
    /// (finish without launch, a neuron it does not hold).
    Tier {
        /// The tier's name (e.g. `"reference"`, `"cuda:0"`).
        tier: String,
        /// What went wrong.
        reason: String,
    },
    /// An error from candle while reading or building tensors.
    Candle(candle_core::Error),
}

impl Error {
    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// For an error about a whole file ([`ErrorKind::BadMagic`], [`ErrorKind::Truncated`],
    /// [`ErrorKind::Format`]), what is wrong with it without the file's name, for a caller that
    /// names the file itself; `None` for the other kinds.
    pub fn file_problem(&self) -> Option<String> {
        Some(match &self.kind {
            ErrorKind::BadMagic { got, .. } => format!(
                "not a GGUF file: magic {:?} ({got:02x?}), expected \"GGUF\" or \"PWRI\"",
                String::from_utf8_lossy(got)
            ),
            ErrorKind::Truncated {
                what, needed, len, ..
            } => format!("truncated: {what} needs {needed} bytes, the file has {len}"),
            ErrorKind::Format { reason, .. } => reason.clone(),
            _ => return None,
        })
    }

    pub(crate) fn shape(tensor: &str, expected: &[Option<usize>], got: &[usize]) -> Self {
        ErrorKind::Shape {
            tensor: tensor.to_string(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        }
        .into()
    }

    /// A [`ErrorKind::Config`] error: `setting` is invalid because of `reason`.
    pub fn config(setting: &str, reason: impl Into<String>) -> Self {
        ErrorKind::Config {
            setting: setting.to_string(),
            reason: reason.into(),
        }
        .into()
    }

    /// A [`ErrorKind::Count`] error: `what` has `got` entries where `expected` are needed.
    pub fn count(what: &str, expected: usize, got: usize) -> Self {
        ErrorKind::Count {
            what: what.to_string(),
            expected,
            got,
        }
        .into()
    }

    /// An [`ErrorKind::Io`] error: `op` on `file` failed with `source`.
    pub fn io(file: impl AsRef<std::path::Path>, op: &str, source: std::io::Error) -> Self {
        ErrorKind::Io {
            file: file.as_ref().display().to_string(),
            op: op.to_string(),
            source,
        }
        .into()
    }

    /// An [`ErrorKind::Tier`] error: tier `tier` failed because of `reason`.
    pub fn tier(tier: &str, reason: impl Into<String>) -> Self {
        ErrorKind::Tier {
            tier: tier.to_string(),
            reason: reason.into(),
        }
        .into()
    }

    pub(crate) fn non_finite(tensor: &str, index: usize) -> Self {
        ErrorKind::NonFinite {
            tensor: tensor.to_string(),
            index,
        }
        .into()
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error { kind }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        ErrorKind::Candle(e).into()
    }
}

/// Lets `?` carry an engine error through `candle_core::Module::forward`.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

fn dims(d: &[Option<usize>]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|x| x.map_or_else(|| "_".to_string(), |v| v.to_string()))
        .collect();
    format!("[{}]", parts.join(", "))
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layer = |l: &Option<usize>| l.map_or_else(String::new, |l| format!("layer {l}: "));
        match &self.kind {
            ErrorKind::Shape {
                tensor,
                expected,
                got,
            } => write!(
                f,
                "tensor `{tensor}` has shape {got:?}, expected {}",
                dims(expected)
            ),
            ErrorKind::DType { tensor, got } => {
                write!(f, "tensor `{tensor}` has unsupported dtype {got:?}")
            }
            ErrorKind::Device { tensor, got } => {
                write!(f, "tensor `{tensor}` is on {got}, this path needs the CPU")
            }
            ErrorKind::NonFinite { tensor, index } => {
                write!(
                    f,
                    "tensor `{tensor}` has a NaN or infinity at flat index {index}"
                )
            }
            ErrorKind::NeuronOutOfRange {
                layer: l,
                neuron,
                intermediate,
            } => write!(
                f,
                "{}neuron index {neuron} out of range (intermediate size {intermediate})",
                layer(l)
            ),
            ErrorKind::DuplicateNeuron { layer: l, neuron } => {
                write!(f, "{}neuron index {neuron} given twice", layer(l))
            }
            ErrorKind::Budget { budget, reason } => {
                write!(f, "byte budget {budget} is unusable: {reason}")
            }
            ErrorKind::Count {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected}, got {got}"),
            ErrorKind::Config { setting, reason } => write!(f, "invalid `{setting}`: {reason}"),
            ErrorKind::MissingTensor { name } => write!(f, "missing tensor `{name}`"),
            ErrorKind::Artifact { path, reason } => {
                write!(f, "artifact {}: {reason}", path.display())
            }
            ErrorKind::ArtifactMismatch {
                artifact_model,
                model_sha256,
            } => write!(
                f,
                "the artifact was made for {artifact_model}, not for this model file \
                 (sha256 {model_sha256}); run `powerinfer analyze` on this model"
            ),
            ErrorKind::BadMagic { file, .. }
            | ErrorKind::Truncated { file, .. }
            | ErrorKind::Format { file, .. } => {
                let problem = self.file_problem().unwrap_or_default();
                write!(f, "{file}: {problem}")
            }
            ErrorKind::TensorType {
                tensor,
                got,
                expected,
            } => write!(f, "tensor `{tensor}` has type {got}, expected {expected}"),
            ErrorKind::GpuIndexMismatch {
                layer,
                neuron,
                flagged_not_listed,
            } => {
                if *flagged_not_listed {
                    write!(
                        f,
                        "blk.{layer}.gpu_idx flags neuron {neuron} hot but blk.{layer}.gpu_bucket \
                         does not list it"
                    )
                } else {
                    write!(
                        f,
                        "blk.{layer}.gpu_bucket lists neuron {neuron} but blk.{layer}.gpu_idx \
                         does not flag it hot"
                    )
                }
            }
            ErrorKind::Io { file, op, source } => write!(f, "{file}: {op}: {source}"),
            ErrorKind::Tier { tier, reason } => write!(f, "fast tier `{tier}`: {reason}"),
            ErrorKind::Candle(e) => write!(f, "candle: {e}"),
        }
    }
}

/// The wrapped error's message is already part of this one's (`Display`), so `source` goes on
/// from what it wraps: a chain printed whole (`{:#}` in anyhow) says each thing once.
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            ErrorKind::Candle(e) => e.source(),
            ErrorKind::Io { source, .. } => source.source(),
            _ => None,
        }
    }
}
