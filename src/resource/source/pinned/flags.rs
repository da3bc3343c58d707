//! The page-locking flags shared by `cuMemHostAlloc` and `cuMemHostRegister`.

use std::ops::BitOr;

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Flags for pinned host memory; combine with `|`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PinnedFlags {
    /// Pinned for every context, not only the one that allocated it.
    pub portable: bool,
    /// Mapped into the device's address space: kernels reach it through
    /// [`device_ptr`](super::PinnedBuffer::device_ptr) without a copy.
    pub device_mapped: bool,
    /// Write-combined: faster host writes and PCIe transfers, very slow host reads. Allocation
    /// only; `cuMemHostRegister` has no such flag.
    pub write_combined: bool,
}

impl PinnedFlags {
    /// Plain pinned memory.
    pub const NONE: PinnedFlags = PinnedFlags {
        portable: false,
        device_mapped: false,
        write_combined: false,
    };
    /// See [`PinnedFlags::portable`].
    pub const PORTABLE: PinnedFlags = PinnedFlags {
        portable: true,
        ..Self::NONE
    };
    /// See [`PinnedFlags::device_mapped`].
    pub const DEVICE_MAPPED: PinnedFlags = PinnedFlags {
        device_mapped: true,
        ..Self::NONE
    };
    /// See [`PinnedFlags::write_combined`].
    pub const WRITE_COMBINED: PinnedFlags = PinnedFlags {
        write_combined: true,
        ..Self::NONE
    };

    /// The `CU_MEMHOSTALLOC_*` bits.
    pub fn alloc_bits(self) -> u32 {
        let mut bits = 0;
        if self.portable {
            bits |= sys::CU_MEMHOSTALLOC_PORTABLE;
        }
        if self.device_mapped {
            bits |= sys::CU_MEMHOSTALLOC_DEVICEMAP;
        }
        if self.write_combined {
            bits |= sys::CU_MEMHOSTALLOC_WRITECOMBINED;
        }
        bits
    }

    /// The flags of `CU_MEMHOSTALLOC_*` bits (other bits are ignored).
    pub fn from_alloc_bits(bits: u32) -> PinnedFlags {
        PinnedFlags {
            portable: bits & sys::CU_MEMHOSTALLOC_PORTABLE != 0,
            device_mapped: bits & sys::CU_MEMHOSTALLOC_DEVICEMAP != 0,
            write_combined: bits & sys::CU_MEMHOSTALLOC_WRITECOMBINED != 0,
        }
    }

    /// The `CU_MEMHOSTREGISTER_*` bits; [`Error::InvalidArgument`] for write-combined, which
    /// registration cannot give to memory that already exists.
    pub fn register_bits(self) -> Result<u32> {
        if self.write_combined {
            return Err(Error::InvalidArgument(
                "write-combined applies to cuMemHostAlloc only; existing memory cannot be \
                 registered as write-combined"
                    .into(),
            ));
        }
        let mut bits = 0;
        if self.portable {
            bits |= sys::CU_MEMHOSTREGISTER_PORTABLE;
        }
        if self.device_mapped {
            bits |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        }
        Ok(bits)
    }
}

impl BitOr for PinnedFlags {
    type Output = PinnedFlags;
    fn bitor(self, rhs: PinnedFlags) -> PinnedFlags {
        PinnedFlags {
            portable: self.portable | rhs.portable,
            device_mapped: self.device_mapped | rhs.device_mapped,
            write_combined: self.write_combined | rhs.write_combined,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_flag_alone_and_together_maps_to_the_driver_bits() {
        assert_eq!(PinnedFlags::NONE.alloc_bits(), 0);
        assert_eq!(PinnedFlags::PORTABLE.alloc_bits(), 1);
        assert_eq!(PinnedFlags::DEVICE_MAPPED.alloc_bits(), 2);
        assert_eq!(PinnedFlags::WRITE_COMBINED.alloc_bits(), 4);
        let all = PinnedFlags::PORTABLE | PinnedFlags::DEVICE_MAPPED | PinnedFlags::WRITE_COMBINED;
        assert_eq!(all.alloc_bits(), 7);
        for bits in 0..8 {
            assert_eq!(PinnedFlags::from_alloc_bits(bits).alloc_bits(), bits);
        }
        assert_eq!(
            (PinnedFlags::PORTABLE | PinnedFlags::DEVICE_MAPPED)
                .register_bits()
                .unwrap(),
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP
        );
        assert_eq!(PinnedFlags::NONE.register_bits().unwrap(), 0);
    }

    #[test]
    fn registration_refuses_write_combined() {
        for f in [
            PinnedFlags::WRITE_COMBINED,
            PinnedFlags::WRITE_COMBINED | PinnedFlags::DEVICE_MAPPED,
        ] {
            assert!(matches!(f.register_bits(), Err(Error::InvalidArgument(_))));
        }
    }
}
