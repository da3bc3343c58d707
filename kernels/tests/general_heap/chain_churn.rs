//! Mixed warps of any width over class chains laid out as growth lays them (two segments per
//! class, in the class's stride, the newer first) that run out, among frees at random.

use super::*;

/// Warps of 1 to 32 lanes asking mixed sizes from chains that run out, and freeing blocks at
/// random in warps of any width: no block is handed out twice, contents stay intact, the blocks
/// in use over both segments match the live ones, and no free is counted as double or foreign.
#[test]
fn mixed_warps_on_exhausted_chains_never_share_a_block() {
    const SIZES: [u64; 6] = [3100, 3500, 16, 48, 1000, 2000];
    let heap = HostGeneral::grown(1 << 16, 8);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || support::xorshift(&mut rng);
    let mut live: Vec<(u64, u64, u8)> = Vec::new();
    let (mut nulls, mut in_older) = (0, 0);
    let big = class_of(3100).unwrap() as usize;
    for call in 0..400u32 {
        let lanes = 1 + (next() % 32) as u32;
        let mix = next();
        let sizes: Vec<u64> = (0..32)
            .map(|l| SIZES[((mix >> (2 * l)) % 6) as usize])
            .collect();
        let tag = |l: usize| (call as u8).wrapping_mul(31) ^ l as u8;
        let got = lockstep::run(lanes, call, |w| {
            let bytes = sizes[w.lane() as usize];
            let p = heap.malloc(w, bytes);
            if !p.is_null() {
                // SAFETY: the block is this lane's, at least `bytes` long.
                unsafe { p.write_bytes(tag(w.lane() as usize), bytes as usize) };
            }
            p as u64
        });
        nulls += got.iter().filter(|&&p| p == 0).count();
        let older = heap.chain(big)[1];
        in_older += got
            .iter()
            .filter(|&&p| p >= older.data && p < older.data + older.capacity * older.block_size)
            .count();
        live.extend(
            got.iter()
                .zip(&sizes)
                .enumerate()
                .filter(|(_, (&p, _))| p != 0)
                .map(|(l, (&p, &b))| (p, b, tag(l))),
        );
        let mut sorted: Vec<(u64, u64)> = live.iter().map(|&(p, b, _)| (p, b)).collect();
        assert!(disjoint(&mut sorted), "call {call}: overlap");
        let n = (next() % 33) as usize;
        let freed = take_at_random(&mut live, n, &mut next);
        for &(p, b, t) in &freed {
            // SAFETY: a live block of `b` bytes written with `t`; nobody else holds it.
            let s = unsafe { std::slice::from_raw_parts(p as *const u8, b as usize) };
            assert!(s.iter().all(|&x| x == t), "call {call}: {p:#x} overwritten");
        }
        let width = 1 + (next() % 32) as usize;
        for chunk in freed.chunks(width) {
            lockstep::run(chunk.len() as u32, call, |w| {
                heap.free(w, chunk[w.lane() as usize].0 as *mut u8)
            });
        }
        assert_eq!(heap.chain_in_use(), live.len() as u64, "call {call}");
    }
    // The chains ran out, and their older segments served.
    assert!(
        nulls > 0 && in_older > 0,
        "{nulls} null, {in_older} from older segments"
    );
    assert_eq!(heap.chain_double_frees(), 0);
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 0);
}
