//! `ReferenceTier`: a fast tier run by CPU threads of its own, on its own copy of the neurons it
//! holds. It does what a GPU tier does (a separate memory under a byte budget, asynchronous
//! launch, a neuron cache filled from RAM) with the CPU kernels, so the split, the merge, the
//! budget and the cache are tested exactly on any machine, and a device tier has a model to
//! match.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::budget::{Reservation, TierBudget};
use super::cache::NeuronCache;
use super::tier::{FastTier, TierCall, TierCounters};
use crate::active::ActiveSet;
use crate::cpu::{Kernels, Pool, QuantizedRow, SparseJob, ThreadScratch};
use crate::error::{Error, ErrorKind, Result};
use crate::ffn::NeuronBundles;

const NAME: &str = "reference";
const NONE: u32 = u32::MAX;

/// The tier's memory: the held neurons' bundles (placed hot neurons first, then the cache slots)
/// and where each neuron of the layer lies in it.
#[derive(Debug)]
struct Store {
    bundles: NeuronBundles,
    /// Storage index of each neuron of the layer (`NONE`: not held).
    local: Vec<u32>,
    /// The layer's neuron at each storage index (`NONE`: an empty slot).
    ids: Vec<u32>,
    /// Placed hot neurons (storage indices `0..hot`).
    hot: usize,
    cache: NeuronCache,
}

/// One launch's copied inputs (what a GPU would upload).
struct Job {
    x: Vec<f32>,
    rows: usize,
    neurons: Vec<u32>,
    set: ActiveSet,
    rule: Option<f32>,
}

/// What the worker sends back: the partial output and the storage indices of the neurons with
/// a nonzero contribution.
type Done = Result<(Vec<f32>, Vec<u32>)>;

#[derive(Debug)]
struct Link {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    pending: bool,
    /// The last call's contributing neurons (storage indices), for the cache's bookkeeping.
    used: Vec<u32>,
}

/// A fast tier on CPU threads: holds the placed hot neurons and a cache of cold ones in memory of
/// its own, reserved under a [`TierBudget`], and computes its share on a thread of its own while
/// the CPU pool computes the rest. See the module docs for why it exists.
#[derive(Debug)]
pub struct ReferenceTier {
    hidden: usize,
    neuron_bytes: u64,
    store: Arc<Mutex<Store>>,
    /// One bit per neuron of the layer: held now (hot or cached). Read by the split without a
    /// lock; written only between calls (by `observe`).
    held: Vec<AtomicU64>,
    link: Mutex<Link>,
    counters: Mutex<TierCounters>,
    worker: Option<JoinHandle<()>>,
    _reservation: Reservation,
}

impl ReferenceTier {
    /// A tier holding `hot` (neurons of `bundles`, no repeats) plus `cache_slots` cache slots,
    /// computing on `threads` threads of its own. Reserves the bytes under `budget` first: more
    /// than it has is a `Budget` error naming the bytes, and nothing is allocated.
    pub fn new(
        bundles: &NeuronBundles,
        hot: &[u32],
        cache_slots: usize,
        budget: &Arc<TierBudget>,
        threads: usize,
    ) -> Result<Self> {
        let spec = *bundles.spec();
        let n = spec.intermediate;
        if threads == 0 {
            return Err(Error::config(
                "threads",
                "the reference tier needs at least 1",
            ));
        }
        let placement = super::LayerPlacement::new(n, hot.to_vec(), None)?;
        let capacity = hot.len() + cache_slots;
        if capacity == 0 {
            return Err(Error::config(
                "fast tier",
                "holds no neuron (no hot neuron, no cache slot); attach no tier",
            ));
        }
        let neuron_bytes = tier_neuron_bytes(bundles);
        let reservation = budget.reserve(
            neuron_bytes.saturating_mul(capacity as u64),
            &format!("{} hot neurons and {cache_slots} cache slots", hot.len()),
        )?;
        let cache = NeuronCache::new(n, cache_slots)?;
        // Spare slots start as copies of some neuron; they are not held until filled.
        let mut ids = placement.hot().to_vec();
        ids.resize(capacity, 0);
        let stored = bundles.select(&ids)?;
        let mut local = vec![NONE; n];
        let mut ids = placement.hot().to_vec();
        ids.resize(capacity, NONE);
        let held: Vec<AtomicU64> = (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        for (k, &i) in placement.hot().iter().enumerate() {
            local[i as usize] = k as u32;
            held[i as usize / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
        }
        let store = Arc::new(Mutex::new(Store {
            bundles: stored,
            local,
            ids,
            hot: hot.len(),
            cache,
        }));
        let (jobs, job_rx) = channel::<Job>();
        let (done_tx, done) = channel::<Done>();
        let kernels = Kernels::detect()?;
        let worker_store = Arc::clone(&store);
        let worker = std::thread::Builder::new()
            .name("powerinfer-reference-tier".into())
            .spawn(move || {
                let pool = Pool::new(threads);
                let mut states = vec![ThreadScratch::default(); threads];
                let mut xq = Vec::new();
                for job in job_rx {
                    let store = worker_store.lock().unwrap_or_else(|e| e.into_inner());
                    let out = compute(&store, &kernels, &pool, &job, &mut xq, &mut states);
                    drop(store);
                    if done_tx.send(out).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| Error::tier(NAME, format!("cannot start its thread: {e}")))?;
        Ok(ReferenceTier {
            hidden: spec.hidden,
            neuron_bytes,
            store,
            held,
            link: Mutex::new(Link {
                jobs: Some(jobs),
                done,
                pending: false,
                used: Vec::new(),
            }),
            counters: Mutex::new(TierCounters::default()),
            worker: Some(worker),
            _reservation: reservation,
        })
    }

    /// Bytes one neuron of `bundles` takes in the tier (its bundle and biases): what a placement
    /// planned for this tier must charge per hot neuron.
    pub fn neuron_bytes(bundles: &NeuronBundles) -> u64 {
        tier_neuron_bytes(bundles)
    }

    /// Keeps every cached neuron used in the last `window` calls (see
    /// [`NeuronCache::with_window`]); the default is 1.
    pub fn with_cache_window(self, window: u64) -> Result<Self> {
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        store.cache.set_window(window)?;
        drop(store);
        Ok(self)
    }

    /// How many cache slots of `bundles`' neurons fit in what `budget` has free after `hot`
    /// neurons: the largest cache a tier built now can have.
    pub fn cache_slots_that_fit(bundles: &NeuronBundles, hot: usize, budget: &TierBudget) -> usize {
        let per = tier_neuron_bytes(bundles);
        let free = budget.available() / per;
        (free as usize).saturating_sub(hot)
    }

    /// Neurons held now: placed hot ones and cached ones, sorted.
    pub fn held(&self) -> Vec<u32> {
        let store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        (0..store.local.len() as u32)
            .filter(|&i| store.local[i as usize] != NONE)
            .collect()
    }

    fn set_held(&self, neuron: u32, on: bool) {
        let bit = 1u64 << (neuron % 64);
        let w = &self.held[neuron as usize / 64];
        if on {
            w.fetch_or(bit, Ordering::Release);
        } else {
            w.fetch_and(!bit, Ordering::Release);
        }
    }
}

/// What one held neuron costs: its bundle plus its gate and up biases where the layer has them.
fn tier_neuron_bytes(bundles: &NeuronBundles) -> u64 {
    let spec = bundles.spec();
    let biases = [bundles.gate_bias.is_some(), bundles.up_bias.is_some()];
    spec.neuron_bytes(bundles.dtype()) as u64 + 4 * biases.iter().filter(|&&b| b).count() as u64
}

/// The worker's computation: the listed neurons (by storage index) over the job's rows.
fn compute(
    store: &Store,
    kernels: &Kernels,
    pool: &Pool,
    job: &Job,
    xq: &mut Vec<QuantizedRow>,
    states: &mut [ThreadScratch],
) -> Done {
    let b = &store.bundles;
    let hidden = b.spec().hidden;
    if b.dtype().quant().is_some() {
        QuantizedRow::quantize_rows(xq, &job.x, hidden);
    }
    let sparse = SparseJob {
        bundles: b.view(),
        kernels,
        x: &job.x,
        rows: job.rows,
        set: &job.set,
        xq,
        rule: job.rule,
    };
    sparse.run(pool, &job.neurons, states);
    let mut out = vec![0f32; job.rows * hidden];
    let mut used = Vec::new();
    let n = pool.threads();
    for (t, st) in states.iter().enumerate() {
        for (o, a) in out.iter_mut().zip(&st.acc) {
            *o += a;
        }
        let mine = &job.neurons[crate::cpu::share(job.neurons.len(), t, n)];
        for (&k, h) in mine.iter().zip(st.h.chunks(job.rows.max(1))) {
            if h.iter().any(|&v| v != 0.0) {
                used.push(k);
            }
        }
    }
    Ok((out, used))
}

impl FastTier for ReferenceTier {
    fn name(&self) -> &str {
        NAME
    }

    #[inline]
    fn holds(&self, neuron: usize) -> bool {
        self.held
            .get(neuron / 64)
            .is_some_and(|w| w.load(Ordering::Acquire) >> (neuron % 64) & 1 == 1)
    }

    fn bytes(&self) -> u64 {
        self._reservation.bytes()
    }

    fn launch(&self, call: &TierCall<'_>) -> Result<()> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        if link.pending {
            return Err(Error::tier(NAME, "launch while a launch is pending"));
        }
        if call.x.len() != call.rows * self.hidden {
            return Err(Error::count(
                "fast tier input values",
                call.rows * self.hidden,
                call.x.len(),
            ));
        }
        // The copy to the tier's memory: input rows, the list and the rows' membership, in
        // storage indices (the layer's sets re-indexed to what this tier holds).
        let store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let capacity = store.bundles.spec().intermediate;
        let mut neurons = Vec::with_capacity(call.neurons.len());
        let mut set = ActiveSet::new();
        set.reset(call.rows, capacity);
        if call.set.is_all() {
            set.fill_all();
        }
        for &i in call.neurons {
            let k = store.local.get(i as usize).copied().unwrap_or(NONE);
            if k == NONE {
                return Err(ErrorKind::Tier {
                    tier: NAME.into(),
                    reason: format!("asked for neuron {i}, which it does not hold"),
                }
                .into());
            }
            neurons.push(k);
            if !call.set.is_all() {
                for r in 0..call.rows {
                    if call.set.contains(r, i as usize) == Some(true) {
                        set.insert(r, k as usize)?;
                    }
                }
            }
        }
        drop(store);
        set.finish();
        let job = Job {
            x: call.x.to_vec(),
            rows: call.rows,
            neurons,
            set,
            rule: call.rule,
        };
        let n = job.neurons.len() as u64;
        let sent = link.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            return Err(Error::tier(NAME, "its thread has stopped"));
        }
        link.pending = true;
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        c.calls += 1;
        c.neurons += n;
        Ok(())
    }

    fn finish(&self, out: &mut [f32]) -> Result<usize> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        if !link.pending {
            return Err(Error::tier(NAME, "finish without a launch"));
        }
        link.pending = false;
        link.used.clear();
        let (partial, used) = link
            .done
            .recv()
            .map_err(|_| Error::tier(NAME, "its thread stopped during a call"))??;
        if partial.len() != out.len() {
            return Err(Error::count(
                "fast tier output values",
                partial.len(),
                out.len(),
            ));
        }
        for (o, p) in out.iter_mut().zip(&partial) {
            *o += p;
        }
        link.used = used;
        Ok(link.used.len())
    }

    fn observe(&self, src: &NeuronBundles, missed: &[u32]) -> Result<()> {
        // The link before the store, as `launch` takes them (one lock order, no deadlock).
        let used = std::mem::take(&mut self.link.lock().unwrap_or_else(|e| e.into_inner()).used);
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        if store.cache.slots() == 0 {
            return Ok(());
        }
        let (mine, theirs) = (store.bundles.spec(), src.spec());
        if (mine.hidden, mine.gated, store.bundles.dtype())
            != (theirs.hidden, theirs.gated, src.dtype())
            || theirs.intermediate != store.local.len()
        {
            return Err(Error::tier(
                NAME,
                format!("cache fill from another layer's weights ({theirs:?})"),
            ));
        }
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        store.cache.tick();
        let hot = store.hot;
        for &k in used.iter().filter(|&&k| k as usize >= hot) {
            let i = store.ids[k as usize];
            store.cache.touch(i as usize);
            c.hits += 1;
        }
        c.misses += missed.len() as u64;
        for &i in missed {
            let Some(fill) = store.cache.admit(i as usize)? else {
                continue;
            };
            if let Some(e) = fill.evicted {
                store.local[e as usize] = NONE;
                self.set_held(e, false);
                c.evictions += 1;
            }
            let k = hot + fill.slot;
            let Store {
                bundles,
                local,
                ids,
                ..
            } = &mut *store;
            bundles.copy_neuron(k, src, i as usize);
            local[i as usize] = k as u32;
            ids[k] = i;
            self.set_held(i, true);
            c.fills += 1;
            c.bytes_copied += self.neuron_bytes;
        }
        Ok(())
    }

    fn take_counters(&self) -> TierCounters {
        std::mem::take(&mut *self.counters.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for ReferenceTier {
    fn drop(&mut self) {
        // Closing the job channel ends the worker's loop.
        self.link.get_mut().unwrap_or_else(|e| e.into_inner()).jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
