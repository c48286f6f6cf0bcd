//! Pictures for `analyze` and `eval`: each function takes plain numbers and writes
//! `{dir}/{stem}.png` and `{dir}/{stem}.svg` with plotters, returning both paths.
//!
//! This module owns the drawing and nothing else: it knows no model, reads no file, and never
//! panics on odd input (empty, a single layer, zeros, NaN/inf, a budget of 0): it draws what is
//! drawable, says in the picture's note what it left out, and returns an error naming the problem
//! when nothing is. Text is rasterized with ab_glyph from Noto Sans embedded in the binary
//! (`ttf-noto-sans`), registered once as every family plotters asks for, so no system font and no
//! fontconfig are needed; the SVG names the family `sans-serif` and the viewer picks the font.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;

mod frequency;
mod placement;
mod speed;
mod sweep;

use frequency::{Curves, Heatmap};
use placement::Split;
use speed::Speed;
use sweep::Sweep;

/// Frequencies below this (zeros included) are drawn at it on log axes.
const FLOOR: f64 = 1e-5;
/// Families registered with the embedded font (plotters' `FontFamily` names).
const FAMILIES: [&str; 3] = ["sans-serif", "serif", "monospace"];

/// One layer's placement: bytes of its hot neurons (fast tier) and of its cold ones (CPU).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitLayer {
    /// Bytes of the neurons placed on the fast tier (GPU).
    pub hot_bytes: u64,
    /// Bytes of the neurons left on the CPU.
    pub cold_bytes: u64,
}

/// One curve of [`sparsity_perplexity`]: points are (realized FFN sparsity in [0, 1], perplexity).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// (realized sparsity in [0, 1], perplexity) points, in any order.
    pub points: Vec<(f64, f64)>,
}

/// One bar pair of [`speed`]: a `bench` row's name and its median tok/s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpeedRow {
    /// The row's name (`dense`, `input`, `llama.cpp`, ...).
    pub name: String,
    /// Median decode tok/s.
    pub decode_tps: f64,
    /// Median prompt tok/s.
    pub prompt_tps: f64,
}

/// Decode (left axis) and prompt (right axis) tok/s per `bench` row, values on the bars, and
/// `note` (the run's settings) under the picture. Rows with a NaN or negative speed are left
/// out; an error when none is left.
pub fn speed(
    dir: &Path,
    stem: &str,
    title: &str,
    note: &str,
    rows: &[SpeedRow],
) -> Result<Vec<PathBuf>> {
    let fig = Speed::new(title, note, rows).context("speed")?;
    save(dir, stem, &fig)
}

/// Sorted activation frequency of every layer's neurons, log y: the power law.
/// `freqs[layer][neuron]` in [0, 1]; one line per layer coloured by depth.
pub fn frequency_curves(
    dir: &Path,
    stem: &str,
    title: &str,
    freqs: &[Vec<f64>],
) -> Result<Vec<PathBuf>> {
    let fig = Curves::new(title, freqs).context("frequency_curves")?;
    save(dir, stem, &fig)
}

/// Layer x neuron heat map of activation frequency (log colour scale), neurons in index order,
/// averaged over groups when a layer is wider than ~1000 columns.
pub fn frequency_heatmap(
    dir: &Path,
    stem: &str,
    title: &str,
    freqs: &[Vec<f64>],
) -> Result<Vec<PathBuf>> {
    let fig = Heatmap::new(title, freqs).context("frequency_heatmap")?;
    save(dir, stem, &fig)
}

/// Per-layer stacked bars of hot (fast tier) and cold (CPU) bytes, the cumulative fast-tier use
/// (predictor + hot bytes) against the budget, and the totals in the note.
pub fn placement_split(
    dir: &Path,
    stem: &str,
    title: &str,
    layers: &[SplitLayer],
    budget: u64,
    predictor_bytes: u64,
) -> Result<Vec<PathBuf>> {
    if layers.is_empty() {
        bail!("placement_split: no layers");
    }
    let fig = Split {
        title,
        layers,
        budget,
        predictor_bytes,
    };
    save(dir, stem, &fig)
}

/// Perplexity against realized FFN sparsity (%), one line per series, the dense model as a
/// dashed horizontal line. The y axis turns logarithmic when perplexities span more than 10x.
pub fn sparsity_perplexity(
    dir: &Path,
    stem: &str,
    title: &str,
    dense_ppl: f64,
    series: &[Series],
) -> Result<Vec<PathBuf>> {
    let x = "FFN sparsity (% of neurons skipped)";
    sweep(dir, stem, title, x, dense_ppl, series).context("sparsity_perplexity")
}

/// Perplexity against the share of FFN weight bytes skipped per token (%), one line per series
/// (points: (share in [0, 1], perplexity)), the dense model as a dashed line.
pub fn bytes_perplexity(
    dir: &Path,
    stem: &str,
    title: &str,
    x: &'static str,
    dense_ppl: f64,
    series: &[Series],
) -> Result<Vec<PathBuf>> {
    sweep(dir, stem, title, x, dense_ppl, series).context("bytes_perplexity")
}

fn sweep(
    dir: &Path,
    stem: &str,
    title: &str,
    x_desc: &'static str,
    dense_ppl: f64,
    series: &[Series],
) -> Result<Vec<PathBuf>> {
    save(dir, stem, &Sweep::new(title, x_desc, dense_ppl, series)?)
}

/// A picture that can be drawn on any backend.
trait Figure {
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static;
}

fn save(dir: &Path, stem: &str, fig: &impl Figure) -> Result<Vec<PathBuf>> {
    if stem.is_empty() || stem.contains(['/', '\\']) {
        bail!("picture name {stem:?} must be a non-empty file stem");
    }
    register_fonts()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    let size = fig.size();
    render(BitMapBackend::new(&png, size).into_drawing_area(), fig)
        .with_context(|| format!("writing {}", png.display()))?;
    render(SVGBackend::new(&svg, size).into_drawing_area(), fig)
        .with_context(|| format!("writing {}", svg.display()))?;
    Ok(vec![png, svg])
}

fn render<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, fig: &impl Figure) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    fig.draw(&root)?;
    root.present()?;
    Ok(())
}

fn register_fonts() -> Result<()> {
    static OK: OnceLock<bool> = OnceLock::new();
    let ok = *OK.get_or_init(|| {
        FAMILIES
            .iter()
            .all(|f| register_font(f, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok())
    });
    if !ok {
        bail!("the embedded Noto Sans font could not be parsed");
    }
    Ok(())
}

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().into()
}

/// Title at the top, note lines at the bottom; returns the area between.
fn frame<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    notes: &[String],
) -> Result<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    let body = root.titled(title, font(26))?;
    let h = body.dim_in_pixel().1 as i32;
    let line = 20;
    let (body, foot) = body.split_vertically(h - 10 - line * notes.len() as i32);
    for (i, note) in notes.iter().enumerate() {
        foot.draw_text(
            note,
            &font(15).color(&RGBColor(60, 60, 60)),
            (20, line * i as i32),
        )?;
    }
    Ok(body)
}

/// A vertical colour bar: `colour(t)` for t in [0, 1] over `range`, ticks through `fmt`.
fn colour_bar<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    label: &str,
    range: Range<f64>,
    colour: &dyn Fn(f64) -> RGBColor,
    fmt: &dyn Fn(&f64) -> String,
    x_label_area: u32,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let mut chart = ChartBuilder::on(area)
        .margin_top(10)
        .margin_bottom(10)
        .margin_right(10)
        .x_label_area_size(x_label_area)
        .y_label_area_size(0)
        .right_y_label_area_size(75)
        .build_cartesian_2d(0.0..1.0, range.clone())?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(6)
        .y_label_formatter(fmt)
        .y_desc(label)
        .label_style(font(14))
        .axis_desc_style(font(16))
        .draw()?;
    let steps = 200;
    let span = range.end - range.start;
    chart.draw_series((0..steps).map(|i| {
        let t0 = i as f64 / steps as f64;
        let t1 = (i + 1) as f64 / steps as f64;
        let y0 = range.start + span * t0;
        let y1 = range.start + span * t1;
        Rectangle::new([(0.0, y0), (1.0, y1)], colour((t0 + t1) / 2.0).filled())
    }))?;
    Ok(())
}

fn viridis(t: f64) -> RGBColor {
    ViridisRGB::get_color(t.clamp(0.0, 1.0))
}

/// `0.05`, `0.5`, `1`, `1e-4`: short labels for frequencies.
fn fmt_frequency(v: f64) -> String {
    if v >= 1e-3 {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.0e}")
    }
}

/// Tick labels on a log axis: every decade, and 2x and 5x as well when the axis spans at most
/// three decades; other ticks stay unlabelled (minor ticks).
fn log_label(v: f64, range: &Range<f64>, fmt: impl Fn(f64) -> String) -> String {
    let few = (range.end / range.start).log10() <= 3.0;
    let mantissa = v / 10f64.powf(v.log10().floor());
    let near = |k: f64| (mantissa - k).abs() < 1e-6 * k;
    if near(1.0) || near(10.0) || (few && (near(2.0) || near(5.0))) {
        fmt(v)
    } else {
        String::new()
    }
}

/// `5`, `2.5`: one decimal at most.
fn fmt_short(v: f64) -> String {
    let s = format!("{v:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

/// Ticks asked of plotters on a log axis, so that it places 2x..9x minor ticks.
const LOG_TICKS: usize = 60;

/// An integer label only at integer ticks (layers, ranks).
fn fmt_integer(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{:.0}", v.round())
    } else {
        String::new()
    }
}

/// 10^floor(log10(v)), at least [`FLOOR`].
fn decade_below(v: f64) -> f64 {
    if v.is_finite() && v > FLOOR {
        10f64.powf(v.log10().floor())
    } else {
        FLOOR
    }
}
