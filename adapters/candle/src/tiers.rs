//! Fast tiers for a whole model: one byte budget for every layer, the hottest neurons of all
//! layers placed first (PowerInfer's global placement), the rest of the budget as neuron caches.

use std::sync::Arc;

use powerinfer::analysis::ActivationStats;
use powerinfer::{
    tier::plan_placement, tier::FastTier, tier::LayerPlacement, tier::ReferenceTier,
    tier::TierBudget, tier::TierCounters, NeuronBundles,
};

use crate::error::{check_count, Result};
use crate::model::{Ffn, Llama};

/// How a model's fast tiers are laid out (`--vram-budget`, `--cache`, `--cache-window`,
/// `--force-dense-layers`).
#[derive(Debug, Clone, PartialEq)]
pub struct TierOptions {
    /// Bytes of the fast tier for all layers together: hot neurons and cache slots.
    pub budget: u64,
    /// Share of `budget` kept for the layers' neuron caches, in `[0, 1]`; the rest holds the
    /// placed hot neurons.
    pub cache_share: f64,
    /// Calls a cached neuron stays protected after its last use (at least 1).
    pub cache_window: u64,
    /// Layers computed densely on the CPU, with no fast tier (every neuron, every token).
    pub force_dense_layers: Vec<usize>,
    /// While layer `l` runs, layer `l + prefetch_depth`'s predictor guesses its neurons from
    /// the residual stream and its tier copies the ones it lacks into its cache
    /// ([`powerinfer::HybridFfn::prefetch`]); 0 turns it off. Needs cache slots and a predictor
    /// that is not an inline threshold rule (an artifact's trained predictors).
    pub prefetch_depth: usize,
    /// Which tier.
    pub kind: TierKind,
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            budget: 0,
            cache_share: 0.0,
            cache_window: 1,
            force_dense_layers: Vec::new(),
            prefetch_depth: 0,
            kind: TierKind::Reference { threads: 1 },
        }
    }
}

/// Which fast tier [`Llama::attach_tiers`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierKind {
    /// [`ReferenceTier`]: CPU threads of its own (`threads` per layer), for tests and for
    /// measuring the split without a GPU.
    Reference {
        /// Threads per layer.
        threads: usize,
    },
    /// `powerinfer::tier::CudaTier` on CUDA device `ordinal` (builds with the `cuda` feature; in
    /// other builds, and without a device, every layer stays on the CPU with a warning).
    Cuda {
        /// The device.
        ordinal: usize,
    },
}

impl std::str::FromStr for TierKind {
    type Err = powerinfer::Error;

    /// `reference`, `reference:THREADS`, `cuda` or `cuda:ORDINAL`.
    fn from_str(s: &str) -> powerinfer::Result<Self> {
        let (kind, n) = match s.split_once(':') {
            Some((k, n)) => (k, Some(n)),
            None => (s, None),
        };
        let num = |default: usize| -> powerinfer::Result<usize> {
            n.map_or(Ok(default), |n| {
                n.parse().map_err(|_| {
                    powerinfer::Error::config("tier", format!("`{n}` is not a number (in `{s}`)"))
                })
            })
        };
        match kind {
            "reference" => match num(1)? {
                0 => Err(powerinfer::Error::config(
                    "tier",
                    "the reference tier needs a thread",
                )),
                threads => Ok(TierKind::Reference { threads }),
            },
            "cuda" => Ok(TierKind::Cuda { ordinal: num(0)? }),
            _ => Err(powerinfer::Error::config(
                "tier",
                format!("`{s}`: expected reference[:THREADS] or cuda[:DEVICE]"),
            )),
        }
    }
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TierKind::Reference { threads } => write!(f, "reference:{threads}"),
            TierKind::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// A device to build layers' tiers on.
enum Builder {
    Reference(usize),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::CudaDevice),
}

impl Builder {
    /// The device for `kind`, or why there is none (the caller warns and stays on the CPU).
    fn open(kind: TierKind) -> std::result::Result<Builder, String> {
        match kind {
            TierKind::Reference { threads } => Ok(Builder::Reference(threads)),
            #[cfg(feature = "cuda")]
            TierKind::Cuda { ordinal } => powerinfer::tier::cuda_device(ordinal)
                .map(Builder::Cuda)
                .map_err(|e| e.to_string()),
            #[cfg(not(feature = "cuda"))]
            TierKind::Cuda { .. } => {
                Err("this build has no CUDA support (build with `--features cuda`)".into())
            }
        }
    }

    /// Bytes a hot neuron of `b` takes in the tier.
    fn neuron_bytes(&self, b: &NeuronBundles) -> u64 {
        match self {
            Builder::Reference(_) => ReferenceTier::neuron_bytes(b),
            #[cfg(feature = "cuda")]
            Builder::Cuda(_) => powerinfer::tier::CudaTier::neuron_bytes(b),
        }
    }

    /// Bytes of a layer's per-call buffers at most (`capacity` neurons held).
    fn work_bytes(&self, b: &NeuronBundles, capacity: usize) -> u64 {
        let _ = (b, capacity);
        match self {
            Builder::Reference(_) => 0,
            #[cfg(feature = "cuda")]
            Builder::Cuda(_) => powerinfer::tier::CudaTier::work_bytes(b, capacity),
        }
    }

    fn build(
        &self,
        b: &NeuronBundles,
        hot: &[u32],
        slots: usize,
        budget: &Arc<TierBudget>,
        window: u64,
    ) -> powerinfer::Result<Box<dyn FastTier>> {
        Ok(match self {
            Builder::Reference(threads) => Box::new(
                ReferenceTier::new(b, hot, slots, budget, *threads)?.with_cache_window(window)?,
            ),
            #[cfg(feature = "cuda")]
            Builder::Cuda(dev) => Box::new(
                powerinfer::tier::CudaTier::new(dev, b, hot, slots, budget)?
                    .with_cache_window(window)?,
            ),
        })
    }
}

/// What [`Llama::attach_tiers`] placed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierReport {
    /// The tier (`reference`, `cuda:0`).
    pub tier: String,
    /// Why some or all layers stayed on the CPU (no device, out of memory), if any did.
    pub fallback: Option<String>,
    /// The budget, bytes.
    pub budget: u64,
    /// Bytes reserved by all tiers (never above `budget`).
    pub reserved: u64,
    /// Hot neurons placed, all layers.
    pub hot_neurons: usize,
    /// Cache slots, all layers.
    pub cache_slots: usize,
    /// Bytes of the FFN weights of the layers with a tier (what a budget of 100% holds).
    pub ffn_bytes: u64,
}

impl Llama {
    /// How often each neuron of each hybrid layer is active on `tokens` (run in chunks of
    /// `chunk` positions) with the predictors installed now: the statistics a placement is
    /// planned from when no artifact gives them. Dense layers get an empty vector.
    pub fn neuron_frequencies(&mut self, tokens: &[u32], chunk: usize) -> Result<Vec<Vec<f64>>> {
        self.hybrids()?;
        for l in &self.layers {
            if let Ffn::Hybrid(h) = &l.ffn {
                h.enable_stats(0.0);
            }
        }
        let chunk = chunk.max(1);
        let run = (|| -> Result<()> {
            for w in tokens.chunks(chunk) {
                self.clear_kv_cache();
                self.forward(w, 0)?;
            }
            Ok(())
        })();
        self.clear_kv_cache();
        let stats: Vec<Option<ActivationStats>> = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Hybrid(h) => h.take_stats(),
                _ => None,
            })
            .collect();
        run?;
        Ok(stats
            .into_iter()
            .map(|s| {
                s.map_or_else(Vec::new, |s| {
                    s.counts
                        .iter()
                        .map(|&c| c as f64 / s.tokens.max(1) as f64)
                        .collect()
                })
            })
            .collect())
    }

    /// Gives every hybrid layer (but the forced-dense ones) a fast tier of `opts.kind`: the
    /// hottest neurons of all layers by `frequencies` (one vector per layer, e.g. an artifact's
    /// counts or [`Llama::neuron_frequencies`]) until `(1 - cache_share)` of the budget (less
    /// the tiers' buffers) is spent, then equal cache slots per layer from the rest. Every tier
    /// reserves its bytes under one [`TierBudget`], so the total never passes `budget`.
    /// Replaces the layers' placements.
    ///
    /// No device (or a build without it) leaves every layer on the CPU, and a layer whose tier
    /// cannot be allocated (out of memory) stays on the CPU: both are logged as warnings and
    /// named in [`TierReport::fallback`], not errors.
    pub fn attach_tiers(
        &mut self,
        opts: &TierOptions,
        frequencies: &[Vec<f64>],
    ) -> Result<TierReport> {
        if !(0.0..=1.0).contains(&opts.cache_share) {
            return Err(powerinfer::Error::config(
                "cache share",
                format!("{} is not in [0, 1]", opts.cache_share),
            )
            .into());
        }
        let layers = self.layers.len();
        if let Some(&l) = opts.force_dense_layers.iter().find(|&&l| l >= layers) {
            return Err(powerinfer::Error::config(
                "force-dense layers",
                format!("layer {l} does not exist (the model has {layers})"),
            )
            .into());
        }
        let budget = TierBudget::new(opts.budget)?;
        self.prefetch_depth = opts.prefetch_depth;
        let mut hybrids = self.hybrids()?;
        check_count(
            "neuron frequencies (one vector per layer)",
            hybrids.len(),
            frequencies.len(),
        )?;
        for (l, h) in hybrids.iter_mut().enumerate() {
            h.detach_tier();
            h.set_force_dense(opts.force_dense_layers.contains(&l));
        }

        let mut report = TierReport {
            tier: opts.kind.to_string(),
            budget: opts.budget,
            ..Default::default()
        };
        let builder = match Builder::open(opts.kind) {
            Ok(b) => b,
            Err(why) => {
                tracing::warn!(
                    "no fast tier `{}`: {why}; the FFN runs on the CPU",
                    opts.kind
                );
                report.fallback = Some(why);
                return Ok(report);
            }
        };
        let tiered: Vec<usize> = (0..layers)
            .filter(|l| !opts.force_dense_layers.contains(l))
            .collect();
        let per: Vec<u64> = tiered
            .iter()
            .map(|&l| builder.neuron_bytes(hybrids[l].bundles()))
            .collect();
        let mut buffers = 0u64;
        for (&l, &p) in tiered.iter().zip(&per) {
            let (b, n) = (hybrids[l].bundles(), hybrids[l].spec().intermediate());
            check_count(
                &format!("layer {l} neuron frequencies"),
                n,
                frequencies[l].len(),
            )?;
            report.ffn_bytes += p * n as u64;
            buffers += builder.work_bytes(b, n);
        }
        let hot_budget =
            ((opts.budget as f64 * (1.0 - opts.cache_share)) as u64).saturating_sub(buffers);
        let smallest = per.iter().copied().min().unwrap_or(u64::MAX);
        let hot: Vec<LayerPlacement> = if hot_budget >= smallest {
            let f: Vec<Vec<f64>> = tiered.iter().map(|&l| frequencies[l].clone()).collect();
            plan_placement(&f, &per, hot_budget)?.layers
        } else {
            tiered
                .iter()
                .map(|&l| LayerPlacement::all_cold(hybrids[l].spec().intermediate()))
                .collect()
        };
        let hot_bytes: u64 = hot
            .iter()
            .zip(&per)
            .map(|(h, p)| h.hot().len() as u64 * p)
            .sum();
        let cache_bytes = opts.budget.saturating_sub(hot_bytes + buffers);
        let mut failed = Vec::new();
        for ((&l, placement), &p) in tiered.iter().zip(hot).zip(&per) {
            let h = &mut hybrids[l];
            h.set_placement(placement)?;
            let slots = (cache_bytes / tiered.len() as u64 / p) as usize;
            let slots = slots.min(h.spec().intermediate() - h.placement().hot().len());
            if h.placement().hot().is_empty() && slots == 0 {
                continue;
            }
            let hot = h.placement().hot().to_vec();
            match builder.build(h.bundles(), &hot, slots, &budget, opts.cache_window) {
                Ok(tier) => {
                    report.hot_neurons += hot.len();
                    report.cache_slots += slots;
                    h.attach_tier(tier)?;
                }
                Err(e) => {
                    tracing::warn!("layer {l}: no fast tier ({e}); it runs on the CPU");
                    h.set_placement(LayerPlacement::all_cold(h.spec().intermediate()))?;
                    failed.push(format!("layer {l}: {e}"));
                }
            }
        }
        if !failed.is_empty() {
            report.fallback = Some(failed.join("; "));
        }
        report.reserved = budget.used();
        Ok(report)
    }

    /// The bytes every hybrid layer's neurons (but `force_dense_layers`') take in a tier of
    /// `kind`: what a budget of 100% is. Quantized layers take their f16 size in a CUDA tier.
    pub fn full_tier_bytes(&self, kind: TierKind, force_dense_layers: &[usize]) -> u64 {
        let per = |b: &NeuronBundles| match kind {
            #[cfg(feature = "cuda")]
            TierKind::Cuda { .. } => powerinfer::tier::CudaTier::neuron_bytes(b),
            _ => ReferenceTier::neuron_bytes(b),
        };
        self.layers
            .iter()
            .enumerate()
            .filter(|(l, _)| !force_dense_layers.contains(l))
            .map(|(_, layer)| match &layer.ffn {
                Ffn::Hybrid(h) => per(h.bundles()) * h.spec().intermediate() as u64,
                _ => 0,
            })
            .sum()
    }

    /// Detaches every layer's fast tier (everything on the CPU again; their bytes are given
    /// back to the budget) and clears forced-dense layers.
    pub fn detach_tiers(&mut self) {
        self.prefetch_depth = 0;
        for l in &mut self.layers {
            if let Ffn::Hybrid(h) = &mut l.ffn {
                h.detach_tier();
                h.set_force_dense(false);
            }
        }
    }

    /// The fast tiers' counters summed over layers, reset to zero.
    pub fn take_tier_counters(&mut self) -> TierCounters {
        let mut sum = TierCounters::default();
        for l in &self.layers {
            if let Some(t) = match &l.ffn {
                Ffn::Hybrid(h) => h.fast_tier(),
                _ => None,
            } {
                sum += t.take_counters();
            }
        }
        sum
    }
}
