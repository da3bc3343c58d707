//! `carve bench --plot DIR`: each table as an SVG bar chart. Each row is a group of bars, one
//! per measured (numeric) column. Key columns (sizes, thread counts, N) and text columns name
//! the row instead.

use std::path::Path;

use crate::plot::{Chart, Series};

use super::table::Table;

/// Headers that say which case a row is, not what was measured.
const KEY_COLUMNS: [&str; 4] = ["bytes", "threads", "N", "size"];

/// `1,234`, `9.8×`, `12.5 %`: the number in a cell, if it holds one.
fn number(cell: &str) -> Option<f64> {
    let t: String = cell
        .chars()
        .filter(|c| !matches!(c, ',' | '×' | '%' | ' ' | '*'))
        .collect();
    t.parse().ok().filter(|v: &f64| v.is_finite())
}

/// The chart of `table`: per row a group of bars, one per measured column.
pub fn chart(table: &Table) -> Chart {
    let columns = table.header.len();
    let measured: Vec<usize> = (0..columns)
        .filter(|&c| !KEY_COLUMNS.contains(&table.header[c].as_str()))
        .filter(|&c| {
            let mut cells = table.rows.iter().filter_map(|r| r.get(c));
            // Numeric where filled; cells like "–" (not run) do not make a column text.
            cells.clone().any(|v| number(v).is_some())
                && cells.all(|v| number(v).is_some() || !v.chars().any(|c| c.is_alphabetic()))
        })
        .collect();
    let names = table
        .rows
        .iter()
        .map(|row| {
            (0..columns)
                .filter(|c| !measured.contains(c))
                .filter_map(|c| row.get(c))
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let series = measured
        .iter()
        .map(|&c| Series {
            name: table.header[c].clone(),
            points: table
                .rows
                .iter()
                .enumerate()
                .filter_map(|(x, row)| Some((x as f64, number(row.get(c)?)?)))
                .collect(),
        })
        .collect();
    Chart {
        title: table.title.clone(),
        x_label: String::new(),
        y_label: String::new(),
        x_names: Some(names),
        series,
        bars: true,
    }
}

/// A file name from a table's title: `random_allocations-multi-threaded.svg`.
pub fn file_name(table: &Table, index: usize) -> String {
    let head = table.title.split(['(', ':']).next().unwrap_or("table");
    let slug: String = head
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("{index:02}-{}.svg", slug.trim_matches('-'))
}

/// Writes `table`'s chart into `dir` (created if needed); returns the file.
pub fn write(table: &Table, index: usize, dir: &Path) -> carve::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(file_name(table, index));
    chart(table).write_svg(&path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rows_become_lines_over_measured_columns() {
        // Imports inside: under `cargo bench` (no test harness) the test is dropped.
        use super::{chart, file_name, Table};
        let mut t = Table::new(
            "random_allocations: ns per step",
            &["resource", "N=1e3", "N=1e4", "threads"],
        );
        t.row(vec!["pool".into(), "75".into(), "1,709".into(), "1".into()]);
        t.row(vec!["arena".into(), "–".into(), "9.8×".into(), "16".into()]);
        let c = chart(&t);
        assert_eq!(
            c.x_names.as_deref(),
            Some(&["pool 1".to_string(), "arena 16".into()][..])
        );
        assert_eq!(c.series[0].name, "N=1e3");
        assert_eq!(c.series[0].points, vec![(0.0, 75.0)]);
        assert_eq!(c.series[1].points, vec![(0.0, 1709.0), (1.0, 9.8)]);
        assert_eq!(file_name(&t, 3), "03-random_allocations.svg");
        let svg = c.to_svg().unwrap();
        roxmltree::Document::parse(&svg).expect("valid XML");
        assert!(svg.contains("arena 16") && svg.contains("N=1e4"));
    }
}
