//! The slab and mixed-size tables' columns and cells, from measurements: each row beside the
//! floor that bounds it (with its fraction of that floor) and, when it was built, Gallatin.

use super::floor;
use crate::bench::table::Table;

/// A peer's rates on a row (G requests/s), with its failed requests over every launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Peer {
    pub alloc: f64,
    pub free: f64,
    pub failed: u64,
}

/// A carve rate, with one decimal.
pub(super) fn rate(v: f64) -> String {
    format!("{v:.1}")
}

/// A peer's rate: two decimals below 10 G/s (Gallatin's run from 0.5 to 100).
fn peer_rate(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

/// `a / b` as `0.45×`, or "–" when it is not a number.
pub(super) fn ratio(a: f64, b: f64) -> String {
    let r = a / b;
    if r.is_finite() {
        format!("{r:.2}×")
    } else {
        "–".into()
    }
}

/// `rate`, with the failed requests when there were any.
pub(super) fn with_failures(rate: String, failed: u64) -> String {
    if failed == 0 {
        rate
    } else {
        format!("{rate} ({failed} failed)")
    }
}

fn dash() -> String {
    "–".into()
}

/// The cells of a peer and carve's ratios to it, or dashes where it was not run.
fn peer_cells(p: Option<Peer>, alloc: f64, free: f64) -> [String; 4] {
    match p {
        Some(p) => [
            with_failures(peer_rate(p.alloc), p.failed),
            peer_rate(p.free),
            ratio(alloc, p.alloc),
            ratio(free, p.free),
        ],
        None => [dash(), dash(), dash(), dash()],
    }
}

/// The first table: N × block size.
pub(super) const SLAB_TITLE: &str =
    "device_alloc: N threads, one request each (G allocs/s unless noted; median of 5)";

/// The first table's columns; Gallatin's only when it was built.
pub(super) fn slab_header(gallatin: bool) -> Vec<&'static str> {
    let mut h = vec![
        "N",
        "block B",
        "empty kernel ms",
        "atomicAdd/thread",
        "bump",
        "bump (block)",
        "slab alloc (1.5×)",
        "slab free (1.5×)",
        "relaxed alloc (floor)",
        "relaxed free (floor)",
        "slab alloc / floor",
        "slab free / floor",
        "slab alloc (50 % fill)",
        "slab alloc (90 % fill)",
    ];
    if gallatin {
        h.extend([
            "Gallatin alloc",
            "Gallatin free",
            "slab / Gallatin alloc",
            "slab / Gallatin free",
        ]);
    }
    h.extend(["CUDA malloc", "CUDA free"]);
    h
}

/// One row of the first table.
#[derive(Debug, Clone, Default)]
pub(super) struct SlabRow {
    pub log_n: u32,
    pub block: u64,
    pub empty_ms: f64,
    /// `None`: the heap would pass 40 GiB, nothing was run.
    pub m: Option<SlabMeasured>,
}

/// What a row of the first table measured; `None` cells were not run.
#[derive(Debug, Clone, Default)]
pub(super) struct SlabMeasured {
    pub atomic_add: Option<String>,
    pub bump: Option<String>,
    pub bump_block: Option<String>,
    /// Slab alloc and free, G/s.
    pub slab: (f64, f64),
    /// The same with relaxed bitmap atomics: the floor of the slab's design.
    pub relaxed: Option<(f64, f64)>,
    pub fill50: Option<f64>,
    pub fill90: Option<f64>,
    pub gallatin: Option<Peer>,
    pub cuda: Option<(String, String)>,
}

/// A row of the first table, in the columns of [`slab_header`]`(gallatin)`.
pub(super) fn slab_cells(row: &SlabRow, gallatin: bool) -> Vec<String> {
    let mut c = vec![
        format!("2^{}", row.log_n),
        row.block.to_string(),
        format!("{:.3}", row.empty_ms),
    ];
    let Some(m) = &row.m else {
        let rest = slab_header(gallatin).len() - c.len();
        c.extend(std::iter::repeat_n("(heap > 40 GiB)".to_string(), rest));
        return c;
    };
    let (a, f) = m.slab;
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(dash);
    c.extend([opt(&m.atomic_add), opt(&m.bump), opt(&m.bump_block)]);
    c.extend([rate(a), rate(f)]);
    match m.relaxed {
        Some((ra, rf)) => c.extend([rate(ra), rate(rf), ratio(a, ra), ratio(f, rf)]),
        None => c.extend([dash(), dash(), dash(), dash()]),
    }
    c.extend([m.fill50, m.fill90].map(|v| v.map_or_else(dash, rate)));
    if gallatin {
        c.extend(peer_cells(m.gallatin, a, f));
    }
    match &m.cuda {
        Some((ma, fr)) => c.extend([ma.clone(), fr.clone()]),
        None => c.extend([dash(), dash()]),
    }
    c
}

/// The first table with `rows`.
pub(super) fn slab_table(rows: &[SlabRow], gallatin: bool) -> Table {
    let mut t = Table::new(SLAB_TITLE, &slab_header(gallatin));
    for r in rows {
        t.row(slab_cells(r, gallatin));
    }
    t
}

/// The mixed-size table.
pub(super) const MIXED_TITLE: &str =
    "device_alloc, mixed sizes: thread i asks for 16 B + hash(i) % (max − 15) bytes \
     (G requests/s unless noted; median of 5)";

/// The mixed-size table's columns; Gallatin's only when it was built.
pub(super) fn mixed_header(gallatin: bool) -> Vec<&'static str> {
    let mut h = vec![
        "N",
        "sizes",
        "heap (GiB)",
        "growth",
        "carve_malloc",
        "carve_free",
        "failed",
        "malloc floor (fetch_add + fetch_or)",
        "malloc / floor",
        "free floor, pair (fetch_and + fetch_sub)",
        "free / pair floor",
        "free floor, one atomic (fetch_and)",
        "free / one-atomic floor",
    ];
    if gallatin {
        h.extend([
            "Gallatin malloc",
            "Gallatin free",
            "carve_malloc / Gallatin",
            "carve_free / Gallatin",
        ]);
    }
    h.extend(["CUDA malloc", "CUDA free"]);
    h
}

/// One row of the mixed-size table.
#[derive(Debug, Clone, Default)]
pub(super) struct MixedRow {
    pub log_n: u32,
    pub max: u64,
    pub heap_gib: f64,
    /// `None`: the heap would pass 64 GiB, nothing was run.
    pub m: Option<MixedMeasured>,
}

/// What a row of the mixed-size table measured; `None` cells were not run.
#[derive(Debug, Clone, Default)]
pub(super) struct MixedMeasured {
    pub growth_ms: f64,
    pub malloc: f64,
    pub free: f64,
    pub failed: u64,
    pub floor: Option<floor::Rates>,
    pub gallatin: Option<Peer>,
    pub cuda: Option<(String, String)>,
}

/// A row of the mixed-size table, in the columns of [`mixed_header`]`(gallatin)`.
pub(super) fn mixed_cells(row: &MixedRow, gallatin: bool) -> Vec<String> {
    let mut c = vec![
        format!("2^{}", row.log_n),
        format!("16 B–{} KiB", row.max >> 10),
        format!("{:.1}", row.heap_gib),
    ];
    let Some(m) = &row.m else {
        let rest = mixed_header(gallatin).len() - c.len();
        c.extend(std::iter::repeat_n("(heap > 64 GiB)".to_string(), rest));
        return c;
    };
    c.extend([
        format!("{:.1} ms", m.growth_ms),
        rate(m.malloc),
        rate(m.free),
        m.failed.to_string(),
    ]);
    match m.floor {
        Some(f) => c.extend([
            rate(f.add_or),
            ratio(m.malloc, f.add_or),
            rate(f.and_sub),
            ratio(m.free, f.and_sub),
            rate(f.and),
            ratio(m.free, f.and),
        ]),
        None => c.extend(std::iter::repeat_n(dash(), 6)),
    }
    if gallatin {
        c.extend(peer_cells(m.gallatin, m.malloc, m.free));
    }
    match &m.cuda {
        Some((ma, fr)) => c.extend([ma.clone(), fr.clone()]),
        None => c.extend([dash(), dash()]),
    }
    c
}

/// The mixed-size table with `rows`.
pub(super) fn mixed_table(rows: &[MixedRow], gallatin: bool) -> Table {
    let mut t = Table::new(MIXED_TITLE, &mixed_header(gallatin));
    for r in rows {
        t.row(mixed_cells(r, gallatin));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slab_row(gallatin: Option<Peer>) -> SlabRow {
        SlabRow {
            log_n: 24,
            block: 16,
            empty_ms: 0.046,
            m: Some(SlabMeasured {
                atomic_add: Some("42.9".into()),
                bump: Some("124.6".into()),
                bump_block: Some("46.1".into()),
                slab: (118.0, 122.0),
                relaxed: Some((151.0, 165.5)),
                fill50: Some(118.6),
                fill90: Some(117.0),
                gallatin,
                cuda: None,
            }),
        }
    }

    fn mixed_row(gallatin: Option<Peer>) -> MixedRow {
        MixedRow {
            log_n: 22,
            max: 4096,
            heap_gib: 10.9,
            m: Some(MixedMeasured {
                growth_ms: 2.0,
                malloc: 19.6,
                free: 35.8,
                failed: 0,
                floor: Some(floor::Rates {
                    add: 90.1,
                    add_or: 62.0,
                    and_sub: 62.1,
                    and: 81.1,
                    cache: 131.7,
                }),
                gallatin,
                cuda: None,
            }),
        }
    }

    /// The cell of `table`'s `row` under `column`.
    fn cell<'a>(t: &'a Table, row: usize, column: &str) -> &'a str {
        let c = t.header.iter().position(|h| h == column).unwrap();
        &t.rows[row][c]
    }

    #[test]
    fn every_row_fills_every_column() {
        for g in [false, true] {
            let peer = g.then_some(Peer {
                alloc: 17.1,
                free: 78.4,
                failed: 0,
            });
            let big = SlabRow {
                log_n: 26,
                block: 4096,
                empty_ms: 0.165,
                m: None,
            };
            let t = slab_table(&[slab_row(peer), slab_row(None), big], g);
            assert!(t.rows.iter().all(|r| r.len() == t.header.len()));
            let big = MixedRow {
                log_n: 22,
                max: 65536,
                heap_gib: 170.0,
                m: None,
            };
            let t = mixed_table(&[mixed_row(peer), mixed_row(None), big], g);
            assert!(t.rows.iter().all(|r| r.len() == t.header.len()));
            assert_eq!(t.rows[2][3], "(heap > 64 GiB)");
        }
    }

    #[test]
    fn gallatin_columns_only_when_it_was_built() {
        let without = slab_header(false);
        let with = slab_header(true);
        assert!(!without.iter().any(|h| h.contains("Gallatin")));
        assert_eq!(with.len(), without.len() + 4);
        // CUDA's columns stay last.
        assert_eq!(&with[with.len() - 2..], ["CUDA malloc", "CUDA free"]);
        assert_eq!(mixed_header(true).len(), mixed_header(false).len() + 4);
    }

    #[test]
    fn the_slab_row_sits_beside_its_floor_and_gallatin() {
        let peer = Peer {
            alloc: 17.1,
            free: 78.4,
            failed: 0,
        };
        let t = slab_table(&[slab_row(Some(peer)), slab_row(None)], true);
        assert_eq!(cell(&t, 0, "slab alloc (1.5×)"), "118.0");
        assert_eq!(cell(&t, 0, "relaxed alloc (floor)"), "151.0");
        assert_eq!(cell(&t, 0, "slab alloc / floor"), "0.78×");
        assert_eq!(cell(&t, 0, "slab free / floor"), "0.74×");
        assert_eq!(cell(&t, 0, "Gallatin alloc"), "17.1");
        assert_eq!(cell(&t, 0, "slab / Gallatin alloc"), "6.90×");
        assert_eq!(cell(&t, 0, "slab / Gallatin free"), "1.56×");
        // A row Gallatin gave nothing for keeps its place with dashes.
        assert_eq!(cell(&t, 1, "Gallatin free"), "–");
        assert_eq!(cell(&t, 1, "slab / Gallatin alloc"), "–");
        assert_eq!(cell(&t, 0, "CUDA malloc"), "–");
    }

    #[test]
    fn the_mixed_row_sits_beside_its_floors_and_gallatin() {
        let peer = Peer {
            alloc: 0.49,
            free: 52.1,
            failed: 7,
        };
        let t = mixed_table(&[mixed_row(Some(peer))], true);
        let expect = [
            ("carve_malloc", "19.6"),
            ("carve_free", "35.8"),
            ("malloc floor (fetch_add + fetch_or)", "62.0"),
            ("malloc / floor", "0.32×"),
            ("free floor, pair (fetch_and + fetch_sub)", "62.1"),
            ("free / pair floor", "0.58×"),
            ("free floor, one atomic (fetch_and)", "81.1"),
            ("free / one-atomic floor", "0.44×"),
            ("Gallatin malloc", "0.49 (7 failed)"),
            ("Gallatin free", "52.1"),
            ("carve_malloc / Gallatin", "40.00×"),
            ("carve_free / Gallatin", "0.69×"),
        ];
        for (column, v) in expect {
            assert_eq!(cell(&t, 0, column), v, "{column}");
        }
        let no_floor = MixedRow {
            m: Some(MixedMeasured {
                floor: None,
                ..mixed_row(None).m.unwrap()
            }),
            ..mixed_row(None)
        };
        let t = mixed_table(&[no_floor], false);
        assert_eq!(cell(&t, 0, "malloc / floor"), "–");
    }

    #[test]
    fn ratios_and_rates_format() {
        assert_eq!(ratio(35.8, 52.1), "0.69×");
        assert_eq!(ratio(1.0, 0.0), "–");
        assert_eq!(ratio(0.0, 0.0), "–");
        assert_eq!(peer_rate(2.184), "2.18");
        assert_eq!(peer_rate(105.14), "105.1");
        assert_eq!(with_failures("1.0".into(), 0), "1.0");
        assert_eq!(with_failures("1.0".into(), 2), "1.0 (2 failed)");
    }
}
