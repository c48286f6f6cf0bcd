//! Errors of the model adapter: one [`Error`] with a matchable [`ErrorKind`].

use std::fmt;
use std::path::PathBuf;

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// An error from loading, tokenizing, generating or fetching.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
}

/// What went wrong.
#[derive(Debug)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Reading a file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model file is truncated or not in the format it claims.
    Format {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The model's architecture is not one this crate runs.
    UnsupportedArchitecture {
        /// The architecture named by the file.
        arch: String,
    },
    /// The file asks for something this crate does not run (a RoPE scaling type, logit
    /// soft-capping, ...): refused rather than run wrong.
    UnsupportedKey {
        /// The metadata key.
        key: String,
        /// Its value, as the file gives it.
        value: String,
    },
    /// A tensor the model needs is not in the file.
    MissingTensor {
        /// Its name.
        name: String,
    },
    /// A metadata or config key the model needs is missing or has the wrong type.
    MissingKey {
        /// The key.
        key: String,
    },
    /// The config names an activation the sparse FFN does not support.
    UnknownActivation {
        /// The name in the config.
        name: String,
    },
    /// Building or running the tokenizer failed.
    Tokenizer(String),
    /// The prompt cannot be used (empty, or longer than the context).
    Prompt {
        /// Why.
        reason: String,
    },
    /// An error from the sparse FFN engine.
    Engine(powerinfer::Error),
    /// An error from candle.
    Candle(candle_core::Error),
}

impl Error {
    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The file this error names in its message (an I/O error or an invalid file), if any.
    pub fn path(&self) -> Option<&std::path::Path> {
        match &self.kind {
            ErrorKind::Io { path, .. } | ErrorKind::Format { path, .. } => Some(path),
            _ => None,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ErrorKind::Io {
            path: path.into(),
            source,
        }
        .into()
    }

    pub(crate) fn format(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ErrorKind::Format {
            path: path.into(),
            reason: reason.into(),
        }
        .into()
    }

    pub(crate) fn missing_key(key: impl Into<String>) -> Self {
        ErrorKind::MissingKey { key: key.into() }.into()
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error { kind }
    }
}

impl From<powerinfer::Error> for Error {
    fn from(e: powerinfer::Error) -> Self {
        ErrorKind::Engine(e).into()
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        ErrorKind::Candle(e).into()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ErrorKind::Io { path, source } => write!(f, "{}: {source}", path.display()),
            ErrorKind::Format { path, reason } => {
                write!(f, "{}: not a valid model file: {reason}", path.display())
            }
            ErrorKind::UnsupportedArchitecture { arch } => write!(
                f,
                "unsupported architecture `{arch}` (supported: llama, mistral, qwen2 and gemma3 GGUF files; llama, mistral and qwen2 checkpoints)"
            ),
            ErrorKind::UnsupportedKey { key, value } => {
                write!(f, "unsupported `{key}` = {value}: not run by this crate")
            }
            ErrorKind::MissingTensor { name } => write!(f, "missing tensor `{name}`"),
            ErrorKind::MissingKey { key } => write!(f, "missing or invalid key `{key}`"),
            ErrorKind::UnknownActivation { name } => write!(
                f,
                "unknown activation `{name}` (supported: silu, swish, relu, drelu, gelu, gelu_tanh, gelu_pytorch_tanh, gelu_new)"
            ),
            ErrorKind::Tokenizer(e) => write!(f, "tokenizer: {e}"),
            ErrorKind::Prompt { reason } => write!(f, "prompt: {reason}"),
            ErrorKind::Engine(e) => write!(f, "{e}"),
            ErrorKind::Candle(e) => write!(f, "candle: {e}"),
        }
    }
}

/// The wrapped error's message is already part of this one's (`Display`), so `source` goes on
/// from what it wraps: a chain printed whole (`{:#}` in anyhow) says each thing once.
impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            ErrorKind::Io { source, .. } => source.source(),
            ErrorKind::Engine(e) => e.source(),
            ErrorKind::Candle(e) => e.source(),
            _ => None,
        }
    }
}

/// `Ok` when a per-layer list has `got == expected` entries, else the engine's
/// [`powerinfer::ErrorKind::Count`] error naming `what`.
pub(crate) fn check_count(what: &str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        return Ok(());
    }
    Err(powerinfer::Error::count(what, expected, got).into())
}
