//! Moving memory the process already has onto a sealed memfd in place
//! ([`share_host_range`]): the checks that it may move, the copy and the remap over the same
//! addresses, and naming the memfd of memory already shared.

use std::os::fd::AsRawFd;

use umbp_unix::clock::page_size;
use umbp_unix::memfd::Seals;

use super::maps::{classify, find_open_fd, vmas_overlapping, Kind, Vma};
use super::memfd::{sealed_memfd, sys, unix, SharedHostMemory};
use crate::error::ClientError;

/// Bytes moved onto the memfd at a time by [`share_host_range`]: the most memory the call holds
/// twice at any moment.
const CHUNK: u64 = 64 << 20;

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
        super::tests::after_copy(span_start, span);
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
    let sealed = umbp_unix::memfd::seals(&fd).is_ok_and(|s| s.contains(Seals::SHRINK));
    if !sealed {
        return Err(unsupported(
            "a shared mapping of a memfd that is not sealed against shrinking",
            "seal it with F_SEAL_SHRINK | F_SEAL_GROW (fcntl F_ADD_SEALS), or share anonymous \
             memory / memory of alloc_shared_host",
        ));
    }
    let size = umbp_unix::memfd::file_info(&fd)
        .map_err(|e| unix(len, "fstat of the memfd", e, "check the descriptor"))?
        .size;
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
