//! GPU tests of the virtual-memory resource, the expandable pool and graph-safe allocation:
//! kernels write and check memory that was mapped, moved and captured. Each skips (saying why)
//! without a GPU, and fails instead under CARVE_REQUIRE_GPU=1.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use carve::cudarc::driver::{result, sys};
use carve::resource::{
    CudaBackingOptions, ExpandableOptions, GraphSafeMemoryResource, VirtualOptions,
};
use carve::{
    require_gpu, CudaMemoryResource, Device, Error, ExpandableMemoryResource, MemoryResource,
    Stream, VirtualMemoryResource,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const MIB: usize = 1 << 20;

/// One test at a time: the resources' trims, and moves while several streams hold free blocks,
/// synchronise the whole device (`cuCtxSynchronize`), which fails, and invalidates the capture,
/// while another test's stream captures a graph in this process.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies `n` words at `ptr` to the host (after the stream's work).
fn read(s: &Stream, ptr: usize, n: usize) -> Vec<u32> {
    s.synchronize().unwrap();
    let mut out = vec![0u32; n];
    // SAFETY: `ptr` is a live device block of at least `n` words; the stream is idle.
    unsafe { result::memcpy_dtoh_sync(&mut out, ptr as sys::CUdeviceptr) }.unwrap();
    out
}

/// Writes `pattern(i) + delta` into `n` words at `ptr`.
fn fill(dev: &Device, s: &Stream, ptr: usize, n: usize, delta: u32) {
    let k = dev.test_kernels().unwrap();
    // SAFETY: `ptr` is a live device block of at least `n` words, used only by this stream.
    unsafe {
        k.smoke_fill(s, ptr as u64, n as u32).unwrap();
        k.smoke_add(s, ptr as u64, n as u32, delta).unwrap();
    }
}

fn check(s: &Stream, ptr: usize, n: usize, delta: u32, what: &str) {
    let got = read(s, ptr, n);
    for (i, &x) in got.iter().enumerate() {
        assert_eq!(x, pattern(i as u32).wrapping_add(delta), "{what}: word {i}");
    }
}

fn free(mr: &dyn MemoryResource, s: &Stream, p: usize, bytes: usize) {
    // SAFETY: `p` came from `mr` with `bytes`; the stream orders the free after its work.
    unsafe { mr.deallocate(s.as_ref(), NonNull::new(p as *mut u8).unwrap(), bytes, 256) }.unwrap();
}

/// An expandable pool of at most `maximum` bytes whose large range is filled with one block per
/// page (block `i` holding `pattern + i`), every other block then freed on `s`: half its pages
/// free and apart, so a request for `holes` bytes must move them.
struct Checkerboard {
    r: ExpandableMemoryResource,
    page: usize,
    blocks: Vec<usize>,
    holes: usize,
}

impl Checkerboard {
    fn new(dev: &Device, s: &Stream, maximum: usize) -> Self {
        let r = ExpandableMemoryResource::on_device(
            dev,
            CudaBackingOptions::default(),
            ExpandableOptions {
                maximum: Some(maximum),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let page = r.stats().large.chunk_size;
        let count = maximum / page;
        let blocks: Vec<usize> = (0..count)
            .map(|i| {
                let p = r.allocate(s.as_ref(), page, 256).unwrap().as_ptr() as usize;
                fill(dev, s, p, page / 4, i as u32);
                p
            })
            .collect();
        for &p in blocks.iter().step_by(2) {
            free(&r, s, p, page);
        }
        let holes = count / 2 * page;
        Checkerboard {
            r,
            page,
            blocks,
            holes,
        }
    }

    /// Checks `big` (the moved pages, filled with `delta`) and the live blocks, then frees them.
    fn check_and_free(&self, s: &Stream, big: usize, delta: u32) {
        check(s, big, self.holes / 4, delta, "moved pages");
        for (i, &p) in self.blocks.iter().enumerate().skip(1).step_by(2) {
            check(s, p, self.page / 4, i as u32, "live block");
        }
        self.r.check_invariants().unwrap();
        free(&self.r, s, big, self.holes);
        for &p in self.blocks.iter().skip(1).step_by(2) {
            free(&self.r, s, p, self.page);
        }
    }
}

#[test]
fn virtual_resource_maps_grows_in_place_and_trims() {
    let _serial = serial();
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let r = VirtualMemoryResource::on_device(
        &dev,
        CudaBackingOptions::default(),
        VirtualOptions::new().maximum(1 << 30),
    )
    .unwrap();
    let mut blocks = vec![];
    for i in 0..40usize {
        let bytes = (i % 7 + 1) * 3 * MIB + 4;
        let p = r.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
        assert!(p >= r.base() && p < r.base() + r.stats().reserved);
        fill(&dev, &s, p, bytes / 4, i as u32);
        blocks.push((p, bytes, i as u32));
    }
    for &(p, bytes, d) in &blocks {
        check(&s, p, bytes / 4, d, "virtual block");
    }
    r.check_invariants().unwrap();
    for (p, bytes, _) in blocks.drain(..) {
        free(&r, &s, p, bytes);
    }
    let mapped = r.stats().mapped;
    assert_eq!(r.trim().unwrap(), mapped);
    assert_eq!(r.stats().mapped, 0);
}

/// A block goes where its pages are still mapped, inside a free block whose start was trimmed:
/// no driver call, and every live block keeps its contents; the trimmed start maps again.
#[test]
fn expandable_blocks_land_on_mapped_pages_first() {
    let _serial = serial();
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let r = VirtualMemoryResource::on_device(
        &dev,
        CudaBackingOptions::default(),
        VirtualOptions::expandable().maximum(64 * MIB),
    )
    .unwrap();
    let page = r.stats().chunk_size;
    let two = 2 * page;
    let take = |bytes: usize| r.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
    let (a, b, guard) = (take(two), take(two), take(page));
    for (i, &p) in [a, b].iter().enumerate() {
        fill(&dev, &s, p, two / 4, i as u32);
    }
    fill(&dev, &s, guard, page / 4, 7);
    free(&r, &s, a, two);
    r.trim().unwrap();
    free(&r, &s, b, two);
    let before = r.stats();
    let x = take(two);
    assert_eq!(x, b, "the mapped end of the free block");
    let st = r.stats();
    assert_eq!(
        (st.chunks_created, st.chunks_moved),
        (before.chunks_created, 0),
        "{st:?}"
    );
    assert_eq!(st.maps, before.maps, "no driver call: {st:?}");
    fill(&dev, &s, x, two / 4, 11);
    let y = take(two);
    assert_eq!(y, a, "the trimmed start maps again");
    fill(&dev, &s, y, two / 4, 12);
    check(&s, x, two / 4, 11, "block on mapped pages");
    check(&s, y, two / 4, 12, "block on pages mapped again");
    check(&s, guard, page / 4, 7, "live neighbour");
    r.check_invariants().unwrap();
    for (p, bytes) in [(x, two), (y, two), (guard, page)] {
        free(&r, &s, p, bytes);
    }
    r.trim().unwrap();
    assert_eq!(r.stats().mapped, 0);
}

/// With `mark_every_free`, a block freed on one stream goes to another stream as soon as the
/// device is past it: no wait and no synchronisation. Without, the other stream reaches it only
/// through a device-wide synchronisation.
#[test]
fn marking_every_free_hands_a_done_block_to_another_stream() {
    let _serial = serial();
    let dev = require_gpu!();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    for every in [true, false] {
        let mut options = VirtualOptions::expandable().maximum(64 * MIB);
        options.mark_every_free = every;
        let r =
            VirtualMemoryResource::on_device(&dev, CudaBackingOptions::default(), options).unwrap();
        let page = r.stats().chunk_size;
        let take = |s: &Stream| r.allocate(s.as_ref(), page, 256).unwrap().as_ptr() as usize;
        let on_b = take(&b);
        let x = take(&a);
        fill(&dev, &a, x, page / 4, 3);
        free(&r, &a, x, page);
        a.synchronize().unwrap();
        let before = r.stats();
        let y = take(&b);
        let st = r.stats();
        assert_eq!(y, x, "{st:?}");
        assert_eq!(st.maps, before.maps, "no page mapped: {st:?}");
        if every {
            assert!(before.marks >= 1 && st.mark_queries >= 1, "{st:?}");
            assert_eq!(st.synchronizations, 0, "{st:?}");
        } else {
            assert_eq!((st.marks, st.mark_queries), (0, 0), "{st:?}");
            assert_eq!(st.synchronizations, 1, "{st:?}");
        }
        fill(&dev, &b, y, page / 4, 5);
        check(&b, y, page / 4, 5, "block taken on the second stream");
        r.check_invariants().unwrap();
        for p in [on_b, y] {
            free(&r, &b, p, page);
        }
    }
}

/// Scattered free pages move to serve a large request; live blocks keep their contents.
#[test]
fn expandable_pool_moves_free_pages_and_keeps_live_data() {
    let _serial = serial();
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let board = Checkerboard::new(&dev, &s, 512 * MIB);
    let r = &board.r;
    let big = r.allocate(s.as_ref(), board.holes, 256).unwrap().as_ptr() as usize;
    fill(&dev, &s, big, board.holes / 4, 99);
    let st = r.stats();
    assert!(
        st.large.chunks_moved >= (board.blocks.len() / 2) as u64,
        "{st:?}"
    );
    assert!(st.peak_physical <= 512 * MIB, "{st:?}");
    // The driver calls the replay report prints, counted by the backing and by each range.
    let (sm, lg) = (st.small, st.large);
    assert_eq!(
        st.calls.creates,
        sm.chunks_created + lg.chunks_created,
        "{st:?}"
    );
    assert_eq!(st.calls.maps, sm.maps + lg.maps, "{st:?}");
    assert_eq!(lg.maps, lg.chunks_created + lg.chunks_moved, "{st:?}");
    assert_eq!(
        st.calls.unmaps,
        lg.chunks_moved + lg.chunks_released,
        "{st:?}"
    );
    // One stream freed every block: a move waits for that stream, not the device.
    assert!(
        lg.stream_synchronizations >= 1 && lg.synchronizations == 0,
        "a move waits for the freeing stream: {st:?}"
    );
    board.check_and_free(&s, big, 99);
    r.trim().unwrap();
    assert_eq!(r.stats().physical, 0);
}

#[test]
fn exported_chunks_are_file_descriptors() {
    let _serial = serial();
    let dev = require_gpu!();
    let backing = CudaBackingOptions {
        exportable: true,
        ..CudaBackingOptions::default()
    };
    let r = match VirtualMemoryResource::on_device(&dev, backing, VirtualOptions::new()) {
        Ok(r) => r,
        Err(Error::Unsupported(why)) => {
            eprintln!("SKIPPED exported_chunks_are_file_descriptors: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let p = r.allocate_sync(5 * MIB, 256).unwrap();
    let (fd, start, size) = r.export_chunk(p).unwrap();
    use std::os::fd::AsRawFd;
    assert!(fd.as_raw_fd() >= 0);
    assert!(start <= p.as_ptr() as usize && (p.as_ptr() as usize) < start + size);
    // SAFETY: from `r` with these arguments.
    unsafe { r.deallocate_sync(p, 5 * MIB, 256) }.unwrap();
    let plain = VirtualMemoryResource::on_device(
        &dev,
        CudaBackingOptions::default(),
        VirtualOptions::new(),
    )
    .unwrap();
    let q = plain.allocate_sync(MIB, 256).unwrap();
    assert!(matches!(plain.export_chunk(q), Err(Error::Unsupported(_))));
    // SAFETY: as above.
    unsafe { plain.deallocate_sync(q, MIB, 256) }.unwrap();
}

/// A move of free pages while another thread captures a graph (global mode) on another stream:
/// the move waits for the stream that freed the pages, not the device, and its driver calls run
/// in relaxed capture mode, so the capture ends with a graph that runs.
#[test]
fn a_page_move_leaves_another_threads_capture_alone() {
    let _serial = serial();
    let dev = require_gpu!();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let cuda = CudaMemoryResource::new(&dev);
    let n = 1 << 16;
    let buf = cuda.allocate(s1.as_ref(), n * 4, 256).unwrap().as_ptr() as usize;
    // Loads the test module outside the capture.
    fill(&dev, &s1, buf, n, 0);
    s1.synchronize().unwrap();
    let board = Checkerboard::new(&dev, &s2, 256 * MIB);
    let (r, big_bytes) = (&board.r, board.holes);
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let big = std::thread::scope(|scope| {
        let (dev, s1) = (&dev, &s1);
        let capture = scope.spawn(move || {
            dev.bind().unwrap();
            s1.cudarc()
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
                .unwrap();
            started_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            fill(dev, s1, buf, n, 5);
            let graph = s1
                .cudarc()
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .expect("the capture survived the move")
                .expect("a graph");
            graph.launch().unwrap();
            check(s1, buf, n, 5, "the captured fill");
        });
        started_rx.recv().unwrap();
        let big = r.allocate(s2.as_ref(), big_bytes, 256);
        go_tx.send(()).unwrap();
        capture.join().unwrap();
        big
    });
    let big = big.unwrap().as_ptr() as usize;
    let lg = r.stats().large;
    assert!(lg.chunks_moved >= (board.blocks.len() / 2) as u64, "{lg:?}");
    assert_eq!(lg.synchronizations, 0, "{lg:?}");
    assert!(lg.stream_synchronizations >= 1, "{lg:?}");
    fill(&dev, &s2, big, big_bytes / 4, 77);
    board.check_and_free(&s2, big, 77);
    free(&cuda, &s1, buf, n * 4);
}

/// Kernels that allocate, captured once and launched 100 times: the results are right every
/// time, the captured addresses never change hands, and memory allocated between launches
/// (outside capture) never overlaps them. A plain cuMemAlloc resource refuses the captured
/// stream with a typed error, and the capture survives it.
#[test]
fn graph_captured_allocations_keep_their_addresses_across_launches() {
    let _serial = serial();
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let cuda = CudaMemoryResource::new(&dev);
    let mr = GraphSafeMemoryResource::new(cuda.clone());
    let n = 1 << 16;
    let bytes = n * 4;
    let before = mr.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
    // Loads the test module outside the capture (loading is not a call to make inside one).
    fill(&dev, &s, before, n, 0);
    s.synchronize().unwrap();
    s.cudarc()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    // cuMemFree here would invalidate the capture: deferred to the next uncaptured call.
    free(&mr, &s, before, bytes);
    assert_eq!(mr.pending_frees(), 1);
    assert!(matches!(
        cuda.allocate(s.as_ref(), bytes, 256),
        Err(Error::StreamCapture { .. })
    ));
    let a = mr.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
    fill(&dev, &s, a, n, 1);
    let b = mr.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
    fill(&dev, &s, b, n, 2);
    free(&mr, &s, a, bytes); // deferred: the graph writes `a` on every launch
    let c = mr.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
    assert!(
        c + bytes <= a || a + bytes <= c,
        "a deferred block was reused"
    );
    fill(&dev, &s, c, n, 3);
    let graph = s
        .cudarc()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    let capture = mr
        .graph_pool_of(NonNull::new(b as *mut u8).unwrap())
        .unwrap();
    assert_eq!(mr.pending_frees(), 1);
    for launch in 0..100 {
        // Other work between launches allocates outside capture, from the upstream.
        let other = mr.allocate(s.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
        assert_eq!(mr.pending_frees(), 0);
        for &g in &[a, b, c] {
            assert!(other + bytes <= g || g + bytes <= other, "launch {launch}");
        }
        fill(&dev, &s, other, n, 1000);
        graph.launch().unwrap();
        if launch % 10 == 0 || launch == 99 {
            check(&s, a, n, 1, "a");
            check(&s, b, n, 2, "b");
            check(&s, c, n, 3, "c");
        }
        free(&mr, &s, other, bytes);
    }
    dev.synchronize().unwrap();
    let pools = mr.graph_pools();
    assert_eq!(pools.len(), 1);
    assert_eq!((pools[0].blocks, pools[0].deferred_frees), (3, 1));
    drop(graph);
    // SAFETY: the graph is destroyed; nothing uses a, b or c any more.
    assert!(unsafe { mr.release_graph_pool(capture) }.unwrap() >= 3 * bytes);
    assert!(mr.graph_pools().is_empty());
}

#[test]
fn non_capturing_streams_go_to_the_upstream() {
    let _serial = serial();
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let mr = GraphSafeMemoryResource::new(Arc::new(CudaMemoryResource::new(&dev)));
    let p = mr.allocate(s.as_ref(), 1000, 256).unwrap();
    assert!(mr.graph_pool_of(p).is_none());
    // SAFETY: from `mr` with these arguments.
    unsafe { mr.deallocate(s.as_ref(), p, 1000, 256) }.unwrap();
}
