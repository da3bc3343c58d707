//! `carve replay --plot`: the chart of live and reserved bytes over the replay's steps.

use std::path::Path;

use super::timeline::Timeline;
use crate::plot::{Chart, Series};

/// One `live` and (where known) one `reserved` line per resource.
pub fn chart(timelines: &[Timeline], log: &Path) -> Chart {
    let mut series = Vec::new();
    for t in timelines {
        let reserved: Vec<(f64, f64)> = t
            .points
            .iter()
            .filter_map(|&(step, _, r)| Some((step as f64, r? as f64)))
            .collect();
        if !reserved.is_empty() {
            series.push(Series {
                name: format!("{} reserved", t.resource),
                points: reserved,
            });
        }
        series.push(Series {
            name: format!("{} live", t.resource),
            points: t
                .points
                .iter()
                .map(|&(step, live, _)| (step as f64, live as f64))
                .collect(),
        });
    }
    let name = log
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    Chart {
        title: format!("carve replay {name}: bytes over the replay"),
        x_label: "step".into(),
        y_label: "bytes".into(),
        x_names: None,
        series,
        bars: false,
    }
}
