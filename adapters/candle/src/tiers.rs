//! Fast tiers for a whole model: one byte budget for every layer, the hottest neurons of all
//! layers placed first (PowerInfer's global placement), the rest of the budget as neuron caches.

use powerinfer::analysis::ActivationStats;
use powerinfer::{plan_placement, LayerPlacement, ReferenceTier, TierBudget, TierCounters};

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
    /// Threads of each layer's reference tier.
    pub threads: usize,
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            budget: 0,
            cache_share: 0.0,
            cache_window: 1,
            force_dense_layers: Vec::new(),
            threads: 1,
        }
    }
}

/// What [`Llama::attach_reference_tiers`] placed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierReport {
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

    /// Gives every hybrid layer (but the forced-dense ones) a [`ReferenceTier`]: the hottest
    /// neurons of all layers by `frequencies` (one vector per layer, e.g. an artifact's counts or
    /// [`Llama::neuron_frequencies`]) until `(1 - cache_share) * budget` is spent, then equal
    /// cache slots per layer from the rest. Every tier reserves its bytes under one
    /// [`TierBudget`], so the total never passes `budget`. Replaces the layers' placements.
    pub fn attach_reference_tiers(
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
        let mut hybrids = self.hybrids()?;
        check_count(
            "neuron frequencies (one vector per layer)",
            hybrids.len(),
            frequencies.len(),
        )?;
        let tiered: Vec<usize> = (0..layers)
            .filter(|l| !opts.force_dense_layers.contains(l))
            .collect();
        let per: Vec<u64> = tiered
            .iter()
            .map(|&l| ReferenceTier::neuron_bytes(hybrids[l].bundles()))
            .collect();
        let mut report = TierReport {
            budget: opts.budget,
            ..Default::default()
        };
        for (&l, &p) in tiered.iter().zip(&per) {
            check_count(
                &format!("layer {l} neuron frequencies"),
                hybrids[l].spec().intermediate,
                frequencies[l].len(),
            )?;
            report.ffn_bytes += p * hybrids[l].spec().intermediate as u64;
        }
        let hot_budget = (opts.budget as f64 * (1.0 - opts.cache_share)) as u64;
        let smallest = per.iter().copied().min().unwrap_or(u64::MAX);
        let hot: Vec<LayerPlacement> = if hot_budget >= smallest {
            let f: Vec<Vec<f64>> = tiered.iter().map(|&l| frequencies[l].clone()).collect();
            plan_placement(&f, &per, hot_budget)?.layers
        } else {
            tiered
                .iter()
                .map(|&l| LayerPlacement::all_cold(hybrids[l].spec().intermediate))
                .collect()
        };
        let hot_bytes: u64 = hot
            .iter()
            .zip(&per)
            .map(|(h, p)| h.hot().len() as u64 * p)
            .sum();
        let cache_bytes = opts.budget - hot_bytes.min(opts.budget);
        for (l, h) in hybrids.iter_mut().enumerate() {
            // The old tiers' bytes are not in this budget: drop them first all the same.
            h.detach_tier();
            h.set_force_dense(opts.force_dense_layers.contains(&l));
        }
        for ((&l, placement), &p) in tiered.iter().zip(hot).zip(&per) {
            let h = &mut hybrids[l];
            h.set_placement(placement)?;
            let slots = (cache_bytes / tiered.len() as u64 / p) as usize;
            let slots = slots.min(h.spec().intermediate - h.placement().hot().len());
            if h.placement().hot().is_empty() && slots == 0 {
                continue;
            }
            let tier = ReferenceTier::new(
                h.bundles(),
                h.placement().hot(),
                slots,
                &budget,
                opts.threads,
            )?
            .with_cache_window(opts.cache_window)?;
            report.hot_neurons += h.placement().hot().len();
            report.cache_slots += slots;
            h.attach_tier(Box::new(tier))?;
        }
        report.reserved = budget.used();
        Ok(report)
    }

    /// Detaches every layer's fast tier (everything on the CPU again; their bytes are given
    /// back to the budget) and clears forced-dense layers.
    pub fn detach_tiers(&mut self) {
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
                let c = t.take_counters();
                sum.calls += c.calls;
                sum.neurons += c.neurons;
                sum.hits += c.hits;
                sum.misses += c.misses;
                sum.fills += c.fills;
                sum.evictions += c.evictions;
                sum.bytes_copied += c.bytes_copied;
            }
        }
        sum
    }
}
