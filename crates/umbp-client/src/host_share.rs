//! A client's host memory (a CPU engine's KV cache) made reachable by the standalone server
//! without a KV byte crossing the socket.
//!
//! The client's KV cache is backed by a memfd; the client sends the descriptor to the server
//! (`SCM_RIGHTS`), which maps it `MAP_SHARED` (umbp-server's `hostmem`, after checking its
//! seals) and copies between it and its pool with the same copy path it uses for everything
//! else. Two ways to get there:
//! * [`alloc_shared_host`]: fresh memory in a new memfd, for callers that can allocate their
//!   cache in it;
//! * [`share_host_range`]: memory the process already has (a torch tensor's `data_ptr()`), moved
//!   onto a memfd *in place*: the bytes are copied into the memfd and the memfd is mapped over
//!   the same virtual addresses, so every pointer into the range stays valid.
//!
//! The memfd is sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`): the client cannot truncate it under the server's mapping, which would raise
//! `SIGBUS` in the server.
//!
//! # Why shared memory and not `process_vm_readv`/`process_vm_writev`
//!
//! Two routes let a server reach a client's memory directly: (a) this one, a shared mapping
//! copied with plain `memcpy`; (b) cross-process copies (`process_vm_readv/writev`), which the
//! client permits by the ptrace rules (under Yama, `prctl(PR_SET_PTRACER, server_pid)`).
//! Route (a) was chosen by measurement: `umbp bench host-route` (release build, 2026-12-01, a
//! 16-core Intel Xeon VM, Linux 6.18, THP `madvise`, `shmem_enabled` `never`), one run, 1 GiB
//! each way per case, one thread, client pieces in random order, best of 3 rounds; GB/s and
//! the ratio to a copy between two buffers of one process with the same copy function as
//! route (a) (`umbp_copy::memcpy::copy`):
//!
//! ```text
//! pages    piece  direction      memcpy GB/s   (a) shm GB/s  ratio   (b) pvm GB/s  ratio
//! 4k       4 KiB  out of client         6.36           6.46   1.02           2.85   0.45
//! 4k       4 KiB  into client           7.70           8.17   1.06           2.92   0.38
//! 4k      16 KiB  out of client         7.59           6.48   0.85           4.12   0.54
//! 4k      16 KiB  into client           8.44           7.79   0.92           4.04   0.48
//! 4k      64 KiB  out of client         7.89           7.38   0.94           4.72   0.60
//! 4k      64 KiB  into client           7.43           7.13   0.96           4.64   0.62
//! 4k     256 KiB  out of client         8.12           8.55   1.05           5.05   0.62
//! 4k     256 KiB  into client           7.71           7.44   0.97           4.82   0.62
//! 4k       1 MiB  out of client         7.85           8.22   1.05           4.77   0.61
//! 4k       1 MiB  into client           6.96           7.09   1.02           4.48   0.64
//! thp      4 KiB  out of client         8.03           6.49   0.81           3.67   0.46
//! thp      4 KiB  into client           8.55           8.43   0.99           3.47   0.41
//! thp     16 KiB  out of client         8.85           7.39   0.84           4.36   0.49
//! thp     16 KiB  into client           8.51           8.56   1.01           4.57   0.54
//! thp     64 KiB  out of client         8.68           8.29   0.96           5.14   0.59
//! thp     64 KiB  into client           7.77           7.88   1.01           4.89   0.63
//! thp    256 KiB  out of client         8.83           7.16   0.81           5.11   0.58
//! thp    256 KiB  into client           7.87           8.41   1.07           5.14   0.65
//! thp      1 MiB  out of client         7.88           7.86   1.00           4.84   0.61
//! thp      1 MiB  into client           7.21           7.06   0.98           4.92   0.68
//! ```
//!
//! Route (a) runs at the speed of an in-process copy at every piece size and page size (ratio
//! 0.81–1.07 in one thread, 0.94–1.02 with `--threads 4`, where the ceiling is 20–27 GB/s);
//! route (b) reaches 0.38–0.68 (0.35–0.71 with four threads), worst at 4 KiB pieces. Route (b)
//! pays a system call per batch of at most `IOV_MAX` pieces and pins and maps every client page
//! on every call; route (a) has no system call per transfer, needs no ptrace permission (it
//! works under any Yama setting and in containers without `CAP_SYS_PTRACE`), and reuses the
//! server's one copy path (the copy engine over registered memory, streaming stores included).
//!
//! Its price: the first touch of each page of a new server mapping is a page fault (a one-time
//! cost: the first pass over a fresh 1 GiB mapping ran at 4.4 GB/s instead of about 7), and the
//! shared pages are shmem, so the host's `shmem_enabled`, not `enabled`, decides whether they
//! can be transparent huge pages. In the `thp` rows above both sides of route (a) were still
//! 4 KiB pages (`shmem_enabled` `never`) against huge pages for the others; with `shmem_enabled`
//! `advise` both mappings of route (a) were huge pages throughout (checked on a 2-core machine,
//! whose figures are too noisy to quote).
//!
//! # What sharing in place changes for the process
//!
//! After [`share_host_range`] the range is a `MAP_SHARED` mapping of the memfd: a `fork`ed
//! child shares it instead of getting a copy-on-write copy; the pages count as `Shmem` (still
//! in the same memory cgroup); they are allocated by the calling thread's NUMA policy (the old
//! pages' placement is not carried); and transparent huge pages follow `shmem_enabled`. Memory
//! freed back to a heap stays a shared mapping: `MADV_DONTNEED` (as `malloc_trim` does) does
//! not return shared pages, which go back only when the mapping is unmapped (large allocations
//! are their own mappings, unmapped by `free`).

use std::ffi::CStr;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use umbp_pool::shared_fd::page_size;

use crate::error::ClientError;

/// Name of the memfds made here (shown as `/memfd:umbp-kv` in `/proc/<pid>/maps`).
pub const MEMFD_NAME: &CStr = c"umbp-kv";

/// The seals on every memfd made here.
pub const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Bytes moved onto the memfd at a time by [`share_host_range`]: the most memory the call holds
/// twice at any moment.
const CHUNK: u64 = 64 << 20;
/// Fresh shared memory starts on this boundary, so huge pages can back it where allowed.
const ALLOC_ALIGN: u64 = umbp_pool::shared_fd::MAP_ALIGN as u64;

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
    fd: OwnedFd,
    addr: u64,
    len: u64,
    offset: u64,
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

fn sys(len: u64, call: &'static str, fix: impl Into<String>) -> ClientError {
    ClientError::ShareSystem {
        len,
        call,
        source: std::io::Error::last_os_error(),
        fix: fix.into(),
    }
}

/// A new memfd of `len` bytes (of huge pages of `huge` bytes when given), sealed with [`SEALS`].
fn sealed_memfd(len: u64, huge: Option<u64>) -> Result<OwnedFd, ClientError> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if let Some(h) = huge {
        flags |= libc::MFD_HUGETLB | (h.trailing_zeros() << libc::MFD_HUGE_SHIFT);
    }
    // SAFETY: a valid NUL-terminated name; plain flags.
    let raw = unsafe { libc::memfd_create(MEMFD_NAME.as_ptr(), flags) };
    if raw < 0 {
        return Err(sys(
            len,
            "memfd_create",
            "the process is at its descriptor limit (ulimit -n) or the kernel lacks memfd \
             (Linux 3.17; huge-page memfds with seals need 4.16)",
        ));
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sizing our own new memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(sys(len, "ftruncate of the memfd", "share less memory"));
    }
    // SAFETY: sealing our own new memfd; plain integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
        return Err(sys(
            len,
            "fcntl(F_ADD_SEALS)",
            "the kernel cannot seal this memfd (needs Linux 3.17, 4.16 for huge pages)",
        ));
    }
    Ok(fd)
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
    let fd = sealed_memfd(span, None)?;
    let at =
        umbp_pool::shared_fd::map_shared_aligned(fd.as_fd(), span as usize).map_err(|source| {
            ClientError::ShareSystem {
                len: span,
                call: "mmap of the memfd",
                source,
                fix: "lower the size or raise the process's address-space limit (ulimit -v)".into(),
            }
        })?;
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

/// One mapping of this process, from `/proc/self/smaps`.
#[derive(Debug, Clone, Default)]
struct Vma {
    start: u64,
    end: u64,
    perms: String,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
    path: String,
    /// `KernelPageSize`, bytes.
    page: u64,
    /// `VmFlags`, two-letter codes.
    flags: Vec<String>,
    /// `AnonHugePages`, bytes: transparent huge pages backing it.
    anon_huge: u64,
}

impl Vma {
    fn flag(&self, f: &str) -> bool {
        self.flags.iter().any(|x| x == f)
    }
}

/// Parses an smaps header line (`start-end perms offset major:minor inode   path`).
fn parse_header(line: &str) -> Option<Vma> {
    let mut it = line.splitn(6, ' ');
    let (range, perms, offset, dev, inode) =
        (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
    let (s, e) = range.split_once('-')?;
    let (ma, mi) = dev.split_once(':')?;
    Some(Vma {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms: perms.to_owned(),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: (
            u32::from_str_radix(ma, 16).ok()?,
            u32::from_str_radix(mi, 16).ok()?,
        ),
        inode: inode.parse().ok()?,
        path: it.next().unwrap_or("").trim().to_owned(),
        page: 0,
        flags: Vec::new(),
        anon_huge: 0,
    })
}

/// The mappings of this process that overlap `[lo, hi)`, in address order. Reads
/// `/proc/self/smaps` only as far as `hi` (the kernel builds it as it is read).
fn vmas_overlapping(lo: u64, hi: u64) -> Result<Vec<Vma>, ClientError> {
    let f = std::fs::File::open("/proc/self/smaps").map_err(ClientError::ShareProc)?;
    let mut out: Vec<Vma> = Vec::new();
    let mut cur: Option<Vma> = None;
    let finish = |v: Vma, out: &mut Vec<Vma>| {
        if v.end > lo && v.start < hi {
            out.push(v);
        }
    };
    for line in BufReader::new(f).lines() {
        let line = line.map_err(ClientError::ShareProc)?;
        if let Some(v) = parse_header(&line) {
            if let Some(done) = cur.take() {
                finish(done, &mut out);
            }
            if v.start >= hi {
                return Ok(out);
            }
            cur = Some(v);
        } else if let Some(v) = cur.as_mut() {
            if let Some(rest) = line.strip_prefix("KernelPageSize:") {
                let kib: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(4);
                v.page = kib * 1024;
            } else if let Some(rest) = line.strip_prefix("AnonHugePages:") {
                let kib: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(0);
                v.anon_huge = kib * 1024;
            } else if let Some(rest) = line.strip_prefix("VmFlags:") {
                v.flags = rest.split_whitespace().map(str::to_owned).collect();
            }
        }
    }
    if let Some(done) = cur.take() {
        finish(done, &mut out);
    }
    Ok(out)
}

/// What kind of memory a mapping is, for sharing.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// Private anonymous memory of normal pages (malloc, mmap MAP_ANONYMOUS, THP included).
    Anon,
    /// Private anonymous huge pages (MAP_HUGETLB) of this size.
    Hugetlb(u64),
    /// A shared mapping of a memfd: its device and inode, the address of its offset 0, its
    /// page size and whether they are huge pages.
    Memfd {
        dev: (u32, u32),
        inode: u64,
        base: u64,
        page: u64,
        hugetlb: bool,
    },
}

/// The kind of `v`, or what it is and what to do instead.
fn classify(v: &Vma) -> Result<Kind, (String, String)> {
    let anon_fix = || {
        "share private anonymous memory (malloc, mmap MAP_PRIVATE | MAP_ANONYMOUS, a torch CPU \
         tensor) or allocate the cache with alloc_shared_host"
            .to_owned()
    };
    if !v.perms.starts_with("rw") {
        return Err((
            format!("not readable and writable (permissions {})", v.perms),
            "share memory the process reads and writes; the server writes it too".into(),
        ));
    }
    for (flag, what) in [
        ("io", "device I/O memory"),
        ("pf", "a raw page-frame mapping"),
    ] {
        if v.flag(flag) {
            return Err((what.into(), anon_fix()));
        }
    }
    if v.flag("dc") {
        return Err((
            "marked MADV_DONTFORK, as memory pinned for a device (RDMA, a GPU) usually is".into(),
            "share memory no device has registered: a device keeps using the old pages after the \
             move; if nothing pins it, clear the mark with madvise(MADV_DOFORK)"
                .into(),
        ));
    }
    let private = v.perms.as_bytes().get(3) == Some(&b'p');
    if private {
        if v.flag("ht") {
            if v.path.starts_with("/anon_hugepage") {
                return Ok(Kind::Hugetlb(v.page));
            }
            return Err((
                format!("a private mapping of the hugetlbfs file {}", v.path),
                anon_fix(),
            ));
        }
        let anonymous = v.path.is_empty() || v.path == "[heap]" || v.path.starts_with("[anon:");
        if v.inode == 0 && anonymous {
            return Ok(Kind::Anon);
        }
        let what = if v.path.starts_with('[') {
            format!("the {} mapping", v.path)
        } else {
            format!("a private mapping of the file {}", v.path)
        };
        return Err((what, anon_fix()));
    }
    if v.path.starts_with("/memfd:") {
        return Ok(Kind::Memfd {
            dev: v.dev,
            inode: v.inode,
            base: v.start.wrapping_sub(v.offset),
            page: v.page.max(page_size()),
            hugetlb: v.flag("ht"),
        });
    }
    let what = if v.path.is_empty() || v.path.starts_with("/dev/zero") {
        "shared anonymous memory (MAP_SHARED | MAP_ANONYMOUS), which has no descriptor".to_owned()
    } else {
        format!("a shared mapping of {}", v.path)
    };
    Err((what, anon_fix()))
}

/// A descriptor open in this process for the file `(dev, inode)`, duplicated.
fn find_open_fd(dev: (u32, u32), inode: u64) -> Option<OwnedFd> {
    let same = |raw: libc::c_int| {
        // SAFETY: `stat` is plain data filled by fstat; a stale number only fails.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let ok = unsafe { libc::fstat(raw, &mut st) } == 0;
        ok && libc::major(st.st_dev) == dev.0
            && libc::minor(st.st_dev) == dev.1
            && st.st_ino == inode
    };
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(raw) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        if !same(raw) {
            continue;
        }
        // SAFETY: duplicating a descriptor number of this process; a number closed meanwhile
        // fails or names another file, which the check after it catches.
        let dup = unsafe { libc::fcntl(raw, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            continue;
        }
        // SAFETY: `dup` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(dup) };
        if same(fd.as_raw_fd()) {
            return Some(fd);
        }
    }
    None
}

/// Makes the existing memory `[addr, addr + len)` of this process shareable with the server
/// without moving it: the range, rounded out to whole pages of its mapping (huge pages for a
/// hugetlb mapping), is copied into a new sealed memfd which is then mapped over the same
/// addresses (`MAP_SHARED | MAP_FIXED`). Pointers into it stay valid and see the same bytes.
///
/// The range must be private anonymous memory (`mmap(MAP_ANONYMOUS)`, a large malloc, a torch
/// CPU tensor; huge pages of `MAP_HUGETLB` too), or already lie in a shared mapping of a memfd
/// whose descriptor this process still holds (memory from [`alloc_shared_host`], or a range
/// shared before): then nothing moves and the result names that memfd, its whole size as the
/// span.
///
/// Rounding out to pages must not take in anyone else's bytes: a write to them between the
/// copy and the remap would be lost (heap neighbours are written by any thread's malloc and
/// free). So the range must start and end on page boundaries, or be exactly one glibc
/// allocation with a mapping of its own (malloc / posix_memalign above the mmap threshold,
/// which is at most 32 MiB), whose header the move carries along. Anything else is refused
/// with [`ClientError::ShareUnsupported`].
///
/// The range is moved 64 MiB at a time, so at most that much memory is held twice. On an
/// error the bytes are unchanged (part of the range may already be backed by a memfd that
/// nothing else holds).
///
/// # Safety
///
/// * No other thread may write the range during the call: a write made while it is being
///   copied would be lost. Reads are fine.
/// * No device or kernel object may hold the span's physical pages: memory registered with a
///   GPU (`cudaHostRegister`, pinned allocations), with RDMA (`ibv_reg_mr`), as io_uring fixed
///   buffers or in a `vmsplice`d pipe keeps being used there at its old pages, silently apart
///   from the new ones.
///
/// The memory stays the caller's: it is freed as before (`free`, `munmap`, the tensor's
/// deleter), which only drops this process's mapping; a server that mapped the memfd keeps its
/// own mapping and the pages alive until it unmaps.
pub unsafe fn share_host_range(addr: u64, len: u64) -> Result<SharedHostMemory, ClientError> {
    let bad = |reason: &str| ClientError::ShareBadRange {
        addr,
        len,
        reason: reason.into(),
    };
    if len == 0 {
        return Err(bad("the length is 0; share at least one byte"));
    }
    let end = addr
        .checked_add(len)
        .filter(|e| usize::try_from(*e).is_ok())
        .ok_or_else(|| bad("the range runs past the end of the address space"))?;
    let vmas = vmas_overlapping(addr, end)?;
    // The mappings must cover the range without a gap.
    let mut at = addr;
    for v in &vmas {
        if v.start > at {
            break;
        }
        at = at.max(v.end);
    }
    if at < end {
        return Err(ClientError::ShareNotMapped { addr, len, at });
    }
    let unsupported = |v: &Vma, what: &str, fix: &str| ClientError::ShareUnsupported {
        addr,
        len,
        start: v.start,
        end: v.end,
        what: what.into(),
        fix: fix.into(),
    };
    let mut kinds = Vec::with_capacity(vmas.len());
    for v in &vmas {
        kinds.push(classify(v).map_err(|(what, fix)| unsupported(v, &what, &fix))?);
    }
    // The calling thread writes its own stack during the move (thread stacks are plain
    // anonymous mappings, so the kind check does not catch them).
    let here = 0u8;
    let sp = std::ptr::addr_of!(here) as u64;
    if let Some(v) = vmas.iter().find(|v| v.start <= sp && sp < v.end) {
        return Err(unsupported(
            v,
            "the calling thread's stack",
            "share memory allocated on the heap or mapped for the purpose",
        ));
    }
    // Already in one memfd whose descriptor is open here: name it, move nothing.
    if let Some(Kind::Memfd {
        dev, inode, base, ..
    }) = kinds.first()
    {
        if kinds.iter().all(|k| k == &kinds[0]) && find_open_fd(*dev, *inode).is_some() {
            return existing_memfd(addr, len, *dev, *inode, *base);
        }
    }
    // Otherwise everything is moved: anonymous memory, and memfd mappings left behind by
    // memory that was shared, freed and reused (heap memory of a closed client, say), whose
    // descriptors are gone, whether the range lies in one of them or reaches beyond. One page
    // size for all of it.
    let mut page_kind: Option<(u64, bool)> = None;
    for (v, k) in vmas.iter().zip(&kinds) {
        let pk = match k {
            Kind::Anon => (page_size(), false),
            Kind::Hugetlb(p) => (*p, true),
            Kind::Memfd {
                dev,
                inode,
                page,
                hugetlb,
                ..
            } => {
                if find_open_fd(*dev, *inode).is_some() {
                    return Err(unsupported(
                        v,
                        "part of memory already shared (its memfd is still open here), and the \
                         range reaches beyond it",
                        "share within one allocation: the shared one or memory beside it, not both",
                    ));
                }
                (*page, *hugetlb)
            }
        };
        if page_kind.is_some_and(|prev| prev != pk) {
            return Err(unsupported(
                v,
                "of another page size than the mapping before it (the range spans different \
                 memories)",
                "share each allocation on its own",
            ));
        }
        page_kind = Some(pk);
    }
    let (page, hugetlb) = page_kind.expect("a covered range has a mapping");
    let huge = hugetlb.then_some(page);
    let page = page.max(page_size());
    let span_start = addr / page * page;
    let span_end = end
        .checked_next_multiple_of(page)
        .ok_or_else(|| bad("the range runs past the end of the address space"))?;
    let span = span_end - span_start;
    // Bytes of the first and last page outside the range move too; a write to them by any
    // thread (the allocator's own, for a heap neighbour) between the copy and the remap would
    // be lost. Move them only where they provably belong to the range's own allocation.
    if !padding_is_own(addr, end, span_start, span_end) {
        let v = vmas.first().expect("a covered range has a mapping");
        return Err(unsupported(
            v,
            &format!(
                "a range that starts or ends inside a page ({page} bytes) it may share with other \
                 objects (heap neighbours, whose writes during the move would be lost)"
            ),
            "share page-aligned memory (alloc_shared_host, an mmap), or an allocation of its \
             own mapping (glibc malloc / posix_memalign of 32 MiB or more, e.g. a torch CPU \
             tensor or numpy array that large) from its first byte to its last",
        ));
    }
    let fd = sealed_memfd(span, huge)?;
    let chunk = CHUNK.next_multiple_of(page);
    let huge_fix = |call| {
        if huge.is_some() {
            format!(
                "{call}: moving huge-page memory needs free huge pages for up to 64 MiB (or one \
                 page) beside it; reserve more (/sys/kernel/mm/hugepages/*/nr_hugepages)"
            )
        } else {
            "free some memory, or raise vm.max_map_count".to_owned()
        }
    };
    // Memory on transparent huge pages (or advised to be) asks for huge shared pages: the
    // memfd's pages are then allocated through mappings advised MADV_HUGEPAGE, which the host
    // honours where `shmem_enabled` allows (`advise`, `within_size`, `always`). Otherwise both
    // mappings are populated up front, sparing the caller a fault per page later.
    let want_thp = huge.is_none() && vmas.iter().any(|v| v.flag("hg") || v.anon_huge > 0);
    let populate = if want_thp { 0 } else { libc::MAP_POPULATE };
    let mut off = 0;
    while off < span {
        let n = chunk.min(span - off) as usize;
        let target = (span_start + off) as *mut libc::c_void;
        // SAFETY: a new shared mapping of our memfd at an address of the kernel's choosing;
        // checked against MAP_FAILED.
        let tmp = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | populate,
                fd.as_raw_fd(),
                off as libc::off_t,
            )
        };
        if tmp == libc::MAP_FAILED {
            return Err(sys(span, "mmap of the new memfd", huge_fix("mmap")));
        }
        if want_thp {
            // SAFETY: advising our own temporary mapping before its pages exist; ignored where
            // the host refuses huge shared pages.
            unsafe { libc::madvise(tmp, n, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `target..target + n` lies in the span, which the mappings checked above
        // cover (readable); `tmp` is our own new mapping of `n` bytes; they cannot overlap. By
        // the caller's contract nothing writes the span meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(target.cast::<u8>(), tmp.cast::<u8>(), n) };
        #[cfg(test)]
        tests::after_copy(span_start, span);
        // SAFETY: unmapping our own temporary mapping.
        unsafe { libc::munmap(tmp, n) };
        // SAFETY: replaces `[target, target + n)`, part of the caller's memory, with the memfd
        // pages that now hold the same bytes: every address keeps its contents, so pointers
        // into it stay valid. The caller guarantees nobody writes it meanwhile and that no
        // device holds its old pages.
        let p = unsafe {
            libc::mmap(
                target,
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | populate,
                fd.as_raw_fd(),
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = sys(span, "mmap(MAP_FIXED) of the new memfd", huge_fix("mmap"));
            // A failed MAP_FIXED may have dropped the old mapping already. Where it did, put
            // the copy (the memfd holds the same bytes) in its place; where it did not, this
            // fails with EEXIST and the old pages are still there.
            // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped: it cannot replace
            // anything.
            let again = unsafe {
                libc::mmap(
                    target,
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
                    fd.as_raw_fd(),
                    off as libc::off_t,
                )
            };
            if again != target {
                if again != libc::MAP_FAILED {
                    // SAFETY: an older kernel that took the flag as a hint mapped it
                    // elsewhere; unmap that mapping of ours.
                    unsafe { libc::munmap(again, n) };
                }
                return Err(e);
            }
        }
        off += n as u64;
    }
    // Carry the properties of the old mappings that the new one can have.
    let bytes = span as usize;
    if want_thp {
        // SAFETY: advising and populating (mapping the memfd's existing pages, huge ones whole)
        // the span we just mapped; both leave its contents alone, and failures (a host without
        // huge shared pages, a kernel before 5.14) are harmless and ignored.
        unsafe {
            libc::madvise(span_start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
            libc::madvise(
                span_start as *mut libc::c_void,
                bytes,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
    if vmas.iter().any(|v| v.flag("lo")) {
        // SAFETY: locking the span we just mapped; only pins pages of our own memory.
        let rc = unsafe { libc::mlock(span_start as *const libc::c_void, bytes) };
        if rc != 0 {
            log::warn!(
            "umbp: the shared range {span_start:#x}+{span} was locked in memory (mlock) and could \
             not be locked again after the move: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(SharedHostMemory {
        fd,
        addr: span_start,
        len: span,
        offset: addr - span_start,
    })
}

/// Whether the bytes that rounding `[addr, end)` out to whole pages adds,
/// `[span_start, addr)` and `[end, span_end)`, belong to the range's own allocation, so that
/// no other object lives there. True when there are none (a page-aligned range), or when the
/// range is exactly a glibc allocation served by its own mapping (`malloc` / `posix_memalign`
/// above the mmap threshold: torch CPU tensors, numpy arrays): then the added bytes are that
/// allocation's header and the slack after it, which nothing writes while the memory is live.
///
/// The proof reads the chunk header glibc keeps in the 16 bytes before the pointer: the offset
/// of the chunk in its mapping, and the chunk's size with the `IS_MMAPPED` bit. Both must
/// describe a page-aligned mapping that holds the whole span. A heap (brk or arena) chunk lacks
/// the bit; other allocators keep no such header, and their unaligned ranges are refused.
fn padding_is_own(addr: u64, end: u64, span_start: u64, span_end: u64) -> bool {
    if addr == span_start && end == span_end {
        return true;
    }
    // glibc returns 16-byte-aligned pointers at least 16 bytes into a chunk's mapping. The
    // header lies in the range's first page, or (a page-aligned pointer of posix_memalign)
    // at the end of the page before it, which must then be mapped readable.
    if !addr.is_multiple_of(16) || addr < 16 {
        return false;
    }
    if addr - span_start < 16 {
        let readable = vmas_overlapping(addr - 16, addr)
            .is_ok_and(|v| v.len() == 1 && v[0].start <= addr - 16 && v[0].perms.starts_with('r'));
        if !readable {
            return false;
        }
    }
    const IS_MMAPPED: u64 = 0x2;
    const FLAG_BITS: u64 = 0x7;
    // SAFETY: `[addr - 16, addr)` lies in the page of `addr`, the span's first page, which the
    // caller found mapped readable, or in a page just checked to be. Volatile, since another
    // thread may write those bytes (if they are not a header); any value read is only
    // compared.
    let (prev_size, head) = unsafe {
        (
            std::ptr::read_volatile((addr - 16) as *const u64),
            std::ptr::read_volatile((addr - 8) as *const u64),
        )
    };
    if head & IS_MMAPPED == 0 {
        return false;
    }
    let chunk = addr - 16;
    let size = head & !FLAG_BITS;
    let (Some(map_start), Some(map_len)) =
        (chunk.checked_sub(prev_size), prev_size.checked_add(size))
    else {
        return false;
    };
    let Some(map_end) = map_start.checked_add(map_len) else {
        return false;
    };
    let base = page_size();
    map_start.is_multiple_of(base)
        && map_len.is_multiple_of(base)
        && chunk
            .checked_add(size)
            .is_some_and(|c| c >= end && c <= map_end)
        && map_start <= span_start
        && span_end <= map_end
}

/// The result for a range that already lies in a shared mapping of a memfd.
fn existing_memfd(
    addr: u64,
    len: u64,
    dev: (u32, u32),
    inode: u64,
    base: u64,
) -> Result<SharedHostMemory, ClientError> {
    let unsupported = |what: &str, fix: &str| ClientError::ShareUnsupported {
        addr,
        len,
        start: base,
        end: addr + len,
        what: what.into(),
        fix: fix.into(),
    };
    let Some(fd) = find_open_fd(dev, inode) else {
        return Err(unsupported(
            "already a shared mapping of a memfd, but no descriptor of it is open in this process",
            "keep the SharedHostMemory of alloc_shared_host or of the first share_host_range \
             (or its descriptor) alive while the memory is in use",
        ));
    };
    // SAFETY: F_GET_SEALS only reads the seals of our descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(unsupported(
            "a shared mapping of a memfd that is not sealed against shrinking",
            "seal it with F_SEAL_SHRINK | F_SEAL_GROW (fcntl F_ADD_SEALS), or share anonymous \
             memory / memory of alloc_shared_host",
        ));
    }
    // SAFETY: `stat` is plain data filled by fstat on our descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(sys(len, "fstat of the memfd", "check the descriptor"));
    }
    let size = st.st_size.max(0) as u64;
    if addr < base || addr + len > base + size {
        return Err(unsupported(
            "a mapping of a memfd placed at an offset that does not match its addresses",
            "map the memfd from offset 0 at one address, or share anonymous memory",
        ));
    }
    Ok(SharedHostMemory {
        fd,
        addr: base,
        len: size,
        offset: addr - base,
    })
}

#[cfg(test)]
mod tests {
    use std::alloc::Layout;

    /// What the server checks of a shared memfd before mapping it (as umbp-server's
    /// `hostmem::check_shareable`, which this crate cannot depend on): a regular file sealed
    /// against shrinking, at least `len` bytes.
    fn check_shareable_fd(fd: BorrowedFd<'_>, len: u64) -> Result<(), String> {
        // SAFETY: `st` is plain data filled by fstat on a borrowed descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(format!("fstat: {}", std::io::Error::last_os_error()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err("not a regular file".into());
        }
        // SAFETY: F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("not sealed against shrinking".into());
        }
        if (st.st_size as u64) < len {
            return Err(format!("{} bytes, fewer than {len}", st.st_size));
        }
        Ok(())
    }

    /// A memfd mapped as the server maps it (`MAP_SHARED`, from offset 0); unmapped on drop.
    struct ServerMapping {
        addr: u64,
        len: usize,
    }

    impl ServerMapping {
        fn map(fd: BorrowedFd<'_>, len: u64) -> Result<Self, String> {
            check_shareable_fd(fd, len)?;
            // SAFETY: a new shared mapping at an address of the kernel's choosing.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(format!("mmap: {}", std::io::Error::last_os_error()));
            }
            Ok(ServerMapping {
                addr: p as u64,
                len: len as usize,
            })
        }

        fn addr(&self) -> u64 {
            self.addr
        }

        fn as_ptr(&self) -> *mut u8 {
            self.addr as *mut u8
        }
    }

    impl Drop for ServerMapping {
        fn drop(&mut self) {
            // SAFETY: the mapping this value made, unused once it is dropped.
            unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        }
    }

    use super::*;

    const PAGE: usize = 4096;

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(131) ^ (i >> 9)) as u8
    }

    fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
        let st = |fd: BorrowedFd<'_>| {
            // SAFETY: plain data filled by fstat on a borrowed descriptor.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
            (st.st_dev, st.st_ino)
        };
        st(a) == st(b)
    }

    /// Checks that the first line of `/proc/self/maps` at `addr` is a mapping of our memfd.
    fn backed_by_memfd(addr: u64) -> bool {
        let v = vmas_overlapping(addr, addr + 1).unwrap();
        v.len() == 1 && v[0].path.starts_with("/memfd:umbp-kv") && v[0].perms == "rw-s"
    }

    /// Checks the share of `[addr, addr + len)`, whose bytes must read `pattern(addr - base)`
    /// for the `whole` buffer `[base, base + whole)`: unchanged bytes, and writes going both
    /// ways between the caller's pointer and a second (server) mapping of the memfd.
    fn check_share(s: &SharedHostMemory, base: *mut u8, whole: usize, addr: u64, len: u64) {
        assert_eq!(s.span_addr() + s.offset_in_span(), addr);
        assert_eq!(s.span_addr() % PAGE as u64, 0);
        assert_eq!(s.span_len() % PAGE as u64, 0);
        assert!(s.span_addr() + s.span_len() >= addr + len);
        assert!(backed_by_memfd(addr) && backed_by_memfd(addr + len - 1));
        // Every byte of the buffer, neighbours in the first and last page included.
        for i in 0..whole {
            // SAFETY: `i < whole`, inside the test's buffer.
            assert_eq!(unsafe { *base.add(i) }, pattern(i), "byte {i} changed");
        }
        check_shareable_fd(s.fd(), s.span_len()).unwrap();
        let m = ServerMapping::map(s.fd(), s.span_len()).unwrap();
        let at = |a: u64| (m.addr() + (a - s.span_addr())) as *mut u8;
        for a in [addr, addr + len / 2, addr + len - 1] {
            // SAFETY: `a` lies in the shared range: in the caller's buffer and, at the same
            // offset from the span start, in the server mapping; only this test uses either.
            unsafe {
                let mine = a as *mut u8;
                assert_eq!(at(a).read_volatile(), mine.read_volatile());
                mine.write_volatile(0x5A);
                assert_eq!(
                    at(a).read_volatile(),
                    0x5A,
                    "caller's write not seen by server"
                );
                at(a).write_volatile(0xC3);
                assert_eq!(
                    mine.read_volatile(),
                    0xC3,
                    "server's write not seen by caller"
                );
                let i = (a - base as u64) as usize;
                mine.write_volatile(pattern(i));
            }
        }
    }

    #[test]
    fn shares_a_page_aligned_big_allocation_in_place() {
        let len = 16 << 20;
        let layout = Layout::from_size_align(len, PAGE).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        assert!(!p.is_null());
        for i in 0..len {
            // SAFETY: `i < len`, inside the allocation.
            unsafe { p.add(i).write(pattern(i)) };
        }
        // SAFETY: this test's own allocation; no other thread touches it.
        let s = unsafe { share_host_range(p as u64, len as u64) }.unwrap();
        assert_eq!(
            (s.span_addr(), s.span_len(), s.offset_in_span()),
            (p as u64, len as u64, 0)
        );
        check_share(&s, p, len, p as u64, len as u64);
        drop(s);
        // Freeing works as before.
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(p, layout) };
    }

    /// A byte to write at an address between the copy and the remap of the span holding it
    /// (`after_copy`): another thread's write landing in the move's window.
    static AFTER_COPY: std::sync::Mutex<Option<(u64, u8)>> = std::sync::Mutex::new(None);

    /// Called by `share_host_range` after copying a chunk of `[span_start, span_start + span)`
    /// and before mapping the memfd over it.
    pub(super) fn after_copy(span_start: u64, span: u64) {
        if let Some((at, value)) = *AFTER_COPY.lock().unwrap() {
            if (span_start..span_start + span).contains(&at) {
                // SAFETY: the test that set the hook owns `at`, a byte of its own mapping.
                unsafe { (at as *mut u8).write_volatile(value) };
            }
        }
    }

    #[test]
    fn refuses_a_range_whose_pages_it_shares_with_other_objects() {
        // Heap memory as the allocator hands it out: a range 64 bytes into a page, a live
        // neighbour object before it, whose owner (any thread) writes it during the move.
        // SAFETY: a new mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as u64;
        let neighbour = base + 8;
        *AFTER_COPY.lock().unwrap() = Some((neighbour, 0xAB));
        // SAFETY: this test's own mapping; the range is refused before anything moves.
        let r = unsafe { share_host_range(base + 64, 1000) };
        *AFTER_COPY.lock().unwrap() = None;
        // SAFETY: a byte of this test's mapping.
        let seen = unsafe { (neighbour as *const u8).read_volatile() };
        if r.is_ok() {
            assert_eq!(seen, 0xAB, "the neighbour's write during the move was lost");
        }
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("heap neighbours") && e.contains("page-aligned"),
            "{e}"
        );
        // The same range, page-aligned at both ends, moves; the neighbour stays the caller's
        // to coordinate (it lies in the range).
        // SAFETY: as above; no other thread writes the mapping.
        let s = unsafe { share_host_range(base, 2 * PAGE as u64) }.unwrap();
        assert_eq!((s.span_addr(), s.span_len()), (base, 2 * PAGE as u64));
        drop(s);
        // SAFETY: unmapping this test's own mapping.
        unsafe { libc::munmap(p, 2 * PAGE) };
    }

    #[test]
    fn shares_a_glibc_allocation_of_its_own_mapping_whole() {
        // Above glibc's largest mmap threshold (32 MiB), so each has a mapping of its own:
        // malloc's pointer lies 16 bytes into it, posix_memalign's (as torch's CPU allocator
        // calls it) further.
        // Not a whole number of pages: the last page's slack moves too.
        let len = (40 << 20) + 100;
        for align in [0usize, 64, 2 << 20] {
            let mut p: *mut libc::c_void = std::ptr::null_mut();
            if align == 0 {
                // SAFETY: a plain allocation, checked for null below.
                p = unsafe { libc::malloc(len) };
            } else {
                // SAFETY: `align` is a power of two and a multiple of the pointer size.
                assert_eq!(unsafe { libc::posix_memalign(&mut p, align, len) }, 0);
            }
            assert!(!p.is_null());
            let b = p.cast::<u8>();
            for i in 0..len {
                // SAFETY: `i < len`, inside the allocation.
                unsafe { b.add(i).write(pattern(i)) };
            }
            // A part of it that does not start at the allocation is refused: nothing proves
            // whose the bytes before it are.
            // SAFETY: this test's own allocation; refused before anything moves.
            let e = unsafe { share_host_range(p as u64 + 4096 + 32, 100) }.unwrap_err();
            assert!(e.to_string().contains("heap neighbours"), "{e}");
            // The whole of it moves, with the allocator's header before the pointer, which
            // only malloc and free use.
            // SAFETY: this test's own allocation; no other thread touches it.
            let s = unsafe { share_host_range(p as u64, len as u64) }.unwrap();
            // Page-aligned for 2 MiB (glibc gives the pages before it back).
            let off = s.offset_in_span();
            assert!(off >= 16 || align >= PAGE, "align {align}: {off}");
            check_share(&s, b, len, p as u64, len as u64);
            // Once shared, any part of it names the memfd (nothing moves).
            // SAFETY: as above.
            let inner = unsafe { share_host_range(p as u64 + 4096 + 32, 100) }.unwrap();
            assert!(same_file(s.fd(), inner.fd()));
            drop((s, inner));
            // free() reads the header the move carried over, and unmaps the chunk.
            // SAFETY: allocated above by malloc / posix_memalign.
            unsafe { libc::free(p) };
        }
        // A small heap allocation shares its pages with other objects: refused.
        // SAFETY: a plain allocation.
        let small = unsafe { libc::malloc(1000) };
        assert!(!small.is_null());
        // SAFETY: refused before anything moves.
        let e = unsafe { share_host_range(small as u64, 1000) }.unwrap_err();
        assert!(e.to_string().contains("heap neighbours"), "{e}");
        // SAFETY: allocated above.
        unsafe { libc::free(small) };
    }

    #[test]
    fn shares_memory_advised_for_transparent_huge_pages() {
        let len = 4 << 20;
        // SAFETY: a new mapping at an address of the kernel's choosing (2 MiB over, to align).
        let r = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + (2 << 20),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        let p = r
            .cast::<u8>()
            .wrapping_add(r.cast::<u8>().align_offset(2 << 20));
        // SAFETY: advising part of our own new mapping.
        unsafe { libc::madvise(p.cast(), len, libc::MADV_HUGEPAGE) };
        for i in 0..len {
            // SAFETY: `i < len`, inside the mapping.
            unsafe { p.add(i).write(pattern(i)) };
        }
        // SAFETY: this test's own mapping.
        let s = unsafe { share_host_range(p as u64, len as u64) }.unwrap();
        assert_eq!((s.span_addr(), s.span_len()), (p as u64, len as u64));
        check_share(&s, p, len, p as u64, len as u64);
        // SAFETY: unmapping this test's own mapping.
        unsafe { libc::munmap(r, len + (2 << 20)) };
    }

    #[test]
    fn sharing_again_names_the_same_memfd() {
        let len = 4 << 20;
        let layout = Layout::from_size_align(len, PAGE).unwrap();
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null());
        // SAFETY: this test's own allocation; no other thread touches it.
        let first = unsafe { share_host_range(p as u64, len as u64) }.unwrap();
        // SAFETY: as above; a range inside the one already shared.
        let again = unsafe { share_host_range(p as u64 + 10_000, 5000) }.unwrap();
        assert!(same_file(first.fd(), again.fd()));
        assert_eq!(again.span_addr(), p as u64);
        assert_eq!(again.span_len(), len as u64);
        assert_eq!(again.offset_in_span(), 10_000);
        let inode = |fd: BorrowedFd<'_>| {
            // SAFETY: `st` is plain data filled by fstat on a descriptor we hold.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
            st.st_ino
        };
        let old = inode(first.fd());
        drop(again);
        // Once no descriptor is left (the memory freed and reused, say), the memfd cannot be
        // named any more: the range is moved again, onto a new memfd.
        drop(first);
        // SAFETY: as above.
        let moved = unsafe { share_host_range(p as u64 + 8192, 8192) }.unwrap();
        assert_ne!(inode(moved.fd()), old);
        assert_eq!(moved.span_addr(), p as u64 + 8192);
        assert_eq!(moved.span_len(), 8192);
        // SAFETY: inside this test's allocation, zeroed and never written.
        assert_eq!(unsafe { *p.add(12_000) }, 0);
        drop(moved);
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(p, layout) };
    }

    #[test]
    fn memory_shared_freed_and_reused_is_moved_again() {
        let len = 8 * PAGE;
        // SAFETY: a new mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let p = p.cast::<u8>();
        for i in 0..len {
            // SAFETY: `i < len`, inside the mapping.
            unsafe { p.add(i).write(pattern(i)) };
        }
        let inner = (p as u64 + 2 * PAGE as u64, 2 * PAGE as u64);
        // SAFETY: this test's own mapping.
        let first = unsafe { share_host_range(inner.0, inner.1) }.unwrap();
        // While the inner share is alive, a range reaching beyond it is refused.
        // SAFETY: as above; refused before anything moves.
        let e = unsafe { share_host_range(p as u64, len as u64) }.unwrap_err();
        assert!(e.to_string().contains("already shared"), "{e}");
        // Once its descriptor is gone (the memory freed and reused, say), all of it moves.
        drop(first);
        // SAFETY: as above.
        let s = unsafe { share_host_range(p as u64, len as u64) }.unwrap();
        assert_eq!((s.span_addr(), s.span_len()), (p as u64, len as u64));
        check_share(&s, p, len, p as u64, len as u64);
        let v = vmas_overlapping(p as u64, p as u64 + len as u64).unwrap();
        assert_eq!(v.len(), 1, "one mapping of the new memfd: {v:?}");
        // SAFETY: unmapping this test's own mapping.
        unsafe { libc::munmap(p.cast(), len) };
    }

    #[test]
    fn alloc_shared_host_is_sealed_and_reachable_from_the_server() {
        let s = alloc_shared_host((3 << 20) + 5).unwrap();
        assert_eq!(
            s.span_len(),
            ((3 << 20) + 5u64).next_multiple_of(PAGE as u64)
        );
        assert_eq!(s.span_addr() % ALLOC_ALIGN, 0);
        assert_eq!(s.offset_in_span(), 0);
        // SAFETY: F_GET_SEALS reads the seals of our descriptor.
        let seals = unsafe { libc::fcntl(s.fd().as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & SEALS, SEALS);
        // SAFETY: ftruncate on our memfd; the seals must refuse it.
        assert_ne!(unsafe { libc::ftruncate(s.fd().as_raw_fd(), 4096) }, 0);
        let m = ServerMapping::map(s.fd(), s.span_len()).unwrap();
        let p = s.span_addr() as *mut u8;
        // SAFETY: both mappings are `span_len` bytes long and used by this test only.
        unsafe {
            p.add(12345).write_volatile(9);
            assert_eq!(m.as_ptr().add(12345).read_volatile(), 9);
            m.as_ptr().write_volatile(7);
            assert_eq!(p.read_volatile(), 7);
        }
        // The memory can be shared "again": it is already ours.
        // SAFETY: the range lies in the memory allocated above.
        let again = unsafe { share_host_range(s.span_addr() + 100, 100) }.unwrap();
        assert!(same_file(s.fd(), again.fd()));
        assert_eq!(again.offset_in_span(), 100);
        // SAFETY: unmapping the caller-owned mapping from alloc_shared_host.
        unsafe { libc::munmap(p.cast(), s.span_len() as usize) };
        assert!(alloc_shared_host(0).is_err());
    }

    #[test]
    fn refuses_memory_it_cannot_move() {
        // SAFETY: share_host_range only reads the map for these; nothing is remapped.
        unsafe {
            let e = share_host_range(0x1000, 0).unwrap_err();
            assert!(matches!(e, ClientError::ShareBadRange { .. }), "{e}");
            let e = share_host_range(u64::MAX - 10, 100).unwrap_err();
            assert!(matches!(e, ClientError::ShareBadRange { .. }), "{e}");
        }
        let map = |prot, flags, fd| {
            // SAFETY: a new mapping at an address of the kernel's choosing.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), 4 * PAGE, prot, flags, fd, 0) };
            assert_ne!(p, libc::MAP_FAILED);
            p as u64
        };
        let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // A hole: the middle page unmapped.
        let p = map(rw, anon, -1);
        // SAFETY: unmapping a page of our own new mapping.
        unsafe { libc::munmap((p + PAGE as u64) as *mut _, PAGE) };
        // SAFETY: nothing is remapped when the check fails.
        let e = unsafe { share_host_range(p, 3 * PAGE as u64) }.unwrap_err();
        match e {
            ClientError::ShareNotMapped { at, .. } => assert_eq!(at, p + PAGE as u64),
            e => panic!("{e}"),
        }
        // Read-only memory.
        let ro = map(libc::PROT_READ, anon, -1);
        // SAFETY: as above.
        let e = unsafe { share_host_range(ro, 100) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("not readable and writable"), "{e}");
        // Shared anonymous memory has no descriptor.
        let sh = map(rw, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1);
        // SAFETY: as above.
        let e = unsafe { share_host_range(sh, 100) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("shared anonymous"), "{e}");
        // A private mapping of a file.
        let path = std::env::temp_dir().join(format!("umbp-host-share-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(4 * PAGE as u64).unwrap();
        let fm = map(rw, libc::MAP_PRIVATE, f.as_raw_fd());
        let _ = std::fs::remove_file(&path);
        // SAFETY: as above.
        let e = unsafe { share_host_range(fm, 100) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("private mapping of the file"), "{e}");
        // The calling thread's stack (a test thread's: a plain anonymous mapping).
        let on_stack = std::hint::black_box([0u8; 64]);
        // SAFETY: as above.
        let e = unsafe { share_host_range(on_stack.as_ptr() as u64, 64) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("stack"), "{e}");
        for a in [p, ro, sh, fm] {
            // SAFETY: unmapping this test's own mappings (the hole in `p` included: harmless).
            unsafe { libc::munmap(a as *mut _, 4 * PAGE) };
        }
    }

    #[test]
    fn shares_huge_page_memory_where_the_host_has_some() {
        let len = 4 << 20;
        // SAFETY: a new mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            eprintln!("no huge pages reserved on this host: hugetlb sharing not exercised");
            return;
        }
        let p = p.cast::<u8>();
        for i in 0..len {
            // SAFETY: `i < len`, inside the mapping.
            unsafe { p.add(i).write(pattern(i)) };
        }
        // SAFETY: this test's own mapping.
        match unsafe { share_host_range(p as u64 + 3 * PAGE as u64, 100) } {
            Ok(s) => {
                assert_eq!(s.span_addr(), p as u64, "rounded to the 2 MiB page");
                assert_eq!(s.span_len(), 2 << 20);
                check_share(&s, p, len, p as u64 + 3 * PAGE as u64, 100);
            }
            // Too few huge pages free to hold the copy beside the original.
            Err(ClientError::ShareSystem { call, .. }) if call.starts_with("mmap") => {
                eprintln!("not enough free huge pages for the copy: hugetlb sharing not exercised")
            }
            Err(e) => panic!("{e}"),
        }
        // SAFETY: unmapping this test's own mapping.
        unsafe { libc::munmap(p.cast(), len) };
    }

    /// Reads one byte from `fd` (a pipe), retrying on EINTR; false at end of file or error.
    fn wait_byte(fd: libc::c_int) -> bool {
        let mut b = 0u8;
        loop {
            // SAFETY: reads one byte into `b`.
            let n = unsafe { libc::read(fd, (&mut b as *mut u8).cast(), 1) };
            if n == 1 {
                return true;
            }
            // SAFETY: reads this thread's errno.
            if n < 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
                continue;
            }
            return false;
        }
    }

    fn send_byte(fd: libc::c_int) {
        // SAFETY: writes one byte from a local.
        assert_eq!(unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) }, 1);
    }

    #[test]
    fn a_forked_child_mapping_the_fd_sees_the_parents_writes() {
        let len = 1 << 20;
        let s = alloc_shared_host(len as u64).unwrap();
        let p = s.span_addr() as *mut u8;
        let (mut to_child, mut to_parent) = ([0; 2], [0; 2]);
        // SAFETY: pipe2 fills two descriptors each.
        unsafe {
            assert_eq!(libc::pipe2(to_child.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(to_parent.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        let raw = s.fd().as_raw_fd();
        // SAFETY: the child only makes system calls (no allocation, no locks) until `_exit`,
        // as a child of a multi-threaded process must.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: the child: its own mapping of the memfd, never the inherited one; only
            // system calls and plain loads and stores; leaves with `_exit`.
            unsafe {
                let m = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    raw,
                    0,
                );
                if m == libc::MAP_FAILED {
                    libc::_exit(10);
                }
                let m = m.cast::<u8>();
                // Mapped: tell the parent (no assertion: a child must not panic).
                if libc::write(to_parent[1], [1u8].as_ptr().cast(), 1) != 1 {
                    libc::_exit(13);
                }
                if !wait_byte(to_child[0]) {
                    libc::_exit(11);
                }
                for i in (0..len).step_by(997) {
                    if m.add(i).read_volatile() != pattern(i) {
                        libc::_exit(12);
                    }
                }
                for i in (0..len).step_by(1009) {
                    m.add(i).write_volatile(!pattern(i));
                }
                libc::munmap(m.cast(), len);
                libc::_exit(0);
            }
        }
        assert!(wait_byte(to_parent[0]), "child did not map the memfd");
        // Written after the child mapped the memfd: it can only see these through the file.
        for i in 0..len {
            // SAFETY: `i < len`, inside our shared mapping.
            unsafe { p.add(i).write_volatile(pattern(i)) };
        }
        send_byte(to_child[1]);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child failed: status {status:#x}"
        );
        for i in (0..len).step_by(1009) {
            // SAFETY: inside our shared mapping.
            assert_eq!(unsafe { p.add(i).read_volatile() }, !pattern(i), "byte {i}");
        }
        // SAFETY: closing our pipe ends and unmapping our memory.
        unsafe {
            for fd in to_child.into_iter().chain(to_parent) {
                libc::close(fd);
            }
            libc::munmap(p.cast(), len);
        }
    }
}
