//! `powerinfer bench`: prompt and decode speed of every mode in the same run, with where decode
//! time goes and the floor memory bandwidth puts under it; optionally llama.cpp as a peer.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use powerinfer::cpu::ReadBandwidth;
use powerinfer_candle::{FfnMode, Llama, Timings};

use crate::args::{BenchMode, Peer, SparseMode};
use crate::common::{corpus_tokens, load, load_sparse, model_path, SparseSettings};
use crate::output::say;
use crate::plots::SpeedRow;
use crate::BenchArgs;

/// One measured mode.
struct Row {
    mode: String,
    prompt_tps: f64,
    decode_tps: f64,
    /// The slowest and the fastest run's decode tok/s (the spread around `decode_tps`).
    decode_range: (f64, f64),
    /// Per-component decode times over all runs (our model only).
    per_token: Option<Timings>,
    /// Mean decode time per token over all runs, ms (our model only; what the components sum to).
    measured_ms: Option<f64>,
    /// Bytes one decoded token reads (our model only).
    bytes: Option<f64>,
    /// Realized FFN sparsity (sparse modes).
    sparsity: Option<f64>,
    /// Share of the FFN weight bytes not read per decoded token (`dense`/`all`: 0; `input`:
    /// measured).
    ffn_bytes_skipped: Option<f64>,
    /// The same for the attention projections (`input` on GGUF files).
    attention_bytes_skipped: Option<f64>,
    /// The rule and its setting (`input`).
    rule: Option<String>,
    /// This process's peak resident bytes while the row loaded and ran (Linux).
    peak: Option<u64>,
}

impl Row {
    /// A peer engine's row: medians of its prompt and decode samples, nothing else known.
    fn peer(mode: &str, prompt: Vec<f64>, decode: Vec<f64>) -> Row {
        Row {
            mode: mode.to_string(),
            prompt_tps: median(prompt),
            decode_range: range(&decode),
            decode_tps: median(decode),
            per_token: None,
            measured_ms: None,
            bytes: None,
            sparsity: None,
            ffn_bytes_skipped: None,
            attention_bytes_skipped: None,
            rule: None,
            peak: None,
        }
    }
}

/// Ends a row's memory window: the rows not yet given a peak get this process's peak resident
/// bytes since the last call, the memory the row freed goes back to the system, and the peak
/// starts again from what is resident now (the next row's load on top of the run's own
/// buffers, the tokenizer and text among them).
fn mark(rows: &mut [Row]) {
    let peak = crate::memory::peak_bytes();
    for r in rows.iter_mut().filter(|r| r.peak.is_none()) {
        r.peak = peak;
    }
    powerinfer::cpu::release_freed_memory();
    crate::memory::reset_peak();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// The smallest and the largest sample.
fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

fn argmax(v: &[f32]) -> u32 {
    let best = v
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
            if x > b.1 {
                (i, x)
            } else {
                b
            }
        });
    best.0 as u32
}

/// candle-transformers' quantized model for a GGUF file's `general.architecture`.
enum CandleModel {
    Llama(candle_transformers::models::quantized_llama::ModelWeights),
    Qwen2(candle_transformers::models::quantized_qwen2::ModelWeights),
    Gemma3(candle_transformers::models::quantized_gemma3::ModelWeights),
}

impl CandleModel {
    fn load(path: &std::path::Path, dev: &candle_core::Device) -> Result<Self> {
        use candle_transformers::models::{quantized_gemma3, quantized_llama, quantized_qwen2};
        let mut f = std::fs::File::open(path)
            .with_context(|| format!("candle row: opening {}", path.display()))?;
        let ct = candle_core::quantized::gguf_file::Content::read(&mut f)?;
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        Ok(match arch.as_str() {
            "llama" | "mistral" => {
                CandleModel::Llama(quantized_llama::ModelWeights::from_gguf(ct, &mut f, dev)?)
            }
            "qwen2" => {
                CandleModel::Qwen2(quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, dev)?)
            }
            "gemma3" => {
                CandleModel::Gemma3(quantized_gemma3::ModelWeights::from_gguf(ct, &mut f, dev)?)
            }
            other => bail!(
                "candle row: {} is a `{other}` file; candle-transformers' quantized llama, qwen2 \
                 and gemma3 models are measured",
                path.display()
            ),
        })
    }

    /// The last position's logits, `[1, vocab]`.
    fn forward(&mut self, x: &candle_core::Tensor, pos: usize) -> Result<candle_core::Tensor> {
        Ok(match self {
            CandleModel::Llama(m) => m.forward(x, pos)?,
            CandleModel::Qwen2(m) => m.forward(x, pos)?,
            CandleModel::Gemma3(m) => m.forward(x, pos)?,
        })
    }
}

/// The peer: candle-transformers' quantized model of the file's architecture (`quantized_llama`,
/// `quantized_qwen2`, `quantized_gemma3`) on the same GGUF file and prompt.
fn measure_candle(
    path: &std::path::Path,
    prompt: &[u32],
    decode: usize,
    runs: usize,
) -> Result<Row> {
    let dev = candle_core::Device::Cpu;
    let mut m = CandleModel::load(path, &dev)?;
    let (mut p, mut d) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let x = candle_core::Tensor::new(prompt, &dev)?.unsqueeze(0)?;
        let logits = m.forward(&x, 0)?.squeeze(0)?;
        p.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        let mut next = argmax(&logits.to_vec1::<f32>()?);
        let t = Instant::now();
        for i in 0..decode {
            let x = candle_core::Tensor::new(&[next], &dev)?.unsqueeze(0)?;
            next = argmax(
                &m.forward(&x, prompt.len() + i)?
                    .squeeze(0)?
                    .to_vec1::<f32>()?,
            );
        }
        d.push(decode as f64 / t.elapsed().as_secs_f64());
    }
    Ok(Row::peer("candle", p, d))
}

/// Prompt and decode tok/s of our model (medians over `runs`), with per-component decode times
/// and the mean decode time, both over all runs. Decode goes through [`Llama::forward_logits`],
/// as a serving loop would.
fn measure(
    model: &mut Llama,
    prompt: &[u32],
    decode: usize,
    runs: usize,
    mode: &str,
) -> Result<Row> {
    let (mut p, mut d) = (Vec::new(), Vec::new());
    let mut per_token = Timings::default();
    let mut decode_time = std::time::Duration::ZERO;
    model.reserve_kv_cache(prompt.len() + decode);
    for _ in 0..runs {
        model.clear_kv_cache();
        let t = Instant::now();
        let logits = model.forward_logits(prompt, 0)?;
        let mut next = argmax(logits);
        p.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        model.enable_timings();
        let mut sampling = std::time::Duration::ZERO;
        let t = Instant::now();
        for i in 0..decode {
            let logits = model.forward_logits(&[next], prompt.len() + i)?;
            let s = Instant::now();
            next = argmax(logits);
            sampling += s.elapsed();
        }
        let elapsed = t.elapsed();
        decode_time += elapsed;
        d.push(decode as f64 / elapsed.as_secs_f64());
        // Every run's components, to compare with every run's time (`measured`).
        if let Some(tm) = model.timings() {
            per_token.attention += tm.attention;
            per_token.ffn += tm.ffn;
            per_token.lm_head += tm.lm_head;
            // Choosing the next token is part of a decode step: counted with `other`.
            per_token.other += tm.other + sampling;
            per_token.calls += tm.calls;
        }
    }
    let positions = prompt.len() + decode / 2;
    Ok(Row {
        mode: mode.to_string(),
        prompt_tps: median(p),
        decode_range: range(&d),
        decode_tps: median(d),
        measured_ms: Some(decode_time.as_secs_f64() * 1e3 / (runs * decode) as f64),
        per_token: Some(per_token),
        bytes: Some(model.decode_bytes().per_token(positions, 0.0)),
        sparsity: None,
        ffn_bytes_skipped: (mode == "dense" || mode == "all").then_some(0.0),
        attention_bytes_skipped: (mode == "dense" || mode == "all").then_some(0.0),
        rule: None,
        peak: None,
    })
}

/// llama.cpp's `llama-bench` on the same file, threads and lengths, through
/// `scripts/llama-bench.sh` (which builds it on first use): prompt and decode tok/s samples.
fn measure_llama_cpp(
    path: &std::path::Path,
    threads: usize,
    prompt: usize,
    decode: usize,
    runs: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let script = std::env::var_os("POWERINFER_LLAMA_BENCH")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/llama-bench.sh")
        });
    if !script.is_file() {
        bail!(
            "--peer llama.cpp: {} not found (set POWERINFER_LLAMA_BENCH to the script)",
            script.display()
        );
    }
    let out = Command::new("bash")
        .arg(&script)
        .args(["run", &path.display().to_string()])
        .args([threads, prompt, decode, runs].map(|v| v.to_string()))
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (mut p, mut d) = (Vec::new(), Vec::new());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("llama-bench output line `{line}`"))?;
        let samples: Vec<f64> = v["samples_ts"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        if v["n_gen"].as_u64().unwrap_or(0) > 0 {
            d.extend(samples);
        } else {
            p.extend(samples);
        }
    }
    if p.is_empty() || d.is_empty() {
        bail!("llama-bench printed no prompt or no decode result");
    }
    Ok((p, d))
}

pub(crate) fn run(a: &BenchArgs) -> Result<()> {
    if a.runs == 0 || a.decode_tokens == 0 || a.prompt_tokens == 0 {
        bail!("--runs, --decode-tokens and --prompt-tokens must be at least 1");
    }
    if let Some(png) = a
        .plot
        .as_ref()
        .filter(|p| p.extension().is_none_or(|e| e != "png"))
    {
        bail!("--plot {}: give a file name ending in .png", png.display());
    }
    let peer = a.peer == Some(Peer::LlamaCpp);
    // Rows asked for by name must run; of the default set (every row), those the file cannot
    // run are skipped with the reason.
    let named = !a.modes.is_empty();
    let want = |m: BenchMode| !named || a.modes.contains(&m);
    let skipped = |row: &str, e: anyhow::Error| -> Result<()> {
        if named {
            return Err(e);
        }
        eprintln!("no `{row}` row: {e:#}");
        Ok(())
    };
    let settings = SparseSettings::from_args(&a.model)?;
    let threads = settings.threads;
    // candle's ops (the reference and candle rows) use rayon, sized by RAYON_NUM_THREADS: give them
    // the same thread count as ours (before the first candle op starts rayon's pool).
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    let path = model_path(&a.model.model)?;
    let gguf = path.extension().is_some_and(|e| e == "gguf");
    // The read bandwidth at the start and at the end of the run: the better of the two sets the
    // floor (the stricter one when the machine's load moves during the run).
    let bw_start = powerinfer::cpu::read_bandwidth(threads);
    let mut lcpp = (Vec::new(), Vec::new());
    let peer_run = |lcpp: &mut (Vec<f64>, Vec<f64>)| -> Result<()> {
        if peer && gguf {
            let (p, d) =
                measure_llama_cpp(&path, threads, a.prompt_tokens, a.decode_tokens, a.runs)?;
            lcpp.0.extend(p);
            lcpp.1.extend(d);
        }
        Ok(())
    };
    // llama.cpp before and after our rows: both halves of the run see the same machine.
    peer_run(&mut lcpp)?;

    let tok = powerinfer_candle::TextTokenizer::open(&path)?;
    let prompt = corpus_tokens(&tok, 2000..=2021, a.prompt_tokens)?;
    let mut rows = Vec::new();
    mark(&mut rows);
    // candle-transformers' `quantized_llama` (llama files only).
    if gguf && want(BenchMode::Candle) {
        match measure_candle(&path, &prompt, a.decode_tokens, a.runs) {
            Ok(r) => rows.push(r),
            Err(e) => skipped("candle", e)?,
        }
    }
    mark(&mut rows);
    // candle's ops around our model code (llama, mistral and qwen2 files; Gemma 3 runs on the
    // fused decoder only).
    if want(BenchMode::Reference) {
        match load(&path, &FfnMode::Dense) {
            Ok(mut reference) => rows.push(measure(
                &mut reference.model,
                &prompt,
                a.decode_tokens,
                a.runs,
                "reference",
            )?),
            Err(e) => skipped("reference", e)?,
        }
    }
    mark(&mut rows);
    // The dense FFN on our kernels and decoder (GGUF with Q4_0/Q4_1/Q8_0 projections only).
    if gguf && want(BenchMode::Dense) {
        match load(&path, &FfnMode::Fused { threads }) {
            Ok(mut dense) => {
                rows.push(measure(
                    &mut dense.model,
                    &prompt,
                    a.decode_tokens,
                    a.runs,
                    "dense",
                )?);
            }
            Err(e) => eprintln!("no `dense` row: {e:#}"),
        }
    }
    mark(&mut rows);
    // Every neuron through the sparse FFN's kernels: what the kernels cost before skipping.
    // A file whose FFN blocks the sparse layouts do not hold (K-quants, Q5) has no such rows:
    // the reason is printed and the run goes on.
    let mut fused = true;
    if want(BenchMode::All) {
        match load(&path, &settings.hybrid_ffn_mode()) {
            Ok(mut all) => {
                rows.push(measure(
                    &mut all.model,
                    &prompt,
                    a.decode_tokens,
                    a.runs,
                    "all",
                )?);
                fused = all.model.is_fused();
            }
            Err(e) => skipped("all", e)?,
        }
    }
    mark(&mut rows);
    // The neuron-major sparse rows: exact thresholding, and the predictors where an artifact is
    // given (or they are named, which without one is an error).
    let predictors =
        a.modes.contains(&BenchMode::Predictors) || (!named && settings.artifact.is_some());
    if want(BenchMode::GateFirst) || predictors {
        let which = [want(BenchMode::GateFirst), predictors];
        let row = if which[0] { "gate-first" } else { "predictors" };
        match measure_sparse(&path, &settings, &prompt, a, &mut rows, which) {
            Ok(f) => fused &= f,
            Err(e) => skipped(row, e)?,
        }
    }
    mark(&mut rows);
    if gguf && want(BenchMode::Input) {
        match measure_input(&path, &settings, &prompt, a) {
            Ok(r) => rows.push(r),
            Err(e) => skipped("input", e)?,
        }
    }
    mark(&mut rows);
    let mut notes = Vec::new();
    if !a.vram_budget.is_empty() && (want(BenchMode::GateFirst) || predictors) {
        measure_tiers(&path, &settings, &prompt, a, &mut rows, &mut notes)?;
    }
    if !a.vram_budget.is_empty() && gguf && want(BenchMode::Input) {
        measure_hot(&path, &settings, &prompt, a, &mut rows, &mut notes)?;
    }
    peer_run(&mut lcpp)?;
    let bw_end = powerinfer::cpu::read_bandwidth(threads);
    // The rows have run: a config that cannot be read again only leaves the KV term out.
    let config = powerinfer_candle::read_config(&path);
    let positions = prompt.len() + a.decode_tokens;
    let info = RunInfo {
        file_bytes: crate::memory::file_bytes(&path),
        kv_bytes: config.map_or(0, |c| crate::memory::kv_bytes(&c, positions)),
        bw: [bw_start, bw_end],
        threads,
        prompt_tokens: prompt.len(),
        args: a,
        fused,
        model: &path,
    };
    print_table(rows, (peer && gguf).then_some(lcpp), &info)?;
    for n in notes {
        say!("{n}");
    }
    Ok(())
}

/// The sparse model with a fast tier in every layer, one row per `--vram-budget`, and a note per
/// row with the placement and what the tiers did per decoded token.
fn measure_tiers(
    path: &std::path::Path,
    settings: &SparseSettings,
    prompt: &[u32],
    a: &BenchArgs,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) -> Result<()> {
    // An artifact's predictors where one is given, else exact thresholding.
    let mode = match settings.artifact {
        Some(_) => SparseMode::Predictors,
        None => SparseMode::GateFirst,
    };
    let settings = &SparseSettings {
        mode,
        ..settings.clone()
    };
    let mut sp = load_sparse(path, settings)?;
    let freq = match &sp.artifact {
        Some(art) => art
            .layers
            .iter()
            .map(|l| l.counts.iter().map(|&c| f64::from(c)).collect())
            .collect(),
        None => {
            let calib = corpus_tokens(&sp.m.tok, 1790..=1999, 1024)?;
            sp.m.model.neuron_frequencies(&calib, 256)?
        }
    };
    let ffn_bytes = sp.m.model.full_tier_bytes(a.tier.0, &a.force_dense_layers);
    for b in &a.vram_budget {
        let budget = b.bytes(ffn_bytes);
        let label = format!("tier {b}");
        if budget == 0 {
            // No tier: every layer on the CPU, as the `gate-first` row, measured again here.
            sp.m.model.detach_tiers();
        } else {
            let opts = powerinfer_candle::TierOptions {
                budget,
                cache_share: a.cache,
                cache_window: a.cache_window,
                force_dense_layers: a.force_dense_layers.clone(),
                prefetch_depth: a.prefetch_depth,
                kind: a.tier.0,
            };
            let r = sp.m.model.attach_tiers(&opts, &freq)?;
            notes.push(format!(
                "{label} ({}): budget {:.2} MB of {:.2} MB FFN bytes, reserved {:.2} MB: {} hot neurons, {} cache slots{}",
                r.tier,
                budget as f64 / 1e6,
                ffn_bytes as f64 / 1e6,
                r.reserved as f64 / 1e6,
                r.hot_neurons,
                r.cache_slots,
                r.fallback.map_or(String::new(), |f| format!("; on the CPU: {f}"))
            ));
        }
        let mut row = measure(&mut sp.m.model, prompt, a.decode_tokens, a.runs, &label)?;
        add_sparsity(&mut row, &mut sp.m.model, prompt, a)?;
        rows.push(row);
        mark(rows);
        // What the tiers did per decoded token, on one more decode.
        sp.m.model.clear_kv_cache();
        let mut next = argmax(sp.m.model.forward_logits(prompt, 0)?);
        sp.m.model.take_tier_counters();
        for i in 0..a.decode_tokens {
            next = argmax(sp.m.model.forward_logits(&[next], prompt.len() + i)?);
        }
        let c = sp.m.model.take_tier_counters();
        if budget > 0 {
            let per = |v: u64| v as f64 / a.decode_tokens as f64;
            let looked = c.hits + c.misses;
            notes.push(format!(
                "{label}: per decoded token {:.0} neurons on the tier, cache hits {:.0} / misses {:.0} ({:.1}% hit rate), {:.1} KB copied ({:.0} neurons prefetched)",
                per(c.neurons),
                per(c.hits),
                per(c.misses),
                if looked > 0 { 100.0 * c.hits as f64 / looked as f64 } else { 0.0 },
                per(c.bytes_copied) / 1e3,
                per(c.prefetched)
            ));
        }
    }
    Ok(())
}

/// The default sparse mode with FFN neurons on the `--tier` device, two rows per
/// `--vram-budget`: `split B`, whole layers' FFNs on the device from the first layer on and the
/// others on our dense decoder (the layer split users run today), and `hybrid B`, every layer's
/// most active neurons on the device and the others under the input rule on the CPU. The
/// rows' bytes are what the CPU reads (the model's less the device's). Attention stays on the
/// CPU in both.
fn measure_hot(
    path: &std::path::Path,
    settings: &SparseSettings,
    prompt: &[u32],
    a: &BenchArgs,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) -> Result<()> {
    use powerinfer_candle::HotPlacement;
    if let Err(e) = powerinfer_candle::hot_device(a.tier.0) {
        notes.push(format!(
            "no `split`/`hybrid` rows: device `{}`: {e}",
            a.tier
        ));
        return Ok(());
    }
    let scores = crate::input::neuron_scores(path, settings.threads)?;
    for b in &a.vram_budget {
        for placement in [HotPlacement::LayerSplit, HotPlacement::Hybrid] {
            let (mut m, rule) = match placement {
                HotPlacement::LayerSplit => {
                    let layouts = crate::input::dense_layouts();
                    let m = crate::input::load_input(path, settings.threads, false, layouts)?;
                    (m, "dense".to_string())
                }
                HotPlacement::Hybrid => {
                    let sm = crate::input::load_rule(path, settings)?;
                    (sm.m, sm.label)
                }
            };
            let r = crate::input::place_hot_with(&mut m, path, &scores, *b, placement, a.tier)?;
            // The layer split's CPU layers run the dense decoder's FFN.
            m.model.run_rows_dense()?;
            let label = match placement {
                HotPlacement::LayerSplit => format!("split {b}"),
                HotPlacement::Hybrid => format!("hybrid {b}"),
            };
            let mut row = measure(&mut m.model, prompt, a.decode_tokens, a.runs, &label)?;
            row.bytes = row.bytes.map(|v| (v - r.bytes as f64).max(0.0));
            row.rule = Some(rule);
            notes.push(format!(
                "{label} ({placement} on {}): {:.1} MB of {:.1} MB FFN bytes on the device, {:.1}% of the neurons, {} of {} layers with neurons there",
                a.tier,
                r.bytes as f64 / 1e6,
                r.ffn_bytes as f64 / 1e6,
                100.0 * r.neuron_share(m.model.config().intermediate),
                r.neurons.iter().filter(|&&n| n > 0).count(),
                r.neurons.len()
            ));
            rows.push(row);
            drop(m);
            mark(rows);
        }
    }
    Ok(())
}

/// The neuron-major sparse rows, `[gate-first, predictors]` as `which` asks (the predictors
/// need an artifact), with their realized sparsity; whether they ran on the fused decoder.
fn measure_sparse(
    path: &std::path::Path,
    settings: &SparseSettings,
    prompt: &[u32],
    a: &BenchArgs,
    rows: &mut Vec<Row>,
    which: [bool; 2],
) -> Result<bool> {
    if which[1] && settings.artifact.is_none() {
        bail!("the `predictors` row needs --powerinfer ARTIFACT");
    }
    // Exact thresholding at the artifact's |h| thresholds (or calibrated ones), then its trained
    // predictors.
    let mut sp = load_sparse(path, settings)?;
    for (mode, run) in [SparseMode::GateFirst, SparseMode::Predictors]
        .into_iter()
        .zip(which)
    {
        if !run {
            continue;
        }
        if mode == SparseMode::Predictors {
            sp.use_trained(settings.target)?;
        }
        let mut row = measure(
            &mut sp.m.model,
            prompt,
            a.decode_tokens,
            a.runs,
            mode.name(),
        )?;
        add_sparsity(&mut row, &mut sp.m.model, prompt, a)?;
        rows.push(row);
    }
    Ok(sp.m.model.is_fused())
}

/// Realized sparsity on the prompt, counted after the timed runs, and the bytes a decoded
/// token reads at that sparsity.
fn add_sparsity(row: &mut Row, model: &mut Llama, prompt: &[u32], a: &BenchArgs) -> Result<()> {
    model.enable_ffn_stats();
    model.clear_kv_cache();
    model.forward_logits(prompt, 0)?;
    let s = crate::common::mean_sparsity(model);
    row.sparsity = Some(s);
    let positions = prompt.len() + a.decode_tokens / 2;
    row.bytes = Some(model.decode_bytes().per_token(positions, s));
    Ok(())
}

/// Which FFN matrices run input-sparse (stored by column) in how many layers; the others run
/// as dense rows because their sparse product measured slower.
pub(crate) fn layout_summary(model: &powerinfer_candle::Llama) -> String {
    let c = model.ffn_layout_counts();
    let parts: Vec<String> = ["gate", "up", "down"]
        .iter()
        .zip(c)
        .map(|(n, (cols, rows))| format!("{n} {cols}/{}", cols + rows))
        .collect();
    format!("sparse in {} layers", parts.join(", "))
}

/// The input-sparse FFN at the default rule (calibrated on speeches up to 1999), with the
/// share of FFN weight bytes it skipped per decoded token, measured on one more decode.
fn measure_input(
    path: &std::path::Path,
    settings: &SparseSettings,
    prompt: &[u32],
    a: &BenchArgs,
) -> Result<Row> {
    let crate::input::SparseModel { mut m, label, .. } = crate::input::load_rule(path, settings)?;
    for d in m.model.layout_decisions() {
        say!("input layout: {d}");
    }
    let mut row = measure(&mut m.model, prompt, a.decode_tokens, a.runs, "input")?;
    row.rule = Some(format!("{label}; {}", layout_summary(&m.model)));
    m.model.clear_kv_cache();
    let mut next = argmax(m.model.forward_logits(prompt, 0)?);
    m.model.take_ffn_traffic();
    m.model.take_attention_traffic();
    for i in 0..a.decode_tokens {
        next = argmax(m.model.forward_logits(&[next], prompt.len() + i)?);
    }
    let skipped = m.model.take_ffn_traffic().skipped();
    let attention = m.model.take_attention_traffic().skipped();
    let db = m.model.decode_bytes();
    let ffn = (db.ffn_gate_up + db.ffn_down) as f64;
    row.bytes = row
        .bytes
        .map(|b| b - ffn * skipped - db.attention as f64 * attention);
    row.ffn_bytes_skipped = Some(skipped);
    row.attention_bytes_skipped = Some(attention);
    Ok(row)
}

/// What the table says about the run besides its rows.
struct RunInfo<'a> {
    /// Read bandwidth at the start and at the end of the run.
    bw: [ReadBandwidth; 2],
    threads: usize,
    prompt_tokens: usize,
    args: &'a BenchArgs,
    /// Whether the sparse rows ran on the fused decoder.
    fused: bool,
    /// The model file.
    model: &'a std::path::Path,
    /// Its bytes on disk.
    file_bytes: u64,
    /// The f32 KV cache of the run's positions (prompt and decode).
    kv_bytes: u64,
}

/// Adds the peer's row (llama.cpp's samples from both halves of the run, if it ran) and prints.
fn print_table(
    mut rows: Vec<Row>,
    lcpp: Option<(Vec<f64>, Vec<f64>)>,
    info: &RunInfo,
) -> Result<()> {
    if let Some((p, d)) = lcpp {
        rows.insert(0, Row::peer("llama.cpp", p, d));
    }
    let RunInfo {
        bw: [bw_start, bw_end],
        threads,
        prompt_tokens,
        args: a,
        fused,
        model,
        file_bytes,
        kv_bytes,
    } = *info;
    let floor_mem = (file_bytes + kv_bytes) as f64;
    let bw = bw_start.best().max(bw_end.best());
    say!(
        "{threads} thread(s), prompt {} tokens, decode {} tokens, medians of {} runs; read bandwidth {bw:.1} GB/s",
        prompt_tokens,
        a.decode_tokens,
        a.runs
    );
    say!(
        "  (GB/s at the start and at the end: plain sum {:.1} and {:.1}, prefetching sum {:.1} and {:.1})",
        bw_start.plain, bw_end.plain, bw_start.prefetching, bw_end.prefetching
    );
    say!(
        "{:<9} {:>9} {:>9} {:>11} | decode ms/token: {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} | {:>7} {:>8} | {:>7} {:>5}",
        "mode",
        "prompt/s",
        "decode/s",
        "min-max",
        "attn",
        "ffn",
        "head",
        "other",
        "sum",
        "measured",
        "MB/tok",
        "floor ms",
        "peak MB",
        "x mem"
    );
    for r in &rows {
        let measured = r.measured_ms.unwrap_or(1e3 / r.decode_tps);
        let (cols, sum) = match &r.per_token {
            Some(t) => {
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.calls.max(1) as f64;
                let parts = [ms(t.attention), ms(t.ffn), ms(t.lm_head), ms(t.other)];
                let sum: f64 = parts.iter().sum();
                (
                    format!(
                        "{:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3}",
                        parts[0], parts[1], parts[2], parts[3], sum
                    ),
                    Some(sum),
                )
            }
            None => (format!("{:>34}", ""), None),
        };
        let floor = r.bytes.map(|b| b / bw / 1e6);
        say!(
            "{:<9} {:>9.1} {:>9.1} {:>11} |                  {cols} {:>8.3} | {:>7} {:>8} | {:>7} {:>5}",
            r.mode,
            r.prompt_tps,
            r.decode_tps,
            format!("{:.1}-{:.1}", r.decode_range.0, r.decode_range.1),
            measured,
            r.bytes.map_or(String::new(), |b| format!("{:.1}", b / 1e6)),
            floor.map_or(String::new(), |f| format!("{f:.3}")),
            r.peak.map_or(String::new(), |p| format!("{:.0}", p as f64 / 1e6)),
            r.peak.map_or(String::new(), |p| format!("{:.2}", p as f64 / floor_mem)),
        );
        let t = r.per_token.as_ref();
        crate::output::record(serde_json::json!({
            "mode": r.mode, "threads": threads, "prompt_tokens": prompt_tokens,
            "decode_tokens": a.decode_tokens, "prompt_tps": r.prompt_tps,
            "decode_tps": r.decode_tps,
            "decode_tps_min": r.decode_range.0, "decode_tps_max": r.decode_range.1,
            "measured_ms": measured, "sum_ms": sum,
            "ms_per_token": t.map(|t| {
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.calls.max(1) as f64;
                serde_json::json!({"attention": ms(t.attention), "ffn": ms(t.ffn),
                    "lm_head": ms(t.lm_head), "other": ms(t.other)})
            }),
            "bytes_per_token": r.bytes, "floor_ms": floor, "read_bandwidth_gbs": bw,
            "realized_sparsity": r.sparsity, "ffn_bytes_skipped": r.ffn_bytes_skipped,
            "attention_bytes_skipped": r.attention_bytes_skipped, "rule": r.rule,
            "peak_rss_bytes": r.peak, "file_bytes": file_bytes, "kv_cache_bytes": kv_bytes,
        }));
    }
    say!(
        "memory: peak MB is this process's peak resident memory while a row loaded and ran; x mem is it over the file ({:.1} MB) and an f32 KV cache of the run's {} positions ({:.1} MB)",
        file_bytes as f64 / 1e6,
        prompt_tokens + a.decode_tokens,
        kv_bytes as f64 / 1e6
    );
    let find = |m: &str| rows.iter().find(|r| r.mode == m);
    if let Some(s) = find("gate-first").and_then(|r| r.sparsity) {
        say!("gate-first: realized FFN sparsity {:.1}%", s * 100.0);
    }
    if let Some(r) = find("input") {
        say!(
            "input ({}): {:.1}% of the FFN weight bytes and {:.1}% of the attention projections' skipped per decoded token",
            r.rule.as_deref().unwrap_or("?"),
            r.ffn_bytes_skipped.unwrap_or(0.0) * 100.0,
            r.attention_bytes_skipped.unwrap_or(0.0) * 100.0
        );
    }
    if !fused {
        say!("note: this model's projections are not all Q4_0/Q4_1/Q8_0: `all`, `gate-first` and `predictors` run on candle ops");
    }
    for base in ["llama.cpp", "candle", "reference"] {
        let Some(b) = find(base) else { continue };
        let ratios: Vec<String> = ["dense", "all", "gate-first", "predictors", "input"]
            .iter()
            .filter_map(|m| find(m))
            .map(|r| {
                format!(
                    "{} {:.2}x/{:.2}x",
                    r.mode,
                    r.decode_tps / b.decode_tps,
                    r.prompt_tps / b.prompt_tps
                )
            })
            .collect();
        say!("vs {base} (decode/prompt): {}", ratios.join(", "));
    }
    if let Some(png) = &a.plot {
        let note = format!(
            "{threads} thread(s), prompt {prompt_tokens} tokens, decode {} tokens, medians of {} runs, read bandwidth {bw:.1} GB/s",
            a.decode_tokens, a.runs
        );
        let name = model
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let bars: Vec<SpeedRow> = rows
            .iter()
            .map(|r| SpeedRow {
                name: r.mode.clone(),
                decode_tps: r.decode_tps,
                prompt_tps: r.prompt_tps,
            })
            .collect();
        // `run` checked the name; the `.svg` goes beside it, under the same stem.
        let (dir, stem) = crate::analyze::picture_stem(png);
        let files =
            crate::plots::speed(&dir, &stem, &format!("{name}: tok/s per row"), &note, &bars)?;
        for f in files {
            say!("picture: {}", f.display());
        }
    }
    Ok(())
}
