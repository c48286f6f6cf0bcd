//! The CUDA fast tier (cargo feature `cuda`): a layer's hot neurons, and a cache of cold ones,
//! in GPU memory, computed by the kernels of `kernels/ffn.cu` on candle's CUDA device and stream
//! while the CPU pool computes the cold neurons.
//!
//! Per call ([`FastTier::launch`]): the input rows, the list of held neurons and the rows' masks
//! are copied up (the input through pinned memory), three kernels run on the device's stream,
//! and the partial output and the activations are copied back into pinned memory; an event
//! recorded after them is all [`FastTier::finish`] waits on (no device-wide synchronisation).
//! Cache fills go up on a second stream; the next launch waits on their event.
//!
//! Quantized layers are held as f16 rows on the device (the kernels read f32, f16 and bf16), and
//! the budget is charged for those bytes.

mod upload;

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDevice;
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::ffn::NeuronBundles;
use crate::hybrid::{FastTier, Reservation, Residency, TierBudget, TierCall, TierCounters};
use upload::{DeviceDType, HostRows};

/// The kernels, compiled to PTX by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ffn.ptx"));
const MODULE: &str = "powerinfer_ffn";
/// The largest batch one call takes (its buffers are reserved up front); larger ones run on
/// the CPU.
pub const MAX_ROWS: usize = 64;
/// Rows per kernel launch (the down partials are sized for this many).
const BLOCK_ROWS: usize = 16;
/// Most chunks the down sum is split into, and the fewest neurons per chunk.
const CHUNKS: usize = 32;
const MIN_CHUNK: usize = 64;

/// Opens CUDA device `ordinal` through candle. No driver, no device, or a library that cannot
/// be loaded is a [`ErrorKind::Tier`] error naming the cause (never a panic).
pub fn cuda_device(ordinal: usize) -> Result<CudaDevice> {
    let name = format!("cuda:{ordinal}");
    let opened = std::panic::catch_unwind(|| candle_core::Device::new_cuda(ordinal));
    match opened {
        Ok(Ok(candle_core::Device::Cuda(d))) => Ok(d),
        Ok(Ok(other)) => Err(Error::tier(&name, format!("candle opened {other:?}"))),
        Ok(Err(e)) => Err(Error::tier(
            &name,
            format!("no CUDA device: {}", first_line(&e)),
        )),
        Err(_) => Err(Error::tier(
            &name,
            "no CUDA device: the CUDA libraries panicked",
        )),
    }
}

fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// The layer's rows in device memory.
enum Weights {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

/// The held neurons in device memory: placed hot neurons first, then the cache slots (where
/// each neuron lies is the `Residency`'s).
struct Store {
    weights: Weights,
    gate_bias: CudaSlice<f32>,
    up_bias: CudaSlice<f32>,
    /// Recorded after the last cache fills on the copy stream; the next launch waits on it.
    filled: Option<CudaEvent>,
}

/// Per-call buffers, reserved at construction for [`MAX_ROWS`] rows.
struct Work {
    x_host: PinnedHostSlice<f32>,
    x: CudaSlice<f32>,
    list_host: Vec<u32>,
    list: CudaSlice<u32>,
    mask_host: Vec<u8>,
    mask: CudaSlice<u8>,
    h: CudaSlice<f32>,
    h_host: PinnedHostSlice<f32>,
    partial: CudaSlice<f32>,
    out: CudaSlice<f32>,
    out_host: PinnedHostSlice<f32>,
    /// The launched call: rows and neurons.
    pending: Option<(usize, usize)>,
    /// Recorded after each call's copies back (one event, recorded again every call).
    done: CudaEvent,
    /// With kernel timing on: events around the launched call's kernels.
    timed: Option<(CudaEvent, CudaEvent)>,
    /// Kernel time of the calls since timing was turned on, ms.
    kernel_ms: f64,
    timing: bool,
    /// Storage indices of the last call's contributing neurons.
    used: Vec<u32>,
}

/// A fast tier on a CUDA GPU (see the module docs).
pub struct CudaTier {
    name: String,
    dev: CudaDevice,
    copy: Arc<CudaStream>,
    hidden: usize,
    gated: bool,
    activation: i32,
    dtype: DeviceDType,
    stride: usize,
    neuron_bytes: u64,
    store: Mutex<Store>,
    residency: Residency,
    work: Mutex<Work>,
    counters: Mutex<TierCounters>,
    reservation: Reservation,
}

impl std::fmt::Debug for CudaTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTier")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("bytes", &self.reservation.bytes())
            .finish()
    }
}

fn dev_err(name: &str) -> impl Fn(&dyn std::fmt::Display) -> Error + '_ {
    move |e| Error::tier(name, first_line(e))
}

/// Pinned host memory of `len` zeros.
fn pinned<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    len: usize,
    name: &str,
) -> Result<PinnedHostSlice<T>> {
    let ctx = dev.cuda_stream().context().clone();
    // SAFETY: the memory is zeroed through a raw pointer before any reference to it is made;
    // flags 0: cached (not write-combined) memory, which the host reads back fast.
    unsafe {
        let mut p = ctx
            .alloc_pinned_with_flags::<T>(len.max(1), 0)
            .map_err(|e| dev_err(name)(&e))?;
        let ptr = p.as_mut_ptr().map_err(|e| dev_err(name)(&e))?;
        std::ptr::write_bytes(ptr, 0, len.max(1));
        Ok(p)
    }
}

impl CudaTier {
    /// Bytes one neuron of `bundles` takes on the device (rows in the device's element type and
    /// two biases): what a placement planned for this tier charges per hot neuron.
    pub fn neuron_bytes(bundles: &NeuronBundles) -> u64 {
        upload::neuron_bytes(bundles)
    }

    /// Bytes of the per-call buffers of a layer holding `capacity` neurons.
    pub fn work_bytes(bundles: &NeuronBundles, capacity: usize) -> u64 {
        let h = bundles.spec().hidden;
        let floats = 2 * MAX_ROWS * h + 2 * capacity * MAX_ROWS + CHUNKS * BLOCK_ROWS * h;
        (floats * 4 + capacity * (4 + MAX_ROWS)) as u64
    }

    /// A tier on `dev` holding `hot` (neurons of `bundles`, no repeats) plus `cache_slots` cache
    /// slots. Reserves the rows and the buffers under `budget` before allocating; a refused
    /// reservation is a `Budget` error and a failed allocation (out of memory) a `Tier` error,
    /// both leaving nothing allocated.
    pub fn new(
        dev: &CudaDevice,
        bundles: &NeuronBundles,
        hot: &[u32],
        cache_slots: usize,
        budget: &Arc<TierBudget>,
    ) -> Result<Self> {
        let name = "cuda".to_string();
        let spec = *bundles.spec();
        let n = spec.intermediate;
        let placement = crate::hybrid::LayerPlacement::new(n, hot.to_vec(), None)?;
        let capacity = hot.len() + cache_slots;
        if capacity == 0 {
            return Err(Error::config(
                "fast tier",
                "holds no neuron (no hot neuron, no cache slot); attach no tier",
            ));
        }
        let per = upload::neuron_bytes(bundles);
        let bytes = per
            .saturating_mul(capacity as u64)
            .saturating_add(Self::work_bytes(bundles, capacity));
        let reservation = budget.reserve(
            bytes,
            &format!(
                "{} hot neurons, {cache_slots} cache slots and buffers",
                hot.len()
            ),
        )?;
        let err = dev_err(&name);
        // Spare slots are uploaded as copies of neuron 0; they are not held until filled.
        let mut upload_ids = placement.hot().to_vec();
        upload_ids.resize(capacity, 0);
        let weights = match upload::rows(bundles, &upload_ids)? {
            HostRows::F32(v) => Weights::F32(dev.clone_htod(&v)?),
            HostRows::F16(v) => Weights::F16(dev.clone_htod(&v)?),
            HostRows::BF16(v) => Weights::BF16(dev.clone_htod(&v)?),
        };
        let (gb, ub) = upload::biases(bundles, &upload_ids);
        let (gate_bias, up_bias) = (dev.clone_htod(&gb)?, dev.clone_htod(&ub)?);
        let residency = Residency::new(n, placement.hot(), cache_slots)?;
        let h = spec.hidden;
        let work = Work {
            x_host: pinned(dev, MAX_ROWS * h, &name)?,
            x: dev.alloc_zeros(MAX_ROWS * h)?,
            list_host: Vec::with_capacity(capacity),
            list: dev.alloc_zeros(capacity)?,
            mask_host: Vec::with_capacity(capacity * MAX_ROWS),
            mask: dev.alloc_zeros(capacity * MAX_ROWS)?,
            // Outputs start as NaN: a kernel that leaves an entry unwritten shows in the result.
            h: dev.clone_htod(&vec![f32::NAN; capacity * MAX_ROWS])?,
            h_host: pinned(dev, capacity * MAX_ROWS, &name)?,
            partial: dev.clone_htod(&vec![f32::NAN; CHUNKS * BLOCK_ROWS * h])?,
            out: dev.clone_htod(&vec![f32::NAN; MAX_ROWS * h])?,
            out_host: pinned(dev, MAX_ROWS * h, &name)?,
            pending: None,
            done: dev
                .cuda_stream()
                .record_event(None)
                .map_err(|e| dev_err(&name)(&e))?,
            timed: None,
            kernel_ms: 0.0,
            timing: false,
            used: Vec::new(),
        };
        // Load the module now: a PTX the driver cannot compile fails here, not mid-call.
        let dtype = DeviceDType::of(bundles);
        for k in dtype.kernels().into_iter().chain(["sum_chunks"]) {
            dev.get_or_load_custom_func(k, MODULE, PTX)?;
        }
        let copy = dev.cuda_stream().fork().map_err(|e| err(&e))?;
        drop(err);
        Ok(CudaTier {
            name,
            dev: dev.clone(),
            copy,
            hidden: h,
            gated: spec.gated,
            activation: activation_code(spec.activation),
            dtype,
            stride: upload::stride(bundles),
            neuron_bytes: per,
            store: Mutex::new(Store {
                weights,
                gate_bias,
                up_bias,
                filled: None,
            }),
            residency,
            work: Mutex::new(work),
            counters: Mutex::new(TierCounters::default()),
            reservation,
        })
    }

    /// Keeps every cached neuron used in the last `window` calls (see
    /// [`crate::tier::NeuronCache::with_window`]); the default is 1.
    pub fn with_cache_window(self, window: u64) -> Result<Self> {
        self.residency.set_window(window)?;
        Ok(self)
    }

    /// Starts (or stops) timing the kernels of each call with CUDA events, and resets the
    /// total: for measuring the kernels apart from the copies and the synchronisation.
    pub fn time_kernels(&self, on: bool) {
        let mut w = self.work.lock().unwrap_or_else(|e| e.into_inner());
        w.timing = on;
        w.kernel_ms = 0.0;
    }

    /// Kernel time of the calls finished since [`CudaTier::time_kernels`], ms.
    pub fn kernel_ms(&self) -> f64 {
        self.work
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kernel_ms
    }

    /// Queues the three kernels for rows `r0..r0 + rows` of the call (`count` listed neurons).
    /// Cache fills come from the layer's own weights, in the layout uploaded.
    fn check_source(&self, src: &NeuronBundles) -> Result<()> {
        let theirs = src.spec();
        if (
            theirs.hidden,
            theirs.gated,
            upload::stride(src),
            DeviceDType::of(src),
        ) != (self.hidden, self.gated, self.stride, self.dtype)
            || theirs.intermediate != self.residency.intermediate()
        {
            return Err(Error::tier(
                &self.name,
                format!("cache fill from another layer's weights ({theirs:?})"),
            ));
        }
        Ok(())
    }

    /// Queues the copy of neuron `i` of `src` into storage index `k` on the copy stream.
    fn fill(&self, store: &mut Store, src: &NeuronBundles, k: usize, i: u32) -> Result<()> {
        let err = dev_err(&self.name);
        let range = k * self.stride..(k + 1) * self.stride;
        let Store {
            weights,
            gate_bias,
            up_bias,
            ..
        } = store;
        match (upload::rows(src, &[i])?, weights) {
            (HostRows::F32(v), Weights::F32(w)) => {
                self.copy.memcpy_htod(&v, &mut w.slice_mut(range))
            }
            (HostRows::F16(v), Weights::F16(w)) => {
                self.copy.memcpy_htod(&v, &mut w.slice_mut(range))
            }
            (HostRows::BF16(v), Weights::BF16(w)) => {
                self.copy.memcpy_htod(&v, &mut w.slice_mut(range))
            }
            _ => {
                return Err(Error::tier(
                    &self.name,
                    "cache fill of another element type",
                ))
            }
        }
        .map_err(|e| err(&e))?;
        let (gb, ub) = upload::biases(src, &[i]);
        self.copy
            .memcpy_htod(&gb, &mut gate_bias.slice_mut(k..k + 1))
            .map_err(|e| err(&e))?;
        self.copy
            .memcpy_htod(&ub, &mut up_bias.slice_mut(k..k + 1))
            .map_err(|e| err(&e))?;
        Ok(())
    }

    /// The next launch waits for the fills queued so far (`filled`).
    fn record_fills(&self, store: &mut Store) -> Result<()> {
        let ev = self
            .copy
            .record_event(None)
            .map_err(|e| dev_err(&self.name)(&e))?;
        store.filled = Some(ev);
        Ok(())
    }

    fn run_block(
        &self,
        store: &Store,
        work: &mut Work,
        r0: usize,
        rows: usize,
        count: usize,
        rule: Option<f32>,
    ) -> Result<()> {
        let h = self.hidden;
        let [gate_up, down] = self.dtype.kernels();
        let x = work.x.slice(r0 * h..(r0 + rows) * h);
        let moff = r0 * count;
        let mask = work.mask.slice(moff..moff + rows * count);
        let mut hv = work.h.slice_mut(moff..moff + rows * count);
        let (stride, hidden) = (self.stride as u64, h as i32);
        let (rows_i, count_i) = (rows as i32, count as i32);
        let (gated, act) = (i32::from(self.gated), self.activation);
        let (has_rule, t) = (i32::from(rule.is_some()), rule.unwrap_or(0.0));
        let gate_up = self.dev.get_or_load_custom_func(gate_up, MODULE, PTX)?;
        let mut b = gate_up.builder();
        match &store.weights {
            Weights::F32(w) => b.arg(w),
            Weights::F16(w) => b.arg(w),
            Weights::BF16(w) => b.arg(w),
        };
        b.arg(&stride)
            .arg(&gated)
            .arg(&hidden)
            .arg(&x)
            .arg(&rows_i)
            .arg(&work.list);
        b.arg(&count_i)
            .arg(&mask)
            .arg(&store.gate_bias)
            .arg(&store.up_bias);
        b.arg(&act).arg(&has_rule).arg(&t).arg(&mut hv);
        let warps_per_block = 8u32;
        let cfg = LaunchConfig {
            grid_dim: ((count as u32).div_ceil(warps_per_block), 1, 1),
            block_dim: (32 * warps_per_block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `gate_up_<T>`'s parameters in order and type (`T` rows of
        // `stride` elements per neuron, `capacity` neurons; `x` holds `rows * hidden` floats,
        // `mask` and `h` `rows * count`, `list` `count` storage indices below the capacity, the
        // biases one float per storage index); one warp per listed neuron.
        unsafe { b.launch(cfg) }.map_err(|e| dev_err(&self.name)(&e))?;
        drop(b);

        let chunk = MIN_CHUNK.max(count.div_ceil(CHUNKS));
        let chunks = count.div_ceil(chunk);
        let down_at = ((1 + usize::from(self.gated)) * h) as u64;
        let (chunk_i, chunks_i) = (chunk as i32, chunks as i32);
        let hv = work.h.slice(moff..moff + rows * count);
        let down = self.dev.get_or_load_custom_func(down, MODULE, PTX)?;
        let mut b = down.builder();
        match &store.weights {
            Weights::F32(w) => b.arg(w),
            Weights::F16(w) => b.arg(w),
            Weights::BF16(w) => b.arg(w),
        };
        b.arg(&stride)
            .arg(&down_at)
            .arg(&hidden)
            .arg(&rows_i)
            .arg(&work.list);
        b.arg(&count_i)
            .arg(&chunk_i)
            .arg(&hv)
            .arg(&mut work.partial);
        let cfg = LaunchConfig {
            grid_dim: ((h as u32).div_ceil(256), chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `down_<T>`; `partial` holds `CHUNKS * BLOCK_ROWS * hidden`
        // floats and `chunks <= CHUNKS`, `rows <= BLOCK_ROWS`; one thread per output column and
        // chunk.
        unsafe { b.launch(cfg) }.map_err(|e| dev_err(&self.name)(&e))?;
        drop(b);

        let sum = self
            .dev
            .get_or_load_custom_func("sum_chunks", MODULE, PTX)?;
        let mut out = work.out.slice_mut(r0 * h..(r0 + rows) * h);
        let mut b = sum.builder();
        b.arg(&work.partial)
            .arg(&chunks_i)
            .arg(&rows_i)
            .arg(&hidden)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (((rows * h) as u32).div_ceil(256).max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `sum_chunks` reads `chunks * rows * hidden` partials and writes `rows * hidden`
        // outputs into this block's rows of `out`.
        unsafe { b.launch(cfg) }.map_err(|e| dev_err(&self.name)(&e))?;
        Ok(())
    }
}

/// The kernels' activation codes (`kernels/ffn.cu`).
fn activation_code(a: crate::Activation) -> i32 {
    match a {
        crate::Activation::Relu => 0,
        crate::Activation::DRelu => 1,
        crate::Activation::Silu => 2,
        crate::Activation::Gelu => 3,
        crate::Activation::GeluTanh => 4,
    }
}

impl FastTier for CudaTier {
    fn name(&self) -> &str {
        &self.name
    }

    #[inline]
    fn holds(&self, neuron: usize) -> bool {
        self.residency.holds(neuron)
    }

    fn bytes(&self) -> u64 {
        self.reservation.bytes()
    }

    fn max_rows(&self) -> usize {
        MAX_ROWS
    }

    fn launch(&self, call: &TierCall<'_>) -> Result<()> {
        let mut work = self.work.lock().unwrap_or_else(|e| e.into_inner());
        if work.pending.is_some() {
            return Err(Error::tier(&self.name, "launch while a launch is pending"));
        }
        let (rows, h) = (call.rows, self.hidden);
        if rows > MAX_ROWS {
            return Err(Error::tier(
                &self.name,
                format!("{rows} rows; it takes {MAX_ROWS}"),
            ));
        }
        if call.x.len() != rows * h {
            return Err(Error::count(
                "fast tier input values",
                rows * h,
                call.x.len(),
            ));
        }
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let count = call.neurons.len();
        let Work {
            list_host,
            mask_host,
            ..
        } = &mut *work;
        self.residency.map(&self.name, call.neurons, list_host)?;
        mask_host.clear();
        mask_host.resize(rows * count, 0);
        for (k, &i) in call.neurons.iter().enumerate() {
            // Mask layout: per block of `BLOCK_ROWS` rows, `[neuron][row in block]`.
            for r in 0..rows {
                if call.set.is_all() || call.set.contains(r, i as usize) == Some(true) {
                    let (b0, rb) = (
                        r / BLOCK_ROWS * BLOCK_ROWS,
                        (rows - r / BLOCK_ROWS * BLOCK_ROWS).min(BLOCK_ROWS),
                    );
                    mask_host[b0 * count + k * rb + (r - b0)] = 1;
                }
            }
        }
        let err = dev_err(&self.name);
        let stream = self.dev.cuda_stream();
        if let Some(ev) = store.filled.take() {
            stream.wait(&ev).map_err(|e| err(&e))?;
        }
        {
            let Work {
                x_host,
                x,
                list_host,
                list,
                mask_host,
                mask,
                ..
            } = &mut *work;
            let xs = x_host.as_mut_slice().map_err(|e| err(&e))?;
            xs[..rows * h].copy_from_slice(call.x);
            stream
                .memcpy_htod(&xs[..rows * h], &mut x.slice_mut(..rows * h))
                .map_err(|e| err(&e))?;
            stream
                .memcpy_htod(&list_host[..], &mut list.slice_mut(..count))
                .map_err(|e| err(&e))?;
            stream
                .memcpy_htod(&mask_host[..], &mut mask.slice_mut(..rows * count))
                .map_err(|e| err(&e))?;
        }
        let timer = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let start = if work.timing {
            Some(timer().map_err(|e| err(&e))?)
        } else {
            None
        };
        // No neuron: nothing to launch (a zero-sized grid is a launch error); `finish` adds 0.
        for r0 in (0..rows).step_by(BLOCK_ROWS).filter(|_| count > 0) {
            let rb = (rows - r0).min(BLOCK_ROWS);
            self.run_block(&store, &mut work, r0, rb, count, call.rule)?;
        }
        if let Some(start) = start {
            work.timed = Some((start, timer().map_err(|e| err(&e))?));
        }
        {
            let Work {
                out,
                out_host,
                h: hv,
                h_host,
                ..
            } = &mut *work;
            let o = out_host.as_mut_slice().map_err(|e| err(&e))?;
            stream
                .memcpy_dtoh(&out.slice(..rows * h), &mut o[..rows * h])
                .map_err(|e| err(&e))?;
            let hh = h_host.as_mut_slice().map_err(|e| err(&e))?;
            stream
                .memcpy_dtoh(&hv.slice(..rows * count), &mut hh[..rows * count])
                .map_err(|e| err(&e))?;
        }
        work.done.record(&stream).map_err(|e| err(&e))?;
        work.pending = Some((rows, count));
        drop(store);
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        c.calls += 1;
        c.neurons += count as u64;
        Ok(())
    }

    fn finish(&self, out: &mut [f32]) -> Result<usize> {
        let mut work = self.work.lock().unwrap_or_else(|e| e.into_inner());
        let Some((rows, count)) = work.pending.take() else {
            return Err(Error::tier(&self.name, "finish without a launch"));
        };
        let err = dev_err(&self.name);
        work.done.synchronize().map_err(|e| err(&e))?;
        if let Some((start, end)) = work.timed.take() {
            work.kernel_ms += f64::from(start.elapsed_ms(&end).map_err(|e| err(&e))?);
        }
        let h = self.hidden;
        if out.len() != rows * h {
            return Err(Error::count("fast tier output values", rows * h, out.len()));
        }
        let Work {
            out_host,
            h_host,
            list_host,
            used,
            ..
        } = &mut *work;
        if count == 0 {
            used.clear();
            return Ok(0);
        }
        let partial = out_host.as_slice().map_err(|e| err(&e))?;
        for (o, p) in out.iter_mut().zip(&partial[..rows * h]) {
            *o += p;
        }
        // h is `[block][neuron][row in block]`: a neuron contributed if any row is nonzero.
        let hv = h_host.as_slice().map_err(|e| err(&e))?;
        used.clear();
        for (k, &s) in list_host.iter().enumerate().take(count) {
            let any = (0..rows).step_by(BLOCK_ROWS).any(|b0| {
                let rb = (rows - b0).min(BLOCK_ROWS);
                hv[b0 * count + k * rb..b0 * count + (k + 1) * rb]
                    .iter()
                    .any(|&v| v != 0.0)
            });
            if any {
                used.push(s);
            }
        }
        Ok(used.len())
    }

    fn observe(&self, src: &NeuronBundles, missed: &[u32]) -> Result<()> {
        let used = std::mem::take(&mut self.work.lock().unwrap_or_else(|e| e.into_inner()).used);
        if self.residency.slots() == 0 {
            return Ok(());
        }
        self.check_source(src)?;
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let filled = self
            .residency
            .observe(&used, missed, self.neuron_bytes, &mut c, |k, i| {
                self.fill(&mut store, src, k, i)
            })?;
        if filled {
            self.record_fills(&mut store)?;
        }
        Ok(())
    }

    fn prefetch(&self, src: &NeuronBundles, neurons: &[u32]) -> Result<usize> {
        if self.residency.slots() == 0 || neurons.is_empty() {
            return Ok(0);
        }
        self.check_source(src)?;
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let filled = self
            .residency
            .prefetch(neurons, self.neuron_bytes, &mut c, |k, i| {
                self.fill(&mut store, src, k, i)
            })?;
        if filled > 0 {
            self.record_fills(&mut store)?;
        }
        Ok(filled)
    }

    fn take_counters(&self) -> TierCounters {
        std::mem::take(&mut *self.counters.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
