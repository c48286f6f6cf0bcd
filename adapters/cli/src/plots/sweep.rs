//! The sweep picture: perplexity against realized FFN sparsity, the dense model as a line.

use std::ops::Range;

use anyhow::{bail, Result};
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{decade_below, fmt_short, font, frame, log_label, Figure, Series, LOG_TICKS};

pub(super) struct Sweep<'a> {
    title: &'a str,
    /// What the x axis measures (a percentage).
    x_desc: &'static str,
    dense: Option<f64>,
    /// Per series: name, points as (sparsity %, perplexity) sorted by sparsity.
    series: Vec<(&'a str, Vec<(f64, f64)>)>,
    x: Range<f64>,
    y: Range<f64>,
    log_y: bool,
    notes: Vec<String>,
}

impl<'a> Sweep<'a> {
    pub(super) fn new(
        title: &'a str,
        x_desc: &'static str,
        dense_ppl: f64,
        series: &'a [Series],
    ) -> Result<Self> {
        let valid = |s: f64, p: f64| s.is_finite() && p.is_finite() && p > 0.0;
        let mut skipped = 0;
        let series: Vec<(&str, Vec<(f64, f64)>)> = series
            .iter()
            .map(|s| {
                let mut pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .filter(|&&(x, y)| valid(x, y))
                    .map(|&(x, y)| (100.0 * x, y))
                    .collect();
                skipped += s.points.len() - pts.len();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (s.name.as_str(), pts)
            })
            .collect();
        let dense = (dense_ppl.is_finite() && dense_ppl > 0.0).then_some(dense_ppl);
        let all = || series.iter().flat_map(|(_, p)| p.iter().copied());
        if all().next().is_none() && dense.is_none() {
            bail!("nothing to plot: no finite (sparsity, perplexity) point and no finite dense perplexity");
        }
        let (mut x0, mut x1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| {
            (a.min(x), b.max(x))
        });
        if x0 > x1 {
            (x0, x1) = (0.0, 100.0);
        }
        let pad = ((x1 - x0) * 0.05).max(2.0);
        let (y0, y1) = all()
            .map(|p| p.1)
            .chain(dense)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
                (a.min(y), b.max(y))
            });
        let log_y = y1 / y0 > 10.0;
        let y = if log_y {
            // From a decade: plotters starts its ticks at the first decade in range.
            decade_below(y0 / 1.1) * 0.999..y1 * 1.1
        } else {
            let pad = ((y1 - y0) * 0.08).max(y1 * 0.02);
            (y0 - pad).max(0.0)..y1 + pad
        };
        let mut notes = vec![format!(
            "Perplexity ({}) against the {}{}.",
            if log_y { "log scale" } else { "linear scale" },
            x_desc.to_lowercase(),
            match dense {
                Some(d) => format!("; dashed: the dense model, {d:.2}"),
                None => "; the dense perplexity is not finite and not drawn".into(),
            }
        )];
        if skipped > 0 {
            notes.push(format!(
                "{skipped} points with a non-finite value or a perplexity <= 0 skipped."
            ));
        }
        Ok(Self {
            title,
            x_desc,
            dense,
            series,
            x: x0 - pad..x1 + pad,
            y,
            log_y,
            notes,
        })
    }

    fn plot<DB, Y>(&self, area: &DrawingArea<DB, Shift>, y: Y) -> Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .margin_right(30)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(RangedCoordf64::from(self.x.clone()), y)?;
        chart
            .configure_mesh()
            .x_desc(self.x_desc)
            .y_desc("perplexity")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_labels(if self.log_y { LOG_TICKS } else { 10 })
            .bold_line_style(RGBColor(215, 215, 215))
            .max_light_lines(if self.log_y { 0 } else { 4 })
            .y_label_formatter(&|v| {
                if self.log_y {
                    log_label(*v, &self.y, fmt_short)
                } else {
                    // Enough decimals that ten ticks over the range read apart.
                    let span = self.y.end - self.y.start;
                    let decimals = (-(span / 10.0).log10().floor()).clamp(0.0, 6.0) as usize;
                    format!("{v:.decimals$}")
                }
            })
            .label_style(font(15))
            .axis_desc_style(font(17))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        if let Some(d) = self.dense {
            let style = BLACK.stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new(
                    [(self.x.start, d), (self.x.end, d)],
                    8,
                    5,
                    style,
                ))?
                .label(format!("dense: {d:.2}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
        for (i, (name, pts)) in self.series.iter().enumerate() {
            let colour = Palette99::pick(i).to_rgba();
            let line = colour.stroke_width(2);
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), line))?
                .label(*name)
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new([(-0, 0), (20, 0)], line)
                        + Circle::new((10, 0), 4, colour.filled())
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .label_font(font(15))
            .draw()?;
        Ok(())
    }
}

impl Figure for Sweep<'_> {
    fn size(&self) -> (u32, u32) {
        (1000, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let body = frame(root, self.title, &self.notes)?;
        if self.log_y {
            self.plot(&body, LogCoord::<f64>::from(self.y.clone().log_scale()))
        } else {
            self.plot(&body, RangedCoordf64::from(self.y.clone()))
        }
    }
}
