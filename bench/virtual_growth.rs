//! What growing costs: one allocation of N bytes from a fresh virtual-memory resource (which
//! creates and maps N / chunk chunks), from a fresh expandable pool (32 MiB pages), and from
//! cuMemAlloc, side by side on the device. Median of the repetitions, µs per allocation.

use std::time::Instant;

use carve::resource::{CudaBackingOptions, ExpandableOptions, VirtualOptions};
use carve::{
    CudaMemoryResource, Device, ExpandableMemoryResource, MemoryResource, StreamRef,
    VirtualMemoryResource,
};

use super::table::Table;

const SIZES: [usize; 4] = [2 << 20, 32 << 20, 256 << 20, 1 << 30];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// µs for one `allocate(bytes)` on `mr`, then frees it (untimed).
fn once(mr: &dyn MemoryResource, bytes: usize) -> carve::Result<f64> {
    let t = Instant::now();
    let p = mr.allocate(StreamRef::DEFAULT, bytes, 256)?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    // SAFETY: from `mr` with these arguments, freed once; nothing used it.
    unsafe { mr.deallocate_sync(p, bytes, 256)? };
    Ok(us)
}

pub fn run(quick: bool) -> carve::Result<Table> {
    let reps = if quick { 1 } else { 7 };
    let mut table = Table::new(
        "virtual_growth: one allocation that maps new memory (µs, median)",
        &[
            "bytes",
            "cuMemAlloc",
            "virtual (2 MiB chunks)",
            "ratio",
            "expandable (32 MiB pages)",
            "ratio",
        ],
    );
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            table.note(format!("no GPU ({e}): nothing measured"));
            return Ok(table);
        }
    };
    table.note(format!("device: {}", dev.properties()?.name));
    let cuda = CudaMemoryResource::new(&dev);
    for bytes in SIZES {
        let (mut c, mut v, mut x) = (vec![], vec![], vec![]);
        for _ in 0..reps {
            c.push(once(&cuda, bytes)?);
            let r = VirtualMemoryResource::on_device(
                &dev,
                CudaBackingOptions::default(),
                VirtualOptions::new(),
            )?;
            v.push(once(&r, bytes)?);
            let e = ExpandableMemoryResource::on_device(
                &dev,
                CudaBackingOptions::default(),
                ExpandableOptions::default(),
            )?;
            x.push(once(&e, bytes)?);
        }
        let (c, v, x) = (median(c), median(v), median(x));
        table.row(vec![
            format!("{} MiB", bytes >> 20),
            format!("{c:.1}"),
            format!("{v:.1}"),
            format!("{:.2}×", v / c),
            format!("{x:.1}"),
            format!("{:.2}×", x / c),
        ]);
    }
    Ok(table)
}
