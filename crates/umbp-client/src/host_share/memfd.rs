//! The sealed memfds that back shared host memory: making and sealing one, fresh shared
//! memory in a new one ([`alloc_shared_host`]), and allocating a shared span's pages before
//! the server maps it ([`populate`]).

use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use umbp_unix::clock::page_size;
use umbp_unix::mapping::SharedMapping;
use umbp_unix::memfd::Seals;
use umbp_unix::{Op, UnixError};

use crate::error::ClientError;

/// Name of the memfds made here (shown as `/memfd:umbp-kv` in `/proc/<pid>/maps`).
pub const MEMFD_NAME: &CStr = c"umbp-kv";

/// The seals on every memfd made here.
pub const SEALS: Seals = Seals::SHRINK.union(Seals::GROW).union(Seals::SEAL);

/// Fresh shared memory starts on this boundary, so huge pages can back it where allowed.
pub(super) const ALLOC_ALIGN: u64 = umbp_unix::mapping::HUGE_PAGE_ALIGN as u64;

/// Host memory of this process backed by a sealed memfd that the server can map.
///
/// The span `[span_addr, span_addr + span_len)` of this process is a `MAP_SHARED` mapping of
/// the memfd from file offset 0 (at least where the shared range lies); the caller's range
/// starts `offset_in_span` bytes into it. The server maps the memfd's first `span_len` bytes
/// and reaches a client address `a` of the range at `a - span_addr` in its mapping.
///
/// Dropping this value closes the descriptor only: the memory stays mapped and the caller's
/// (unmap or free it as before); a server that mapped the memfd keeps its own mapping alive.
#[derive(Debug)]
pub struct SharedHostMemory {
    pub(super) fd: OwnedFd,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) offset: u64,
}

impl SharedHostMemory {
    /// The memfd, to send to the server.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The memfd, taken out of this value.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Address in this process of the span's first byte (file offset 0 of the memfd).
    pub fn span_addr(&self) -> u64 {
        self.addr
    }

    /// Bytes of the span: a multiple of its page size, what the server maps.
    pub fn span_len(&self) -> u64 {
        self.len
    }

    /// Where the caller's range starts, in bytes from [`span_addr`](Self::span_addr).
    pub fn offset_in_span(&self) -> u64 {
        self.offset
    }
}

pub(super) fn sys(len: u64, call: &'static str, fix: impl Into<String>) -> ClientError {
    ClientError::ShareSystem {
        len,
        call,
        source: std::io::Error::last_os_error(),
        fix: fix.into(),
    }
}

/// A new memfd of `len` bytes (of huge pages of `huge` bytes when given), sealed with [`SEALS`].
pub(super) fn sealed_memfd(len: u64, huge: Option<u64>) -> Result<OwnedFd, ClientError> {
    umbp_unix::memfd::create_sealed(MEMFD_NAME, len, huge, SEALS).map_err(|e| {
        let (call, fix) = match e.op() {
            Op::MemfdCreate => (
                "memfd_create",
                "the process is at its descriptor limit (ulimit -n) or the kernel lacks memfd \
                 (Linux 3.17; huge-page memfds with seals need 4.16)",
            ),
            Op::Ftruncate => ("ftruncate of the memfd", "share less memory"),
            _ => (
                "fcntl(F_ADD_SEALS)",
                "the kernel cannot seal this memfd (needs Linux 3.17, 4.16 for huge pages)",
            ),
        };
        unix(len, call, e, fix)
    })
}

/// A failed call of `umbp_unix` while sharing `len` bytes, and what to change.
pub(super) fn unix(len: u64, call: &'static str, e: UnixError, fix: &str) -> ClientError {
    ClientError::ShareSystem {
        len,
        call,
        source: e.to_io(),
        fix: fix.into(),
    }
}

/// A new sealed memfd of `len` bytes (whole pages) mapped read-write in this process at a
/// [`ALLOC_ALIGN`] boundary, pages allocated on first touch.
pub(crate) fn shared_mapping(len: u64) -> Result<(OwnedFd, SharedMapping), ClientError> {
    let fd = sealed_memfd(len, None)?;
    let n = usize::try_from(len).map_err(|_| ClientError::ShareBadRange {
        addr: 0,
        len,
        reason: "the length does not fit this address space".into(),
    })?;
    let mapping = SharedMapping::map_aligned(&fd, n, ALLOC_ALIGN as usize).map_err(|e| {
        unix(
            len,
            "mmap of the memfd",
            e,
            "lower the size or raise the process's address-space limit (ulimit -v)",
        )
    })?;
    mapping.advise_hugepage();
    Ok((fd, mapping))
}

/// Fresh host memory of at least `len` bytes (rounded up to whole pages), zeroed, in a new
/// sealed memfd mapped read-write in this process at a 2 MiB boundary. Pages are allocated on
/// first touch.
///
/// The mapping belongs to the caller and outlives the returned value: unmap it with
/// `munmap(span_addr, span_len)` when done (a server that mapped the memfd keeps its own
/// mapping alive).
pub fn alloc_shared_host(len: u64) -> Result<SharedHostMemory, ClientError> {
    let bad = |reason: &str| ClientError::ShareBadRange {
        addr: 0,
        len,
        reason: reason.into(),
    };
    if len == 0 {
        return Err(bad("the length is 0; ask for at least one byte"));
    }
    let page = page_size();
    let span = len
        .checked_next_multiple_of(page)
        .filter(|s| usize::try_from(*s + ALLOC_ALIGN).is_ok())
        .ok_or_else(|| bad("the length does not fit this address space"))?;
    let (fd, mapping) = shared_mapping(span)?;
    let (at, _) = mapping.into_raw();
    Ok(SharedHostMemory {
        fd,
        addr: at.as_ptr() as u64,
        len: span,
        offset: 0,
    })
}

/// `MADV_POPULATE_WRITE` (Linux 5.14), not in every libc crate.
const MADV_POPULATE_WRITE: i32 = 23;

/// Allocates every page of the shared span `[addr, addr + len)` of this process without
/// changing its contents, so the pages exist (and are charged to this process's memory
/// cgroup) before the server maps them. Kernels before 5.14 get one byte per page read, which
/// allocates a shared-memory page just as well.
pub(crate) fn populate(addr: u64, len: u64) -> Result<(), ClientError> {
    // SAFETY: the span is a live shared mapping of this process (a SharedHostMemory's);
    // populating allocates pages and leaves their contents as they are.
    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(ClientError::ShareSystem {
            len,
            call: "madvise(MADV_POPULATE_WRITE) of the shared memory",
            source: e,
            fix: "free memory, or raise this process's memory limit: every page of the KV cache must exist before the server maps it".into(),
        });
    }
    for at in (addr..addr + len).step_by(page_size() as usize) {
        // SAFETY: inside the live mapping; a read changes nothing.
        unsafe { std::ptr::read_volatile(at as *const u8) };
    }
    Ok(())
}
