//! Predictor training: (FFN input, active mask) samples in, a [`LowRank`] predictor out.
//!
//! The predictor `score = fc2 relu(fc1 x) + b` is fitted with candle's autograd and AdamW on a
//! recall-weighted binary cross-entropy (a missed active neuron costs `pos_weight` times a wasted
//! one). Its score threshold is then chosen on a validation split so that a target share of the
//! truly active (row, neuron) pairs scores at or above it: recall is what keeps quality, and the
//! threshold, not the loss, decides it.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::error::{Error, ErrorKind, Result};
use crate::predict::LowRank;

/// Captured training rows of one layer: the FFN input and which neurons were active.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples {
    hidden: usize,
    intermediate: usize,
    words: usize,
    x: Vec<f32>,
    active: Vec<u64>,
    /// `|h|` of every (row, neuron) pair (f16).
    mag: Vec<half::f16>,
    /// A neuron is active in a row when `|h| > threshold`.
    threshold: f32,
}

impl Samples {
    /// No rows yet, for a layer of `hidden` inputs and `intermediate` neurons whose neurons count
    /// as active when `|h| > threshold`.
    pub fn new(hidden: usize, intermediate: usize, threshold: f32) -> Self {
        Samples {
            hidden,
            intermediate,
            words: intermediate.div_ceil(64),
            x: Vec::new(),
            active: Vec::new(),
            mag: Vec::new(),
            threshold,
        }
    }

    /// Adds a row: input `x` (`hidden` values) and activations `h` (`intermediate` values);
    /// neuron `i` is active when `|h_i|` is above the set's threshold.
    pub fn push(&mut self, x: &[f32], h: &[f32]) -> Result<()> {
        if x.len() != self.hidden || h.len() != self.intermediate {
            return Err(Error::shape(
                "sample (x, h)",
                &[Some(self.hidden), Some(self.intermediate)],
                &[x.len(), h.len()],
            ));
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite("sample x", i));
        }
        if let Some(i) = h.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite("sample h", i));
        }
        self.x.extend_from_slice(x);
        let base = self.active.len();
        self.active.resize(base + self.words, 0);
        for (i, &v) in h.iter().enumerate() {
            if v.abs() > self.threshold {
                self.active[base + i / 64] |= 1 << (i % 64);
            }
        }
        self.mag
            .extend(h.iter().map(|&v| half::f16::from_f32(v.abs())));
        Ok(())
    }

    /// Splits off rows `at..` into a new set (e.g. a validation split of later text).
    pub fn split_off(&mut self, at: usize) -> Samples {
        let at = at.min(self.len());
        Samples {
            x: self.x.split_off(at * self.hidden),
            active: self.active.split_off(at * self.words),
            mag: self.mag.split_off(at * self.intermediate),
            ..*self
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.x.len() / self.hidden.max(1)
    }

    /// True when no row is held.
    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }

    /// `(hidden, intermediate)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.hidden, self.intermediate)
    }

    /// Whether `neuron` was active in `row`; `None` when either is out of range.
    pub fn is_active(&self, row: usize, neuron: usize) -> Option<bool> {
        (row < self.len() && neuron < self.intermediate).then(|| self.active_at(row, neuron))
    }

    /// [`Samples::is_active`] for indices the caller keeps in range.
    fn active_at(&self, row: usize, neuron: usize) -> bool {
        self.active[row * self.words + neuron / 64] >> (neuron % 64) & 1 == 1
    }

    /// Share of (row, neuron) pairs that were active.
    pub fn active_fraction(&self) -> f64 {
        let ones: u64 = self.active.iter().map(|w| u64::from(w.count_ones())).sum();
        ones as f64 / (self.len() * self.intermediate).max(1) as f64
    }

    /// `|h|` of (row, neuron).
    pub fn magnitude(&self, row: usize, neuron: usize) -> f32 {
        self.mag[row * self.intermediate + neuron].to_f32()
    }

    /// Per-pair loss weights `[n, intermediate]`: for active pairs `min(|h| / t, cap)` (missing a
    /// large contribution costs more), 1 for inactive ones.
    fn mass_weights(
        &self,
        range: std::ops::Range<usize>,
        cap: f32,
        dev: &Device,
    ) -> Result<Tensor> {
        let n = range.len();
        let mut w = Vec::with_capacity(n * self.intermediate);
        for r in range {
            let t = self.threshold.max(f32::MIN_POSITIVE);
            w.extend((0..self.intermediate).map(|i| {
                if self.active_at(r, i) {
                    (self.magnitude(r, i) / t).clamp(1.0, cap)
                } else {
                    1.0
                }
            }));
        }
        Ok(Tensor::from_vec(w, (n, self.intermediate), dev)?)
    }

    /// Rows `range` as tensors: inputs `[n, hidden]` and 0/1 targets `[n, intermediate]`.
    fn tensors(&self, range: std::ops::Range<usize>, dev: &Device) -> Result<(Tensor, Tensor)> {
        let n = range.len();
        let x = Tensor::from_slice(
            &self.x[range.start * self.hidden..range.end * self.hidden],
            (n, self.hidden),
            dev,
        )?;
        let mut y = vec![0f32; n * self.intermediate];
        for (k, r) in range.enumerate() {
            let words = &self.active[r * self.words..(r + 1) * self.words];
            let out = &mut y[k * self.intermediate..(k + 1) * self.intermediate];
            for (i, o) in out.iter_mut().enumerate() {
                *o = (words[i / 64] >> (i % 64) & 1) as f32;
            }
        }
        Ok((x, Tensor::from_vec(y, (n, self.intermediate), dev)?))
    }
}

/// How to train a predictor.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// Bottleneck width of `fc1`.
    pub rank: usize,
    /// Passes over the training rows.
    pub epochs: usize,
    /// Rows per step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Weight of a missed active neuron relative to a wasted inactive one in the loss.
    pub pos_weight: f64,
    /// Share of truly active pairs the chosen threshold must keep on the validation rows.
    pub target_recall: f64,
    /// Seed of the initial weights and the row order.
    pub seed: u64,
    /// Weigh each missed active neuron by its contribution `|h| / threshold` (capped at this
    /// value) on top of `pos_weight`, so the predictor learns to keep the large ones: quality
    /// follows the activation mass kept, not the count. `1.0` turns it off.
    pub mass_cap: f32,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            rank: 64,
            epochs: 8,
            batch: 512,
            lr: 3e-3,
            pos_weight: 2.0,
            target_recall: 0.9,
            seed: 2024,
            mass_cap: 1.0,
        }
    }
}

impl TrainOptions {
    /// Checks every setting (a typed error naming the first bad one).
    pub fn validate(&self) -> Result<()> {
        let bad = |s: &str, why: String| Err(Error::config(s, why));
        if self.rank == 0 || self.epochs == 0 || self.batch == 0 {
            return bad("rank/epochs/batch", "must all be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", format!("{} must be positive", self.lr));
        }
        if !(self.pos_weight > 0.0 && self.pos_weight.is_finite()) {
            return bad(
                "pos_weight",
                format!("{} must be positive", self.pos_weight),
            );
        }
        if !(self.mass_cap >= 1.0 && self.mass_cap.is_finite()) {
            return bad("mass_cap", format!("{} must be >= 1", self.mass_cap));
        }
        if !(self.target_recall > 0.0 && self.target_recall <= 1.0) {
            return bad(
                "target_recall",
                format!("{} must be in (0, 1]", self.target_recall),
            );
        }
        Ok(())
    }
}

/// Quality of a predictor at one threshold, measured on rows it was not trained on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PredictorQuality {
    /// Share of truly active pairs predicted active.
    pub recall: f64,
    /// Share of predicted pairs that were truly active.
    pub precision: f64,
    /// Share of all pairs predicted active (1 - realized sparsity).
    pub predicted: f64,
    /// Share of all pairs truly active.
    pub truth: f64,
    /// Share of the activation mass `sum |h|` the predicted pairs carry.
    pub mass: f64,
}

/// Score thresholds for a sweep: `quantiles[k]` predicts about `1 - k / (len - 1) * QUANTILE_MAX`
/// of the pairs active (see [`Trained::threshold_for_sparsity`]).
pub const QUANTILE_STEPS: usize = 20;
/// The highest sparsity the stored quantiles reach.
pub const QUANTILE_MAX: f64 = 0.95;

/// A trained predictor and what validation says about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Trained {
    /// `[rank, hidden]`, row-major.
    pub fc1: Vec<f32>,
    /// `[intermediate, rank]`, row-major.
    pub fc2: Vec<f32>,
    /// `[intermediate]`.
    pub bias: Vec<f32>,
    /// Bottleneck width.
    pub rank: usize,
    /// The score threshold reaching the target recall on the validation rows.
    pub threshold: f32,
    /// Validation quality at `threshold`.
    pub quality: PredictorQuality,
    /// Score thresholds giving sparsity `k / QUANTILE_STEPS * QUANTILE_MAX` on the validation
    /// rows, `k = 0..=QUANTILE_STEPS`.
    pub quantiles: Vec<f32>,
    /// Share of the validation activation mass `sum |h|` kept at each of `quantiles`.
    pub mass_kept: Vec<f64>,
    /// Mean training loss of each epoch.
    pub losses: Vec<f64>,
}

/// Bytes a rank-`rank` low-rank predictor for an FFN of `hidden` inputs and `intermediate`
/// neurons takes in memory and in a placement budget ([`Trained::stored_bytes`] of one trained
/// with that rank), known before training.
pub fn predictor_bytes(hidden: usize, intermediate: usize, rank: usize) -> u64 {
    crate::predict::stored_bytes(rank * hidden, intermediate * rank, intermediate) as u64
}

impl Trained {
    /// Bytes the predictor takes in memory and in a placement budget (what
    /// [`crate::Predictor::weight_bytes`] of [`Trained::predictor`] reports).
    pub fn stored_bytes(&self) -> u64 {
        crate::predict::stored_bytes(self.fc1.len(), self.fc2.len(), self.bias.len()) as u64
    }

    /// The predictor, on `hidden` inputs.
    pub fn predictor(&self, hidden: usize) -> Result<LowRank> {
        let dev = Device::Cpu;
        let n = self.bias.len();
        let fc1 = Tensor::from_slice(&self.fc1, (self.rank, hidden), &dev)?;
        let fc2 = Tensor::from_slice(&self.fc2, (n, self.rank), &dev)?;
        LowRank::new(&fc1, &fc2, self.threshold)?
            .with_bias(&Tensor::from_slice(&self.bias, n, &dev)?)
    }

    /// The stored score threshold for about `sparsity` realized sparsity (interpolated between
    /// quantiles); `None` outside `[0, QUANTILE_MAX]`.
    pub fn threshold_for_sparsity(quantiles: &[f32], sparsity: f64) -> Option<f32> {
        if quantiles.len() < 2 || !(0.0..=QUANTILE_MAX).contains(&sparsity) {
            return None;
        }
        let pos = sparsity / QUANTILE_MAX * (quantiles.len() - 1) as f64;
        let k = (pos.floor() as usize).min(quantiles.len() - 2);
        let f = (pos - k as f64) as f32;
        Some(quantiles[k] * (1.0 - f) + quantiles[k + 1] * f)
    }
}

/// `sum(w * (pos_weight * y * softplus(-s) + (1 - y) * softplus(s))) / n`, softplus written
/// stably; `w` optional per-pair weights.
fn weighted_bce(
    scores: &Tensor,
    y: &Tensor,
    w: Option<&Tensor>,
    pos_weight: f64,
) -> candle_core::Result<Tensor> {
    let softplus = |t: &Tensor| -> candle_core::Result<Tensor> {
        // softplus(t) = relu(t) + log(1 + exp(-|t|))
        t.relu()? + ((t.abs()?.neg()?.exp()? + 1.0)?.log()?)
    };
    let pos = (y * softplus(&scores.neg()?)?)?.affine(pos_weight, 0.0)?;
    let neg = (y.affine(-1.0, 1.0)? * softplus(scores)?)?;
    match w {
        Some(w) => ((pos + neg)? * w)?.mean_all(),
        None => (pos + neg)?.mean_all(),
    }
}

/// Fits a predictor on `train` and picks its threshold on `val` (see the module docs).
/// `on_epoch(epoch, mean_loss)` is called after every epoch.
pub fn train_low_rank(
    train: &Samples,
    val: &Samples,
    opts: &TrainOptions,
    on_epoch: &mut dyn FnMut(usize, f64),
) -> Result<Trained> {
    opts.validate()?;
    let (hidden, n) = train.dims();
    if val.dims() != (hidden, n) {
        return Err(ErrorKind::Count {
            what: "validation sample width (hidden, intermediate)".into(),
            expected: hidden * n,
            got: val.dims().0 * val.dims().1,
        }
        .into());
    }
    if train.is_empty() || val.is_empty() {
        return Err(Error::config(
            "samples",
            format!(
                "need training and validation rows (got {} and {})",
                train.len(),
                val.len()
            ),
        ));
    }
    let dev = Device::Cpu;
    let rank = opts.rank;
    // Row order and initial weights from the seed, so a run is reproducible.
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut init = |rows: usize, cols: usize| -> Result<Var> {
        let scale = (1.0 / cols as f64).sqrt();
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| (normal(&mut rng) * scale) as f32)
            .collect();
        Ok(Var::from_tensor(&Tensor::from_vec(v, (rows, cols), &dev)?)?)
    };
    let fc1 = init(rank, hidden)?;
    let fc2 = init(n, rank)?;
    // Start the bias at each neuron's base rate (log-odds), the best constant predictor.
    let mut ones = vec![0f64; n];
    for r in 0..train.len() {
        for (i, o) in ones.iter_mut().enumerate() {
            *o += f64::from(u8::from(train.active_at(r, i)));
        }
    }
    let b0: Vec<f32> = ones
        .iter()
        .map(|&c| {
            let p = ((c + 0.5) / (train.len() as f64 + 1.0)).clamp(1e-4, 1.0 - 1e-4);
            (p / (1.0 - p)).ln() as f32
        })
        .collect();
    let bias = Var::from_tensor(&Tensor::from_vec(b0, n, &dev)?)?;
    let mut opt = AdamW::new(
        vec![fc1.clone(), fc2.clone(), bias.clone()],
        ParamsAdamW {
            lr: opts.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    let forward = |x: &Tensor| -> candle_core::Result<Tensor> {
        x.matmul(&fc1.t()?)?
            .relu()?
            .matmul(&fc2.t()?)?
            .broadcast_add(bias.as_tensor())
    };
    // All training rows as two tensors; batches are contiguous slices (the rows are already
    // spread over the calibration text), visited in a shuffled order each epoch.
    let (xs, ys) = train.tensors(0..train.len(), &dev)?;
    let ws = if opts.mass_cap > 1.0 {
        Some(train.mass_weights(0..train.len(), opts.mass_cap, &dev)?)
    } else {
        None
    };
    let mut order: Vec<usize> = (0..train.len().div_ceil(opts.batch)).collect();
    let mut losses = Vec::with_capacity(opts.epochs);
    for epoch in 0..opts.epochs {
        order.shuffle(&mut rng);
        let mut total = 0f64;
        for &b in &order {
            let start = b * opts.batch;
            let len = opts.batch.min(train.len() - start);
            let (x, y) = (xs.narrow(0, start, len)?, ys.narrow(0, start, len)?);
            let w = ws.as_ref().map(|w| w.narrow(0, start, len)).transpose()?;
            let loss = weighted_bce(&forward(&x)?, &y, w.as_ref(), opts.pos_weight)?;
            opt.backward_step(&loss)?;
            total += f64::from(loss.to_scalar::<f32>()?);
        }
        let mean = total / order.len() as f64;
        if !mean.is_finite() {
            return Err(Error::config(
                "lr",
                format!(
                    "training diverged in epoch {epoch} (loss {mean}); lower the learning rate"
                ),
            ));
        }
        losses.push(mean);
        on_epoch(epoch, mean);
    }

    // Validation scores, computed like inference does (f16 weights), split by truth.
    let trained = Trained {
        fc1: fc1.as_tensor().flatten_all()?.to_vec1()?,
        fc2: fc2.as_tensor().flatten_all()?.to_vec1()?,
        bias: bias.as_tensor().to_vec1()?,
        rank,
        threshold: 0.0,
        quality: PredictorQuality::default(),
        quantiles: Vec::new(),
        mass_kept: Vec::new(),
        losses,
    };
    let round =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    let f1 = Tensor::from_vec(round(&trained.fc1), (rank, hidden), &dev)?;
    let f2 = Tensor::from_vec(round(&trained.fc2), (n, rank), &dev)?;
    let b = Tensor::from_slice(&trained.bias, n, &dev)?;
    let mut on = Vec::new();
    let mut all = Vec::with_capacity(val.len() * n);
    let mut mass = Vec::with_capacity(val.len() * n);
    for start in (0..val.len()).step_by(4096) {
        let (x, _) = val.tensors(start..(start + 4096).min(val.len()), &dev)?;
        let s = x
            .matmul(&f1.t()?)?
            .relu()?
            .matmul(&f2.t()?)?
            .broadcast_add(&b)?
            .to_dtype(DType::F32)?;
        let s: Vec<Vec<f32>> = s.to_vec2()?;
        for (r, row) in s.iter().enumerate() {
            for (i, &v) in row.iter().enumerate() {
                if val.active_at(start + r, i) {
                    on.push(v);
                }
                all.push(v);
                mass.push(val.magnitude(start + r, i));
            }
        }
    }
    let threshold = recall_threshold(&mut on, opts.target_recall);
    let mut quality = measure(&on, &all, threshold);
    let kept: f64 = all
        .iter()
        .zip(&mass)
        .filter(|(&s, _)| s >= threshold)
        .map(|(_, &m)| f64::from(m))
        .sum();
    quality.mass = kept
        / mass
            .iter()
            .map(|&m| f64::from(m))
            .sum::<f64>()
            .max(f64::MIN_POSITIVE);
    // Scores ascending with their masses: the mass kept above each quantile is a suffix sum.
    let mut pairs: Vec<(f32, f32)> = all.into_iter().zip(mass).collect();
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = pairs.iter().map(|p| f64::from(p.1)).sum();
    let mut suffix = vec![0f64; pairs.len() + 1];
    for k in (0..pairs.len()).rev() {
        suffix[k] = suffix[k + 1] + f64::from(pairs[k].1);
    }
    let at = |k: usize| {
        let q = k as f64 / QUANTILE_STEPS as f64 * QUANTILE_MAX;
        ((q * pairs.len() as f64) as usize).min(pairs.len() - 1)
    };
    let quantiles = (0..=QUANTILE_STEPS).map(|k| pairs[at(k)].0).collect();
    let mass_kept = (0..=QUANTILE_STEPS)
        .map(|k| suffix[at(k)] / total.max(f64::MIN_POSITIVE))
        .collect();
    Ok(Trained {
        threshold,
        quality,
        quantiles,
        mass_kept,
        ..trained
    })
}

/// The largest threshold that keeps at least `recall` of `active_scores` (sorted in place).
fn recall_threshold(active_scores: &mut [f32], recall: f64) -> f32 {
    if active_scores.is_empty() {
        return f32::MAX;
    }
    active_scores.sort_by(f32::total_cmp);
    let drop = ((1.0 - recall) * active_scores.len() as f64).floor() as usize;
    active_scores[drop.min(active_scores.len() - 1)]
}

/// Recall, precision and shares at `threshold` from the truly active scores and all scores.
fn measure(active_scores: &[f32], all: &[f32], threshold: f32) -> PredictorQuality {
    let hit = active_scores.iter().filter(|&&s| s >= threshold).count() as f64;
    let predicted = all.iter().filter(|&&s| s >= threshold).count() as f64;
    let total = all.len().max(1) as f64;
    PredictorQuality {
        recall: hit / active_scores.len().max(1) as f64,
        precision: hit / predicted.max(1.0),
        predicted: predicted / total,
        truth: active_scores.len() as f64 / total,
        mass: 0.0,
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * rng.random::<f64>()).cos()
}
