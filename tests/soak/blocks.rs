//! The soak's blocks: how their tags are written and read, and the registry of live ranges that
//! catches a block handed out twice.

use std::collections::BTreeMap;
use std::sync::Mutex;

use carve::cudarc::driver::result;
use carve::StreamRef;

/// How a block's tag is written and read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Access {
    /// Host-accessible: written and read by the CPU.
    Host,
    /// Device memory: cuMemsetD8Async / cuMemcpyDtoHAsync on the block's stream.
    Device,
}

/// A live block.
#[derive(Clone, Copy, Debug)]
pub struct Live {
    pub addr: usize,
    pub bytes: usize,
    pub res: usize,
    pub tag: u8,
}

/// Every live block of every resource, by start address: the "handed out twice" check.
#[derive(Default)]
pub struct Registry {
    pub live: Mutex<BTreeMap<usize, (usize, usize)>>,
}

impl Registry {
    pub fn claim(&self, b: &Live, names: &[&str]) {
        let mut live = self.live.lock().unwrap();
        if let Some((&a, &(n, r))) = live.range(..=b.addr).next_back() {
            assert!(
                a + n <= b.addr,
                "{} handed out {:#x}+{} inside live {:#x}+{n} from {}",
                names[b.res],
                b.addr,
                b.bytes,
                a,
                names[r]
            );
        }
        if let Some((&a, &(_, r))) = live.range(b.addr..).next() {
            assert!(
                b.addr + b.bytes <= a,
                "{} handed out {:#x}+{} overlapping live {a:#x} from {}",
                names[b.res],
                b.addr,
                b.bytes,
                names[r]
            );
        }
        live.insert(b.addr, (b.bytes, b.res));
    }

    pub fn release(&self, b: &Live) {
        let removed = self.live.lock().unwrap().remove(&b.addr);
        assert_eq!(removed, Some((b.bytes, b.res)), "registry lost {b:?}");
    }
}

/// Writes `b`'s tag (first and last 8 bytes), ordered on `stream` for device memory.
pub fn tag(b: &Live, access: Access, stream: StreamRef<'_>) {
    let n = b.bytes.min(8);
    match access {
        // SAFETY: the block is ours, `bytes` long and host-accessible.
        Access::Host => unsafe {
            let p = b.addr as *mut u8;
            p.write_bytes(b.tag, n);
            p.add(b.bytes - n).write_bytes(b.tag, n);
        },
        Access::Device => {
            for at in [b.addr, b.addr + b.bytes - n] {
                // SAFETY: [at, at + n) lies in a live device block of ours; ordered on its stream.
                unsafe { result::memset_d8_async(at as u64, b.tag, n, stream.as_raw()) }.unwrap();
            }
        }
    }
}

/// Reads `b`'s tag back (waiting for `stream`) and checks it.
pub fn check_tag(b: &Live, access: Access, stream: StreamRef<'_>, name: &str) {
    let n = b.bytes.min(8);
    let mut got = [[0u8; 8]; 2];
    for (i, at) in [b.addr, b.addr + b.bytes - n].into_iter().enumerate() {
        match access {
            // SAFETY: as in `tag`.
            Access::Host => unsafe {
                std::ptr::copy_nonoverlapping(at as *const u8, got[i].as_mut_ptr(), n)
            },
            Access::Device => {
                // SAFETY: reads n bytes of a live device block into `got`, waited for below.
                unsafe { result::memcpy_dtoh_async(&mut got[i][..n], at as u64, stream.as_raw()) }
                    .unwrap();
            }
        }
    }
    if access == Access::Device {
        // SAFETY: a stream handle that outlives this call (owned by the calling worker).
        unsafe { result::stream::synchronize(stream.as_raw()) }.unwrap();
    }
    for g in got {
        assert!(
            g[..n].iter().all(|&x| x == b.tag),
            "{name}: block {:#x}+{} lost its tag {:#x}: {:?}",
            b.addr,
            b.bytes,
            b.tag,
            &g[..n]
        );
    }
}
