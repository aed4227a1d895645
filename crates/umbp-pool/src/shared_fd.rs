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

use std::os::fd::BorrowedFd;

use umbp_unix::clock::page_size;
use umbp_unix::mapping::{SharedMapping, HUGE_PAGE_ALIGN};
use umbp_unix::memfd::{self, FileType, Seals};

use crate::PoolError;

/// Seals a client's descriptor must carry before the server maps it.
pub const REQUIRED_SEALS: Seals = Seals::SHRINK;

fn refuse(reason: impl Into<String>) -> PoolError {
    PoolError::SharedFd {
        reason: reason.into(),
    }
}

fn os_refuse(what: &str, e: umbp_unix::UnixError) -> PoolError {
    refuse(format!("{what}: {}", e.to_io()))
}

/// What [`inspect`] learned of a descriptor that passed the checks.
#[derive(Debug, Clone, Copy)]
struct Inspected {
    /// The page size of the file (a huge page size for hugetlbfs).
    page: u64,
    hugetlb: bool,
}

fn inspect(fd: BorrowedFd<'_>, len: u64) -> Result<Inspected, PoolError> {
    let info = memfd::file_info(fd).map_err(|e| os_refuse("cannot fstat the descriptor", e))?;
    if info.file_type != FileType::Regular {
        let kind = match info.file_type {
            FileType::Fifo => "a pipe",
            FileType::Socket => "a socket",
            FileType::CharDevice => "a character device",
            FileType::BlockDevice => "a block device",
            FileType::Directory => "a directory",
            _ => "not a regular file",
        };
        return Err(refuse(format!(
            "the descriptor is {kind}, not a memfd; send the descriptor of the memfd that backs \
             the memory (umbp_client::host_share)"
        )));
    }
    let seals = memfd::seals(fd).map_err(|e| {
        refuse(format!(
            "the descriptor is a file that cannot carry seals ({}); only a memfd made with \
             memfd_create(MFD_ALLOW_SEALING) can be shared with the server",
            e.to_io()
        ))
    })?;
    if !seals.contains(REQUIRED_SEALS) {
        return Err(refuse(
            "the memfd is not sealed against shrinking: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) \
             before sending it, so it can never be truncated under the server's mapping",
        ));
    }
    let huge = memfd::hugetlb_page_size(fd);
    let hugetlb = huge.is_some();
    let page = huge.map_or(page_size(), |h| h.max(page_size()));
    if len == 0 || !len.is_multiple_of(page) {
        return Err(refuse(format!(
            "a length of {len} bytes cannot be mapped: it must be a non-zero multiple of the \
             memfd's page size ({page} bytes); round the shared span out to whole pages"
        )));
    }
    // The size is read once the seal is known to be there: from here on it can only grow.
    let size = memfd::file_info(fd)
        .map_err(|e| os_refuse("cannot fstat the descriptor", e))?
        .size;
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
    mapping: SharedMapping,
    page: u64,
    hugetlb: bool,
}

impl ServerMapping {
    /// Maps the first `len` bytes of `fd`, once [`check_shareable_fd`] passes. The descriptor
    /// may be closed afterwards: the mapping keeps the file alive.
    pub fn map(fd: BorrowedFd<'_>, len: u64) -> Result<Self, PoolError> {
        let info = inspect(fd, len)?;
        let n = usize::try_from(len)
            .map_err(|_| refuse(format!("{len} bytes do not fit this address space")))?;
        // Huge-page files are aligned by the kernel; normal pages get 2 MiB alignment, and
        // the advice to back them with transparent huge pages.
        let mapping = if info.hugetlb {
            SharedMapping::map(fd, n)
        } else {
            SharedMapping::map_aligned(fd, n, HUGE_PAGE_ALIGN).inspect(|m| m.advise_hugepage())
        }
        .map_err(|e| os_refuse("mmap of the client's memfd failed", e))?;
        Ok(ServerMapping {
            mapping,
            page: info.page,
            hugetlb: info.hugetlb,
        })
    }

    /// The mapping itself, taken out of this value (still unmapped when that is dropped).
    pub fn into_mapping(self) -> SharedMapping {
        self.mapping
    }

    /// Address of the mapping's first byte in this process.
    pub fn addr(&self) -> u64 {
        self.mapping.addr()
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mapping.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.mapping.len() as u64
    }

    /// Whether the mapping is empty (never: a zero length is refused).
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
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

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use std::os::fd::{AsFd, OwnedFd};

    use super::*;

    fn memfd(len: u64, seals: Seals) -> OwnedFd {
        memfd::create_sealed(c"umbp-test", len, None, seals).unwrap()
    }

    fn msg(e: PoolError) -> String {
        assert!(matches!(e, PoolError::SharedFd { .. }), "{e:?}");
        e.to_string()
    }

    #[test]
    fn accepts_a_sealed_memfd() {
        let fd = memfd(1 << 20, Seals::SHRINK | Seals::GROW);
        check_shareable_fd(fd.as_fd(), 1 << 20).unwrap();
        check_shareable_fd(fd.as_fd(), 4096).unwrap();
    }

    #[test]
    fn refuses_an_unsealed_memfd() {
        let fd = memfd(1 << 20, Seals::empty());
        let e = msg(check_shareable_fd(fd.as_fd(), 1 << 20).unwrap_err());
        assert!(e.contains("F_SEAL_SHRINK"), "{e}");
        // Growing alone is not enough.
        let fd = memfd(1 << 20, Seals::GROW);
        let e = msg(check_shareable_fd(fd.as_fd(), 1 << 20).unwrap_err());
        assert!(e.contains("F_SEAL_SHRINK"), "{e}");
    }

    #[test]
    fn refuses_a_too_small_memfd_and_bad_lengths() {
        let fd = memfd(1 << 20, Seals::SHRINK);
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
        let (r, _w) = std::io::pipe().unwrap();
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
        let fd = memfd(len, Seals::SHRINK | Seals::GROW | Seals::SEAL);
        let a = ServerMapping::map(fd.as_fd(), len).unwrap();
        let b = ServerMapping::map(fd.as_fd(), len).unwrap();
        drop(fd); // the mappings keep the file alive
        assert_eq!(a.len(), len);
        assert!(!a.is_empty() && !a.is_hugetlb());
        assert_eq!(a.page_size(), page_size());
        assert_eq!(a.addr() % HUGE_PAGE_ALIGN as u64, 0, "2 MiB-aligned");
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
