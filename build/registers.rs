//! Register caps for the device heap's kernels, written into the PTX text by `build.rs`.
//!
//! rustc has no launch-bounds attribute, and ptxas sizes a kernel's register file for the
//! deepest function it may call: the heap kernels' rare out-of-line paths (a full slab, mixed
//! bump requests) would take them to ~60 registers and 50-60 % occupancy although the fast
//! paths fit in 32. A `.maxnreg 32` directive keeps every warp slot usable; ptxas spills in the
//! cold paths instead.

/// Kernels whose names start with one of these get the cap. The bench kernel of mixed sizes,
/// `carve_bench_general_malloc`, does not: its fast step keeps each class group's state live
/// across the leaders' atomics, and capped it runs slower (H100, 2^22 threads over 16 B–4 KiB:
/// 12.9 G/s at 32 registers, 13.4 at 40, 13.9 at 48, 14.5–14.7 uncapped at 64). One size per warp
/// (`carve_bench_general_malloc_one`) gains instead: 71 to 87 G/s, and the general free 90 to
/// 102.
const CAPPED: [&str; 4] = [
    "carve_heap_",
    "carve_bench_slab_",
    "carve_bench_general_malloc_one",
    "carve_bench_general_free",
];

/// Registers per thread that give 2048 resident threads per SM (full occupancy on sm_70+).
const MAX_REGISTERS: u32 = 32;

/// `ptx` with `.maxnreg` after the parameter list of each capped `.entry`.
pub fn cap_heap_kernels(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut in_capped_params = false;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(name) = line.trim_start().strip_prefix(".visible .entry ") {
            in_capped_params = CAPPED.iter().any(|p| name.starts_with(p));
            // An entry without parameters closes its list on the same line.
            if in_capped_params && name.trim_end().ends_with(')') {
                out.push_str(&format!(".maxnreg {MAX_REGISTERS}\n"));
                in_capped_params = false;
            }
        } else if in_capped_params && line.trim() == ")" {
            out.push_str(&format!(".maxnreg {MAX_REGISTERS}\n"));
            in_capped_params = false;
        }
    }
    out
}
