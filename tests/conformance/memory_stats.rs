//! The check that a resource's [`MemoryResource::memory_stats`] agrees with its own typed
//! statistics (the list entry's usage probe), read through `dyn MemoryResource` and through an
//! `Arc`, as the C ABI, Python and the current resource read it.

use std::sync::Arc;

use carve::{MemoryResource, MemoryStats};

use super::subject::{note, Env, Subject, Usage};

/// What the trait says, through a trait object and through the `Arc` forwarding; both must
/// agree.
fn read<R: MemoryResource>(name: &str, mr: &R) -> Option<MemoryStats> {
    let direct = (mr as &dyn MemoryResource).memory_stats().unwrap();
    let shared: Arc<&dyn MemoryResource> = Arc::new(mr);
    let forwarded = shared.memory_stats().unwrap();
    assert_eq!(direct, forwarded, "{name}: memory_stats through an Arc");
    direct
}

fn agree(name: &str, when: &str, trait_stats: &MemoryStats, typed: Usage) {
    assert_eq!(
        trait_stats.bytes_in_use, typed.bytes,
        "{name}: memory_stats().bytes_in_use {when} against the typed statistics"
    );
    if let (Some(a), Some(b)) = (trait_stats.live_blocks, typed.blocks) {
        assert_eq!(
            a, b,
            "{name}: memory_stats().live_blocks {when} against the typed statistics"
        );
    }
    if let Some(held) = trait_stats.bytes_reserved {
        assert!(
            held >= trait_stats.bytes_in_use,
            "{name}: {held} bytes reserved but {} in use {when}",
            trait_stats.bytes_in_use
        );
    }
    assert!(
        !trait_stats.detail.is_empty(),
        "{name}: memory_stats() without named counters"
    );
}

/// `memory_stats()` matches the typed statistics before, during and after a few allocations.
pub fn memory_stats<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let Some(first) = read(name, &s.mr) else {
        note(
            name,
            "memory_stats() is None: the resource keeps no statistics of its own",
        );
        return;
    };
    let Ok(probe) = s.usage else {
        note(
            name,
            "memory_stats() reported, but no typed statistics to compare",
        );
        return;
    };
    agree(name, "at first", &first, probe(&s.mr));
    let st = env.stream(0);
    let mut blocks = Vec::new();
    for bytes in [1, 256, 3000, 10_000]
        .into_iter()
        .filter(|&b| b <= s.max_bytes)
    {
        blocks.push((s.mr.allocate(st, bytes, 256).unwrap(), bytes));
        let now = read(name, &s.mr).expect("memory_stats() stopped reporting");
        agree(
            name,
            &format!("after allocating {bytes} bytes"),
            &now,
            probe(&s.mr),
        );
    }
    while let Some((p, bytes)) = blocks.pop() {
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { s.mr.deallocate(st, p, bytes, 256) }.unwrap();
        let now = read(name, &s.mr).expect("memory_stats() stopped reporting");
        agree(
            name,
            &format!("after freeing {bytes} bytes"),
            &now,
            probe(&s.mr),
        );
    }
}
