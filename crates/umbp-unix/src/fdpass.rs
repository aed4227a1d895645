//! Bytes with descriptors over a Unix socket (`SCM_RIGHTS`): how a client hands its memfds to
//! the server and its hash buffer to a lookup worker.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::{Op, UnixError};

/// Sends `bytes` with `fds` attached, in one `sendmsg` (never raising `SIGPIPE`): the bytes
/// sent, which may be fewer than given (the descriptors went with the first of them).
pub fn send_with_fds(
    socket: impl AsFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<usize, UnixError> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        let pushed = control.push(SendAncillaryMessage::ScmRights(fds));
        debug_assert!(pushed, "the control buffer is sized for the descriptors");
    }
    rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(|e| UnixError::os(Op::SendFds, e))
}

/// What one [`recv_with_fds`] brought.
#[derive(Debug)]
pub struct Received {
    /// Bytes read into the buffer (0: the peer closed the stream).
    pub len: usize,
    /// The descriptors that came with them, close-on-exec, each closed when dropped.
    pub fds: Vec<OwnedFd>,
}

/// Receives up to `buf.len()` bytes and the descriptors attached to them, at most `max_fds`.
/// `nonblocking`: fail with `EAGAIN` ([`UnixError::would_block`]) rather than wait when
/// nothing has come. A message with more than `max_fds` descriptors fails with
/// [`UnixError::TooManyFds`], every descriptor of it closed.
pub fn recv_with_fds(
    socket: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    nonblocking: bool,
) -> Result<Received, UnixError> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(max_fds))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut flags = RecvFlags::CMSG_CLOEXEC;
    if nonblocking {
        flags |= RecvFlags::DONTWAIT;
    }
    let msg = rustix::net::recvmsg(socket, &mut [IoSliceMut::new(buf)], &mut control, flags)
        .map_err(|e| UnixError::os(Op::RecvFds, e))?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(got) = m {
            fds.extend(got);
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > max_fds {
        // `fds` is dropped here: every descriptor that did arrive is closed.
        return Err(UnixError::TooManyFds {
            op: Op::RecvFds,
            max: max_fds,
        });
    }
    Ok(Received {
        len: msg.bytes,
        fds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::SharedMapping;
    use crate::memfd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_memfd_round_trips_and_names_the_same_memory() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = memfd::create(c"umbp-test", 4096, None).unwrap();
        let mine = SharedMapping::map(&fd, 4096).unwrap();
        assert_eq!(send_with_fds(&a, b"hello", &[fd.as_fd()]).unwrap(), 5);
        let mut buf = [0u8; 16];
        let got = recv_with_fds(&b, &mut buf, 4, false).unwrap();
        assert_eq!(&buf[..got.len], b"hello");
        assert_eq!(got.fds.len(), 1);
        let theirs = SharedMapping::map(&got.fds[0], 4096).unwrap();
        mine.write_at(100, b"kv-block");
        let mut back = [0u8; 8];
        theirs.read_at(100, &mut back);
        assert_eq!(&back, b"kv-block");
    }

    #[test]
    fn bytes_alone_and_an_empty_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 4];
        let e = recv_with_fds(&b, &mut buf, 1, true).unwrap_err();
        assert!(e.would_block(), "{e}");
        send_with_fds(&a, b"abc", &[]).unwrap();
        let got = recv_with_fds(&b, &mut buf, 1, true).unwrap();
        assert_eq!((got.len, got.fds.len()), (3, 0));
        drop(a);
        assert_eq!(recv_with_fds(&b, &mut buf, 1, false).unwrap().len, 0);
    }

    #[test]
    fn too_many_descriptors_is_an_error_and_closes_them() {
        let (a, b) = UnixStream::pair().unwrap();
        let fds: Vec<OwnedFd> = (0..3)
            .map(|_| memfd::create(c"umbp-test", 0, None).unwrap())
            .collect();
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        send_with_fds(&a, b"x", &borrowed).unwrap();
        let mut buf = [0u8; 4];
        let e = recv_with_fds(&b, &mut buf, 1, false).unwrap_err();
        assert!(matches!(e, UnixError::TooManyFds { max: 1, .. }), "{e}");
    }
}
