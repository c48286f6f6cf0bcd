//! The activation-frequency pictures: sorted curves per layer and the layer x neuron heat map.

use anyhow::{bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{
    colour_bar, decade_below, fmt_frequency, fmt_integer, font, frame, viridis, Figure, FLOOR,
};

/// At most this many points per curve; sorted curves are monotone, so a subset loses nothing.
const MAX_POINTS: usize = 1000;
/// At most this many heat-map columns; wider layers are averaged over groups of neurons.
const MAX_COLUMNS: usize = 1000;
const MISSING: RGBColor = RGBColor(200, 200, 200);

/// What was skipped or clamped in the input, for the note.
#[derive(Default)]
struct Cleanup {
    non_finite: usize,
    out_of_range: usize,
}

impl Cleanup {
    /// A finite frequency clamped to [0, 1], or None.
    fn frequency(&mut self, v: f64) -> Option<f64> {
        if !v.is_finite() {
            self.non_finite += 1;
            return None;
        }
        if !(0.0..=1.0).contains(&v) {
            self.out_of_range += 1;
        }
        Some(v.clamp(0.0, 1.0))
    }

    fn note(&self) -> Option<String> {
        let mut parts = vec![];
        if self.non_finite > 0 {
            parts.push(format!("{} NaN/inf values skipped", self.non_finite));
        }
        if self.out_of_range > 0 {
            parts.push(format!(
                "{} values outside [0, 1] clamped",
                self.out_of_range
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

fn check_freqs(freqs: &[Vec<f64>]) -> Result<usize> {
    if freqs.is_empty() {
        bail!("no layers");
    }
    let width = freqs.iter().map(Vec::len).max().unwrap_or(0);
    if width == 0 {
        bail!("{} layers but no neurons", freqs.len());
    }
    Ok(width)
}

pub(super) struct Curves<'a> {
    title: &'a str,
    /// Per layer: (rank from 1, frequency clamped to [FLOOR, 1]).
    lines: Vec<Vec<(f64, f64)>>,
    width: usize,
    y_low: f64,
    notes: Vec<String>,
}

impl<'a> Curves<'a> {
    pub(super) fn new(title: &'a str, freqs: &[Vec<f64>]) -> Result<Self> {
        let width = check_freqs(freqs)?;
        let mut clean = Cleanup::default();
        let mut low = f64::INFINITY;
        let lines = freqs
            .iter()
            .map(|layer| {
                let mut v: Vec<f64> = layer.iter().filter_map(|&x| clean.frequency(x)).collect();
                v.sort_by(|a, b| b.total_cmp(a));
                if let Some(&m) = v.last() {
                    low = low.min(m.max(FLOOR));
                }
                let n = v.len();
                let pick = |i: usize| ((i + 1) as f64, v[i].max(FLOOR));
                if n <= MAX_POINTS {
                    (0..n).map(pick).collect()
                } else {
                    (0..MAX_POINTS)
                        .map(|k| pick(k * (n - 1) / (MAX_POINTS - 1)))
                        .collect()
                }
            })
            .collect();
        let mut notes = vec![format!(
            "Each layer's neurons sorted by activation frequency. Zeros (and values below {}) are drawn at {}.",
            fmt_frequency(FLOOR),
            fmt_frequency(FLOOR)
        )];
        notes.extend(clean.note());
        Ok(Self {
            title,
            lines,
            width,
            y_low: decade_below(low).min(0.1),
            notes,
        })
    }
}

impl Figure for Curves<'_> {
    fn size(&self) -> (u32, u32) {
        (1000, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let body = frame(root, self.title, &self.notes)?;
        let w = body.dim_in_pixel().0;
        let (plot, bar) = body.split_horizontally(w - 130);
        let last = self.lines.len() - 1;
        let depth = |l: usize| {
            if last == 0 {
                0.0
            } else {
                l as f64 / last as f64
            }
        };
        let x_area = 50;
        // A hair below the decade, or plotters drops its tick to rounding.
        let y = self.y_low * 0.999..1.0;
        let mut chart = ChartBuilder::on(&plot)
            .margin(10)
            .margin_right(20)
            .x_label_area_size(x_area)
            .y_label_area_size(80)
            .build_cartesian_2d(1.0..self.width.max(2) as f64, y.clone().log_scale())?;
        chart
            .configure_mesh()
            .x_desc("neuron rank (most frequent first)")
            .y_desc("activation frequency (log)")
            .x_label_formatter(&fmt_integer)
            .y_label_formatter(&|v| fmt_frequency(*v))
            .label_style(font(15))
            .axis_desc_style(font(17))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        for (l, line) in self.lines.iter().enumerate() {
            let style = viridis(depth(l)).stroke_width(2);
            if line.len() == 1 {
                chart.draw_series(line.iter().map(|&p| Circle::new(p, 3, style.filled())))?;
            } else {
                chart.draw_series(LineSeries::new(line.iter().copied(), style))?;
            }
        }
        let layers = (last + 1) as f64;
        colour_bar(
            &bar,
            &format!("layer (0 to {last}, by colour)"),
            -0.5..layers - 0.5,
            &viridis,
            &fmt_integer,
            x_area + 10,
        )
    }
}

pub(super) struct Heatmap<'a> {
    title: &'a str,
    /// cells[layer][column]: mean finite frequency of the column's neurons, NaN if none.
    cells: Vec<Vec<f64>>,
    width: usize,
    group: usize,
    low: f64,
    notes: Vec<String>,
}

impl<'a> Heatmap<'a> {
    pub(super) fn new(title: &'a str, freqs: &[Vec<f64>]) -> Result<Self> {
        let width = check_freqs(freqs)?;
        let group = width.div_ceil(MAX_COLUMNS);
        let columns = width.div_ceil(group);
        let mut clean = Cleanup::default();
        let mut min_positive = f64::INFINITY;
        let mut missing = 0;
        let cells: Vec<Vec<f64>> = freqs
            .iter()
            .map(|layer| {
                (0..columns)
                    .map(|c| {
                        let start = (c * group).min(layer.len());
                        let end = ((c + 1) * group).min(layer.len());
                        let vals: Vec<f64> = layer[start..end]
                            .iter()
                            .filter_map(|&x| clean.frequency(x))
                            .collect();
                        if vals.is_empty() {
                            missing += 1;
                            return f64::NAN;
                        }
                        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
                        if mean > 0.0 {
                            min_positive = min_positive.min(mean);
                        }
                        mean
                    })
                    .collect()
            })
            .collect();
        let low = decade_below(min_positive).min(0.1);
        let mut first = format!(
            "Colour: activation frequency, log scale; at or below {} drawn as {}.",
            fmt_frequency(low),
            fmt_frequency(low)
        );
        if group > 1 {
            first.push_str(&format!(" Each column is the mean of {group} neurons."));
        }
        let mut notes = vec![first];
        if missing > 0 {
            notes.push(format!(
                "Grey: {missing} cells without a finite value (NaN/inf or a shorter layer)."
            ));
        }
        notes.extend(clean.note());
        Ok(Self {
            title,
            cells,
            width,
            group,
            low,
            notes,
        })
    }

    fn t(&self, v: f64) -> f64 {
        let lo = self.low.log10();
        (v.max(self.low).log10() - lo) / -lo
    }
}

impl Figure for Heatmap<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 650)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let body = frame(root, self.title, &self.notes)?;
        let w = body.dim_in_pixel().0;
        let (plot, bar) = body.split_horizontally(w - 130);
        let layers = self.cells.len() as f64;
        let x_area = 50;
        let mut chart = ChartBuilder::on(&plot)
            .margin(10)
            .margin_right(20)
            .x_label_area_size(x_area)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..self.width as f64, -0.5..layers - 0.5)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("neuron index")
            .y_desc("layer")
            .x_label_formatter(&fmt_integer)
            .y_label_formatter(&fmt_integer)
            .label_style(font(15))
            .axis_desc_style(font(17))
            .draw()?;
        let g = self.group as f64;
        let width = self.width as f64;
        chart.draw_series(self.cells.iter().enumerate().flat_map(|(l, row)| {
            row.iter().enumerate().map(move |(c, &v)| {
                let colour = if v.is_nan() {
                    MISSING
                } else {
                    viridis(self.t(v))
                };
                let x0 = c as f64 * g;
                let x1 = (x0 + g).min(width);
                let y = l as f64;
                Rectangle::new([(x0, y - 0.5), (x1, y + 0.5)], colour.filled())
            })
        }))?;
        let lo = self.low.log10();
        colour_bar(
            &bar,
            "activation frequency",
            lo..0.0,
            &viridis,
            &|v| {
                if (v - v.round()).abs() < 1e-6 {
                    fmt_frequency(10f64.powf(v.round()))
                } else {
                    String::new()
                }
            },
            x_area + 10,
        )
    }
}
