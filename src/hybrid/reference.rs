//! `ReferenceTier`: a fast tier run by CPU threads of its own, on its own copy of the neurons it
//! holds. It does what a GPU tier does (a separate memory under a byte budget, asynchronous
//! launch, a neuron cache filled from RAM) with the CPU kernels, so the split, the merge, the
//! budget and the cache are tested exactly on any machine, and a device tier has a model to
//! match.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};

use super::budget::{Reservation, TierBudget};
use super::cache::Residency;
use super::tier::{FastTier, TierCall, TierCounters};
use crate::active::ActiveSet;
use crate::cpu::{Kernels, Pool, QuantizedRow, SparseJob, ThreadScratch};
use crate::error::{Error, Result};
use crate::ffn::NeuronBundles;

const NAME: &str = "reference";
/// How long `finish` spins before it sleeps: longer than any one layer's share.
const FINISH_SPIN: std::time::Duration = std::time::Duration::from_millis(20);

/// The tier's memory: the held neurons' bundles, placed hot neurons first, then the cache slots
/// (where each neuron lies is the `Residency`'s).
#[derive(Debug)]
struct Store {
    bundles: NeuronBundles,
}

/// One call: the copied inputs (what a GPU would upload) and the answer (what it would copy
/// back). It goes to the worker and comes back, and is kept for the next call, so a call
/// allocates nothing once its sizes have been seen.
#[derive(Debug, Default)]
struct Job {
    x: Vec<f32>,
    rows: usize,
    neurons: Vec<u32>,
    set: ActiveSet,
    rule: Option<f32>,
    /// The partial output, `rows * hidden`.
    out: Vec<f32>,
    /// Storage indices of the neurons with a nonzero contribution.
    used: Vec<u32>,
}

/// A job for the shared worker: the tier's memory, the job, where to send it back.
struct Task {
    store: Arc<Mutex<Store>>,
    job: Job,
    reply: Sender<Job>,
}

/// The thread that computes every reference tier's calls with `threads` threads: one per thread
/// count, shared by all layers (as the CPU pool is), so idle tiers do not each hold a spinning
/// thread.
struct Worker {
    tasks: Sender<Task>,
}

impl Worker {
    fn shared(threads: usize) -> Result<Arc<Worker>> {
        static WORKERS: OnceLock<Mutex<HashMap<usize, Arc<Worker>>>> = OnceLock::new();
        let map = WORKERS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = map.get(&threads) {
            return Ok(Arc::clone(w));
        }
        let kernels = Kernels::detect()?;
        let (tasks, rx) = channel::<Task>();
        std::thread::Builder::new()
            .name(format!("powerinfer-reference-tier-{threads}"))
            .spawn(move || {
                let pool = Pool::new(threads);
                let mut states = vec![ThreadScratch::default(); threads];
                let mut xq = Vec::new();
                while let Some(t) = receive(&rx, 10 * crate::cpu::spin()) {
                    let mut job = t.job;
                    let store = t.store.lock().unwrap_or_else(|e| e.into_inner());
                    compute(&store, &kernels, &pool, &mut job, &mut xq, &mut states);
                    drop(store);
                    // A tier dropped while its call ran: nobody to answer.
                    let _ = t.reply.send(job);
                }
            })
            .map_err(|e| Error::tier(NAME, format!("cannot start its thread: {e}")))?;
        let w = Arc::new(Worker { tasks });
        map.insert(threads, Arc::clone(&w));
        Ok(w)
    }
}

#[derive(Debug)]
struct Link {
    reply: Sender<Job>,
    done: Receiver<Job>,
    /// The job between calls (`None` while one is with the worker); after a call its `used`
    /// are the contributing neurons, for the cache's bookkeeping.
    job: Option<Job>,
}

/// A fast tier on CPU threads: holds the placed hot neurons and a cache of cold ones in memory of
/// its own, reserved under a [`TierBudget`], and computes its share on a thread of its own (one
/// shared by all reference tiers with the same thread count) while the CPU pool computes the
/// rest. See the module docs for why it exists.
#[derive(Debug)]
pub struct ReferenceTier {
    hidden: usize,
    neuron_bytes: u64,
    store: Arc<Mutex<Store>>,
    /// Neurons the store has room for (hot and cache slots).
    capacity: usize,
    residency: Residency,
    link: Mutex<Link>,
    counters: Mutex<TierCounters>,
    worker: Arc<Worker>,
    _reservation: Reservation,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Worker")
    }
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
        let neuron_bytes = Self::neuron_bytes(bundles);
        let reservation = budget.reserve(
            neuron_bytes.saturating_mul(capacity as u64),
            &format!("{} hot neurons and {cache_slots} cache slots", hot.len()),
        )?;
        let residency = Residency::new(n, placement.hot(), cache_slots)?;
        // Spare slots start as copies of some neuron; they are not held until filled.
        let mut ids = placement.hot().to_vec();
        ids.resize(capacity, 0);
        let store = Arc::new(Mutex::new(Store {
            bundles: bundles.select(&ids)?,
        }));
        let worker = Worker::shared(threads)?;
        let (reply, done) = channel::<Job>();
        Ok(ReferenceTier {
            hidden: spec.hidden,
            neuron_bytes,
            store,
            capacity,
            residency,
            link: Mutex::new(Link {
                reply,
                done,
                job: Some(Job::default()),
            }),
            counters: Mutex::new(TierCounters::default()),
            worker,
            _reservation: reservation,
        })
    }

    /// Bytes one neuron of `bundles` takes in the tier (its bundle and biases): what a placement
    /// planned for this tier must charge per hot neuron.
    pub fn neuron_bytes(bundles: &NeuronBundles) -> u64 {
        let spec = bundles.spec();
        let biases = [bundles.gate_bias.is_some(), bundles.up_bias.is_some()];
        spec.neuron_bytes(bundles.dtype()) as u64 + 4 * biases.iter().filter(|&&b| b).count() as u64
    }

    /// Keeps every cached neuron used in the last `window` calls (see
    /// [`NeuronCache::with_window`](super::NeuronCache::with_window)); the default is 1.
    pub fn with_cache_window(self, window: u64) -> Result<Self> {
        self.residency.set_window(window)?;
        Ok(self)
    }

    /// How many cache slots of `bundles`' neurons fit in what `budget` has free after `hot`
    /// neurons: the largest cache a tier built now can have.
    pub fn cache_slots_that_fit(bundles: &NeuronBundles, hot: usize, budget: &TierBudget) -> usize {
        let per = Self::neuron_bytes(bundles);
        let free = budget.available() / per;
        (free as usize).saturating_sub(hot)
    }

    /// Neurons held now: placed hot ones and cached ones, sorted.
    pub fn held(&self) -> Vec<u32> {
        self.residency.held()
    }

    /// Cache fills come from the layer's own weights: another layer's would fill wrong rows
    /// (another storage is `copy_neuron`'s error).
    fn check_source(&self, src: &NeuronBundles) -> Result<()> {
        if src.spec().intermediate != self.residency.intermediate()
            || src.spec().hidden != self.hidden
        {
            return Err(Error::tier(
                NAME,
                format!("cache fill from another layer's weights ({:?})", src.spec()),
            ));
        }
        Ok(())
    }
}

/// The next message: spins for up to `spin` first, then sleeps. Waking a sleeping thread costs
/// 70-100 us on the 2-core virtual machines measured here, as much as half a layer's FFN, so
/// both sides spin: the worker for ten times the pool's spin time between calls (a decode step's
/// layers come a few hundred microseconds apart), `finish` until the partial arrives (its
/// thread has nothing else to do). `None` when the other side is gone.
fn receive<T>(rx: &Receiver<T>, spin: std::time::Duration) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Some(v),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if start.elapsed() < spin => std::hint::spin_loop(),
            Err(TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// The worker's computation: the listed neurons (by storage index) over the job's rows.
fn compute(
    store: &Store,
    kernels: &Kernels,
    pool: &Pool,
    job: &mut Job,
    xq: &mut Vec<QuantizedRow>,
    states: &mut [ThreadScratch],
) {
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
    job.out.clear();
    job.out.resize(job.rows * hidden, 0.0);
    job.used.clear();
    let n = pool.threads();
    for (t, st) in states.iter().enumerate() {
        for (o, a) in job.out.iter_mut().zip(&st.acc) {
            *o += a;
        }
        let mine = &job.neurons[crate::cpu::share(job.neurons.len(), t, n)];
        for (&k, h) in mine.iter().zip(st.h.chunks(job.rows.max(1))) {
            if h.iter().any(|&v| v != 0.0) {
                job.used.push(k);
            }
        }
    }
}

impl FastTier for ReferenceTier {
    fn name(&self) -> &str {
        NAME
    }

    #[inline]
    fn holds(&self, neuron: usize) -> bool {
        self.residency.holds(neuron)
    }

    fn bytes(&self) -> u64 {
        self._reservation.bytes()
    }

    fn launch(&self, call: &TierCall<'_>) -> Result<()> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut job) = link.job.take() else {
            return Err(Error::tier(NAME, "launch while a launch is pending"));
        };
        // The copy to the tier's memory: input rows, the list and the rows' membership, in
        // storage indices (the layer's sets re-indexed to what this tier holds).
        let copied = (|| {
            if call.x.len() != call.rows * self.hidden {
                return Err(Error::count(
                    "fast tier input values",
                    call.rows * self.hidden,
                    call.x.len(),
                ));
            }
            self.residency.map(NAME, call.neurons, &mut job.neurons)?;
            job.set.reset(call.rows, self.capacity);
            if call.set.is_all() {
                job.set.fill_all();
            } else {
                for (&i, &k) in call.neurons.iter().zip(&job.neurons) {
                    for r in 0..call.rows {
                        if call.set.contains(r, i as usize) == Some(true) {
                            job.set.insert(r, k as usize)?;
                        }
                    }
                }
            }
            job.set.finish();
            job.x.clear();
            job.x.extend_from_slice(call.x);
            (job.rows, job.rule) = (call.rows, call.rule);
            Ok(())
        })();
        if let Err(e) = copied {
            link.job = Some(job);
            return Err(e);
        }
        let n = job.neurons.len() as u64;
        let task = Task {
            store: Arc::clone(&self.store),
            job,
            reply: link.reply.clone(),
        };
        if self.worker.tasks.send(task).is_err() {
            return Err(Error::tier(NAME, "its thread has stopped"));
        }
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        c.calls += 1;
        c.neurons += n;
        Ok(())
    }

    fn finish(&self, out: &mut [f32]) -> Result<usize> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        if link.job.is_some() {
            return Err(Error::tier(NAME, "finish without a launch"));
        }
        let job = receive(&link.done, FINISH_SPIN)
            .ok_or_else(|| Error::tier(NAME, "its thread stopped during a call"))?;
        let result = if job.out.len() == out.len() {
            for (o, p) in out.iter_mut().zip(&job.out) {
                *o += p;
            }
            Ok(job.used.len())
        } else {
            Err(Error::count(
                "fast tier output values",
                job.out.len(),
                out.len(),
            ))
        };
        link.job = Some(job);
        result
    }

    fn observe(&self, src: &NeuronBundles, missed: &[u32]) -> Result<()> {
        if self.residency.slots() == 0 {
            return Ok(());
        }
        self.check_source(src)?;
        // The link before the store, as `launch` takes them (one lock order, no deadlock); the
        // job's `used` goes back afterwards, so its buffer is reused.
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let Some(job) = link.job.as_mut() else {
            return Err(Error::tier(NAME, "observe while a launch is pending"));
        };
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        self.residency
            .observe(&job.used, missed, self.neuron_bytes, &mut c, |k, i| {
                store.bundles.copy_neuron(k, src, i as usize)
            })?;
        Ok(())
    }

    /// Copies on the calling thread: this tier's memory is RAM, so a fill costs what computing
    /// the neuron on the CPU does (a GPU's fills run on its copy stream instead).
    fn prefetch(&self, src: &NeuronBundles, neurons: &[u32]) -> Result<usize> {
        if self.residency.slots() == 0 || neurons.is_empty() {
            return Ok(0);
        }
        self.check_source(src)?;
        let link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        if link.job.is_none() {
            return Err(Error::tier(NAME, "prefetch while a launch is pending"));
        }
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        self.residency
            .prefetch(neurons, self.neuron_bytes, &mut c, |k, i| {
                store.bundles.copy_neuron(k, src, i as usize)
            })
    }

    fn take_counters(&self) -> TierCounters {
        std::mem::take(&mut *self.counters.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
