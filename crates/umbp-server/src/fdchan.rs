//! The descriptor side channel: gRPC cannot carry file descriptors, so clients pass their
//! memfds and exported CUDA allocations over a second Unix socket beside the gRPC one
//! (`<socket>.fds`) with `SCM_RIGHTS`, proving their session with its secret, and get one
//! ticket per descriptor to name in the registration request.

use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use umbp_proto::{FdHeader, FD_REFUSED, MAX_FDS_PER_MESSAGE};

use crate::listen::{peer_of, PeerInfo};
use crate::service::{Service, State};

/// Accepts side-channel connections until `stop` changes.
pub(crate) async fn serve(
    listener: tokio::net::UnixListener,
    state: Arc<State>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(std_stream) = stream.into_std() else { continue };
                let state = Arc::clone(&state);
                let rt = tokio::runtime::Handle::current();
                tokio::task::spawn_blocking(move || handle(std_stream, state, rt));
            }
        }
    }
}

pub(crate) fn refuse(mut s: &std::os::unix::net::UnixStream, why: &str) {
    tracing::warn!("descriptor side channel: refused: {why}");
    let mut msg = FD_REFUSED.to_le_bytes().to_vec();
    msg.extend_from_slice(why.as_bytes());
    let _ = s.write_all(&msg);
}

/// Receives one header with its descriptors, closing every descriptor on any error.
fn receive(stream: &std::os::unix::net::UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), String> {
    let mut data = vec![0u8; FdHeader::BYTES + 1];
    // Room for MAX_FDS_PER_MESSAGE descriptors in one control message.
    let space = {
        // SAFETY: CMSG_SPACE only computes a size.
        unsafe { libc::CMSG_SPACE((MAX_FDS_PER_MESSAGE * std::mem::size_of::<i32>()) as u32) }
    } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = [IoSliceMut::new(&mut data)];
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: the msghdr points at live buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(format!("recvmsg: {}", std::io::Error::last_os_error()));
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c) as *const i32;
                for i in 0..payload / std::mem::size_of::<i32>() {
                    // Each received descriptor is new in this process: owned from here on.
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(format!(
            "more than {MAX_FDS_PER_MESSAGE} descriptors in one message"
        ));
    }
    data.truncate(n as usize);
    Ok((data, fds))
}

fn handle(stream: std::os::unix::net::UnixStream, state: Arc<State>, rt: tokio::runtime::Handle) {
    let (sessions, access) = (&state.sessions, &state.access);
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let (uid, gid, pid) = match peer_of(&stream) {
        Ok(c) => c,
        Err(e) => return refuse(&stream, &format!("no peer credentials: {e}")),
    };
    let peer = PeerInfo {
        conn: 0,
        uid,
        gid,
        pid,
    };
    if let Err(m) = access.check(&peer) {
        return refuse(&stream, &m);
    }
    let (data, fds) = match receive(&stream) {
        Ok(x) => x,
        Err(m) => return refuse(&stream, &m),
    };
    let header = match FdHeader::decode(&data) {
        Ok(h) => h,
        Err(e) => return refuse(&stream, &e.to_string()),
    };
    if header.count as usize != fds.len() {
        return refuse(
            &stream,
            &format!(
                "{} descriptors announced, {} received",
                header.count,
                fds.len()
            ),
        );
    }
    let Some(cs) = sessions.get_any(header.session_id) else {
        return refuse(
            &stream,
            &format!("session {} is not attached", header.session_id),
        );
    };
    // Compared in full whatever the first difference (no timing hint about the secret).
    let same = cs
        .secret
        .iter()
        .zip(header.secret.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0;
    if !same || cs.peer.uid != uid || (cs.peer.pid != 0 && pid != 0 && cs.peer.pid != pid) {
        return refuse(
            &stream,
            &format!("session {} belongs to another client", header.session_id),
        );
    }
    if header.count == 0 {
        // A transfer channel: it lives as long as its connection, on a thread of its own
        // (not on the blocking pool, which serves short jobs); that thread answers.
        let svc = Service {
            state: Arc::clone(&state),
        };
        let sid = cs.id;
        if let Err(e) = std::thread::Builder::new()
            .name(format!("umbp-chan-r{sid}"))
            .spawn(move || crate::channel::serve(svc, cs, stream, rt))
        {
            tracing::warn!(session = sid, "transfer channel: no reader thread: {e}");
        }
        return;
    }
    let tickets = cs.add_tickets(fds);
    let mut reply = Vec::with_capacity(tickets.len() * 8);
    for t in tickets {
        reply.extend_from_slice(&t.to_le_bytes());
    }
    let mut s = &stream;
    if let Err(e) = s.write_all(&reply) {
        tracing::warn!("descriptor side channel: reply failed: {e}");
    }
    // Wait for the client to close (so it has read the reply) or time out.
    let _ = s.read(&mut [0u8; 1]);
}
