//! A small SVG line chart, for docs/observability.md's picture of the series a real Prometheus scraped in
//! the observability e2e test (Grafana, AGPL-licensed, is not used by this project).

use std::fmt::Write as _;

/// One line: its legend and `(time, value)` points.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points, time in Unix seconds.
    pub points: Vec<(f64, f64)>,
}

/// One chart of a figure.
pub struct Chart {
    /// Title above the chart.
    pub title: String,
    /// Unit of the y axis.
    pub unit: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// Vertical markers: `(time, label)`, drawn on every chart.
pub type Markers = [(f64, String)];

const WIDTH: f64 = 900.0;
const CHART_HEIGHT: f64 = 230.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 40.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The charts stacked in one SVG, sharing the time axis from `start` (seconds shown relative to
/// it), with `markers` across all of them.
pub fn svg(title: &str, charts: &[Chart], markers: &Markers, start: f64, end: f64) -> String {
    let height = TOP + charts.len() as f64 * (CHART_HEIGHT + BOTTOM) + 10.0;
    let plot_w = WIDTH - LEFT - RIGHT;
    let span = (end - start).max(1.0);
    // Coordinates to a tenth of a pixel keep the file small.
    let x = |t: f64| ((LEFT + (t - start) / span * plot_w) * 10.0).round() / 10.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    for (i, chart) in charts.iter().enumerate() {
        let top = TOP + i as f64 * (CHART_HEIGHT + BOTTOM) + 18.0;
        let plot_h = CHART_HEIGHT - 30.0;
        let max = chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(0.0_f64, f64::max)
            .max(1e-9)
            * 1.1;
        let y = |v: f64| ((top + plot_h - v / max * plot_h) * 10.0).round() / 10.0;
        let _ = writeln!(
            out,
            r#"<text x="{LEFT}" y="{}" font-weight="bold">{}</text>"#,
            top - 6.0,
            escape(&chart.title)
        );
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>"##
        );
        for k in 0..=4 {
            let v = max * f64::from(k) / 4.0;
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" x2="{}" y1="{y0}" y2="{y0}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                y(v) + 4.0,
                format_value(v),
                y0 = y(v),
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="12" y="{}" transform="rotate(-90 12 {})" text-anchor="middle">{}</text>"#,
            top + plot_h / 2.0,
            top + plot_h / 2.0,
            escape(&chart.unit)
        );
        for k in 0..=5 {
            let t = start + span * f64::from(k) / 5.0;
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{}" text-anchor="middle">{:.0} s</text>"#,
                x(t),
                top + plot_h + 16.0,
                t - start
            );
        }
        // Each marker's label on a line of its own, so close markers do not overprint.
        for (k, (t, label)) in markers.iter().enumerate() {
            let _ = writeln!(
                out,
                r##"<line x1="{x0}" x2="{x0}" y1="{top}" y2="{}" stroke="#555" stroke-dasharray="4 3"/><text x="{}" y="{}" fill="#555">{}</text>"##,
                top + plot_h,
                x(*t) + 3.0,
                top + 12.0 + 14.0 * k as f64,
                escape(label),
                x0 = x(*t),
            );
        }
        for (j, s) in chart.series.iter().enumerate() {
            let color = COLORS[j % COLORS.len()];
            let points: Vec<String> = s
                .points
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                points.join(" ")
            );
            let ly = top + 14.0 + j as f64 * 18.0;
            let lx = LEFT + plot_w + 14.0;
            let _ = writeln!(
                out,
                r#"<line x1="{lx}" x2="{}" y1="{}" y2="{}" stroke="{color}" stroke-width="3"/><text x="{}" y="{ly}">{}</text>"#,
                lx + 18.0,
                ly - 4.0,
                ly - 4.0,
                lx + 24.0,
                escape(&s.name)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

fn format_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_each_series_legend_and_marker() {
        let chart = Chart {
            title: "GPU-seconds".into(),
            unit: "s".into(),
            series: vec![
                Series {
                    name: "allocated <ns>".into(),
                    points: vec![(0.0, 0.0), (10.0, 30.0)],
                },
                Series {
                    name: "idle".into(),
                    points: vec![(0.0, 0.0), (10.0, 20.0)],
                },
            ],
        };
        let text = svg("t", &[chart], &[(5.0, "Xid 79".into())], 0.0, 10.0);
        assert_eq!(text.matches("<polyline").count(), 2);
        assert!(text.contains("allocated &lt;ns&gt;"), "{text}");
        assert!(text.contains("Xid 79"));
        assert!(text.ends_with("</svg>\n"));
    }
}
