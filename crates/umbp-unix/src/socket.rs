//! Plain socket calls the standard library does not offer: one non-blocking read or peek
//! without changing the descriptor's mode (which other threads share), a send that never
//! raises `SIGPIPE`, waiting on several descriptors, and buffer sizes.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::net::{RecvFlags, SendFlags};

use crate::{Op, UnixError};

/// One `recv` that does not wait (`MSG_DONTWAIT`): the bytes read (0: the peer closed), or an
/// error for which [`UnixError::would_block`] says nothing has come. `peek`: leave the bytes
/// for the next read. A signal's interruption is tried again.
pub fn recv_nowait(socket: impl AsFd, buf: &mut [u8], peek: bool) -> Result<usize, UnixError> {
    let mut flags = RecvFlags::DONTWAIT;
    if peek {
        flags |= RecvFlags::PEEK;
    }
    loop {
        match rustix::net::recv(socket.as_fd(), &mut *buf, flags) {
            Ok((_, n)) => return Ok(n),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(UnixError::os(Op::Recv, e)),
        }
    }
}

/// One `send` that never raises `SIGPIPE` (`MSG_NOSIGNAL`); `nowait`: fail with `EAGAIN`
/// rather than wait for room (`MSG_DONTWAIT`). The bytes sent.
pub fn send_nosignal(socket: impl AsFd, buf: &[u8], nowait: bool) -> Result<usize, UnixError> {
    let mut flags = SendFlags::NOSIGNAL;
    if nowait {
        flags |= SendFlags::DONTWAIT;
    }
    rustix::net::send(socket, buf, flags).map_err(|e| UnixError::os(Op::Send, e))
}

/// Waits until one of `fds` is readable (or has ended or failed), at most `timeout` (forever
/// when `None`): for each descriptor, whether it is. All false after the timeout or a
/// signal.
pub fn wait_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> Result<Vec<bool>, UnixError> {
    let mut polled: Vec<PollFd<'_>> = fds.iter().map(|f| PollFd::new(f, PollFlags::IN)).collect();
    let ts = timeout.map(|t| rustix::time::Timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: t.subsec_nanos() as _,
    });
    match rustix::event::poll(&mut polled, ts.as_ref()) {
        Ok(_) => Ok(polled.iter().map(|p| !p.revents().is_empty()).collect()),
        Err(rustix::io::Errno::INTR) => Ok(vec![false; fds.len()]),
        Err(e) => Err(UnixError::os(Op::Poll, e)),
    }
}

/// Shuts the socket down both ways: blocked reads of every holder of it return, and its peer
/// sees the end of the stream.
pub fn shutdown(socket: impl AsFd) -> Result<(), UnixError> {
    rustix::net::shutdown(socket, rustix::net::Shutdown::Both)
        .map_err(|e| UnixError::os(Op::Shutdown, e))
}

/// Sets the socket's send buffer (`SO_SNDBUF`); the kernel doubles it and caps it at
/// `net.core.wmem_max`.
pub fn set_send_buffer(socket: impl AsFd, bytes: usize) -> Result<(), UnixError> {
    rustix::net::sockopt::set_socket_send_buffer_size(socket, bytes)
        .map_err(|e| UnixError::os(Op::SetSockOpt, e))
}

/// Sets the socket's receive buffer (`SO_RCVBUF`); the kernel doubles it and caps it at
/// `net.core.rmem_max`.
pub fn set_recv_buffer(socket: impl AsFd, bytes: usize) -> Result<(), UnixError> {
    rustix::net::sockopt::set_socket_recv_buffer_size(socket, bytes)
        .map_err(|e| UnixError::os(Op::SetSockOpt, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_peek_leaves_the_bytes_and_an_empty_socket_would_block() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 4];
        assert!(recv_nowait(&b, &mut buf, false).unwrap_err().would_block());
        assert_eq!(send_nosignal(&a, b"abc", true).unwrap(), 3);
        assert_eq!(recv_nowait(&b, &mut buf[..1], true).unwrap(), 1);
        assert_eq!(recv_nowait(&b, &mut buf, false).unwrap(), 3);
        assert_eq!(&buf[..3], b"abc");
        drop(b);
        let e = send_nosignal(&a, b"x", false).unwrap_err();
        assert_eq!(e.errno(), Some(libc::EPIPE), "no SIGPIPE, an error");
    }

    #[test]
    fn a_wait_names_the_readable_descriptor() {
        let (a, b) = UnixStream::pair().unwrap();
        let (c, d) = UnixStream::pair().unwrap();
        set_send_buffer(&a, 1 << 16).unwrap();
        set_recv_buffer(&b, 1 << 16).unwrap();
        let both = [b.as_fd(), d.as_fd()];
        let none = wait_readable(&both, Some(Duration::from_millis(5))).unwrap();
        assert_eq!(none, [false, false]);
        send_nosignal(&c, b"x", false).unwrap();
        assert_eq!(wait_readable(&both, None).unwrap(), [false, true]);
        shutdown(&a).unwrap();
        assert_eq!(wait_readable(&both, None).unwrap(), [true, true]);
    }
}
