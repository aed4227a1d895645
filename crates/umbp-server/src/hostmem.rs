//! Host memory a client shares with the server: a memfd the client sealed against shrinking,
//! mapped here `MAP_SHARED`, so the server's copy engine reaches the client's KV cache with
//! plain memcpy and no byte crosses the socket.
//!
//! The seal is what keeps the server safe from its client: a mapping of a file that shrinks
//! raises `SIGBUS` on access past its end, so a descriptor whose size could still shrink is
//! refused.

use std::os::fd::{AsRawFd, BorrowedFd};

/// A client's memfd, mapped read-write into the server. Unmapped when dropped.
#[derive(Debug)]
pub(crate) struct HostMapping {
    addr: u64,
    len: u64,
}

impl HostMapping {
    /// Checks `fd` (sealed against shrinking, a regular file or memfd of at least `len`
    /// bytes) and maps its first `len` bytes.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: u64) -> Result<Self, String> {
        check_shareable(fd, len)?;
        // SAFETY: a fresh shared mapping chosen by the kernel; it replaces nothing.
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
            return Err(format!(
                "mmap of {len} bytes failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(HostMapping {
            addr: p as u64,
            len,
        })
    }

    /// Where the memory is mapped in the server.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made; nothing uses it once its registration is gone
        // (the owner drops it only after deregistering).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

/// Whether a client's descriptor can be mapped safely: a regular file (memfds are) sealed
/// against shrinking, at least `len` bytes, `len` a non-zero multiple of the page size.
pub(crate) fn check_shareable(fd: BorrowedFd<'_>, len: u64) -> Result<(), String> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    if len == 0 || len % page != 0 {
        return Err(format!(
            "length {len} must be a non-zero multiple of the page size ({page})"
        ));
    }
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a live descriptor and a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(format!("fstat failed: {}", std::io::Error::last_os_error()));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err("the descriptor is not a memfd or regular file".into());
    }
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err("the memfd is not sealed against shrinking (F_SEAL_SHRINK); create it with MFD_ALLOW_SEALING and seal it before sharing".into());
    }
    if (st.st_size as u64) < len {
        return Err(format!(
            "the memfd has {} bytes, fewer than the {len} to register",
            st.st_size
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    fn memfd(len: u64, seal: bool) -> OwnedFd {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe {
            libc::memfd_create(
                c"umbp-test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor this test owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a live descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) }, 0);
        if seal {
            // SAFETY: a live memfd created with MFD_ALLOW_SEALING.
            let rc = unsafe {
                libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
                )
            };
            assert_eq!(rc, 0);
        }
        fd
    }

    #[test]
    fn sealed_memfds_map_and_share_bytes() {
        let fd = memfd(1 << 20, true);
        let a = HostMapping::map(fd.as_fd(), 1 << 20).unwrap();
        let b = HostMapping::map(fd.as_fd(), 1 << 20).unwrap();
        // SAFETY: both mappings are 1 MiB, live, and of the same memfd.
        unsafe {
            std::ptr::write_bytes(a.addr() as *mut u8, 0x5a, 4096);
            assert_eq!(*((b.addr() + 4095) as *const u8), 0x5a);
        }
        assert_eq!(a.len(), 1 << 20);
    }

    #[test]
    fn unsafe_descriptors_are_refused() {
        let unsealed = memfd(1 << 20, false);
        assert!(HostMapping::map(unsealed.as_fd(), 1 << 20)
            .unwrap_err()
            .contains("F_SEAL_SHRINK"));
        let small = memfd(4096, true);
        assert!(HostMapping::map(small.as_fd(), 1 << 20)
            .unwrap_err()
            .contains("fewer"));
        let fd = memfd(1 << 20, true);
        assert!(HostMapping::map(fd.as_fd(), 100)
            .unwrap_err()
            .contains("page size"));
        assert!(HostMapping::map(fd.as_fd(), 0).is_err());
        let mut p = [0i32; 2];
        // SAFETY: a valid out-array of two descriptors.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors this test owns.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        assert!(HostMapping::map(r.as_fd(), 4096)
            .unwrap_err()
            .contains("not a memfd"));
    }
}
