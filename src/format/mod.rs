//! Files: the `.powerinfer` artifact this crate writes, and PowerInfer's own files (the
//! `PWRI`-magic GGUF model and the `.gpuidx` placement) that it reads.

mod artifact;
mod gguf;
mod gguf_check;
mod gpuidx;

pub use artifact::{
    file_sha256, model_sha256, Artifact, ArtifactMeta, AttentionRuleMeta, CalibrationSummary,
    InputRuleMeta, LayerMeta, LayerTensors, ARTIFACT_FORMAT, ARTIFACT_VERSION,
};
pub use gguf::{
    read_gguf, GgufMagic, PowerInferFile, GGUF_MAGIC, POWERINFER_DEFAULT_THRESHOLD,
    POWERINFER_MAGIC, SPARSE_THRESHOLD_KEY,
};
pub use gpuidx::{parse_gpuidx, read_gpuidx};
