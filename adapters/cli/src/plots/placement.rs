//! The placement picture: per-layer hot (fast tier) and cold (CPU) bytes against the budget.

use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{fmt_integer, fmt_short, font, frame, Figure, SplitLayer};

const HOT: RGBColor = RGBColor(230, 85, 13);
const COLD: RGBColor = RGBColor(49, 130, 189);

const KIB: f64 = 1024.0;

/// The unit that shows `max` bytes best: (divisor, name).
fn byte_unit(max: f64) -> (f64, &'static str) {
    [
        (KIB.powi(6), "EiB"),
        (KIB.powi(5), "PiB"),
        (KIB.powi(4), "TiB"),
        (KIB.powi(3), "GiB"),
        (KIB.powi(2), "MiB"),
        (KIB, "KiB"),
    ]
    .into_iter()
    .find(|&(d, _)| max >= d)
    .unwrap_or((1.0, "B"))
}

fn fmt_bytes(b: f64) -> String {
    match byte_unit(b) {
        (_, "B") => format!("{b:.0} B"),
        (d, u) => format!("{:.1} {u}", b / d),
    }
}

pub(super) struct Split<'a> {
    pub(super) title: &'a str,
    pub(super) layers: &'a [SplitLayer],
    pub(super) budget: u64,
    pub(super) predictor_bytes: u64,
}

impl Figure for Split<'_> {
    fn size(&self) -> (u32, u32) {
        (1000, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let hot: f64 = self.layers.iter().map(|l| l.hot_bytes as f64).sum();
        let cold: f64 = self.layers.iter().map(|l| l.cold_bytes as f64).sum();
        let pred = self.predictor_bytes as f64;
        let budget = self.budget as f64;
        let used = hot + pred;
        let share = if self.budget == 0 {
            "no budget: everything runs on the CPU".to_string()
        } else {
            format!("{:.0}% of the budget", 100.0 * used / budget)
        };
        let mut notes = vec![format!(
            "Fast tier: hot {} + predictor {} = {} against a budget of {} ({share}).",
            fmt_bytes(hot),
            fmt_bytes(pred),
            fmt_bytes(used),
            fmt_bytes(budget)
        )];
        let total = hot + cold;
        if total > 0.0 {
            notes.push(format!(
                "CPU: cold {} ({:.0}% of the FFN bytes).",
                fmt_bytes(cold),
                100.0 * cold / total
            ));
        }
        let body = frame(root, self.title, &notes)?;

        let n = self.layers.len();
        let bar_max = self
            .layers
            .iter()
            .map(|l| l.hot_bytes as f64 + l.cold_bytes as f64)
            .fold(0.0, f64::max);
        let (d, unit) = byte_unit(bar_max);
        let right_max = used.max(budget);
        let (rd, runit) = byte_unit(right_max);
        // Headroom above the data for the legend.
        let top = |m: f64, d: f64| if m > 0.0 { m / d * 1.5 } else { 1.0 };
        let x = -0.5..n as f64 - 0.5;
        let mut chart = ChartBuilder::on(&body)
            .margin(10)
            .margin_right(20)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .right_y_label_area_size(90)
            .build_cartesian_2d(x.clone(), 0.0..top(bar_max, d))?
            .set_secondary_coord(x.clone(), 0.0..top(right_max, rd));
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc(format!("bytes per layer ({unit})"))
            .x_label_formatter(&fmt_integer)
            .y_label_formatter(&|v| fmt_short(*v))
            .label_style(font(15))
            .axis_desc_style(font(17))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        chart
            .configure_secondary_axes()
            .y_desc(format!("cumulative fast-tier bytes ({runit})"))
            .y_label_formatter(&|v| fmt_short(*v))
            .label_style(font(15))
            .axis_desc_style(font(17))
            .draw()?;
        let half = 0.35;
        chart
            .draw_series(self.layers.iter().enumerate().map(|(i, l)| {
                let x = i as f64;
                Rectangle::new(
                    [(x - half, 0.0), (x + half, l.hot_bytes as f64 / d)],
                    HOT.filled(),
                )
            }))?
            .label("hot neurons: fast tier (GPU)")
            .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], HOT.filled()));
        chart
            .draw_series(self.layers.iter().enumerate().map(|(i, l)| {
                let x = i as f64;
                let h = l.hot_bytes as f64 / d;
                Rectangle::new(
                    [(x - half, h), (x + half, h + l.cold_bytes as f64 / d)],
                    COLD.filled(),
                )
            }))?
            .label("cold neurons: CPU")
            .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], COLD.filled()));
        let mut acc = pred;
        let cumulative: Vec<(f64, f64)> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                acc += l.hot_bytes as f64;
                (i as f64, acc / rd)
            })
            .collect();
        let line = BLACK.stroke_width(2);
        chart
            .draw_secondary_series(LineSeries::new(cumulative.iter().copied(), line))?
            .label("predictor + cumulative hot bytes (right axis)")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], line));
        chart.draw_secondary_series(
            cumulative
                .iter()
                .map(|&p| Circle::new(p, 3, BLACK.filled())),
        )?;
        let budget_style = RED.stroke_width(2);
        chart
            .draw_secondary_series(DashedLineSeries::new(
                [(x.start, budget / rd), (x.end, budget / rd)],
                8,
                5,
                budget_style,
            ))?
            .label(format!("budget {} (right axis)", fmt_bytes(budget)))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], budget_style));
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
