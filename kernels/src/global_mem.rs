//! Global-memory access in PTX for the allocators: a relaxed global-space atomic and read-only
//! loads of heap handles and general-heap class pointers. It sits below every allocator (it
//! knows only the layouts of `heap_layout`), so they call down into it and never the reverse.

use crate::heap_layout::{GeneralHeader, HeapHandle, GENERAL_CLASS_SLOTS};
use crate::sync::atomic::AtomicU64;
use static_assertions::const_assert_eq;

/// `a.fetch_add(v)`, relaxed, as one global-space `atom` (what `core`'s atomics give on nvptx,
/// less ptxas's test for a shared-memory address).
#[inline(always)]
pub fn fetch_add_global(a: &AtomicU64, v: u64) -> u64 {
    let old: u64;
    // SAFETY: `a` is a live, aligned atomic in global memory (every heap array is: the region
    // comes from a device allocation); the asm is an atomic RMW on it and nothing else.
    unsafe {
        core::arch::asm!(
            "{{ .reg .b64 g; cvta.to.global.u64 g, {a}; atom.relaxed.gpu.global.add.u64 {old}, [g], {v}; }}",
            old = out(reg64) old, a = in(reg64) a.as_ptr(), v = in(reg64) v,
        )
    };
    old
}

/// The first 96 bytes at `p` (16-byte aligned, global memory) as six pairs, through the
/// read-only data path.
///
/// One statement with effects, so that all six loads issue where the caller reads the handle:
/// as pure per-pair statements LLVM sank the loads of fields used only past a branch below it,
/// a second round trip on every call. ptxas still drops the loads whose results go unused.
///
/// # Safety
/// `p` is a global address of 96 readable bytes that nothing writes while the kernel runs.
#[inline(always)]
unsafe fn ld_nc_handle(p: u64) -> [(u64, u64); 6] {
    let mut v = [(0u64, 0u64); 6];
    // SAFETY: the caller's contract; not `pure`, so that LLVM keeps the loads in place.
    unsafe {
        core::arch::asm!(
            "ld.global.nc.v2.u64 {{{a0}, {b0}}}, [{p}];",
            "ld.global.nc.v2.u64 {{{a1}, {b1}}}, [{p}+16];",
            "ld.global.nc.v2.u64 {{{a2}, {b2}}}, [{p}+32];",
            "ld.global.nc.v2.u64 {{{a3}, {b3}}}, [{p}+48];",
            "ld.global.nc.v2.u64 {{{a4}, {b4}}}, [{p}+64];",
            "ld.global.nc.v2.u64 {{{a5}, {b5}}}, [{p}+80];",
            a0 = out(reg64) v[0].0, b0 = out(reg64) v[0].1,
            a1 = out(reg64) v[1].0, b1 = out(reg64) v[1].1,
            a2 = out(reg64) v[2].0, b2 = out(reg64) v[2].1,
            a3 = out(reg64) v[3].0, b3 = out(reg64) v[3].1,
            a4 = out(reg64) v[4].0, b4 = out(reg64) v[4].1,
            a5 = out(reg64) v[5].0, b5 = out(reg64) v[5].1,
            p = in(reg64) p,
            options(readonly, nostack),
        )
    };
    v
}

/// The global-space address of `p`, a generic address inside a global allocation.
#[inline(always)]
pub(crate) fn global_address(p: u64) -> u64 {
    let g: u64;
    // SAFETY: an address conversion only: no memory is read or written.
    unsafe {
        core::arch::asm!(
            "cvta.to.global.u64 {g}, {p};",
            g = out(reg64) g, p = in(reg64) p,
            options(pure, nomem, nostack),
        )
    };
    g
}

/// A copy of the handle at `heap` in registers, if it is a formatted heap of `kind`: one 16-byte
/// read-only load per pair of fields that the caller uses, all in flight together, instead of a
/// generic load per field each time the allocator reads one.
///
/// # Safety
/// `heap` is null or the device address of a heap region (global memory, 128-byte aligned)
/// whose handle the host writes only between launches.
#[inline(always)]
pub unsafe fn load_handle(heap: *const HeapHandle, tag: u64) -> Option<HeapHandle> {
    if heap.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let h = unsafe { read_handle(heap) };
    (h.magic as u64 | (h.kind as u64) << 32 == tag).then_some(h)
}

/// Class segment `head`'s handle (a general header's class pointer, null or a formatted slab
/// segment), read as [`load_handle`] does but without the tag test: between the loads, that
/// test let ptxas issue the fields' loads after it, a second round trip on the fast paths.
///
/// # Safety
/// `head` is null or a class pointer of a formatted general header in global memory.
#[inline(always)]
pub unsafe fn load_class_handle(head: *const HeapHandle) -> Option<HeapHandle> {
    // SAFETY: the caller's contract: a class segment's handle, which the host writes only
    // between launches.
    (!head.is_null()).then(|| unsafe { read_handle(head) })
}

/// The handle at `heap`, read as [`load_handle`] does, unchecked.
///
/// # Safety
/// `heap` is the device address of 128 bytes of global memory, 16-byte aligned, that nothing
/// writes while the kernel runs.
#[inline(always)]
pub(crate) unsafe fn read_handle(heap: *const HeapHandle) -> HeapHandle {
    let g = global_address(heap as u64);
    // SAFETY: the caller's contract; the handle is 128 bytes, 16-byte aligned.
    let [(magic_kind, block_size), (capacity, data), (counters, shard_used), (shard_peak, words), (w64, w72), (w80, next)] =
        unsafe { ld_nc_handle(g) };
    HeapHandle {
        magic: magic_kind as u32,
        kind: (magic_kind >> 32) as u32,
        block_size,
        capacity,
        data,
        counters,
        shard_used,
        shard_peak,
        words,
        nwords: w64 as u32,
        nshards: (w64 >> 32) as u32,
        shard_words_log2: w72 as u32,
        block_shift: (w72 >> 32) as u32,
        flags: w80 as u32,
        _pad: (w80 >> 32) as u32,
        next,
        reserved: [0; 4],
    }
}

/// One read-only load of the general header's class pointer `c` (`< GENERAL_CLASS_SLOTS`).
///
/// # Safety
/// As for [`load_general`](crate::nvptx::load_general), for a heap that it found to be a general
/// one.
#[inline(always)]
pub unsafe fn load_class_pointer(heap: *const GeneralHeader, c: u32) -> u64 {
    debug_assert!((c as usize) < GENERAL_CLASS_SLOTS);
    let off = core::mem::offset_of!(GeneralHeader, classes) as u64 + 8 * c as u64;
    let p = global_address(heap as u64 + off);
    let v: u64;
    // SAFETY: the caller's contract: slot `c` of a general header in global memory, written
    // only between launches.
    unsafe {
        core::arch::asm!(
            "ld.global.nc.u64 {v}, [{p}];",
            v = out(reg64) v, p = in(reg64) p,
            options(readonly, nostack),
        )
    };
    v
}

/// The `capacity`, `data` and `words` fields of the slab handle at `h`: what a free of a run
/// needs, in two read-only 16-byte loads issued together.
///
/// # Safety
/// `h` is a formatted slab handle in global memory (16-byte aligned, as every handle is) that
/// the host writes only between launches.
#[inline(always)]
pub(crate) unsafe fn read_run_fields(h: &HeapHandle) -> (u64, u64, u64) {
    const CAPACITY: usize = core::mem::offset_of!(HeapHandle, capacity);
    const WORDS: usize = core::mem::offset_of!(HeapHandle, words);
    const_assert_eq!(core::mem::offset_of!(HeapHandle, data), CAPACITY + 8);
    const_assert_eq!(CAPACITY % 16, 0);
    // `words` is the second half of its 16-byte pair.
    const_assert_eq!(WORDS % 16, 8);
    let p = global_address(h as *const HeapHandle as u64);
    let (capacity, data, words, _before): (u64, u64, u64, u64);
    // SAFETY: the caller's contract: fields of a handle in global memory, 16-byte aligned.
    unsafe {
        core::arch::asm!(
            "ld.global.nc.v2.u64 {{{c}, {d}}}, [{p}+{co}];",
            "ld.global.nc.v2.u64 {{{b}, {w}}}, [{p}+{wo}];",
            c = out(reg64) capacity, d = out(reg64) data, b = out(reg64) _before,
            w = out(reg64) words, p = in(reg64) p,
            co = const CAPACITY, wo = const WORDS - 8,
            options(readonly, nostack),
        )
    };
    (capacity, data, words)
}
