//! Sending descriptors over the server's side channel (`<socket>.fds`).

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
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
    let sent = umbp_unix::fdpass::send_with_fds(&s, &header, fds).map_err(|e| ClientError::Io {
        what: "sending descriptors",
        source: e.to_io(),
    })?;
    if sent != header.len() {
        return Err(ClientError::Io {
            what: "sending descriptors",
            source: std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("sent {sent} of the header's {} bytes", header.len()),
            ),
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
