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

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use umbp_unix::mapping::SharedMapping;
use umbp_unix::memfd::{self, FileType, Seals};

/// Bytes of the shared buffer (pages are only allocated as they are written): the most hashes a
/// worker takes in one request, at the largest hash size.
pub(crate) const SHM_BYTES: usize = crate::protocol::MAX_KEYS * crate::protocol::MAX_HASH_LEN;

/// The seals a worker requires on a shared buffer before it maps it.
pub(crate) const REQUIRED_SEALS: Seals = Seals::SHRINK.union(Seals::GROW);

/// A shared, writable buffer owned by the client.
#[derive(Debug)]
pub(crate) struct ShmWriter {
    fd: OwnedFd,
    mapping: SharedMapping,
}

impl ShmWriter {
    pub(crate) fn new() -> std::io::Result<Self> {
        // Workers refuse buffers whose size could change under their mapping.
        let fd = memfd::create_sealed(
            c"umbp-lookup",
            SHM_BYTES as u64,
            None,
            REQUIRED_SEALS | Seals::SEAL,
        )?;
        let mapping = SharedMapping::map(&fd, SHM_BYTES)?;
        Ok(ShmWriter { fd, mapping })
    }

    /// Copies `data` to the start of the buffer (callers hold the client's request lock).
    pub(crate) fn write(&mut self, data: &[u8]) {
        assert!(
            data.len() <= SHM_BYTES,
            "request larger than the shared buffer"
        );
        self.mapping.write_at(0, data);
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
        let seals = memfd::seals(&fd).map_err(|e| {
            format!(
                "the shared buffer is not a sealable memfd ({}); create it with \
                 memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK | F_SEAL_GROW",
                e.to_io()
            )
        })?;
        if !seals.contains(REQUIRED_SEALS) {
            return Err(
                "the shared buffer is not sealed against resizing: add the seals \
                 F_SEAL_SHRINK | F_SEAL_GROW (fcntl F_ADD_SEALS) before attaching it"
                    .into(),
            );
        }
        let info = memfd::file_info(&fd)
            .map_err(|e| format!("cannot stat the shared buffer: {}", e.to_io()))?;
        // The size is sealed: it cannot change after this fstat.
        let len = info.size as usize;
        if info.file_type != FileType::Regular || len == 0 || len > SHM_BYTES {
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
            match memfd::read_at(&self.fd, &mut out[got..], offset + got as u64) {
                Ok(0) => return Err("the shared buffer ended early".into()),
                Ok(n) => got += n,
                Err(e) => return Err(format!("cannot read the shared buffer: {}", e.to_io())),
            }
        }
        Ok(out)
    }
}

/// Sends `frame` with `fd` attached (`SCM_RIGHTS`).
pub(crate) fn send_with_fd(
    s: &UnixStream,
    frame: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let n = umbp_unix::fdpass::send_with_fds(s, frame, &[fd])?;
    if n < frame.len() {
        // The rest of the frame goes as plain bytes.
        use std::io::Write;
        let mut w = s;
        w.write_all(&frame[n..])?;
    }
    Ok(())
}

/// Most descriptors taken from one `recvmsg`; a message with more closes them all and fails.
const MAX_RECV_FDS: usize = 4;

/// Receives up to `buf.len()` bytes without blocking, and every descriptor attached to them
/// (a message with more than a few fails, its descriptors closed).
pub(crate) fn recv_with_fds(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
) -> Result<umbp_unix::fdpass::Received, umbp_unix::UnixError> {
    umbp_unix::fdpass::recv_with_fds(socket, buf, MAX_RECV_FDS, true)
}
