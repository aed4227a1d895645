//! Sending descriptors over the server's side channel (`<socket>.fds`).

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use umbp_proto::{FdHeader, FD_REFUSED, MAX_FDS_PER_MESSAGE, SECRET_BYTES};

use crate::ClientError;

/// Sends `fds` for session `session_id` and returns their tickets, in order.
pub(crate) fn send_fds(
    path: &Path,
    session_id: u64,
    secret: &[u8; SECRET_BYTES],
    fds: &[BorrowedFd<'_>],
) -> Result<Vec<u64>, ClientError> {
    let mut tickets = Vec::with_capacity(fds.len());
    for batch in fds.chunks(MAX_FDS_PER_MESSAGE) {
        tickets.extend(send_batch(path, session_id, secret, batch)?);
    }
    Ok(tickets)
}

fn send_batch(
    path: &Path,
    session_id: u64,
    secret: &[u8; SECRET_BYTES],
    fds: &[BorrowedFd<'_>],
) -> Result<Vec<u64>, ClientError> {
    let io = |what| move |source| ClientError::Io { what, source };
    let s = UnixStream::connect(path).map_err(io("connecting to the descriptor side channel"))?;
    crate::peer::check_server(std::os::fd::AsFd::as_fd(&s), path)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io("side channel"))?;
    let header = FdHeader {
        session_id,
        secret: *secret,
        count: fds.len() as u32,
    }
    .encode();
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let iov = [IoSlice::new(&header)];
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one header and `payload` bytes of descriptors.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(c) as *mut i32, raw.len());
    }
    // SAFETY: the msghdr points at live buffers of the sizes it states.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 || n as usize != header.len() {
        return Err(ClientError::Io {
            what: "sending descriptors",
            source: std::io::Error::last_os_error(),
        });
    }
    let mut reply = Vec::new();
    let want = fds.len() * 8;
    let mut r = &s;
    let mut buf = [0u8; 4096];
    loop {
        let n = r
            .read(&mut buf)
            .map_err(io("reading the side channel's reply"))?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        if reply.len() >= 8 && reply[..8] != FD_REFUSED.to_le_bytes() && reply.len() >= want {
            break;
        }
    }
    let _ = (&s).write(&[]);
    if let Some((kind, message)) = umbp_proto::errors::decode_refusal(&reply) {
        return Err(ClientError::Refused {
            call: "descriptors",
            kind,
            message,
        });
    }
    if reply.len() != want {
        return Err(ClientError::Disconnected {
            endpoint: path.display().to_string(),
            reason: format!(
                "the side channel answered {} bytes, expected {want}",
                reply.len()
            ),
        });
    }
    Ok(reply
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}
