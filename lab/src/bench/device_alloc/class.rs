//! The per-class table: one size at a time through `carve_malloc`, beside the slab of that
//! block size, the floor that bounds it.

use carve::{DeviceHeap, DeviceVec};
use carve_kernels::size_class::{class_of, class_size};

use super::args::or_default;
use super::slab::slab;
use super::timing::{per_s, time_alloc_free, Ctx};
use crate::bench::table::Table;

/// One size at a time through `carve_malloc` (every thread asks the class size, so the warp
/// takes its class's straight-line path), against the slab of that block size in the same run:
/// what the general heap's class lookup and header cost a single class.
pub(super) fn table(c: &Ctx, quick: bool) -> carve::Result<Table> {
    let mut table = Table::new(
        "device_alloc, one class at a time: carve_malloc / carve_free of one size against \
         carve_slab_alloc / carve_slab_free of that block size (G requests/s; median of 5)",
        &[
            "N",
            "bytes",
            "carve_malloc",
            "carve_free",
            "slab alloc",
            "slab free",
            "malloc / slab alloc",
            "free / slab free",
        ],
    );
    let sizes = or_default(
        &c.args.class_bytes,
        if quick {
            vec![16, 4096]
        } else {
            vec![16, 64, 256, 1024, 4096, 16384, 65536]
        },
    );
    // The largest N (log2), for the rows to meet the slab table's 2^24.
    let max_log_n = c.args.class_log_threads.unwrap_or(22);
    for bytes in sizes {
        // A class's own size, so that both heaps hand out blocks of exactly `bytes`.
        let class = u32::try_from(bytes).ok().and_then(class_of);
        if class.is_none_or(|k| class_size(k) as u64 != bytes) {
            return Err(carve::Error::InvalidArgument(format!(
                "--class-bytes: {bytes} is not the size of a class \
                 (16, 32, 48, 64, 80, 96, 112, 128, 160, ... 65536)"
            )));
        }
        // Every one of the 44 classes gets the bytes this size needs (equal strides), so N
        // shrinks with the size to keep the heap under 44 GiB.
        let log_n = (29 - bytes.next_power_of_two().trailing_zeros()).min(max_log_n);
        let n = 1u64 << log_n;
        let per_class = (n * bytes * 2).next_power_of_two();
        let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
        let heap = DeviceHeap::general(c.mr.clone(), &c.stream, per_class)?;
        let (k, h, o) = (c.kernels(), heap.device_ptr(), out.as_ptr());
        // SAFETY: `out` holds n u64s; the heap lives until the end of the row; each free takes
        // back exactly what the allocation before it wrote.
        let alloc = || unsafe { k.general_malloc_one_bench(n, h, o, n, bytes) };
        // SAFETY: as above.
        let free = || unsafe { k.general_free_bench(n, h, o, n) };
        let (alloc_ms, free_ms) = time_alloc_free(c, alloc, free)?;
        free()?;
        let s = heap.stats()?;
        if s.failed_allocs > 0 || s.double_frees > 0 || s.foreign_frees > 0 || s.in_use > 0 {
            return Err(carve::Error::InvalidArgument(format!(
                "per-class bench at {bytes} B: {s:?}"
            )));
        }
        drop(heap);
        let (m, f) = (per_s(n, alloc_ms), per_s(n, free_ms));
        let (sa, sf) = slab(c, n, bytes, n + n / 2, &out, false)?;
        table.row(vec![
            format!("2^{log_n}"),
            bytes.to_string(),
            format!("{m:.1}"),
            format!("{f:.1}"),
            format!("{sa:.1}"),
            format!("{sf:.1}"),
            format!("{:.2}×", m / sa),
            format!("{:.2}×", f / sf),
        ]);
    }
    table.note(
        "carve_malloc: a general heap (DeviceHeap::general) whose every class holds twice the \
         row's bytes; slab: a slab heap of 1.5 N blocks of that size, as in the first table.",
    );
    Ok(table)
}
