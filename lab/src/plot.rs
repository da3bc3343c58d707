//! Line charts as SVG files (plotters' SVG backend: no browser, no system fonts), for
//! `carve replay --plot` and `carve bench --plot`.

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use carve::error::{Error, Result};

/// One line: a name for the legend and its points, in x order.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points.
    pub points: Vec<(f64, f64)>,
}

/// A chart: lines over a shared x axis.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chart {
    /// Caption.
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Y axis description.
    pub y_label: String,
    /// Names for x = 0, 1, 2, ... (a categorical axis); `None` for a numeric one.
    pub x_names: Option<Vec<String>>,
    /// The lines (or bar groups).
    pub series: Vec<Series>,
    /// Draw grouped bars instead of lines: at each integer x, one bar per series (for tables,
    /// with `x_names` naming the groups).
    pub bars: bool,
}

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 600;

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("cannot draw the chart: {e}"))
}

impl Chart {
    /// The chart as an SVG document. A y range spanning more than 100× is drawn on a log scale.
    pub fn to_svg(&self) -> Result<String> {
        let finite = |v: &f64| v.is_finite();
        let xs = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .filter(finite);
        let ys = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .filter(finite);
        let (mut x0, mut x1) = bounds(xs).unwrap_or((0.0, 1.0));
        let (y0, y1) = bounds(ys).unwrap_or((0.0, 1.0));
        if self.bars {
            x0 -= 0.5;
            x1 += 0.5;
        }
        let log = y0 > 0.0 && y1 / y0 > 100.0;
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
            root.fill(&WHITE).map_err(plot_error)?;
            let mut builder = ChartBuilder::on(&root);
            builder
                .caption(&self.title, ("sans-serif", 20))
                .margin(15)
                .x_label_area_size(40)
                .y_label_area_size(90);
            let x_range = x0..(if x1 > x0 { x1 } else { x0 + 1.0 });
            if log {
                let mut chart = builder
                    .build_cartesian_2d(x_range, (y0 * 0.8..y1 * 1.25).log_scale())
                    .map_err(plot_error)?;
                self.mesh(&mut chart)?;
                self.lines(&mut chart)?;
            } else {
                let top = if y1 > 0.0 { y1 * 1.05 } else { 1.0 };
                let mut chart = builder
                    .build_cartesian_2d(x_range, 0f64.min(y0)..top)
                    .map_err(plot_error)?;
                self.mesh(&mut chart)?;
                self.lines(&mut chart)?;
            }
            root.present().map_err(plot_error)?;
        }
        Ok(svg)
    }

    /// Writes [`to_svg`](Self::to_svg) to `path`.
    pub fn write_svg(&self, path: impl AsRef<Path>) -> Result<()> {
        std::fs::write(path, self.to_svg()?)?;
        Ok(())
    }

    fn mesh<'a, 'b, Y>(
        &self,
        chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
    ) -> Result<()>
    where
        Y: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
    {
        let names = self.x_names.clone();
        let format_x = move |x: &f64| match &names {
            Some(n) if (x.fract()).abs() < 1e-9 && *x >= 0.0 => {
                n.get(*x as usize).cloned().unwrap_or_default()
            }
            Some(_) => String::new(),
            None => format!("{x}"),
        };
        let ticks = self.x_names.as_ref().map_or(10, |n| n.len() + 1);
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(ticks)
            .x_label_formatter(&format_x)
            .y_label_formatter(&|y: &f64| compact(*y))
            .draw()
            .map_err(plot_error)
    }

    fn lines<'a, 'b: 'a, Y>(
        &self,
        chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
    ) -> Result<()>
    where
        Y: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
    {
        let floor = chart.y_range().start;
        let groups = self.series.len().max(1) as f64;
        for (i, s) in self.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            if self.bars {
                // Bar i of group x spans [x - 0.4 + i w, x - 0.4 + (i + 1) w], w = 0.8 / groups.
                let w = 0.8 / groups;
                let bars = s
                    .points
                    .iter()
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .map(|&(x, y)| {
                        let left = x - 0.4 + i as f64 * w;
                        Rectangle::new([(left, floor), (left + w, y)], color.filled())
                    });
                chart
                    .draw_series(bars)
                    .map_err(plot_error)?
                    .label(&s.name)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled())
                    });
                continue;
            }
            let points = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite());
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(plot_error)?
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)
    }
}

fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// `1.5G`, `640M`, `12k`, `75`: short labels for byte counts and rates.
fn compact(v: f64) -> String {
    let a = v.abs();
    let (d, unit) = if a >= 1e12 {
        (1e12, "T")
    } else if a >= 1e9 {
        (1e9, "G")
    } else if a >= 1e6 {
        (1e6, "M")
    } else if a >= 1e3 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    let x = v / d;
    if x.fract().abs() < 1e-9 {
        format!("{x:.0}{unit}")
    } else {
        format!("{x:.1}{unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_holds_every_series_and_the_title() {
        let chart = Chart {
            title: "bytes over time".into(),
            x_label: "step".into(),
            y_label: "bytes".into(),
            x_names: None,
            series: vec![
                Series {
                    name: "pool reserved".into(),
                    points: vec![(0.0, 0.0), (1.0, 1e6), (2.0, 3e6)],
                },
                Series {
                    name: "pool live".into(),
                    points: vec![(0.0, 0.0), (1.0, 5e5), (2.0, 1e6)],
                },
            ],
            bars: false,
        };
        let svg = chart.to_svg().unwrap();
        let doc = roxmltree::Document::parse(&svg).expect("valid XML");
        let texts: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text())
            .map(str::trim)
            .collect();
        for label in ["pool reserved", "pool live", "bytes over time"] {
            assert!(texts.contains(&label), "{label} in {texts:?}");
        }
        // Series are drawn 2 px wide (axes 1 px): a line and a legend mark each.
        let lines: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke-width") == Some("2"))
            .collect();
        assert_eq!(lines.len(), 4, "two lines, two legend marks");
        assert_ne!(lines[0].attribute("stroke"), lines[1].attribute("stroke"));
    }

    #[test]
    fn empty_and_log_charts_draw() {
        assert!(Chart::default().to_svg().unwrap().contains("</svg>"));
        let chart = Chart {
            x_names: Some(vec!["N=1e3".into(), "N=1e4".into()]),
            series: vec![Series {
                name: "arena".into(),
                points: vec![(0.0, 10.0), (1.0, 100_000.0)],
            }],
            ..Chart::default()
        };
        let svg = chart.to_svg().unwrap();
        assert!(svg.contains("N=1e4"));
        let bars = Chart {
            bars: true,
            ..chart
        };
        let svg = bars.to_svg().unwrap();
        let doc = roxmltree::Document::parse(&svg).expect("valid XML");
        let filled = doc
            .descendants()
            .filter(|n| n.has_tag_name("rect") && n.attribute("fill") != Some("#FFFFFF"))
            .count();
        assert!(
            filled >= 3,
            "two bars and a legend mark, found {filled} filled rects"
        );
    }

    #[test]
    fn compact_labels() {
        assert_eq!(compact(75.0), "75");
        assert_eq!(compact(1500.0), "1.5k");
        assert_eq!(compact(2e9), "2G");
    }
}
