//! Hashes through shared memory.
//!
//! A long prompt's block hashes are hundreds of KiB, and the scheduler sends them to every
//! worker. Copying them through each socket twice (into the kernel and out again) cost more
//! than the lookups themselves, so the client writes them once into a memfd that every worker
//! reads; the socket then carries only `(offset, length)`. The memfd is handed to a worker once
//! per connection with `SCM_RIGHTS`.
//!
//! A worker takes only memfds sealed against shrinking and growing (`F_SEAL_SHRINK |
//! F_SEAL_GROW`), checks every range against the sealed size, and reads with `pread` rather
//! than through a mapping: a client that truncated (or punched a hole in a hugetlb) file under
//! a worker's mapping would kill the worker with SIGBUS on its next read.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

/// Bytes of the shared buffer (pages are only allocated as they are written): the most hashes a
/// worker takes in one request, at the largest hash size.
pub(crate) const SHM_BYTES: usize = crate::protocol::MAX_KEYS * crate::protocol::MAX_HASH_LEN;

/// The seals a worker requires on a shared buffer before it maps it.
pub(crate) const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A shared, writable buffer owned by the client.
#[derive(Debug)]
pub(crate) struct ShmWriter {
    fd: OwnedFd,
    ptr: NonNull<u8>,
}

// SAFETY: the mapping is plain memory owned by this value; writers hold the client's lock.
unsafe impl Send for ShmWriter {}
// SAFETY: as above; `&ShmWriter` only exposes the descriptor.
unsafe impl Sync for ShmWriter {}

impl ShmWriter {
    pub(crate) fn new() -> std::io::Result<Self> {
        let name = c"umbp-lookup";
        // SAFETY: a valid NUL-terminated name; plain flags.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), SHM_BYTES as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Workers refuse buffers whose size could change under their mapping.
        // SAFETY: adding seals to our own memfd; plain integer arguments.
        let sealed = unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                REQUIRED_SEALS | libc::F_SEAL_SEAL,
            )
        };
        if sealed != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of the memfd; checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SHM_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ShmWriter {
            fd,
            ptr: NonNull::new(p.cast()).expect("mmap succeeded"),
        })
    }

    /// Copies `data` to the start of the buffer (callers hold the client's request lock).
    pub(crate) fn write(&mut self, data: &[u8]) {
        assert!(
            data.len() <= SHM_BYTES,
            "request larger than the shared buffer"
        );
        // SAFETY: the mapping is SHM_BYTES long and `data` fits; `&mut self` serialises writers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr(), data.len()) };
    }

    /// A second descriptor of the buffer (tests hand it to a reader).
    #[cfg(test)]
    pub(crate) fn dup_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for ShmWriter {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), SHM_BYTES) };
    }
}

/// A worker's view of a client's buffer: the descriptor and its sealed size. Reads go through
/// `pread`, never a mapping, so no state of the file (a hole punched in it, a hugetlb file out
/// of huge pages) can fault the worker; the seals keep the size it checks ranges against.
#[derive(Debug)]
pub(crate) struct ShmReader {
    fd: OwnedFd,
    len: usize,
}

impl ShmReader {
    /// Takes `fd` (its size from `fstat`), if it is a memfd sealed against shrinking and
    /// growing; otherwise an error that says so.
    pub(crate) fn map(fd: OwnedFd) -> Result<Self, String> {
        // SAFETY: F_GET_SEALS only reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(format!(
                "the shared buffer is not a sealable memfd ({}); create it with \
                 memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK | F_SEAL_GROW",
                std::io::Error::last_os_error()
            ));
        }
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(
                "the shared buffer is not sealed against resizing: add the seals \
                 F_SEAL_SHRINK | F_SEAL_GROW (fcntl F_ADD_SEALS) before attaching it"
                    .into(),
            );
        }
        // SAFETY: `stat` is plain data filled by fstat on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(format!(
                "cannot stat the shared buffer: {}",
                std::io::Error::last_os_error()
            ));
        }
        // The size is sealed: it cannot change after this fstat.
        let len = st.st_size as usize;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || len == 0 || len > SHM_BYTES {
            return Err(format!(
                "shared buffer of {len} bytes (expected a memfd of 1..={SHM_BYTES} bytes)"
            ));
        }
        Ok(ShmReader { fd, len })
    }

    /// A private copy of `[offset, offset + len)`, or an error when it lies outside the buffer.
    /// (Copied because the client may rewrite the buffer for its next request.)
    pub(crate) fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.len as u64)
            .ok_or_else(|| {
                format!(
                    "range {offset}+{len} is outside the {}-byte shared buffer",
                    self.len
                )
            })?;
        let mut out = vec![0u8; (end - offset) as usize];
        let mut got = 0;
        while got < out.len() {
            let rest = &mut out[got..];
            // SAFETY: reads at most `rest.len()` bytes into `rest`, from our descriptor.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                    (offset + got as u64) as libc::off_t,
                )
            };
            match n {
                n if n > 0 => got += n as usize,
                0 => return Err("the shared buffer ended early".into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(format!("cannot read the shared buffer: {e}"));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Sends `frame` with `fd` attached (`SCM_RIGHTS`).
pub(crate) fn send_with_fd(s: &UnixStream, frame: &[u8], fd: RawFd) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; the pointers set below outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(sizeof fd) bytes, as set above.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    }
    // SAFETY: `msg` describes valid buffers; the socket is ours.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (n as usize) < frame.len() {
        // The rest of the frame goes as plain bytes.
        use std::io::Write;
        let mut w = s;
        w.write_all(&frame[n as usize..])?;
    }
    Ok(())
}

/// Most descriptors taken from one `recvmsg`; the kernel closes any beyond (and says so with
/// `MSG_CTRUNC`).
const MAX_RECV_FDS: usize = 4;

/// What one `recvmsg` brought.
#[derive(Debug)]
pub(crate) struct Received {
    /// Bytes read into the buffer (0: end of stream).
    pub(crate) len: usize,
    /// Every descriptor that came with them; each one is closed when dropped.
    pub(crate) fds: Vec<OwnedFd>,
    /// The peer sent more descriptors than fit (the kernel closed the rest).
    pub(crate) truncated: bool,
}

/// Receives up to `buf.len()` bytes without blocking, and every descriptor attached to them.
pub(crate) fn recv_with_fds(fd: RawFd, buf: &mut [u8]) -> std::io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_RECV_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    // u64 words: the control buffer must be aligned for `cmsghdr`.
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the pointers set below outlive the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` describes valid buffers; MSG_CMSG_CLOEXEC marks received fds close-on-exec.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`; each SCM_RIGHTS
    // message holds (cmsg_len - CMSG_LEN(0)) / sizeof(int) descriptors, now ours to own.
    unsafe {
        let header = libc::CMSG_LEN(0) as usize;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count =
                    ((*c).cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        len: n as usize,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}
