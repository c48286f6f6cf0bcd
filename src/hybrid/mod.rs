//! `HybridFfn`: the drop-in sparse FFN block, a `candle_core::Module`.
//!
//! Per call: predictor -> active set -> tiers -> partial outputs summed in a fixed order (bias,
//! fast tier, CPU tier). With a fast tier attached ([`HybridFfn::attach_tier`]) the active set is
//! split by what the tier holds: the tier is launched on its share, the CPU pool computes the
//! rest meanwhile, then the tier's partial is added. Without one the whole active set is the CPU
//! tier's, in one pool dispatch.
//! Scratch buffers live in the block and are reused: no heap allocation and no thread spawn per
//! token inside [`HybridFfn::forward_f32`] once the largest batch has been seen.

mod budget;
mod cache;
mod place;
mod reference;
mod sparsity;
mod tier;

pub use budget::{Reservation, TierBudget};
#[cfg(feature = "cuda")]
pub(crate) use cache::Residency;
pub use cache::{CacheFill, NeuronCache};
pub use place::{plan_placement, LayerPlacement, Placement};
pub use reference::ReferenceTier;
pub use sparsity::{Neurons, Sparsity};
pub use tier::{FastTier, TierCall, TierCounters};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::activation::Activation;
use crate::analysis::{ActivationStats, PredictorAudit};
use crate::cpu::{share, Kernels, Pool, SimdLevel, SparseJob, ThreadScratch};
use crate::error::{Error, ErrorKind, Result};
use crate::ffn::{FfnSpec, FfnWeights, NeuronBundles, WeightDType};
use crate::predict::{ActiveSet, All, PredictInput, Predictor};
use crate::tensor_io::{check_f32_rows, check_finite, check_rows, to_tensor, with_f32};

/// What to do when a call carries many rows at once (prompt prefill).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPolicy {
    /// Run the predictor on every row and compute the union of the rows' active sets once; each
    /// row still only receives its own neurons. Output is what row-by-row decoding would give.
    #[default]
    Union,
    /// From this many rows on, compute every neuron for every row (dense quality, no predictor
    /// cost), as TEAL-style methods do for prefill. Fewer rows use `Union`.
    DenseFrom(usize),
}

/// Construction options of a [`HybridFfn`].
#[derive(Debug, Clone)]
pub struct HybridOptions {
    /// Threads of the CPU tier (the calling thread included). Layers with the same count share
    /// one pool. Default: the machine's available parallelism.
    pub threads: usize,
    /// Force a SIMD level; `None` uses `POWERINFER_CPU` or the best detected level.
    pub simd_level: Option<SimdLevel>,
    /// Many-row behaviour.
    pub prefill: PrefillPolicy,
    /// Layer index, used in error messages.
    pub layer: Option<usize>,
}

impl Default for HybridOptions {
    fn default() -> Self {
        HybridOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd_level: None,
            prefill: PrefillPolicy::Union,
            layer: None,
        }
    }
}

#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    xq: Vec<crate::cpu::QuantizedRow>,
    set: ActiveSet,
    threads: Vec<ThreadScratch>,
    /// This call's split: the fast tier's share and the CPU's.
    fast: Vec<u32>,
    cpu: Vec<u32>,
    /// CPU-share neurons that contributed (what a caching tier may fill).
    missed: Vec<u32>,
}

/// An activation-sparse FFN block with hot/cold neuron placement.
///
/// Swap it in for a model's MLP: it implements [`candle_core::Module`] on `[.., hidden]` CPU
/// tensors of f32, f16 or bf16 and returns the same shape and dtype.
pub struct HybridFfn {
    bundles: NeuronBundles,
    predictor: Box<dyn Predictor>,
    placement: LayerPlacement,
    prefill: PrefillPolicy,
    layer: Option<usize>,
    kernels: Kernels,
    pool: Arc<Pool>,
    force_dense: AtomicBool,
    last_active: AtomicUsize,
    stats_on: AtomicBool,
    stats: Mutex<Option<ActivationStats>>,
    audit_on: AtomicBool,
    audit: Mutex<Option<Audit>>,
    scratch: Mutex<Scratch>,
    fast: Option<Box<dyn FastTier>>,
    /// Set when the fast tier failed: every later call runs on the CPU.
    fast_failed: AtomicBool,
}

/// Audit state: the running totals and the dense activations' buffers.
#[derive(Debug, Default)]
struct Audit {
    totals: PredictorAudit,
    h: Vec<f32>,
    tmp: Vec<f32>,
}

impl std::fmt::Debug for HybridFfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridFfn")
            .field("spec", self.bundles.spec())
            .field("dtype", &self.bundles.dtype())
            .field("predictor", &self.predictor)
            .field("hot", &self.placement.hot().len())
            .field("fast_tier", &self.fast.as_ref().map(|t| t.name()))
            .field("tier", &self.kernels.tier())
            .field("threads", &self.pool.threads())
            .finish()
    }
}

impl HybridFfn {
    /// A block over `bundles` computing every neuron (`All`), every neuron on the CPU tier.
    pub fn new(bundles: NeuronBundles, opts: HybridOptions) -> Result<Self> {
        let kernels = Kernels::for_tier(opts.simd_level)?;
        if opts.threads == 0 {
            return Err(Error::config("threads", "must be at least 1"));
        }
        if let PrefillPolicy::DenseFrom(0) = opts.prefill {
            return Err(Error::config("prefill", "DenseFrom needs at least 1 row"));
        }
        let n = bundles.spec().intermediate;
        Ok(HybridFfn {
            bundles,
            predictor: Box::new(All),
            placement: LayerPlacement::all_cold(n),
            prefill: opts.prefill,
            layer: opts.layer,
            kernels,
            pool: Pool::shared(opts.threads),
            force_dense: AtomicBool::new(false),
            last_active: AtomicUsize::new(0),
            stats_on: AtomicBool::new(false),
            stats: Mutex::new(None),
            audit_on: AtomicBool::new(false),
            audit: Mutex::new(None),
            scratch: Mutex::new(Scratch::default()),
            fast: None,
            fast_failed: AtomicBool::new(false),
        })
    }

    /// Converts `[out, in]` weights to neuron-major storage in `dtype` and builds the block.
    pub fn from_weights(
        spec: FfnSpec,
        weights: FfnWeights<'_>,
        dtype: WeightDType,
        opts: HybridOptions,
    ) -> Result<Self> {
        Self::new(NeuronBundles::from_weights(spec, weights, dtype)?, opts)
    }

    /// Loads the FFN of one layer the way candle models do, from a `VarBuilder` already at the
    /// MLP's prefix (e.g. `vb.pp("mlp")`): `gate_proj`, `up_proj`, `down_proj` (gated), else
    /// `up_proj`, `down_proj` or `fc1`, `fc2` (ungated), each with an optional `.bias`. The
    /// sizes are read from the weights (`up` is `[intermediate, hidden]`; the others are checked
    /// against it) and they are stored in the `VarBuilder`'s dtype.
    pub fn load(activation: Activation, vb: VarBuilder, opts: HybridOptions) -> Result<Self> {
        crate::ffn::with_mlp_tensors(activation, &vb, |spec, weights| {
            let dtype = WeightDType::from_candle(vb.dtype(), "VarBuilder dtype")?;
            Self::from_weights(spec, weights, dtype, opts)
        })
    }

    /// Replaces the predictor.
    pub fn with_predictor(mut self, predictor: impl Predictor + 'static) -> Self {
        self.predictor = Box::new(predictor);
        self
    }

    /// Replaces the predictor in place.
    pub fn set_predictor(&mut self, predictor: impl Predictor + 'static) {
        self.predictor = Box::new(predictor);
    }

    /// Replaces the placement; it must be for this layer's neuron count.
    pub fn with_placement(mut self, placement: LayerPlacement) -> Result<Self> {
        self.set_placement(placement)?;
        Ok(self)
    }

    /// Replaces the placement in place; it must be for this layer's neuron count.
    pub fn set_placement(&mut self, placement: LayerPlacement) -> Result<()> {
        let n = self.bundles.spec().intermediate;
        if placement.intermediate() != n {
            return Err(Error::count(
                "placement neurons",
                n,
                placement.intermediate(),
            ));
        }
        self.placement = placement;
        Ok(())
    }

    /// Attaches a fast tier: from the next call, the active neurons it holds are computed there
    /// while the CPU pool computes the others. It must hold every hot neuron of the placement
    /// (the `Config` error names the first it lacks); it may hold more (a cache).
    pub fn attach_tier(&mut self, tier: Box<dyn FastTier>) -> Result<()> {
        if let Some(&i) = self
            .placement
            .hot()
            .iter()
            .find(|&&i| !tier.holds(i as usize))
        {
            return Err(Error::config(
                "fast tier",
                format!(
                    "`{}` does not hold hot neuron {i} of the placement",
                    tier.name()
                ),
            ));
        }
        self.fast = Some(tier);
        self.fast_failed.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Builds a [`ReferenceTier`] holding this block's hot neurons plus `cache_slots` cache
    /// slots under `budget`, on `threads` threads, and attaches it.
    pub fn attach_reference_tier(
        &mut self,
        budget: &Arc<TierBudget>,
        cache_slots: usize,
        threads: usize,
    ) -> Result<()> {
        let tier = ReferenceTier::new(
            &self.bundles,
            self.placement.hot(),
            cache_slots,
            budget,
            threads,
        )?;
        self.attach_tier(Box::new(tier))
    }

    /// Detaches the fast tier (everything runs on the CPU again) and returns it.
    pub fn detach_tier(&mut self) -> Option<Box<dyn FastTier>> {
        self.fast.take()
    }

    /// The attached fast tier, unless it failed (then every call runs on the CPU).
    pub fn fast_tier(&self) -> Option<&dyn FastTier> {
        self.fast
            .as_deref()
            .filter(|_| !self.fast_failed.load(Ordering::Relaxed))
    }

    /// When on, every call computes every neuron (the predictor is bypassed).
    pub fn set_force_dense(&self, on: bool) {
        self.force_dense.store(on, Ordering::Relaxed);
    }

    /// Starts counting per-neuron activity (`|h| > threshold`) from the next call.
    pub fn enable_stats(&self, threshold: f32) {
        self.start_stats(ActivationStats::new(
            self.bundles.spec().intermediate,
            threshold,
        ));
    }

    /// Like [`HybridFfn::enable_stats`], also recording the `|h|` distribution for
    /// [`ActivationStats::threshold_for_sparsity`] (calibration; a histogram update per value).
    pub fn enable_stats_with_magnitudes(&self, threshold: f32) {
        let n = self.bundles.spec().intermediate;
        self.start_stats(ActivationStats::with_magnitudes(n, threshold));
    }

    fn start_stats(&self, stats: ActivationStats) {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats);
        self.stats_on.store(true, Ordering::Relaxed);
    }

    /// Stops counting and returns what was counted.
    pub fn take_stats(&self) -> Option<ActivationStats> {
        self.stats_on.store(false, Ordering::Relaxed);
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Starts auditing the predictor against the exact set `|h| > threshold` (computed densely
    /// next to every call: for evaluation, not serving). Inline-threshold predictors
    /// (`GateFirst`) are exact by construction and are audited too.
    pub fn enable_audit(&self, threshold: f32) {
        *self.audit.lock().unwrap_or_else(|e| e.into_inner()) = Some(Audit {
            totals: PredictorAudit {
                threshold,
                ..Default::default()
            },
            ..Default::default()
        });
        self.audit_on.store(true, Ordering::Relaxed);
    }

    /// Stops auditing and returns the totals.
    pub fn take_audit(&self) -> Option<PredictorAudit> {
        self.audit_on.store(false, Ordering::Relaxed);
        self.audit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|a| a.totals)
    }

    /// The predictor in use.
    pub fn predictor(&self) -> &dyn Predictor {
        &*self.predictor
    }

    /// The layer's spec.
    pub fn spec(&self) -> &FfnSpec {
        self.bundles.spec()
    }

    /// The neuron-major weights.
    pub fn bundles(&self) -> &NeuronBundles {
        &self.bundles
    }

    /// The hot/cold placement.
    pub fn placement(&self) -> &LayerPlacement {
        &self.placement
    }

    /// The SIMD level in use.
    pub fn simd_level(&self) -> SimdLevel {
        self.kernels.tier()
    }

    /// Threads of the CPU tier.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Neurons whose down row the last call used: nonzero contribution in at least one row.
    pub fn last_active(&self) -> usize {
        self.last_active.load(Ordering::Relaxed)
    }

    /// The FFN on `rows` f32 rows: `x` and `out` are `rows * hidden`, row-major. Allocation-free
    /// once the block has seen a batch of this size.
    pub fn forward_f32(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        self.forward_f32_rms(x, rows, None, out)
    }

    /// [`HybridFfn::forward_f32`] with, per row, `sqrt(mean(u^2) + eps)` of the input `u` before
    /// the FFN's RMSNorm (`rows` values): what a predictor scored on the pre-norm residual needs
    /// ([`HybridFfn::needs_row_rms`]). The values reach the predictor in
    /// [`PredictInput::row_rms`].
    pub fn forward_f32_with_row_rms(
        &self,
        x: &[f32],
        rows: usize,
        row_rms: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        if row_rms.len() != rows {
            return Err(Error::count("row_rms values per row", rows, row_rms.len()));
        }
        self.forward_f32_rms(x, rows, Some(row_rms), out)
    }

    /// Whether the predictor needs the pre-norm RMS of each row
    /// ([`HybridFfn::forward_f32_with_row_rms`]).
    pub fn needs_row_rms(&self) -> bool {
        self.predictor.needs_row_rms()
    }

    fn forward_f32_rms(
        &self,
        x: &[f32],
        rows: usize,
        row_rms: Option<&[f32]>,
        out: &mut [f32],
    ) -> Result<()> {
        check_f32_rows(x, rows, self.bundles.spec().hidden, out)?;
        if rows == 0 {
            return Ok(());
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.compute(&mut scratch, x, rows, row_rms, out)
    }

    /// Prepares a coming call: predicts with this layer's predictor which neurons an input like
    /// `x` (`rows * hidden` f32, row-major) activates, and has the fast tier copy those it does
    /// not hold into its cache now, ahead of the call. A model calls it for layer `l + d` while
    /// it computes layer `l`, on the residual stream normalized with layer `l + d`'s FFN norm:
    /// the input that layer will see, but for the `d` layers in between. Returns how many
    /// neurons were filled.
    ///
    /// Does nothing (returns 0) without a caching fast tier, on a forced-dense layer, during a
    /// statistics run, for batches above the tier's `max_rows`, and with an inline threshold
    /// rule (exact thresholding): that rule's prediction is the layer's own gate product, which
    /// costs what computing the neurons does; nor for a predictor that needs the rows' pre-norm
    /// RMS, which a guessed input does not have. A tier error disables the tier, as in a call.
    pub fn prefetch(&self, x: &[f32], rows: usize) -> Result<usize> {
        let spec = *self.bundles.spec();
        if x.len() != rows * spec.hidden {
            return Err(Error::count(
                "prefetch input values",
                rows * spec.hidden,
                x.len(),
            ));
        }
        let Some(tier) = self.fast_tier() else {
            return Ok(0);
        };
        if rows == 0
            || rows > tier.max_rows()
            || self.force_dense.load(Ordering::Relaxed)
            || self.stats_on.load(Ordering::Relaxed)
            || self.predictor.inline_threshold().is_some()
            || self.predictor.needs_row_rms()
        {
            return Ok(0);
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        let input = self.predict_input(&mut s.xq, &mut s.set, x, rows, None);
        self.predictor
            .predict(&input, &mut s.set)
            .map_err(|e| self.in_layer(e))?;
        s.set.finish();
        s.cpu.clear();
        s.cpu
            .extend(s.set.union().iter().filter(|&&i| !tier.holds(i as usize)));
        match tier.prefetch(&self.bundles, &s.cpu) {
            Ok(n) => Ok(n),
            Err(e) => {
                self.tier_failed(tier, &e);
                Ok(0)
            }
        }
    }

    /// The FFN on a tensor `[.., hidden]` (f32, f16 or bf16, CPU); same shape and dtype out.
    pub fn forward_tensor(&self, xs: &Tensor) -> Result<Tensor> {
        let rows = check_rows(xs, self.bundles.spec().hidden, "input")?;
        if rows == 0 {
            return Ok(xs.clone());
        }
        let mut out = vec![0f32; xs.elem_count()];
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut xbuf = std::mem::take(&mut scratch.x);
        let res = with_f32(xs, &mut xbuf, |x| {
            check_finite(x)?;
            self.compute(&mut scratch, x, rows, None, &mut out)
        });
        scratch.x = xbuf;
        res?;
        to_tensor(out, xs.dims(), xs.dtype())
    }

    /// Readies a call on `x`: `set` emptied for `rows` rows, the input quantized into `xq` where
    /// the storage is quantized, and the predictor's view of both.
    fn predict_input<'a>(
        &'a self,
        xq: &'a mut Vec<crate::cpu::QuantizedRow>,
        set: &mut ActiveSet,
        x: &'a [f32],
        rows: usize,
        row_rms: Option<&'a [f32]>,
    ) -> PredictInput<'a> {
        let spec = self.bundles.spec();
        set.reset(rows, spec.intermediate);
        if self.bundles.dtype().quant().is_some() {
            crate::cpu::QuantizedRow::quantize_rows(xq, x, spec.hidden);
        }
        PredictInput {
            x,
            rows,
            hidden: spec.hidden,
            row_rms,
            bundles: &self.bundles,
            kernels: &self.kernels,
            pool: &self.pool,
            xq,
        }
    }

    /// One call: the rows' sets (or the inline rule), the fast tier's share launched, the CPU's
    /// share on the pool, and the partials merged in a fixed order: bias, the fast tier, the CPU
    /// threads in order.
    fn compute(
        &self,
        s: &mut Scratch,
        x: &[f32],
        rows: usize,
        row_rms: Option<&[f32]>,
        out: &mut [f32],
    ) -> Result<()> {
        let hidden = self.bundles.spec().hidden;
        let rule = self.predict_rows(s, x, rows, row_rms)?;
        match &self.bundles.down_bias {
            Some(b) => out.chunks_mut(hidden).for_each(|o| o.copy_from_slice(b)),
            None => out.fill(0.0),
        }
        let threads = self.pool.threads();
        s.threads.resize_with(threads, ThreadScratch::default);
        let job = SparseJob {
            bundles: self.bundles.view(),
            kernels: &self.kernels,
            x,
            rows,
            set: &s.set,
            xq: &s.xq,
            rule,
        };
        let record = self.stats_on.load(Ordering::Relaxed);
        let mut stats = record.then(|| self.stats.lock().unwrap_or_else(|e| e.into_inner()));
        let list = s.set.union();
        // The split: the fast tier's share is launched first and runs while the pool computes
        // the CPU's share. Statistics need every neuron's `h`, and batches above the tier's
        // `max_rows` do not fit its buffers: both stay on the CPU.
        let tier = self
            .fast_tier()
            .filter(|t| !record && !list.is_empty() && rows <= t.max_rows());
        let call = TierCall {
            x,
            rows,
            neurons: &[],
            set: &s.set,
            rule,
        };
        let (launched, split) = self.launch(tier, call, list, &mut s.fast, &mut s.cpu);
        s.missed.clear();
        let cpu: &[u32] = if split { &s.cpu } else { list };
        if !cpu.is_empty() {
            job.run(&self.pool, cpu, &mut s.threads);
        }
        // Neurons whose contribution was used (nonzero in some row, so their down row was read).
        let mut used = 0usize;
        let mut retry = false;
        if let Some(t) = launched {
            match t.finish(out) {
                Ok(n) => used += n,
                Err(e) => {
                    self.tier_failed(t, &e);
                    retry = true;
                }
            }
        }
        if !cpu.is_empty() {
            let missed = tier.is_some().then_some(&mut s.missed);
            used += merge_threads(out, &s.threads, cpu, rows, missed, stats.as_deref_mut());
        }
        if retry {
            // The tier failed after launch: its share runs on the CPU, added last.
            let fast = std::mem::take(&mut s.fast);
            job.run(&self.pool, &fast, &mut s.threads);
            used += merge_threads(out, &s.threads, &fast, rows, None, None);
        } else if let Some(t) = launched.or(tier).filter(|_| self.fast_tier().is_some()) {
            if let Err(e) = t.observe(&self.bundles, &s.missed) {
                self.tier_failed(t, &e);
            }
        }
        if let Some(Some(stats)) = stats.as_deref_mut() {
            stats.tokens += rows as u64;
        }
        self.last_active.store(used, Ordering::Relaxed);
        Ok(())
    }

    /// Fills `s.set` for the rows (every neuron when dense or when an inline rule will choose
    /// in the tiers' pass) and, while an audit runs, records the call against the exact sets.
    /// Returns the inline rule, if any.
    fn predict_rows(
        &self,
        s: &mut Scratch,
        x: &[f32],
        rows: usize,
        row_rms: Option<&[f32]>,
    ) -> Result<Option<f32>> {
        let dense = self.force_dense.load(Ordering::Relaxed)
            || matches!(self.prefill, PrefillPolicy::DenseFrom(n) if rows >= n);
        let input = self.predict_input(&mut s.xq, &mut s.set, x, rows, row_rms);
        // A threshold predictor runs inline in the tiers' pass (same output, one pass).
        let rule = if dense {
            None
        } else {
            self.predictor.inline_threshold()
        };
        // Off (the serving case): one relaxed load, no lock.
        let mut audit = self
            .audit_on
            .load(Ordering::Relaxed)
            .then(|| self.audit.lock().unwrap_or_else(|e| e.into_inner()));
        let started = audit.is_some().then(std::time::Instant::now);
        if dense || rule.is_some() {
            All.predict(&input, &mut s.set)?;
        } else {
            self.predictor
                .predict(&input, &mut s.set)
                .map_err(|e| self.in_layer(e))?;
        }
        s.set.finish();
        if let (Some(a), Some(t0)) = (audit.as_deref_mut().and_then(Option::as_mut), started) {
            a.totals.predict_time += t0.elapsed();
            a.totals.calls += 1;
            input.dense_pass().contributions(&mut a.h, &mut a.tmp);
            let spec = self.bundles.spec();
            let (set, tmp) = (&s.set, &a.tmp);
            let gate_rule = spec.gated && spec.activation.exact_zeros();
            // Inline rules keep exactly the pairs that pass them (see `Predictor::inline_threshold`).
            let keep = |r: usize, i: usize, h: f32| match rule {
                Some(t) if gate_rule => spec.activation.apply(tmp[2 * i * rows + r]) > t,
                Some(t) => h.abs() > t,
                None => set.has(r, i),
            };
            let h = std::mem::take(&mut a.h);
            a.totals
                .record(&h, rows, |r, i| keep(r, i, h[i * rows + r]));
            a.h = h;
        }
        Ok(rule)
    }

    /// Splits `list` between the fast tier (the neurons it holds, into `fast`) and the CPU (into
    /// `cpu`) and launches the tier's share. Returns the tier when it launched, and whether
    /// `cpu` holds the CPU's share (else the CPU computes the whole `list`). A failed launch
    /// disables the tier and leaves the whole `list` to the CPU.
    fn launch<'t>(
        &self,
        tier: Option<&'t dyn FastTier>,
        call: TierCall<'_>,
        list: &[u32],
        fast: &mut Vec<u32>,
        cpu: &mut Vec<u32>,
    ) -> (Option<&'t dyn FastTier>, bool) {
        fast.clear();
        cpu.clear();
        let Some(t) = tier else {
            return (None, false);
        };
        for &i in list {
            if t.holds(i as usize) {
                fast.push(i);
            } else {
                cpu.push(i);
            }
        }
        if fast.is_empty() {
            return (None, true);
        }
        match t.launch(&TierCall {
            neurons: fast,
            ..call
        }) {
            Ok(()) => (Some(t), true),
            Err(e) => {
                // The CPU computes the whole list.
                self.tier_failed(t, &e);
                fast.clear();
                (None, false)
            }
        }
    }

    /// A fast tier failed: this and every later call run on the CPU; says so once.
    fn tier_failed(&self, tier: &dyn FastTier, e: &Error) {
        if !self.fast_failed.swap(true, Ordering::Relaxed) {
            let layer = self
                .layer
                .map_or_else(String::new, |l| format!(" (layer {l})"));
            tracing::warn!(
                "fast tier `{}` failed{layer}: {e}; computing on the CPU from now on",
                tier.name()
            );
        }
    }

    fn in_layer(&self, e: Error) -> Error {
        match (e.kind(), self.layer) {
            (
                ErrorKind::NeuronOutOfRange {
                    neuron,
                    intermediate,
                    layer: None,
                },
                Some(l),
            ) => ErrorKind::NeuronOutOfRange {
                layer: Some(l),
                neuron: *neuron,
                intermediate: *intermediate,
            }
            .into(),
            _ => e,
        }
    }
}

/// Adds the CPU threads' partials into `out` in thread order; returns how many of `neurons`
/// (split among the threads as the job split them) contributed in some row, pushing those to
/// `missed` (what a caching tier may fill) and recording every `h` in `stats` when given.
fn merge_threads(
    out: &mut [f32],
    threads: &[ThreadScratch],
    neurons: &[u32],
    rows: usize,
    mut missed: Option<&mut Vec<u32>>,
    mut stats: Option<&mut Option<ActivationStats>>,
) -> usize {
    let mut used = 0;
    for (t, st) in threads.iter().enumerate() {
        for (o, a) in out.iter_mut().zip(&st.acc) {
            *o += a;
        }
        let mine = &neurons[share(neurons.len(), t, threads.len())];
        for (&i, h) in mine.iter().zip(st.h.chunks(rows)) {
            if h.iter().any(|&v| v != 0.0) {
                used += 1;
                if let Some(m) = missed.as_deref_mut() {
                    m.push(i);
                }
            }
        }
        if let Some(Some(stats)) = stats.as_deref_mut() {
            stats.record(mine, &st.h, rows);
        }
    }
    used
}

impl Module for HybridFfn {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_tensor(xs)?)
    }
}
