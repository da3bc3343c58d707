//! Which shard of a pool serves a stream: assigned round-robin on a stream's first use, so
//! streams on different threads get distinct shards (and locks), and cached per thread, so the
//! lookup takes no shared lock and writes no shared line.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::stream::StreamId;
use crate::sync::lock;

/// A process-wide identity for each pool, so a thread's cache never confuses a dropped pool with
/// a new one at the same address. (A static counter that no loom model exercises: plain std.)
pub(crate) fn next_pool_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Streams remembered before the map starts over (any mapping is correct; this one only keeps
/// streams apart).
const MAX_STREAMS: usize = 4096;

/// Entries in each thread's cache, by a hash of the stream.
const CACHE_WAYS: usize = 4;

thread_local! {
    /// (pool id, stream id, shard); pool id 0 is empty.
    static CACHE: [Cell<(u64, usize, u32)>; CACHE_WAYS] =
        const { [const { Cell::new((0, 0, 0)) }; CACHE_WAYS] };
}

/// Stream-to-shard assignment for one pool.
#[derive(Debug)]
pub(crate) struct ShardMap {
    pool: u64,
    shards: u32,
    assigned: Mutex<(HashMap<StreamId, u32>, u32)>,
}

impl ShardMap {
    /// A map onto `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        ShardMap {
            pool: next_pool_id(),
            shards: shards.clamp(1, u32::MAX as usize) as u32,
            assigned: Mutex::new((HashMap::new(), 0)),
        }
    }

    /// The shard serving `stream`.
    #[inline]
    pub fn shard_of(&self, stream: StreamId) -> usize {
        if self.shards == 1 {
            return 0;
        }
        let key = stream.get();
        let way = (key.wrapping_mul(0x9E37_79B9) >> 7) % CACHE_WAYS;
        let hit = CACHE.with(|c| {
            let (p, s, i) = c[way].get();
            (p == self.pool && s == key).then_some(i)
        });
        if let Some(i) = hit {
            return i as usize;
        }
        let i = self.assign(stream);
        CACHE.with(|c| c[way].set((self.pool, key, i)));
        i as usize
    }

    #[cold]
    fn assign(&self, stream: StreamId) -> u32 {
        let mut guard = lock(&self.assigned);
        let (map, next) = &mut *guard;
        if let Some(&i) = map.get(&stream) {
            return i;
        }
        if map.len() >= MAX_STREAMS {
            map.clear();
        }
        let i = *next % self.shards;
        *next = next.wrapping_add(1);
        map.insert(stream, i);
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::StreamRef;

    #[test]
    fn streams_get_distinct_shards_round_robin_and_keep_them() {
        let m = ShardMap::new(4);
        let ids: Vec<StreamId> = (0..6).map(|i| StreamRef::simulated(i).id()).collect();
        let first: Vec<usize> = ids.iter().map(|&s| m.shard_of(s)).collect();
        assert_eq!(first, vec![0, 1, 2, 3, 0, 1]);
        let again: Vec<usize> = ids.iter().map(|&s| m.shard_of(s)).collect();
        assert_eq!(again, first);
        // Another thread sees the same assignment (through the shared map).
        let other = std::thread::scope(|s| {
            s.spawn(|| ids.iter().map(|&s| m.shard_of(s)).collect::<Vec<_>>())
                .join()
                .unwrap()
        });
        assert_eq!(other, first);
    }

    #[test]
    fn a_new_pool_does_not_reuse_a_dropped_pools_cache() {
        let s = StreamRef::simulated(9).id();
        let a = ShardMap::new(8);
        a.assign(StreamRef::simulated(1).id());
        assert_eq!(a.shard_of(s), 1);
        drop(a);
        let b = ShardMap::new(8);
        assert_eq!(b.shard_of(s), 0);
    }
}
