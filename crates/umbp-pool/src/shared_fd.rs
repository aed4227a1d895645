//! Client memory the server maps: the checks a client's shared-memory descriptor must pass, and
//! the server's own mapping of it.
//!
//! A client of the standalone server keeps its KV cache in a memfd (made by
//! `umbp_client::host_share`) and hands the descriptor over with `SCM_RIGHTS`; the server maps
//! it `MAP_SHARED` and copies between it and the pool with the same copy path it uses for its
//! own memory. No KV byte crosses the socket.
//!
//! What keeps the server safe from the client:
//! * the descriptor must be a memfd (only memfds carry seals) sealed with `F_SEAL_SHRINK`, so
//!   the client can never cut the file under the server's mapping (a truncated file would
//!   raise `SIGBUS` in the server on its next access); the size is read with `fstat` after the
//!   seal, so it can only stay or grow;
//! * the mapping holds its own reference to the file: the client may unmap, free or die, and
//!   the server's copies still land in valid memory (the file is freed when both let go).
//!
//! One risk the seals do not cover: a memfd of *huge pages* (`MFD_HUGETLB`) whose client punches
//! a hole in it (`fallocate(FALLOC_FL_PUNCH_HOLE)`) while the host's huge page pool is empty
//! makes the server's next access to that page fail with `SIGBUS`; only `F_SEAL_WRITE` would
//! forbid the punch, and it would also forbid the client writing its cache.
//! [`ServerMapping::is_hugetlb`] says when a mapping is of that kind.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use crate::PoolError;

/// Seals a client's descriptor must carry before the server maps it.
pub const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK;

const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
/// Server mappings of normal pages start on this boundary, so transparent huge pages of the
/// file (where the host enables them for shared memory) can be mapped whole.
pub const MAP_ALIGN: usize = 2 << 20;

fn refuse(reason: impl Into<String>) -> PoolError {
    PoolError::SharedFd {
        reason: reason.into(),
    }
}

fn os_refuse(what: &str) -> PoolError {
    refuse(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// The system page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// What [`inspect`] learned of a descriptor that passed the checks.
#[derive(Debug, Clone, Copy)]
struct Inspected {
    /// The page size of the file (a huge page size for hugetlbfs).
    page: u64,
    hugetlb: bool,
}

fn inspect(fd: BorrowedFd<'_>, len: u64) -> Result<Inspected, PoolError> {
    // SAFETY: `stat` is plain data, filled by fstat on a descriptor the caller borrows to us.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(os_refuse("cannot fstat the descriptor"));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFIFO => "a pipe",
            libc::S_IFSOCK => "a socket",
            libc::S_IFCHR => "a character device",
            libc::S_IFBLK => "a block device",
            libc::S_IFDIR => "a directory",
            _ => "not a regular file",
        };
        return Err(refuse(format!(
            "the descriptor is {kind}, not a memfd; send the descriptor of the memfd that backs \
             the memory (umbp_client::host_share)"
        )));
    }
    // SAFETY: F_GET_SEALS only reads the seals of the file.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(refuse(format!(
            "the descriptor is a file that cannot carry seals ({}); only a memfd made with \
             memfd_create(MFD_ALLOW_SEALING) can be shared with the server",
            std::io::Error::last_os_error()
        )));
    }
    if seals & REQUIRED_SEALS != REQUIRED_SEALS {
        return Err(refuse(
            "the memfd is not sealed against shrinking: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) \
             before sending it, so it can never be truncated under the server's mapping",
        ));
    }
    // SAFETY: `statfs` is plain data, filled by fstatfs on the same descriptor.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let hugetlb = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } == 0
        && fs.f_type as i64 == HUGETLBFS_MAGIC;
    let page = if hugetlb {
        (fs.f_bsize as u64).max(page_size())
    } else {
        page_size()
    };
    if len == 0 || !len.is_multiple_of(page) {
        return Err(refuse(format!(
            "a length of {len} bytes cannot be mapped: it must be a non-zero multiple of the \
             memfd's page size ({page} bytes); round the shared span out to whole pages"
        )));
    }
    // The size is read once the seal is known to be there: from here on it can only grow.
    // SAFETY: as the fstat above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(os_refuse("cannot fstat the descriptor"));
    }
    let size = st.st_size.max(0) as u64;
    if size < len {
        return Err(refuse(format!(
            "the memfd holds {size} bytes but {len} were to be mapped; send the length of the \
             shared span (ftruncate the memfd to it before sealing)"
        )));
    }
    Ok(Inspected { page, hugetlb })
}

/// Checks that the server may map `len` bytes of `fd` (a client's descriptor): a memfd sealed
/// with `F_SEAL_SHRINK`, at least `len` bytes long, `len` a non-zero multiple of its page size
/// (the huge page size for a hugetlb memfd). The error says what the client must change.
pub fn check_shareable_fd(fd: BorrowedFd<'_>, len: u64) -> Result<(), PoolError> {
    inspect(fd, len).map(|_| ())
}

/// The server's mapping of a client's memfd: `MAP_SHARED`, read and write, at an address of
/// the kernel's choosing (2 MiB-aligned for normal pages). Unmapped on drop.
///
/// The mapping's bytes are written by the client too, at any time: the server only ever goes
/// through raw pointers to it (its copy path), never references.
#[derive(Debug)]
pub struct ServerMapping {
    base: NonNull<u8>,
    len: usize,
    page: u64,
    hugetlb: bool,
}

// SAFETY: the mapping is plain memory owned by this value and only unmapped in `drop`, which
// needs exclusive ownership; `&ServerMapping` hands out only its address and length.
unsafe impl Send for ServerMapping {}
// SAFETY: as above.
unsafe impl Sync for ServerMapping {}

impl ServerMapping {
    /// Maps the first `len` bytes of `fd`, once [`check_shareable_fd`] passes. The descriptor
    /// may be closed afterwards: the mapping keeps the file alive.
    pub fn map(fd: BorrowedFd<'_>, len: u64) -> Result<Self, PoolError> {
        let info = inspect(fd, len)?;
        let n = usize::try_from(len)
            .map_err(|_| refuse(format!("{len} bytes do not fit this address space")))?;
        // Huge-page files are aligned by the kernel; normal pages get 2 MiB alignment
        // (`map_shared_aligned`).
        let base = if info.hugetlb {
            // SAFETY: a new mapping at an address of the kernel's choosing; nothing existing is
            // touched. Checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(os_refuse("mmap of the client's memfd failed"));
            }
            p.cast::<u8>()
        } else {
            map_shared_aligned(fd, n)
                .map_err(|e| refuse(format!("mmap of the client's memfd failed: {e}")))?
                .as_ptr()
        };
        Ok(ServerMapping {
            base: NonNull::new(base).expect("mmap returned a non-null address"),
            len: n,
            page: info.page,
            hugetlb: info.hugetlb,
        })
    }

    /// Address of the mapping's first byte in this process.
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the mapping is empty (never: a zero length is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd's page size (a huge page size for a hugetlb memfd).
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Whether the memfd is of huge pages (see the module docs for the one risk that carries).
    pub fn is_hugetlb(&self) -> bool {
        self.hugetlb
    }
}

impl Drop for ServerMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`; the value is being dropped, so
        // nothing reaches it through this value afterwards.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Maps the first `len` bytes of `fd` read-write and shared at a 2 MiB boundary (so that huge
/// pages can back it where the host allows them for shared memory, which it is advised to),
/// by reserving `len + 2 MiB` of address space and trimming the ends. The mapping is the
/// caller's to unmap (`munmap(addr, len)`).
pub fn map_shared_aligned(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<NonNull<u8>> {
    let slack = MAP_ALIGN;
    let reserve_len = len
        .checked_add(slack)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    // SAFETY: reserving fresh address space (no access) at an address of the kernel's choosing;
    // checked against MAP_FAILED.
    let r = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let head = r.cast::<u8>().align_offset(MAP_ALIGN);
    let at = r.cast::<u8>().wrapping_add(head);
    // SAFETY: `[at, at + len)` lies inside the reservation just made, which nothing else uses;
    // MAP_FIXED replaces that part of it. Checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            at.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let err = std::io::Error::last_os_error();
        // SAFETY: unmapping the whole reservation made above, unused by anyone.
        unsafe { libc::munmap(r, reserve_len) };
        return Err(err);
    }
    // SAFETY: the head `[r, at)` and the tail `[at + len, r + reserve_len)` are the unused ends
    // of our own reservation (`head < MAP_ALIGN = slack`).
    unsafe {
        if head > 0 {
            libc::munmap(r, head);
        }
        let tail = slack - head;
        if tail > 0 {
            libc::munmap(at.add(len).cast(), tail);
        }
    }
    // SAFETY: advising our own new mapping; failure is harmless (the host may not allow huge
    // pages for shared memory) and ignored.
    unsafe { libc::madvise(at.cast(), len, libc::MADV_HUGEPAGE) };
    Ok(NonNull::new(at).expect("a mapping is never at address 0"))
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::*;

    fn memfd(len: u64, seals: libc::c_int) -> OwnedFd {
        // SAFETY: a valid NUL-terminated name; plain flags.
        let raw = unsafe {
            libc::memfd_create(
                c"umbp-test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing our own memfd.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        assert_eq!(rc, 0);
        if seals != 0 {
            // SAFETY: sealing our own memfd.
            let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(rc, 0);
        }
        fd
    }

    fn msg(e: PoolError) -> String {
        assert!(matches!(e, PoolError::SharedFd { .. }), "{e:?}");
        e.to_string()
    }

    #[test]
    fn accepts_a_sealed_memfd() {
        let fd = memfd(1 << 20, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        check_shareable_fd(fd.as_fd(), 1 << 20).unwrap();
        check_shareable_fd(fd.as_fd(), 4096).unwrap();
    }

    #[test]
    fn refuses_an_unsealed_memfd() {
        let fd = memfd(1 << 20, 0);
        let e = msg(check_shareable_fd(fd.as_fd(), 1 << 20).unwrap_err());
        assert!(e.contains("F_SEAL_SHRINK"), "{e}");
        // Growing alone is not enough.
        let fd = memfd(1 << 20, libc::F_SEAL_GROW);
        let e = msg(check_shareable_fd(fd.as_fd(), 1 << 20).unwrap_err());
        assert!(e.contains("F_SEAL_SHRINK"), "{e}");
    }

    #[test]
    fn refuses_a_too_small_memfd_and_bad_lengths() {
        let fd = memfd(1 << 20, libc::F_SEAL_SHRINK);
        let e = msg(check_shareable_fd(fd.as_fd(), 2 << 20).unwrap_err());
        assert!(e.contains("1048576 bytes") && e.contains("2097152"), "{e}");
        let e = msg(check_shareable_fd(fd.as_fd(), 0).unwrap_err());
        assert!(e.contains("multiple"), "{e}");
        let e = msg(check_shareable_fd(fd.as_fd(), 4097).unwrap_err());
        assert!(e.contains("multiple"), "{e}");
        assert!(ServerMapping::map(fd.as_fd(), 2 << 20).is_err());
    }

    #[test]
    fn refuses_a_pipe_and_a_plain_file() {
        let mut p = [0; 2];
        // SAFETY: pipe2 fills two descriptors into `p`.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are fresh and owned here.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let e = msg(check_shareable_fd(r.as_fd(), 4096).unwrap_err());
        assert!(e.contains("a pipe"), "{e}");

        let path = std::env::temp_dir().join(format!("umbp-shared-fd-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(4096).unwrap();
        let _ = std::fs::remove_file(&path);
        let e = msg(check_shareable_fd(f.as_fd(), 4096).unwrap_err());
        assert!(e.contains("memfd"), "{e}");
    }

    #[test]
    fn server_mapping_round_trip() {
        let len = 4u64 << 20;
        let fd = memfd(
            len,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        );
        let a = ServerMapping::map(fd.as_fd(), len).unwrap();
        let b = ServerMapping::map(fd.as_fd(), len).unwrap();
        drop(fd); // the mappings keep the file alive
        assert_eq!(a.len(), len);
        assert!(!a.is_empty() && !a.is_hugetlb());
        assert_eq!(a.page_size(), page_size());
        assert_eq!(a.addr() % MAP_ALIGN as u64, 0, "2 MiB-aligned");
        assert_ne!(a.addr(), b.addr());
        for (i, at) in [0usize, 4095, 1 << 20, len as usize - 1]
            .into_iter()
            .enumerate()
        {
            // SAFETY: `at < len`, inside both mappings, which this test alone uses.
            unsafe {
                a.as_ptr().add(at).write_volatile(i as u8 + 1);
                assert_eq!(b.as_ptr().add(at).read_volatile(), i as u8 + 1);
                b.as_ptr().add(at).write_volatile(0xA0 + i as u8);
                assert_eq!(a.as_ptr().add(at).read_volatile(), 0xA0 + i as u8);
            }
        }
    }
}
