//! Owned mappings a process keeps for its own memory (the pool's arena): private anonymous
//! memory of normal pages placed for transparent huge pages, of explicit huge pages
//! (`MAP_HUGETLB`), or a shared mapping of a file the caller made; bound to a NUMA node
//! (`mbind`) and populated up front (`MADV_POPULATE_WRITE`, or a touch of every page).
//!
//! Like [`SharedMapping`](crate::mapping::SharedMapping), an [`Arena`] hands out no reference
//! to its bytes, only its address: what is stored where, and who may touch it when, is the
//! owner's business (the pool's allocator and pins). Its own operations never change a byte.

use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::mm::{Advice, MapFlags, ProtFlags};

use crate::{Op, UnixError};

/// `MAP_HUGE_SHIFT`: where `mmap` takes the log2 of a huge page size.
const MAP_HUGE_SHIFT: u32 = 26;
/// `MPOL_BIND`.
const MPOL_BIND: libc::c_int = 2;
/// `MPOL_MF_STRICT | MPOL_MF_MOVE`: fail unless every page ends up on the node, moving any
/// already placed elsewhere.
const MPOL_MF_STRICT_MOVE: libc::c_uint = 1 | 2;
/// Words of the node mask `mbind` is given: nodes 0..=1023.
const NODE_MASK_WORDS: usize = 16;

/// A mapping this value owns, read and write, unmapped on drop.
#[derive(Debug)]
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value and unmapped only in `drop` (which
// takes it by value); `&Arena` hands out its address and makes no access that changes a byte
// (advice, binding, populating, atomic no-op touches).
unsafe impl Send for Arena {}
// SAFETY: as for Send.
unsafe impl Sync for Arena {}

fn rw() -> ProtFlags {
    ProtFlags::READ | ProtFlags::WRITE
}

fn os(op: Op) -> impl FnOnce(rustix::io::Errno) -> UnixError {
    move |e| UnixError::os(op, e)
}

impl Arena {
    /// Private anonymous memory of `len` bytes (a multiple of `page`) on explicit huge pages
    /// of `page` bytes (a power of two). Without `MAP_NORESERVE`: a host without enough free
    /// huge pages refuses here (`ENOMEM`), never with a `SIGBUS` on a later touch.
    pub fn anonymous_huge(len: usize, page: u64) -> Result<Self, UnixError> {
        assert!(page.is_power_of_two(), "huge page size {page}");
        let size = MapFlags::from_bits_retain(page.trailing_zeros() << MAP_HUGE_SHIFT);
        // SAFETY: a new mapping at an address of the kernel's choosing replaces nothing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rw(),
                MapFlags::PRIVATE | MapFlags::HUGETLB | size,
            )
        }
        .map_err(os(Op::Mmap))?;
        Ok(Self::owned(p, len))
    }

    /// Private anonymous memory of `len` bytes of normal pages (`MAP_NORESERVE`) at an address
    /// that is a multiple of `align` (a power of two), by mapping `len + align` bytes and
    /// giving back both ends: so that transparent huge pages can back all of it.
    pub fn anonymous_aligned(len: usize, align: usize) -> Result<Self, UnixError> {
        assert!(align.is_power_of_two(), "alignment {align}");
        let over = len.checked_add(align).ok_or(UnixError::Os {
            op: Op::Mmap,
            errno: libc::ENOMEM,
        })?;
        // SAFETY: as in `anonymous_huge`.
        let r = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                over,
                rw(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(os(Op::Mmap))?
        .cast::<u8>();
        let head = r.align_offset(align);
        let at = r.wrapping_add(head);
        // SAFETY: `head < align`, so `[r, at)` and `[at + len, r + over)` are the two ends of
        // the mapping just made, which nothing uses; the kept part `[at, at + len)` is not
        // touched. Failure to unmap only leaks address space.
        unsafe {
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

    /// The first `len` bytes of `fd` mapped `MAP_SHARED` at an address of the kernel's
    /// choosing (a memfd the caller made, of huge pages or not). The descriptor may be closed
    /// afterwards: the mapping keeps the file alive.
    pub fn shared(fd: impl AsFd, len: usize) -> Result<Self, UnixError> {
        // SAFETY: as in `anonymous_huge`.
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, rw(), MapFlags::SHARED, fd, 0) }
                .map_err(os(Op::Mmap))?;
        Ok(Self::owned(p, len))
    }

    fn owned(p: *mut std::ffi::c_void, len: usize) -> Self {
        Arena {
            base: NonNull::new(p.cast()).expect("a mapping is never at address 0"),
            len,
        }
    }

    /// Advises the kernel to back the mapping with transparent huge pages; a host that does
    /// not allow them (or a mapping of explicit huge pages) ignores it.
    pub fn advise_hugepage(&self) {
        // SAFETY: advice on our own live mapping; MADV_HUGEPAGE changes no contents.
        let _ = unsafe {
            rustix::mm::madvise(self.base.as_ptr().cast(), self.len, Advice::LinuxHugepage)
        };
    }

    /// Binds the whole mapping to NUMA node `node` (`MPOL_BIND`, strict, moving any page
    /// already placed elsewhere). Fails with `EINVAL` for a node above 1023 or one the host
    /// does not have.
    pub fn bind_to_node(&self, node: u32) -> Result<(), UnixError> {
        let mut mask = [0 as libc::c_ulong; NODE_MASK_WORDS];
        let bits = libc::c_ulong::BITS;
        let Some(word) = mask.get_mut((node / bits) as usize) else {
            return Err(UnixError::Os {
                op: Op::Mbind,
                errno: libc::EINVAL,
            });
        };
        *word = 1 << (node % bits);
        // rustix has no `mbind`, so this one call goes through libc.
        // SAFETY: `mbind` on our own live mapping, with a mask of `NODE_MASK_WORDS` words of
        // which it reads at most `maxnode` bits; a policy change moves pages but never
        // changes their contents.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.base.as_ptr(),
                self.len,
                MPOL_BIND,
                mask.as_ptr(),
                (NODE_MASK_WORDS as libc::c_ulong) * libc::c_ulong::from(bits),
                MPOL_MF_STRICT_MOVE,
            )
        };
        if rc != 0 {
            return Err(UnixError::Os {
                op: Op::Mbind,
                errno: std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EINVAL),
            });
        }
        Ok(())
    }

    /// Allocates the pages of `[offset, offset + n)` as a write to each would, without writing
    /// (`MADV_POPULATE_WRITE`, Linux 5.14 and later; older kernels fail with `EINVAL`). Panics
    /// when the range is not inside the mapping.
    pub fn populate_write(&self, offset: usize, n: usize) -> Result<(), UnixError> {
        self.check(offset, n);
        // SAFETY: the range is inside our live mapping (checked); populating changes no byte.
        unsafe {
            rustix::mm::madvise(
                self.base.as_ptr().add(offset).cast(),
                n,
                Advice::LinuxPopulateWrite,
            )
        }
        .map_err(os(Op::Populate))
    }

    /// Makes a write access to the first byte of every `page` bytes of `[offset, offset + n)`
    /// that changes nothing (an atomic add of 0): [`populate_write`](Self::populate_write) for
    /// kernels without it. Panics when the range is not inside the mapping.
    pub fn touch_pages(&self, offset: usize, n: usize, page: usize) {
        self.check(offset, n);
        assert!(page > 0, "page size 0");
        for at in (offset..offset + n).step_by(page) {
            // SAFETY: the byte is inside our live mapping (checked), and this access is atomic
            // and leaves its value as it was.
            let b = unsafe { AtomicU8::from_ptr(self.base.as_ptr().add(at)) };
            b.fetch_add(0, Ordering::Relaxed);
        }
    }

    fn check(&self, offset: usize, n: usize) {
        assert!(
            offset.checked_add(n).is_some_and(|end| end <= self.len),
            "{n} bytes at {offset} of a {}-byte mapping",
            self.len
        );
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value owns, once, as it goes away; its
        // owner keeps it for as long as anything uses its address.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memfd;

    /// Resident pages of `[p, p + len)` (4 KiB pages), from `mincore`.
    fn resident(a: &Arena) -> usize {
        let mut v = vec![0u8; a.len().div_ceil(4096)];
        // SAFETY: `a` is a live page-aligned mapping of `a.len()` bytes, and `v` has a byte
        // for each of its pages.
        let rc = unsafe { libc::mincore(a.as_ptr().cast(), a.len(), v.as_mut_ptr()) };
        assert_eq!(rc, 0);
        v.iter().filter(|b| *b & 1 == 1).count()
    }

    #[test]
    fn aligned_anonymous_memory_is_aligned_zeroed_and_populated_on_request() {
        let a = Arena::anonymous_aligned(4 << 20, 2 << 20).unwrap();
        a.advise_hugepage();
        assert_eq!(a.as_ptr() as usize % (2 << 20), 0);
        assert_eq!(a.len(), 4 << 20);
        assert_eq!(resident(&a), 0, "MAP_NORESERVE memory starts unpopulated");
        match a.populate_write(0, 1 << 20) {
            Ok(()) => assert!(resident(&a) >= 256, "the first MiB is resident"),
            Err(e) => assert_eq!(e.errno(), Some(libc::EINVAL), "a kernel before 5.14"),
        }
        a.touch_pages(1 << 20, 1 << 20, 4096);
        assert!(resident(&a) >= 256);
        // SAFETY: inside the mapping, which this test alone uses.
        assert_eq!(unsafe { a.as_ptr().add((4 << 20) - 1).read() }, 0);
    }

    #[test]
    fn a_shared_arena_sees_the_files_bytes() {
        let fd = memfd::create(c"umbp-arena-test", 1 << 20, None).unwrap();
        let a = Arena::shared(&fd, 1 << 20).unwrap();
        let b = Arena::shared(&fd, 1 << 20).unwrap();
        drop(fd);
        a.touch_pages(0, 1 << 20, 4096);
        // SAFETY: inside both live mappings, which this test alone uses.
        unsafe {
            a.as_ptr().add(12345).write(9);
            assert_eq!(b.as_ptr().add(12345).read(), 9);
        }
    }

    #[test]
    fn huge_pages_are_refused_or_given_never_faked() {
        // 1 GiB pages are rarely reserved: either the kernel refuses at map time or it gives
        // them, aligned to their size.
        match Arena::anonymous_huge(1 << 30, 1 << 30) {
            Ok(a) => assert_eq!(a.as_ptr() as usize % (1 << 30), 0),
            Err(e) => assert_eq!(e.op(), Op::Mmap),
        }
    }

    #[test]
    fn binding_to_a_node_the_host_lacks_fails_and_node_0_binds_where_numa_exists() {
        let a = Arena::anonymous_aligned(2 << 20, 2 << 20).unwrap();
        let e = a.bind_to_node(5000).unwrap_err();
        assert_eq!((e.op(), e.errno()), (Op::Mbind, Some(libc::EINVAL)));
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            // ENOSYS or EPERM where a sandbox forbids mbind; otherwise it binds.
            if let Err(e) = a.bind_to_node(0) {
                assert!(matches!(e.errno(), Some(libc::ENOSYS | libc::EPERM)), "{e}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "of a 4096-byte mapping")]
    fn populating_past_the_end_panics() {
        let a = Arena::anonymous_aligned(4096, 4096).unwrap();
        a.touch_pages(0, 8192, 4096);
    }
}
