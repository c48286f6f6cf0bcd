//! Which layout each GGUF matrix of an input-sparse layer takes: by column only where the column
//! product, at the fraction of channels the rule is expected to keep, is faster on this machine
//! than the dense packed rows; elsewhere the packed rows, whose input is never masked.
//!
//! A sparse mode that decodes slower than dense is a regression whatever it skips, and whether a
//! column product pays depends on the block type, the shape, the kept fraction, the CPU and the
//! thread count. So [`LayoutPlanner`] measures rather than guesses: for each distinct (matrix,
//! block type, shape) of a model it builds both layouts of the first such matrix and times each
//! product on the layer's thread count from DRAM, as the layer dispatches it (gate and up in one
//! dispatch, so two matrices of the shape, each thread a share of their chunks; down alone).
//! Every timed call follows a flush of the timed matrices' cache lines. The columns are kept only if the median of their times is below
//! [`MARGIN`] of the rows' twice: over the first [`REPEATS`] pairs, and over all of twice as
//! many; and they are not even timed where they read [`MARGIN`] of the rows' bytes or more,
//! which no column product beats by the margin (it reads no faster than the rows). Later layers with the same key reuse the decision, so a model is measured once per key
//! (3-6 keys for the files we run, 50-100 ms each).

use std::sync::Mutex;
use std::time::Instant;

use candle_core::quantized::QTensor;

use super::matrix::{self, blocks, Columns, Input, Layout};
use crate::cpu::{BlockKind, Kernels, Pool, SimdLevel, CHUNK};
use crate::error::{Error, Result};

/// Timed calls per layout; the median decides.
pub const REPEATS: usize = 9;

/// The column layout is chosen only if its product takes less than this share of the dense
/// rows' time: it must pay clearly, since dropping inputs costs accuracy, and the measurement
/// leaves out what decoding adds (masking the input, the real pattern of kept channels). On
/// Qwen2.5-Coder-1.5B with 2 threads, downs measured at 0.93-0.98x their rows' time decoded
/// 0.96x as fast as dense with them by column.
pub const MARGIN: f64 = 0.9;

/// The three matrices of a gated FFN, in [`crate::InputThresholds`]' order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FfnMatrix {
    /// `gate_proj` (input: the FFN input).
    Gate,
    /// `up_proj` (input: the FFN input).
    Up,
    /// `down_proj` (input: `h`).
    Down,
}

impl FfnMatrix {
    /// `gate`, `up` or `down`.
    pub fn name(self) -> &'static str {
        match self {
            FfnMatrix::Gate => "gate",
            FfnMatrix::Up => "up",
            FfnMatrix::Down => "down",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How an input-sparse layer lays out its GGUF matrices.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Layouts {
    /// Every matrix by column: every product input-sparse.
    #[default]
    Columns,
    /// Each matrix by column only where, with the rule expected to drop these fractions of
    /// gate's, up's and down's input entries, its column product measured faster than the
    /// packed rows ([`LayoutPlanner`]).
    Measured {
        /// Expected dropped fractions of gate's, up's and down's inputs, each in `[0, 1)`.
        drop: [f64; 3],
    },
}

/// One measured choice of [`LayoutPlanner`].
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutDecision {
    /// Which matrix of the FFN.
    pub matrix: FfnMatrix,
    /// Its block type.
    pub kind: BlockKind,
    /// Output rows and input columns.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Threads the products ran on.
    pub threads: usize,
    /// Fraction of the input channels the column product kept.
    pub kept: f64,
    /// Median ms of the dense packed product, from DRAM, per matrix as the layer dispatches it
    /// (gate and up: half a dispatch of two).
    pub rows_ms: f64,
    /// Median ms of the column product at `kept`, from DRAM (not measured, 0, when nothing is
    /// dropped: the rows win by definition).
    pub columns_ms: f64,
    /// Bytes of the dense matrix and bytes the column product read.
    pub rows_bytes: usize,
    /// Bytes the column product read at `kept`.
    pub columns_bytes: usize,
    /// The layout chosen.
    pub layout: Layout,
}

impl std::fmt::Display for LayoutDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gbs = |b: usize, ms: f64| b as f64 / (ms * 1e6);
        write!(
            f,
            "{} {} {}x{}, {} thread(s): rows {:.3} ms ({:.1} GB/s)",
            self.matrix.name(),
            self.kind,
            self.rows,
            self.cols,
            self.threads,
            self.rows_ms,
            gbs(self.rows_bytes, self.rows_ms),
        )?;
        if self.columns_ms == 0.0 && self.columns_bytes != self.rows_bytes {
            write!(
                f,
                ", columns at {:.0}% kept read {:.0}% of the rows' bytes (not timed: under \
                 {:.0}% could pay)",
                self.kept * 100.0,
                100.0 * self.columns_bytes as f64 / self.rows_bytes.max(1) as f64,
                100.0 * MARGIN,
            )?;
        }
        if self.columns_ms > 0.0 {
            write!(
                f,
                ", columns at {:.0}% kept {:.3} ms ({:.1} GB/s, {:.2}x the rows' time)",
                self.kept * 100.0,
                self.columns_ms,
                gbs(self.columns_bytes, self.columns_ms),
                self.columns_ms / self.rows_ms,
            )?;
        }
        write!(f, " -> {}", self.layout.name())
    }
}

/// Measures and remembers, per (matrix, block type, shape), whether the column layout pays (see
/// the module docs). Shared by every layer of a model while it loads.
#[derive(Debug)]
pub struct LayoutPlanner {
    drop: [f64; 3],
    pool: std::sync::Arc<Pool>,
    kernels: Kernels,
    decisions: Mutex<Vec<LayoutDecision>>,
}

impl LayoutPlanner {
    /// A planner for a rule expected to drop `drop` of gate's, up's and down's inputs (each in
    /// `[0, 1)`), measuring on `threads` threads (the layers' count) with `tier`'s kernels.
    pub fn new(drop: [f64; 3], threads: usize, tier: Option<SimdLevel>) -> Result<Self> {
        if let Some(d) = drop.iter().find(|d| !(0.0..1.0).contains(*d)) {
            return Err(Error::config(
                "expected input sparsity",
                format!("{d} is outside [0, 1)"),
            ));
        }
        if threads == 0 {
            return Err(Error::config("threads", "must be at least 1"));
        }
        Ok(LayoutPlanner {
            drop,
            pool: Pool::shared(threads),
            kernels: Kernels::for_tier(tier)?,
            decisions: Mutex::new(Vec::new()),
        })
    }

    /// The fractions of gate's, up's and down's inputs the rule is expected to drop.
    pub fn expected_drop(&self) -> [f64; 3] {
        self.drop
    }

    /// The layouts of float weights under this planner's expectation, untimed: by column where
    /// some inputs are expected to be dropped, row-major where none are (nothing to skip).
    pub fn float_layouts(&self) -> [Layout; 3] {
        self.drop.map(|d| {
            if d > 0.0 {
                Layout::Columns
            } else {
                Layout::Rows
            }
        })
    }

    /// The decisions so far, in the order they were made.
    pub fn decisions(&self) -> Vec<LayoutDecision> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<LayoutDecision>> {
        self.decisions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The layout of `t` (`[rows, cols]`, GGUF blocks) as `which` matrix of a layer: the
    /// remembered decision for its key, or a new measurement.
    pub fn layout(
        &self,
        which: FfnMatrix,
        t: &QTensor,
        rows: usize,
        cols: usize,
    ) -> Result<Layout> {
        let (kind, data) = blocks(t, which.name(), rows, cols)?;
        let same = |d: &LayoutDecision| {
            d.matrix == which && d.kind == kind && d.rows == rows && d.cols == cols
        };
        if let Some(d) = self.lock().iter().find(|d| same(d)) {
            return Ok(d.layout);
        }
        let d = self.measure(which, kind, rows, cols, &data)?;
        tracing::info!("input-sparse layout: {d}");
        let layout = d.layout;
        self.lock().push(d);
        Ok(layout)
    }

    /// The layouts of one layer of `spec`'s shape: gate (`None` when ungated: the column
    /// layout, unused), up and down, each [`LayoutPlanner::layout`], in the order
    /// [`crate::InputSparseFfn::from_qtensors_as`] takes them.
    pub fn ffn_layouts(
        &self,
        spec: &crate::FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
    ) -> Result<[Layout; 3]> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let gate = match gate {
            Some(g) => self.layout(FfnMatrix::Gate, g, n, h)?,
            None => Layout::Columns,
        };
        Ok([
            gate,
            self.layout(FfnMatrix::Up, up, n, h)?,
            self.layout(FfnMatrix::Down, down, h, n)?,
        ])
    }

    fn measure(
        &self,
        which: FfnMatrix,
        kind: BlockKind,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<LayoutDecision> {
        let name = which.name();
        let drop = self.drop[which.index()];
        // Gate and up run in one dispatch (each thread takes a share of their chunks, one
        // matrix after the other), so they are timed that way: two matrices of the shape.
        let copies = match which {
            FfnMatrix::Down => 1,
            FfnMatrix::Gate | FfnMatrix::Up => 2,
        };
        let dense = (0..copies)
            .map(|_| Columns::rows_from_blocks(kind, rows, cols, data, name))
            .collect::<Result<Vec<_>>>()?;
        let x = input(cols, drop);
        let mut whole = Input::default();
        whole.mask(&x, None, 0.0, &dense[0]);
        let mut d = LayoutDecision {
            matrix: which,
            kind,
            rows,
            cols,
            threads: self.pool.threads(),
            kept: 1.0 - drop,
            rows_ms: 0.0,
            columns_ms: 0.0,
            rows_bytes: dense[0].dense_bytes(),
            columns_bytes: dense[0].dense_bytes(),
            layout: Layout::Rows,
        };
        let flush = Flush::default();
        if drop == 0.0 {
            d.rows_ms = self.median(&flush, &dense, &whole);
            return Ok(d);
        }
        let slab = matrix::slab_rows(rows, copies, self.pool.threads());
        let sparse = (0..copies)
            .map(|_| Columns::from_blocks(kind, rows, cols, data, name, &self.kernels, slab))
            .collect::<Result<Vec<_>>>()?;
        let mut kept = Input::default();
        kept.mask(&x, None, 0.0, &sparse[0]);
        d.columns_bytes = sparse[0].bytes_read(&kept);
        if !bytes_can_pay(d.columns_bytes, d.rows_bytes) {
            d.rows_ms = self.median(&flush, &dense, &whole);
            return Ok(d);
        }
        // Interleaved, so a drift in the machine's load moves both alike. The columns must win
        // twice: on the first REPEATS pairs, and on all of them after REPEATS more (on a shared
        // machine one stretch of 9 can be an outlier; Gemma 3's down, 1 MB, once measured its rows
        // at a third of their speed).
        let (mut tr, mut tc) = (Vec::new(), Vec::new());
        for round in 0..2 {
            for _ in 0..REPEATS {
                tr.push(self.timed(&flush, &dense, &whole));
                tc.push(self.timed(&flush, &sparse, &kept));
            }
            (d.rows_ms, d.columns_ms) = (median(tr.clone()), median(tc.clone()));
            if d.columns_ms >= MARGIN * d.rows_ms {
                return Ok(d);
            }
            if round == 1 {
                d.layout = Layout::Columns;
            }
        }
        Ok(d)
    }

    fn median(&self, flush: &Flush, ms: &[Columns], x: &Input) -> f64 {
        median((0..REPEATS).map(|_| self.timed(flush, ms, x)).collect())
    }

    /// Ms per matrix of one dispatch of the products of `ms` (one shape) over `x` on the pool,
    /// their chunks one matrix after the other, after the caches are flushed.
    fn timed(&self, flush: &Flush, ms: &[Columns], x: &Input) -> f64 {
        let per = ms.first().map_or(0, Columns::chunks);
        let mut out = vec![0f32; ms.len() * per * CHUNK];
        flush.run(&self.pool, ms);
        let t = Instant::now();
        self.pool
            .run_chunks(&mut out, ms.len() * per, CHUNK, &|r, part| {
                let mut at = 0;
                for (i, m) in ms.iter().enumerate() {
                    let (lo, hi) = (r.start.max(i * per), r.end.min((i + 1) * per));
                    if lo < hi {
                        let n = ((hi - lo) * CHUNK).min(part.len() - at);
                        m.product(
                            &self.kernels,
                            lo - i * per..hi - i * per,
                            x,
                            &mut part[at..at + n],
                        );
                        at += n;
                    }
                }
            });
        let ms_total = t.elapsed().as_secs_f64() * 1e3;
        std::hint::black_box(&out);
        ms_total / ms.len().max(1) as f64
    }
}

/// Whether a column product that reads `columns` bytes can take less than [`MARGIN`] of the
/// time of rows that read `rows`: only if it reads less than that share of their bytes. A column
/// product reads its kept bytes no faster than the dense kernel reads the rows (46-99% of its
/// GB/s in every cell measured), so a timing that says otherwise is the machine's noise:
/// Qwen2.5-1.5B's gate at 89% kept (0.9 of the rows' bytes) once timed at 0.82x its rows while
/// another job ran, and decoded 0.95x as fast as dense by column.
pub(crate) fn bytes_can_pay(columns: usize, rows: usize) -> bool {
    (columns as f64) < MARGIN * rows as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A deterministic input of `cols` nonzero values in `[-1, 1]` with a fraction `drop` of them
/// zeroed at pseudo-random places (an activation's small channels look random to the layout).
fn input(cols: usize, drop: f64) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..cols)
        .map(|_| {
            let v = (next() % 2001) as f32 / 1000.0 - 1.0 + 5e-4;
            if ((next() % 1_000_000) as f64) < drop * 1e6 {
                0.0
            } else {
                v
            }
        })
        .collect()
}

/// Before each timed product, the product's weights out of every cache, so that they come from
/// DRAM as they do in decoding: their lines flushed (`clflush` on x86-64: no memory), or on
/// other targets a buffer twice the last-level cache read by the pool's threads (allocated on
/// first use; up to 512 MiB, which a load's peak memory then includes).
#[derive(Default)]
struct Flush(std::cell::OnceCell<Vec<u64>>);

impl Flush {
    fn run(&self, pool: &Pool, ms: &[Columns]) {
        // On the pool, each thread a share of each matrix, so its threads are awake when the
        // timed product starts, as they are between a layer's products.
        let n = pool.threads();
        let evicted = std::sync::atomic::AtomicBool::new(true);
        pool.run(&|t| {
            if !ms.iter().all(|m| m.evict_share(t, n)) {
                evicted.store(false, std::sync::atomic::Ordering::Relaxed);
            }
        });
        if evicted.into_inner() {
            return;
        }
        let buf = self.0.get_or_init(|| {
            let bytes = (2 * last_level_cache()).clamp(16 << 20, 512 << 20);
            // Written (not zeroed pages shared by the kernel), so reading it fills the caches.
            (0..bytes as u64 / 8).collect()
        });
        let n = pool.threads();
        pool.run(&|t| {
            let part = &buf[crate::cpu::share(buf.len(), t, n)];
            std::hint::black_box(part.iter().fold(0u64, |a, &v| a ^ v));
        });
    }
}

/// Bytes of the largest cache Linux reports for CPU 0 (32 MiB when it reports none).
fn last_level_cache() -> usize {
    let parse = |s: &str| -> Option<usize> {
        let s = s.trim();
        let (n, mult) = match s.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (s, 1),
            },
        };
        n.parse::<usize>().ok().map(|n| n * mult)
    };
    (0..8)
        .filter_map(|i| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()
        })
        .filter_map(|s| parse(&s))
        .max()
        .unwrap_or(32 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_drop_about_the_fraction_asked() {
        for drop in [0.0, 0.21, 0.5, 0.9] {
            let x = input(4096, drop);
            let zeros = x.iter().filter(|v| **v == 0.0).count() as f64 / 4096.0;
            assert!((zeros - drop).abs() < 0.03, "{drop}: {zeros}");
        }
    }

    #[test]
    fn cache_sizes_parse() {
        assert!(last_level_cache() >= 1 << 10);
    }
}
