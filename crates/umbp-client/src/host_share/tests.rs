//! Tests of sharing host memory: fresh shared memory, ranges moved in place (and refused),
//! and a second mapping of the memfd (as the server's) seeing the same bytes.

use std::alloc::Layout;
use std::os::fd::{AsRawFd, BorrowedFd};

use umbp_unix::mapping::SharedMapping;
use umbp_unix::memfd;

use super::maps::vmas_overlapping;
use super::memfd::ALLOC_ALIGN;
use super::{alloc_shared_host, share_host_range, SharedHostMemory, SEALS};
use crate::error::ClientError;

/// What the server checks of a shared memfd before mapping it (as umbp-server's
/// `hostmem::check_shareable`, which this crate cannot depend on): a regular file sealed
/// against shrinking, at least `len` bytes.
fn check_shareable_fd(fd: BorrowedFd<'_>, len: u64) -> Result<(), String> {
    let info = memfd::file_info(fd).map_err(|e| e.to_string())?;
    if info.file_type != memfd::FileType::Regular {
        return Err("not a regular file".into());
    }
    if !memfd::seals(fd).is_ok_and(|s| s.contains(memfd::Seals::SHRINK)) {
        return Err("not sealed against shrinking".into());
    }
    if info.size < len {
        return Err(format!("{} bytes, fewer than {len}", info.size));
    }
    Ok(())
}

/// A memfd mapped as the server maps it (`MAP_SHARED`, from offset 0); unmapped on drop.
struct ServerMapping(SharedMapping);

impl ServerMapping {
    fn map(fd: BorrowedFd<'_>, len: u64) -> Result<Self, String> {
        check_shareable_fd(fd, len)?;
        SharedMapping::map(fd, len as usize)
            .map(ServerMapping)
            .map_err(|e| format!("mmap: {}", e.to_io()))
    }

    fn addr(&self) -> u64 {
        self.0.addr()
    }

    fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }
}

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
    assert!(umbp_unix::memfd::seals(s.fd()).unwrap().contains(SEALS));
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
