//! Owned shared mappings: `MAP_SHARED`, read and write, unmapped when dropped.
//!
//! Another process (or another mapping of the same file) may write a shared mapping at any
//! time, so this module hands out no `&[u8]` of one: bytes go in and out by copy
//! ([`SharedMapping::write_at`], [`SharedMapping::read_at`]), words through atomics
//! ([`SharedMapping::atomic_u32`]), and callers that need more take the raw address.

use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::mm::{Advice, MapFlags, ProtFlags};

use crate::{Op, UnixError};

/// The boundary shared memory is mapped on (by the server, and by a client making fresh
/// memory), so transparent huge pages of the file (where the host enables them for shared
/// memory) can be mapped whole.
pub const HUGE_PAGE_ALIGN: usize = 2 << 20;

/// A `MAP_SHARED` read-write mapping this value owns; unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value and unmapped only in `drop` (which
// takes it by value); shared access goes through copies and atomics only.
unsafe impl Send for SharedMapping {}
// SAFETY: as for Send.
unsafe impl Sync for SharedMapping {}

fn rw() -> ProtFlags {
    ProtFlags::READ | ProtFlags::WRITE
}

impl SharedMapping {
    /// Maps the first `len` bytes of `fd` at an address of the kernel's choosing. The
    /// descriptor may be closed afterwards: the mapping keeps the file alive.
    pub fn map(fd: impl AsFd, len: usize) -> Result<Self, UnixError> {
        // SAFETY: a new mapping at an address of the kernel's choosing replaces nothing.
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, rw(), MapFlags::SHARED, fd, 0) }
                .map_err(|e| UnixError::os(Op::Mmap, e))?;
        Ok(Self::owned(p, len))
    }

    /// Fresh zeroed memory of `len` bytes shared with this process's children (and, through
    /// [`atomic_u32`](Self::atomic_u32), a stand-in for another process's page in tests).
    pub fn anonymous(len: usize) -> Result<Self, UnixError> {
        // SAFETY: as in `map`.
        let p = unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, rw(), MapFlags::SHARED)
        }
        .map_err(|e| UnixError::os(Op::Mmap, e))?;
        Ok(Self::owned(p, len))
    }

    /// Maps the first `len` bytes of `fd` at an address that is a multiple of `align` (a power
    /// of two), by reserving `len + align` bytes of address space and giving back its ends: so
    /// that huge pages can back the mapping where the host allows them for shared memory.
    pub fn map_aligned(fd: impl AsFd, len: usize, align: usize) -> Result<Self, UnixError> {
        assert!(align.is_power_of_two(), "alignment {align}");
        let reserve_len = len.checked_add(align).ok_or(UnixError::Os {
            op: Op::Mmap,
            errno: libc::ENOMEM,
        })?;
        // SAFETY: a new reservation (no access, no backing) at an address of the kernel's
        // choosing replaces nothing.
        let r = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                reserve_len,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| UnixError::os(Op::Mmap, e))?
        .cast::<u8>();
        let head = r.align_offset(align);
        let at = r.wrapping_add(head);
        // SAFETY: `[at, at + len)` lies inside the reservation just made, which nothing else
        // uses; MAP_FIXED replaces exactly that part of it.
        let mapped = unsafe {
            rustix::mm::mmap(
                at.cast(),
                len,
                rw(),
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                0,
            )
        };
        // SAFETY: the pieces unmapped below are parts of our own reservation that no mapping
        // handed out uses: all of it on failure, else its head `[r, at)` and its tail
        // `[at + len, r + reserve_len)` (`head < align`). Failure to unmap only leaks address
        // space.
        unsafe {
            if let Err(e) = mapped {
                let _ = rustix::mm::munmap(r.cast(), reserve_len);
                return Err(UnixError::os(Op::Mmap, e));
            }
            if head > 0 {
                let _ = rustix::mm::munmap(r.cast(), head);
            }
            let tail = align - head;
            if tail > 0 {
                let _ = rustix::mm::munmap(at.add(len).cast(), tail);
            }
        }
        Ok(Self::owned(at.cast(), len))
    }

    fn owned(p: *mut std::ffi::c_void, len: usize) -> Self {
        SharedMapping {
            base: NonNull::new(p.cast()).expect("a mapping is never at address 0"),
            len,
        }
    }

    /// Advises the kernel to back the mapping with transparent huge pages; a host that does
    /// not allow them for shared memory ignores it.
    pub fn advise_hugepage(&self) {
        // SAFETY: advice on our own live mapping; MADV_HUGEPAGE changes no contents.
        let _ = unsafe {
            rustix::mm::madvise(self.base.as_ptr().cast(), self.len, Advice::LinuxHugepage)
        };
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Address of the mapping's first byte in this process.
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives the mapping up without unmapping it: its address and length, the caller's to
    /// unmap.
    pub fn into_raw(self) -> (NonNull<u8>, usize) {
        let me = std::mem::ManuallyDrop::new(self);
        (me.base, me.len)
    }

    fn check(&self, offset: usize, n: usize) {
        assert!(
            offset.checked_add(n).is_some_and(|end| end <= self.len),
            "{n} bytes at {offset} of a {}-byte mapping",
            self.len
        );
    }

    /// Copies `data` into the mapping at `offset` (panics when it does not fit).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: the range is inside the live mapping (checked); `data` is our own memory, so
        // they cannot overlap. Another writer of the same bytes races only with their values.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        };
    }

    /// Copies `out.len()` bytes of the mapping at `offset` into `out` (panics when they are
    /// not all inside it).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: as in `write_at`, the other way round.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
    }

    /// The `u32` at `offset` (4-byte aligned, inside the mapping; panics otherwise), to reach
    /// atomically and to [`futex`](crate::futex) on.
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4);
        assert!(
            offset.is_multiple_of(4),
            "offset {offset} is not 4-byte aligned"
        );
        // SAFETY: 4 bytes inside the mapping, which lives as long as the borrow of `self`, at a
        // 4-byte aligned address (mappings are page aligned); every access is atomic.
        unsafe { &*self.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// The `u64` at `offset` (8-byte aligned, inside the mapping; panics otherwise), to reach
    /// atomically.
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        assert!(
            offset.is_multiple_of(8),
            "offset {offset} is not 8-byte aligned"
        );
        // SAFETY: as in `atomic_u32`, for 8 bytes at an 8-byte aligned address.
        unsafe { &*self.as_ptr().add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value owns, once, as it goes away; no
        // borrow of it can outlive `self`.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memfd;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_of_one_memfd_see_each_others_writes() {
        let fd = memfd::create(c"umbp-test", 1 << 20, None).unwrap();
        let a = SharedMapping::map(&fd, 1 << 20).unwrap();
        let b = SharedMapping::map_aligned(&fd, 1 << 20, 2 << 20).unwrap();
        b.advise_hugepage();
        drop(fd); // the mappings keep the file alive
        assert_eq!(b.addr() % (2 << 20), 0);
        assert_ne!(a.addr(), b.addr());
        a.write_at(4095, b"across a page");
        let mut got = [0u8; 13];
        b.read_at(4095, &mut got);
        assert_eq!(&got, b"across a page");
        b.atomic_u32(1 << 19).store(7, Ordering::Release);
        assert_eq!(a.atomic_u32(1 << 19).load(Ordering::Acquire), 7);
        a.atomic_u64(8).store(u64::MAX - 1, Ordering::Release);
        assert_eq!(b.atomic_u64(8).load(Ordering::Acquire), u64::MAX - 1);
    }

    #[test]
    fn anonymous_memory_starts_zeroed_and_into_raw_keeps_it_mapped() {
        let m = SharedMapping::anonymous(8192).unwrap();
        let mut z = [1u8; 16];
        m.read_at(8192 - 16, &mut z);
        assert_eq!(z, [0; 16]);
        let (p, len) = m.into_raw();
        // SAFETY: still mapped (into_raw does not unmap); unmapped once here.
        unsafe {
            p.as_ptr().write(3);
            rustix::mm::munmap(p.as_ptr().cast(), len).unwrap();
        }
    }

    #[test]
    #[should_panic(expected = "of a 4096-byte mapping")]
    fn a_copy_past_the_end_panics() {
        SharedMapping::anonymous(4096)
            .unwrap()
            .write_at(4090, b"too long");
    }
}
