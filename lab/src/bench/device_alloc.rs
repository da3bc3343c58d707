//! In-kernel allocation: N threads each make one request, one kernel timed with events, median
//! of several runs after a warm-up. Peers in the same run: the empty kernel (launch floor), one
//! `atomicAdd` per thread (the single-counter bump limit), CUDA's in-kernel malloc/free
//! (time-bounded), carve's bump arena and carve's slab beside its relaxed floor, and Gallatin
//! when a checkout is given (`--gallatin DIR`). A second table: mixed sizes through
//! `carve_malloc` / `carve_free` (the general heap) beside the floor of their atomics, Gallatin,
//! and CUDA's malloc on the same sizes; then the floor table and one class at a time.

use std::sync::Arc;

use carve::cudarc::driver::{result, sys};
use carve::CudaMemoryResource;

use super::table::Table;

mod args;
mod class;
mod floor;
mod gallatin;
mod layout;
mod mixed;
mod slab;
mod timing;

pub use args::{DeviceAllocArgs, Only, SlabHeap};

use args::or_default;
use timing::{Ctx, MALLOC_LIMIT};

/// The note that says why the Gallatin columns are left out.
fn left_out(why: &str) -> String {
    format!("Gallatin columns left out: {why}.")
}

/// The device-alloc tables that `args` asks for (all four by default).
pub fn run(quick: bool, args: &DeviceAllocArgs) -> carve::Result<Vec<Table>> {
    if let Some(g) = args.gallatin_heap_gib {
        if !(g.is_finite() && g > 0.0) {
            return Err(carve::Error::InvalidArgument(format!(
                "--gallatin-heap-gib {g}: give a positive number of GiB"
            )));
        }
    }
    // The cheap checks first, so that a machine without a GPU still says why Gallatin is out.
    let found = gallatin::find(args.gallatin.as_deref());
    let mut first = layout::slab_table(&[], false);
    let Some(dev) = super::device_or_note(&mut first) else {
        if let Err(why) = &found {
            first.note(left_out(why));
        }
        return Ok(vec![first]);
    };
    dev.bind()?;
    let malloc_heap = 1usize << 30;
    // Set on the bound context before any launch that uses device malloc.
    result::ctx::set_limit(sys::CUlimit::CU_LIMIT_MALLOC_HEAP_SIZE, malloc_heap)
        .map_err(|e| carve::Error::InvalidArgument(format!("cuCtxSetLimit: {e:?}")))?;
    let c = Ctx {
        stream: dev.new_stream()?,
        mr: Arc::new(CudaMemoryResource::new(&dev)),
        dev,
        args: args.clone(),
    };
    let props = c.dev.properties()?;
    // Built once, for the tables that carry Gallatin.
    let (harness, gallatin_note) = match args.only {
        Some(Only::Class | Only::Floor) => (None, None),
        Some(Only::Slab | Only::Mixed) | None => {
            let built = found.and_then(|f| {
                eprintln!("device-alloc: building the Gallatin harness with nvcc");
                f.build(props.compute_capability)
            });
            match built {
                Ok(h) => {
                    let note = format!("Gallatin: lab/gallatin/harness.cu, {}.", h.built);
                    (Some(h), Some(note))
                }
                Err(why) => (None, Some(left_out(&why))),
            }
        }
    };
    let harness = harness.as_ref();
    match args.only {
        Some(Only::Class) => return Ok(vec![class::table(&c, quick)?]),
        Some(Only::Floor) => return Ok(vec![floor::table(&c, quick)?]),
        Some(Only::Mixed) => {
            let mut t = mixed::table(&c, quick, harness)?;
            t.notes.extend(gallatin_note);
            return Ok(vec![t]);
        }
        Some(Only::Slab) | None => {}
    }
    let ns = or_default(
        &args.log_threads,
        if quick {
            vec![20, 22]
        } else {
            vec![20, 22, 24, 26]
        },
    );
    let sizes = or_default(
        &args.block,
        if quick {
            vec![16, 1024]
        } else {
            vec![16, 64, 256, 1024, 4096]
        },
    );
    // Only the slab's alloc and free columns (and Gallatin's), for a focused run.
    let slab_only = args.only == Some(Only::Slab);
    let mut notes = Vec::new();
    let rows = slab::rows(&c, &ns, &sizes, slab_only, harness, &mut notes)?;
    let mut table = layout::slab_table(&rows, harness.is_some());
    table.note(format!(
        "device: {}, {} SMs. Slab heaps hold 1.5 N blocks (or N / 0.9 for the 90 % column), \
         each in a virtual range of its own (--slab-heap cuda: cuMemAlloc); \
         bump arenas N × block × 1.5 bytes, reset between runs. Slab and CUDA malloc kernels \
         store each pointer (8 B/thread); atomicAdd and bump kernels keep theirs in a register. \
         CUDA malloc runs only at N = 2^20 (heap limit {} MiB) and is bounded to {} s.",
        props.name,
        props.multiprocessors,
        malloc_heap >> 20,
        MALLOC_LIMIT.as_secs()
    ));
    if !slab_only {
        table.note(
            "Floor: the same slab with relaxed bitmap atomics (no Acquire/Release; not a \
             correct heap), the ceiling of the slab's design; the two columns after it are the \
             slab's fraction of it. The empty kernel is the launch floor of every column.",
        );
    }
    if harness.is_some() {
        table.note(
            "Gallatin<16 MiB, 16, 4096>: the same N and block size, timed alike (one untimed \
             run, the median of 5; alloc after a free, free after an alloc); its heap is twice \
             the bytes it hands out plus 1 GiB, unless --gallatin-heap-gib sets it; failed \
             counts its null pointers over every launch.",
        );
    }
    table.notes.extend(gallatin_note.clone());
    table.notes.extend(notes);
    if slab_only {
        table.note("--only slab: slab alloc and free only (and Gallatin's, when built).");
        return Ok(vec![table]);
    }
    let mut mixed = mixed::table(&c, quick, harness)?;
    if harness.is_none() {
        mixed.notes.extend(gallatin_note);
    }
    let floor = floor::table(&c, quick)?;
    let classes = class::table(&c, quick)?;
    Ok(vec![table, mixed, floor, classes])
}
