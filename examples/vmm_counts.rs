use carve::replay::{parse_log, plan, replay, Target};
use carve::resource::{ExpandableMemoryResource, ExpandableOptions};
use std::sync::Arc;
fn main() {
    let path = std::env::args().nth(1).unwrap();
    let ev = parse_log(std::fs::File::open(path).unwrap()).unwrap();
    let p = plan(&ev).unwrap();
    for chunk in [2usize << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20] {
        let o = ExpandableOptions {
            large_chunk: Some(chunk),
            ..Default::default()
        };
        let r = ExpandableMemoryResource::simulated(80 << 30, o).unwrap();
        let streams = (0..p.streams.len())
            .map(|i| {
                if p.streams[i] == 0 {
                    carve::StreamRef::DEFAULT
                } else {
                    carve::StreamRef::simulated(i)
                }
            })
            .collect();
        let t = Target::new(Arc::new(r.clone()), "x", streams);
        let rep = replay(&p, &t, false).unwrap();
        let s = r.stats();
        println!(
            "chunk {} MiB: ratio {:.3} created {}+{} moved {}+{} ops {}",
            chunk >> 20,
            s.peak_physical as f64 / rep.peak_bytes as f64,
            s.small.chunks_created,
            s.large.chunks_created,
            s.small.chunks_moved,
            s.large.chunks_moved,
            rep.allocations + rep.frees
        );
    }
}
