//! The speed picture of `bench --plot`: decode and prompt tok/s per row (our modes and the
//! peers), side by side, each bar labelled with its value.

use anyhow::{bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{fmt_short, font, frame, Figure, SpeedRow};

const DECODE: RGBColor = RGBColor(49, 130, 189);
const PROMPT: RGBColor = RGBColor(253, 174, 107);

pub(super) struct Speed<'a> {
    pub(super) title: &'a str,
    pub(super) note: &'a str,
    pub(super) rows: Vec<&'a SpeedRow>,
}

impl<'a> Speed<'a> {
    /// The drawable rows (finite, non-negative speeds); an error when none is.
    pub(super) fn new(title: &'a str, note: &'a str, rows: &'a [SpeedRow]) -> Result<Self> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        let rows: Vec<_> = rows
            .iter()
            .filter(|r| ok(r.decode_tps) && ok(r.prompt_tps))
            .collect();
        if rows.is_empty() {
            bail!("no row with finite tok/s to draw");
        }
        Ok(Speed { title, note, rows })
    }
}

impl Figure for Speed<'_> {
    fn size(&self) -> (u32, u32) {
        (260 + 120 * self.rows.len() as u32, 560)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let notes = [self.note.to_string()];
        let body = frame(root, self.title, &notes)?;
        let n = self.rows.len();
        // Decode on the left axis, prompt on the right: prompts run several times faster.
        let top = |f: fn(&SpeedRow) -> f64| {
            let m = self.rows.iter().map(|r| f(r)).fold(0.0, f64::max);
            if m > 0.0 {
                m * 1.25
            } else {
                1.0
            }
        };
        let (dtop, ptop) = (top(|r| r.decode_tps), top(|r| r.prompt_tps));
        let x = -0.5..n as f64 - 0.5;
        let mut chart = ChartBuilder::on(&body)
            .margin(10)
            .margin_right(20)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .right_y_label_area_size(80)
            .build_cartesian_2d(x.clone(), 0.0..dtop)?
            .set_secondary_coord(x, 0.0..ptop);
        let names: Vec<String> = self.rows.iter().map(|r| r.name.clone()).collect();
        let label = move |v: &f64| {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.max(2) * 2 + 1)
            .x_label_formatter(&label)
            .y_desc("decode tok/s")
            .y_label_formatter(&|v| fmt_short(*v))
            .label_style(font(15))
            .axis_desc_style(font(17))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        chart
            .configure_secondary_axes()
            .y_desc("prompt tok/s")
            .y_label_formatter(&|v| fmt_short(*v))
            .label_style(font(15))
            .axis_desc_style(font(17))
            .draw()?;
        let w = 0.38;
        chart
            .draw_series(self.rows.iter().enumerate().map(|(i, r)| {
                let x = i as f64;
                Rectangle::new([(x - w, 0.0), (x, r.decode_tps)], DECODE.filled())
            }))?
            .label("decode tok/s (left axis)")
            .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], DECODE.filled()));
        chart.draw_series(self.rows.iter().enumerate().map(|(i, r)| {
            Text::new(
                format!("{:.1}", r.decode_tps),
                (i as f64 - w, r.decode_tps + dtop * 0.01),
                font(13),
            )
        }))?;
        chart
            .draw_secondary_series(self.rows.iter().enumerate().map(|(i, r)| {
                let x = i as f64;
                Rectangle::new([(x, 0.0), (x + w, r.prompt_tps)], PROMPT.filled())
            }))?
            .label("prompt tok/s (right axis)")
            .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], PROMPT.filled()));
        chart.draw_secondary_series(self.rows.iter().enumerate().map(|(i, r)| {
            Text::new(
                format!("{:.0}", r.prompt_tps),
                (i as f64 + 0.02, r.prompt_tps + ptop * 0.01),
                font(13),
            )
        }))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(200, 200, 200))
            .label_font(font(15))
            .draw()?;
        Ok(())
    }
}
