//! What growing costs: one allocation of N bytes from a fresh virtual-memory resource (which
//! creates and maps N / chunk chunks), from a fresh expandable pool (32 MiB pages), and from
//! cuMemAlloc, side by side on the device. Median of the repetitions, µs per allocation. And the
//! driver calls such growth is made of, one by one ([`calls`]).

use std::time::Instant;

use carve::resource::{
    CudaBacking, CudaBackingOptions, ExpandableOptions, PhysicalBacking, VirtualOptions,
};
use carve::{
    CudaMemoryResource, ExpandableMemoryResource, MemoryResource, StreamRef, VirtualMemoryResource,
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

/// The growth table (`--quick`: fewer sizes and repetitions).
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
    let Some(dev) = super::device_or_note(&mut table) else {
        return Ok(table);
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

/// µs for `f`, and what it returned.
fn timed<T>(f: impl FnOnce() -> carve::Result<T>) -> carve::Result<(T, f64)> {
    let t = Instant::now();
    let out = f()?;
    Ok((out, t.elapsed().as_secs_f64() * 1e6))
}

/// The driver's virtual memory calls one by one, per chunk size: what creating, moving and
/// trimming a page is made of (a create is cuMemCreate + cuMemMap + cuMemSetAccess; a move is a
/// device-wide synchronisation + cuMemUnmap + cuMemMap + cuMemSetAccess), and what one access
/// grant over eight mappings costs against eight grants. Median of the repetitions.
pub fn calls(quick: bool) -> carve::Result<Table> {
    let reps = if quick { 1 } else { 7 };
    let mut table = Table::new(
        "virtual_growth: the driver's calls one by one (µs, median)",
        &[
            "chunk",
            "cuMemCreate",
            "cuMemMap",
            "cuMemSetAccess",
            "cuMemUnmap",
            "cuMemRelease",
            "synchronise (idle device)",
        ],
    );
    let Some(dev) = super::device_or_note(&mut table) else {
        return Ok(table);
    };
    table.note(format!("device: {}", dev.properties()?.name));
    let b = CudaBacking::new(&dev, CudaBackingOptions::default())?;
    let row = |label: String, cols: [Vec<f64>; 6]| -> Vec<String> {
        let mut r = vec![label];
        r.extend(cols.map(|c| format!("{:.1}", median(c))));
        r
    };
    for bytes in SIZES {
        let va = b.reserve(bytes, b.granularity())?;
        let mut cols: [Vec<f64>; 6] = Default::default();
        for _ in 0..reps {
            let (h, create) = timed(|| b.create(bytes))?;
            // SAFETY: `[va, va + bytes)` is our reservation with nothing mapped; `h` is a live
            // chunk of `bytes`.
            let ((), map) = timed(|| unsafe { b.map(va, bytes, h) })?;
            // SAFETY: the whole range was mapped just above.
            let ((), access) = timed(|| unsafe { b.set_access(va, bytes) })?;
            let ((), sync) = timed(|| dev.synchronize())?;
            // SAFETY: exactly the mapping made above; nothing ever used it.
            let ((), unmap) = timed(|| unsafe { b.unmap(va, bytes) })?;
            // SAFETY: `h` came from `create(bytes)`, is mapped nowhere now and not used again.
            let ((), release) = timed(|| unsafe { b.release(h, bytes) })?;
            for (c, us) in cols
                .iter_mut()
                .zip([create, map, access, unmap, release, sync])
            {
                c.push(us);
            }
        }
        // SAFETY: our reservation, nothing mapped in it any more.
        unsafe { b.free_reservation(va, bytes)? };
        table.row(row(format!("{} MiB", bytes >> 20), cols));
    }
    // Eight 32 MiB chunks mapped side by side, then one access grant over all of them: the
    // per-chunk columns are means over the eight, the access column the one grant.
    let (page, n) = (32 << 20, 8);
    let va = b.reserve(n * page, b.granularity())?;
    let mut cols: [Vec<f64>; 6] = Default::default();
    for _ in 0..reps {
        let (mut create, mut map, mut unmap, mut release) = (0.0, 0.0, 0.0, 0.0);
        let mut handles = vec![];
        for i in 0..n {
            let (h, us) = timed(|| b.create(page))?;
            create += us;
            // SAFETY: page `i` of our reservation is unmapped; `h` is a live chunk of `page`.
            let ((), us) = timed(|| unsafe { b.map(va + i * page, page, h) })?;
            map += us;
            handles.push(h);
        }
        // SAFETY: every byte of the range was mapped just above.
        let ((), access) = timed(|| unsafe { b.set_access(va, n * page) })?;
        let ((), sync) = timed(|| dev.synchronize())?;
        for (i, &h) in handles.iter().enumerate() {
            // SAFETY: page `i` was mapped once above with exactly this range; nothing used it.
            let ((), us) = timed(|| unsafe { b.unmap(va + i * page, page) })?;
            unmap += us;
            // SAFETY: `h` came from `create(page)`, is mapped nowhere now and not used again.
            let ((), us) = timed(|| unsafe { b.release(h, page) })?;
            release += us;
        }
        let k = n as f64;
        for (c, us) in
            cols.iter_mut()
                .zip([create / k, map / k, access, unmap / k, release / k, sync])
        {
            c.push(us);
        }
    }
    // SAFETY: our reservation, nothing mapped in it any more.
    unsafe { b.free_reservation(va, n * page)? };
    table.row(row("8 × 32 MiB, one grant".to_owned(), cols));
    Ok(table)
}
