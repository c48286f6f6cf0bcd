//! Offline analysis: activation statistics and magnitude histograms (recorded by the FFNs while
//! calibration text runs), predictor audits, and training of the low-rank predictors.

mod profile;
mod train;

pub use profile::{ActivationStats, Histogram, PredictorAudit};
pub use train::{
    predictor_bytes, train_low_rank, PredictorQuality, Samples, TrainOptions, Trained,
    QUANTILE_MAX, QUANTILE_STEPS,
};
