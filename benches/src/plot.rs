//! `--plot FILE.svg`: the report's figures as an SVG chart (the `plotters` crate, SVG backend only), beside the CSV.
//!
//! - throughput: prefill and decode tokens/s against the context frontier, with the decode roofline;
//! - kv: restore from the disk store and recompute (prefill) time against the prefix length;
//! - kernels: GB/s of weights per decode kernel and shape, each bar next to the bandwidth measured for it.
//!
//! Readable without a legend: every series is labelled at its end in its own colour (labels pushed apart so they
//! never overlap), every bar row is named on the left, and both axes are titled with units. The SVG text holds the
//! labels verbatim, which is what the plot test checks.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::{kernels, kvbench, throughput};

const WIDTH: u32 = 900;
const HEIGHT: u32 = 520;
const FONT: &str = "sans-serif";
/// Room right of the plot for the series labels.
const LABEL_ROOM: u32 = 190;
/// Smallest vertical distance between two end labels, pixels.
const LABEL_GAP: i32 = 16;

/// Series colours, in order.
pub const COLORS: [RGBColor; 4] =
    [RGBColor(0x1f, 0x77, 0xb4), RGBColor(0xd6, 0x27, 0x28), RGBColor(0x2c, 0xa0, 0x2c), RGBColor(0x94, 0x67, 0xbd)];
/// The colour of reference lines (roofline, measured bandwidth).
pub const REFERENCE: RGBColor = RGBColor(0x55, 0x55, 0x55);

/// One labelled line.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub color: RGBColor,
}

/// A line chart: series over a numeric x, optional horizontal reference lines.
pub struct LineChart {
    pub title: String,
    pub x_title: String,
    pub y_title: String,
    pub series: Vec<Series>,
    /// `(label, y)` dashed reference lines.
    pub references: Vec<(String, f64)>,
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

fn text_style(size: u32, color: RGBColor, h: HPos) -> TextStyle<'static> {
    TextStyle { font: (FONT, size).into_font(), color: color.to_backend_color(), pos: Pos::new(h, VPos::Center) }
}

/// Spread label heights so neighbours are at least [`LABEL_GAP`] apart, keeping their order.
fn spread(mut ys: Vec<(i32, usize)>) -> Vec<(i32, usize)> {
    ys.sort();
    for i in 1..ys.len() {
        if ys[i].0 < ys[i - 1].0 + LABEL_GAP {
            ys[i].0 = ys[i - 1].0 + LABEL_GAP;
        }
    }
    ys
}

fn span(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.filter(|v| v.is_finite()).fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

impl LineChart {
    /// Write the chart to `path` as SVG.
    pub fn write(&self, path: &Path) -> Result<()> {
        let backend = SVGBackend::new(path, (WIDTH, HEIGHT));
        let root = backend.into_drawing_area();
        self.draw(&root)?;
        root.present().map_err(err)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let points = || self.series.iter().flat_map(|s| s.points.iter());
        let Some((x0, x1)) = span(points().map(|p| p.0)) else { bail!("nothing to plot") };
        let (_, y1) = span(points().map(|p| p.1).chain(self.references.iter().map(|r| r.1))).unwrap_or((0.0, 1.0));
        let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x1 + 1.0) };
        let y1 = if y1 > 0.0 { y1 * 1.12 } else { 1.0 };
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 20))
            .margin(12)
            .margin_right(LABEL_ROOM)
            .x_label_area_size(46)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, 0f64..y1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_title)
            .y_desc(&self.y_title)
            .x_label_formatter(&|v| format!("{v}"))
            .y_label_formatter(&|v| format!("{v}"))
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .light_line_style(RGBColor(0xee, 0xee, 0xee))
            .draw()
            .map_err(err)?;
        let mut ends = Vec::new();
        for r in &self.references {
            let style = ShapeStyle::from(&REFERENCE).stroke_width(1);
            chart.draw_series(DashedLineSeries::new([(x0, r.1), (x1, r.1)], 6, 4, style)).map_err(err)?;
            ends.push((chart.backend_coord(&(x1, r.1)), r.0.clone(), REFERENCE));
        }
        for s in &self.series {
            let style = ShapeStyle::from(&s.color).stroke_width(2);
            chart.draw_series(LineSeries::new(s.points.iter().copied(), style)).map_err(err)?;
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, ShapeStyle::from(&s.color).filled())))
                .map_err(err)?;
            if let Some(&last) = s.points.last() {
                ends.push((chart.backend_coord(&last), s.label.clone(), s.color));
            }
        }
        // End labels, right of the plot, in the series' colours.
        let label_x = chart.backend_coord(&(x1, 0.0)).0 + 10;
        let placed = spread(ends.iter().enumerate().map(|(i, e)| (e.0 .1, i)).collect());
        for (y, i) in placed {
            let (_, label, color) = &ends[i];
            root.draw(&Text::new(label.clone(), (label_x, y), text_style(14, *color, HPos::Left))).map_err(err)?;
        }
        Ok(())
    }
}

/// One bar row: a named value next to its reference value.
pub struct Bar {
    pub label: String,
    pub value: f64,
    /// The reference the value is measured against (drawn as a mark across the row).
    pub reference: f64,
    pub color: RGBColor,
}

/// Horizontal bars, each row named on the left, its value and share of the reference written at its end.
pub struct BarChart {
    pub title: String,
    pub x_title: String,
    pub reference_label: String,
    pub unit: String,
    pub bars: Vec<Bar>,
}

impl BarChart {
    /// Write the chart to `path` as SVG.
    pub fn write(&self, path: &Path) -> Result<()> {
        let rows = self.bars.len().max(1) as u32;
        let backend = SVGBackend::new(path, (WIDTH + 100, 110 + 26 * rows));
        let root = backend.into_drawing_area();
        self.draw(&root)?;
        root.present().map_err(err)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        if self.bars.is_empty() {
            bail!("nothing to plot");
        }
        let n = self.bars.len();
        let max = span(self.bars.iter().flat_map(|b| [b.value, b.reference])).map_or(1.0, |s| s.1.max(1e-9));
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 20))
            .margin(12)
            .margin_right(40)
            .x_label_area_size(46)
            .y_label_area_size(330)
            .build_cartesian_2d(0f64..max * 1.25, 0f64..n as f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc(&self.x_title)
            .x_label_formatter(&|v| format!("{v}"))
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .light_line_style(RGBColor(0xee, 0xee, 0xee))
            .draw()
            .map_err(err)?;
        for (i, b) in self.bars.iter().enumerate() {
            // Row 0 at the top.
            let (lo, hi) = ((n - 1 - i) as f64 + 0.18, (n - i) as f64 - 0.18);
            chart
                .draw_series([Rectangle::new([(0.0, lo), (b.value, hi)], ShapeStyle::from(&b.color).filled())])
                .map_err(err)?;
            let mark = ShapeStyle::from(&REFERENCE).stroke_width(3);
            chart
                .draw_series(LineSeries::new([(b.reference, lo - 0.12), (b.reference, hi + 0.12)], mark))
                .map_err(err)?;
            let mid = (lo + hi) / 2.0;
            let (x_left, y) = chart.backend_coord(&(0.0, mid));
            root.draw(&Text::new(b.label.clone(), (x_left - 8, y), text_style(13, BLACK, HPos::Right))).map_err(err)?;
            let share = 100.0 * b.value / b.reference.max(1e-12);
            let value = format!("{:.1} {} ({share:.0} %)", b.value, self.unit);
            let x_end = chart.backend_coord(&(b.value.max(b.reference), mid)).0;
            root.draw(&Text::new(value, (x_end + 6, y), text_style(12, b.color, HPos::Left))).map_err(err)?;
        }
        // Name the reference marks once, at the right end of the x-axis title's line.
        let (x, y) = chart.backend_coord(&(max * 1.25, 0.0));
        let label = format!("| = {}", self.reference_label);
        root.draw(&Text::new(label, (x, y + 34), text_style(13, REFERENCE, HPos::Right))).map_err(err)?;
        Ok(())
    }
}

/// Label of the prefill series.
pub const PREFILL: &str = "prefill t/s";
/// Label of the decode series.
pub const DECODE: &str = "decode t/s";

/// Throughput sweep: prefill and decode t/s against the context, with the decode roofline.
pub fn throughput(rows: &[throughput::ThroughputRow], sessions: usize, roofline_tps: f64, path: &Path) -> Result<()> {
    let decode = if sessions > 1 { format!("{DECODE} ({sessions} sessions)") } else { DECODE.to_string() };
    let chart = LineChart {
        title: "ds4-bench: prefill and decode throughput against context".into(),
        x_title: "context (tokens)".into(),
        y_title: "throughput (tokens/s)".into(),
        series: vec![
            Series {
                label: PREFILL.into(),
                points: rows.iter().map(|r| (r.ctx_tokens as f64, r.prefill_tps)).collect(),
                color: COLORS[0],
            },
            Series {
                label: decode,
                points: rows.iter().map(|r| (r.ctx_tokens as f64, r.gen_tps)).collect(),
                color: COLORS[1],
            },
        ],
        references: vec![(format!("decode roofline {roofline_tps:.1} t/s"), roofline_tps)],
    };
    chart.write(path)
}

/// Label of the recompute series.
pub const RECOMPUTE: &str = "recompute (prefill)";
/// Label of the restore series.
pub const RESTORE: &str = "restore from disk";

/// KV bench: restore vs recompute time against the prefix length.
pub fn kv(rows: &[kvbench::KvRow], path: &Path) -> Result<()> {
    let ms = |s: f64| s * 1e3;
    let chart = LineChart {
        title: "ds4-bench kv: restore from the disk store vs recompute".into(),
        x_title: "prefix length (tokens)".into(),
        y_title: "time (ms)".into(),
        series: vec![
            Series {
                label: RECOMPUTE.into(),
                points: rows.iter().map(|r| (r.prefix_tokens as f64, ms(r.recompute_s))).collect(),
                color: COLORS[1],
            },
            Series {
                label: RESTORE.into(),
                points: rows.iter().map(|r| (r.prefix_tokens as f64, ms(r.restore_s))).collect(),
                color: COLORS[0],
            },
        ],
        references: Vec::new(),
    };
    chart.write(path)
}

/// The label of the bandwidth marks in the kernels chart.
pub const BANDWIDTH: &str = "measured read bandwidth";

/// The kernels chart's row label of a report row.
pub fn kernel_label(r: &kernels::KernelRow) -> String {
    format!("{} {} · {}", r.case.name, r.case.ty, r.kernel)
}

/// Kernels bench: GB/s of weights of every decode kernel row against the bandwidth measured for it (the batched
/// matmul rows are compute-bound and left out).
pub fn kernels(rows: &[kernels::KernelRow], path: &Path) -> Result<()> {
    let color = |k: &str| match k {
        "matvec" => COLORS[0],
        "engine-matvec" => COLORS[2],
        _ => COLORS[3],
    };
    let bars = rows
        .iter()
        .filter(|r| !r.kernel.ends_with("matmul"))
        .map(|r| Bar { label: kernel_label(r), value: r.weights_gbs, reference: r.mem_gbs, color: color(r.kernel) })
        .collect();
    let chart = BarChart {
        title: "ds4-bench kernels: decode kernels' weight GB/s vs measured bandwidth".into(),
        x_title: "weights streamed (GB/s)".into(),
        reference_label: BANDWIDTH.into(),
        unit: "GB/s".into(),
        bars,
    };
    chart.write(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_spread_apart_in_order() {
        let got = spread(vec![(100, 0), (95, 1), (300, 2), (104, 3)]);
        assert_eq!(got, vec![(95, 1), (111, 0), (127, 3), (300, 2)]);
    }

    #[test]
    fn empty_charts_are_errors_not_panics() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("x.svg");
        let empty = LineChart {
            title: "t".into(),
            x_title: "x".into(),
            y_title: "y".into(),
            series: vec![],
            references: vec![],
        };
        assert!(empty.write(&p).is_err());
        let bars = BarChart {
            title: "t".into(),
            x_title: "x".into(),
            reference_label: "r".into(),
            unit: "u".into(),
            bars: vec![],
        };
        assert!(bars.write(&p).is_err());
        // A single point (one frontier) still gets a non-empty x range.
        let one = LineChart {
            series: vec![Series { label: "s".into(), points: vec![(8.0, 2.0)], color: COLORS[0] }],
            ..empty
        };
        one.write(&p).unwrap();
        assert!(
            std::fs::read_to_string(&p).unwrap().lines().any(|l| l.trim() == "s"),
            "the series label is in the SVG"
        );
    }
}
