//! Allocate-then-free of one size in a loop, through each plain resource.

use std::time::Instant;

use carve::{CudaMemoryResource, Device, HostMemoryResource, MemoryResource, StreamRef};

use super::table::{ns, Table};

const SIZES: [usize; 3] = [256, 64 << 10, 1 << 20];

/// Mean ns per allocate and per deallocate of `bytes`, `iters` times.
fn time(mr: &dyn MemoryResource, bytes: usize, iters: usize) -> carve::Result<(f64, f64)> {
    let s = StreamRef::DEFAULT;
    let mut ptrs = Vec::with_capacity(iters);
    let t = Instant::now();
    for _ in 0..iters {
        ptrs.push(mr.allocate(s, bytes, 256)?);
    }
    let alloc = t.elapsed().as_nanos() as f64 / iters as f64;
    let t = Instant::now();
    for p in ptrs {
        // SAFETY: each pointer came from `mr` with these arguments and is freed once.
        unsafe { mr.deallocate(s, p, bytes, 256)? };
    }
    let free = t.elapsed().as_nanos() as f64 / iters as f64;
    Ok((alloc, free))
}

/// The alloc-free table (`--quick`: fewer iterations).
pub fn run(quick: bool) -> carve::Result<Table> {
    let iters = if quick { 100 } else { 2000 };
    let mut resources: Vec<(String, Box<dyn MemoryResource>)> = vec![(
        "host (std::alloc)".into(),
        Box::new(HostMemoryResource::new()),
    )];
    let mut table = Table::new(
        format!("alloc_free: {iters} allocations, then {iters} frees (ns/op)"),
        &["resource", "bytes", "allocate", "deallocate"],
    );
    match Device::get(0) {
        Ok(dev) => {
            let name = dev.properties()?.name;
            resources.push((
                "cuda (cuMemAlloc)".into(),
                Box::new(CudaMemoryResource::new(&dev)),
            ));
            table.note(format!("device: {name}"));
        }
        Err(e) => table.note(format!("no GPU ({e}): host resource only")),
    }
    for (name, mr) in &resources {
        for &bytes in &SIZES {
            time(mr.as_ref(), bytes, iters / 10)?; // warm-up
            let (a, f) = time(mr.as_ref(), bytes, iters)?;
            table.row(vec![name.clone(), bytes.to_string(), ns(a), ns(f)]);
        }
    }
    Ok(table)
}
