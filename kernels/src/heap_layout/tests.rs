//! Layout arithmetic: geometries, offsets and plans.

use super::*;

#[test]
fn geometry_bounds_shards() {
    let g = slab_geometry(1).unwrap();
    assert_eq!((g.nwords, g.nshards, g.shard_words_log2), (1, 1, 0));
    let g = slab_geometry(1 << 24).unwrap();
    assert_eq!(g.nwords, 1 << 18);
    assert!(g.nshards <= 4096);
    assert_eq!((g.nshards as u64) << g.shard_words_log2, 1 << 18);
    let g = slab_geometry(64 * 100).unwrap();
    assert_eq!(g.shard_words_log2, 2);
    assert_eq!(g.nshards, 25);
    assert!(slab_geometry(0).is_none());
}

#[test]
fn slab_layout_is_ordered_and_aligned() {
    let g = slab_geometry(1000).unwrap();
    let l = slab_layout(g, 1000, 48, 16).unwrap();
    assert!(l.counters >= HANDLE_BYTES && l.shard_used >= l.counters + COUNTERS_BYTES);
    assert!(l.words >= l.stats_end && l.words.is_multiple_of(8));
    assert!(l.data >= l.meta_end && l.data.is_multiple_of(256));
    assert_eq!(l.total, l.data + 48_000);
    assert!(slab_layout(g, u64::MAX / 2, 4096, 4096).is_none());
}

#[test]
fn block_alignment_follows_power_of_two_sizes() {
    assert_eq!(slab_block_align(16), 16);
    assert_eq!(slab_block_align(64), 64);
    assert_eq!(slab_block_align(4096), 4096);
    assert_eq!(slab_block_align(1 << 20), MAX_BLOCK_ALIGN);
    assert_eq!(slab_block_align(48), MIN_BLOCK);
    assert_eq!(slab_block_align(96), MIN_BLOCK);
}

#[test]
fn bump_chunks_only_when_roomy() {
    assert_eq!(bump_chunk_log2(1 << 20, 256), None);
    assert_eq!(bump_chunk_log2(1 << 30, 256), Some(20));
    assert_eq!(bump_chunk_log2(1 << 34, 256), Some(24));
    assert_eq!(bump_chunk_log2(1 << 40, 256), Some(24));
    assert_eq!(bump_chunk_log2(1 << 24, 256), Some(14));
}

#[test]
fn general_plans_fill_each_stride() {
    assert!(general_plan(0).is_none());
    assert!(general_plan((1 << GENERAL_MAX_STRIDE_LOG2) + 1).is_none());
    let p = general_plan(1).unwrap();
    assert_eq!(p.stride_log2, GENERAL_MIN_STRIDE_LOG2);
    let p = general_plan(300_000).unwrap();
    assert_eq!(p.stride_log2, 19);
    let stride = 1usize << 19;
    assert_eq!(p.total, GENERAL_CLASSES_OFFSET + p.classes().len() * stride);
    for (c, k) in p.classes().iter().enumerate() {
        assert!(k.capacity >= 1, "class {c}");
        assert!(k.layout.total <= stride, "class {c}");
        // One more block would not fit.
        let more = slab_geometry(k.capacity + 1).and_then(|g| {
            slab_layout(
                g,
                k.capacity + 1,
                k.block_size,
                slab_block_align(k.block_size),
            )
        });
        assert!(more.is_none_or(|l| l.total > stride), "class {c}");
        assert!(p.class_offset(c).is_multiple_of(4096));
    }
    let h = p.header(0x1000_0000);
    assert_eq!(
        h.classes[1],
        0x1000_0000 + (GENERAL_CLASSES_OFFSET + stride) as u64
    );
    assert_eq!(h.classes[p.classes().len()], 0);
    let s = p.class_handle(3, 0x1000_0000, 0);
    assert_eq!(s.block_size, 64);
    assert_eq!(s.data, h.classes[3] + p.classes()[3].layout.data as u64);
}
