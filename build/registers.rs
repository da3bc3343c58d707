//! Register caps for the device heap's kernels, written into the PTX text by `build.rs`.
//!
//! rustc has no launch-bounds attribute, and ptxas sizes a kernel's register file for the
//! deepest function it may call: the heap kernels' rare out-of-line paths (a full slab, mixed
//! bump requests) would take them to ~60 registers and 50-60 % occupancy although the fast
//! paths fit in 32. A `.maxnreg 32` directive keeps every warp slot usable; ptxas spills in the
//! cold paths instead.

/// Kernels whose names start with one of these get the cap beside it (the first that matches).
/// Measured on the benchmark kernels, which launch 2^22 threads:
/// - `carve_bench_general_malloc` (mixed sizes) keeps each class group's state live across the
///   leaders' atomics: at 32 it runs slower (H100, 16 B–4 KiB: 12.9 G/s at 32 registers, 13.4 at
///   40, 13.9 at 48, 14.5–14.7 at 64), and uncapped ptxas gives it 72, which leaves fewer warps
///   per SM than 64.
/// - `carve_bench_general_malloc_one` (one size per warp) spills its handle copy at 32 (ten
///   local loads and eleven stores a warp); on the H200, 2^22 × 16 B: 78.5 G/s at 32, 78.6 at
///   40, 91.7 at 48, 82.4 at 56 and 82.7 at 64.
/// - The general free runs best at 32 (mixed sizes on the H200: 57.6 G/s, 50.4 at 40, 44.5 at
///   48).
/// - `carve_heap_slab_alloc` holds its handle copy and its output address across the inlined
///   slow path's call; at 32 ptxas spills part of the copy on the fast path (H100, 2^22 × 16 B:
///   90.3 G/s at 32, 113.1 at 40, 101.9 at 48, 89.7 at 64).
/// - Its relaxed ablation, the slab's floor, takes the cap at which it runs fastest (H100,
///   2^22 × 16 B: 90.9 G/s at 32, 78.2 at 40, 112.6 at 48, 99.5 at 64).
const CAPPED: [(&str, u32); 7] = [
    ("carve_heap_slab_alloc", 40),
    ("carve_bench_slab_alloc_relaxed", 48),
    ("carve_heap_", 32),
    ("carve_bench_slab_", 32),
    ("carve_bench_general_malloc_one", 48),
    ("carve_bench_general_free", 32),
    ("carve_bench_general_malloc(", 64),
];

/// `ptx` with `.maxnreg` after the parameter list of each capped `.entry`.
pub fn cap_heap_kernels(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut cap = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(name) = line.trim_start().strip_prefix(".visible .entry ") {
            cap = CAPPED
                .iter()
                .find(|(p, _)| name.starts_with(p))
                .map(|&(_, n)| n);
            // An entry without parameters closes its list on the same line.
            if let Some(n) = cap.filter(|_| name.trim_end().ends_with(')')) {
                out.push_str(&format!(".maxnreg {n}\n"));
                cap = None;
            }
        } else if let Some(n) = cap.filter(|_| line.trim() == ")") {
            out.push_str(&format!(".maxnreg {n}\n"));
            cap = None;
        }
    }
    out
}
