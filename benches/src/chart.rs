//! The PNG chart: latency distributions per system, and p50/p99 per system.

use std::path::Path;

use plotters::prelude::*;

use crate::report::summaries;
use crate::scenarios::RunOutput;
use crate::stats::ms;
use crate::{BenchError, Result};

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Chart(e.to_string())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// Draws the chart of `out` into the PNG at `path`.
pub fn draw(out: &RunOutput, path: &Path) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (1600, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(860);
    draw_cdf(out, &left)?;
    draw_percentiles(out, &right)?;
    root.present().map_err(err)?;
    Ok(())
}

fn register_font() -> Result<()> {
    let font = std::fs::read(FONT)
        .map_err(|e| BenchError::Chart(format!("{FONT}: {e} (install fonts-dejavu-core)")))?;
    // plotters wants the font for the life of the process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| err("font does not parse"))
}

/// Sequential create latencies in ms, per system in the order they ran.
fn sequential_latencies(out: &RunOutput) -> Vec<(String, Vec<f64>)> {
    let mut series: Vec<(String, Vec<f64>)> = Vec::new();
    for s in out.samples.iter().filter(|s| s.scenario == "sequential") {
        let v = ms(s.total_us);
        match series.iter_mut().find(|(name, _)| *name == s.system) {
            Some((_, vals)) => vals.push(v),
            None => series.push((s.system.clone(), vec![v])),
        }
    }
    series
}

/// Left: CDF of sequential create latency, one line per system.
fn draw_cdf(out: &RunOutput, area: &Area<'_>) -> Result<()> {
    let series = sequential_latencies(out);
    let max_ms = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(1.0f64, f64::max)
        * 1.05;
    let mut cdf = ChartBuilder::on(area)
        .caption("Sequential create → ready: CDF", ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_ms, 0f64..1.0f64)
        .map_err(err)?;
    cdf.configure_mesh()
        .x_desc("latency (ms)")
        .y_desc("fraction of creates ≤ x")
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    for (i, (name, mut vals)) in series.into_iter().enumerate() {
        vals.sort_by(|a, b| a.total_cmp(b));
        let n = vals.len() as f64;
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = vals
            .iter()
            .enumerate()
            .map(|(k, v)| (*v, (k + 1) as f64 / n))
            .collect();
        cdf.draw_series(LineSeries::new(points, color.stroke_width(3)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    cdf.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// Right: p50 (bar) and p99 (tick) per system and scenario, each system in
/// its colour of the CDF.
fn draw_percentiles(out: &RunOutput, area: &Area<'_>) -> Result<()> {
    let rows = summaries(out);
    let top = rows
        .iter()
        .map(|(_, _, s)| ms(s.p99_us))
        .fold(1.0f64, f64::max)
        * 1.1;
    let n = rows.len().max(1);
    // Segmented y axis: one band per row, its label at the band's centre.
    let mut bars = ChartBuilder::on(area)
        .caption(
            "p50 (bar) and p99 (black tick) per scenario",
            ("sans-serif", 22),
        )
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(330)
        .build_cartesian_2d(0f64..top, (0..n).into_segmented())
        .map_err(err)?;
    let labels: Vec<String> = rows
        .iter()
        .map(|(sc, sy, _)| format!("{sy} [{sc}]"))
        .collect();
    bars.configure_mesh()
        .disable_y_mesh()
        .x_desc("latency (ms)")
        .y_labels(n)
        .y_label_formatter(&|y| match y {
            // plotters draws one band past the last value: leave it blank.
            SegmentValue::CenterOf(i) if *i < n => labels[n - 1 - *i].clone(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    let sequential_order: Vec<String> = sequential_latencies(out)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    for (i, (_, system, s)) in rows.iter().enumerate() {
        // First row at the top.
        let band = n - 1 - i;
        let color_index = sequential_order
            .iter()
            .position(|name| name == system)
            .unwrap_or(i);
        let color = Palette99::pick(color_index).to_rgba();
        bars.draw_series(std::iter::once(Rectangle::new(
            [
                (0.0, SegmentValue::Exact(band)),
                (ms(s.p50_us), SegmentValue::Exact(band + 1)),
            ],
            color.filled(),
        )))
        .map_err(err)?;
        bars.draw_series(std::iter::once(PathElement::new(
            vec![
                (ms(s.p99_us), SegmentValue::Exact(band)),
                (ms(s.p99_us), SegmentValue::Exact(band + 1)),
            ],
            BLACK.stroke_width(3),
        )))
        .map_err(err)?;
    }
    Ok(())
}
