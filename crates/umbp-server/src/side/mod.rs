//! The descriptor side channel: gRPC cannot carry file descriptors, so clients pass their
//! memfds and exported CUDA allocations over a second Unix socket beside the gRPC one
//! (`<socket>.fds`) with `SCM_RIGHTS`, proving their session with its secret, and get one
//! ticket per descriptor to name in the registration request.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use umbp_core::ErrorKind;
use umbp_proto::{FdHeader, MAX_FDS_PER_MESSAGE};

use crate::listen::{peer_of, PeerInfo};
use crate::ratelog::{RateLimited, ACCEPT_BACKOFF};
use crate::state::State;

mod channel;
mod refusal;

use refusal::refuse;

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
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        ACCEPT_FAILED.log(|skipped| {
                            tracing::warn!(skipped, "descriptor side channel: accept failed: {e}; retrying in 100 ms");
                        });
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                let state = Arc::clone(&state);
                let rt = tokio::runtime::Handle::current();
                tokio::spawn(handshake(stream, state, rt));
            }
        }
    }
}

static ACCEPT_FAILED: RateLimited = RateLimited::new();

/// How long a connection to the side channel may take to send its header: 2 s (a client
/// sends it at once after connecting).
const HEADER_DEADLINE: Duration = Duration::from_secs(2);
/// Connections of one uid that may wait for their header at once: 64. Past it new ones are
/// refused at once, so idle connections cannot pile up.
const MAX_WAITING_PER_UID: usize = 64;

/// Connections waiting for their header, per uid.
static WAITING: parking_lot::Mutex<Vec<(u32, usize)>> = parking_lot::Mutex::new(Vec::new());

/// One connection of `uid` counted in [`WAITING`] while it lives.
struct Waiting(u32);

impl Waiting {
    fn enter(uid: u32) -> Option<Waiting> {
        let mut w = WAITING.lock();
        match w.iter_mut().find(|(u, _)| *u == uid) {
            Some((_, n)) if *n >= MAX_WAITING_PER_UID => return None,
            Some((_, n)) => *n += 1,
            None => w.push((uid, 1)),
        }
        Some(Waiting(uid))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut w = WAITING.lock();
        if let Some(i) = w.iter().position(|(u, _)| *u == self.0) {
            w[i].1 -= 1;
            if w[i].1 == 0 {
                w.swap_remove(i);
            }
        }
    }
}

/// A header's bytes and the descriptors that came with it.
type Received = (Vec<u8>, Vec<OwnedFd>);

/// Receives one header with its descriptors without blocking (`WouldBlock` when nothing has
/// come yet), closing every descriptor on any error.
fn receive(stream: &impl AsFd) -> std::io::Result<Result<Received, String>> {
    let mut data = vec![0u8; FdHeader::BYTES + 1];
    match umbp_unix::fdpass::recv_with_fds(stream, &mut data, MAX_FDS_PER_MESSAGE, true) {
        Ok(got) => {
            data.truncate(got.len);
            Ok(Ok((data, got.fds)))
        }
        Err(e) if e.would_block() => Err(e.to_io()),
        Err(umbp_unix::UnixError::TooManyFds { max, .. }) => {
            Ok(Err(format!("more than {max} descriptors in one message")))
        }
        Err(e) => Ok(Err(format!("recvmsg: {}", e.to_io()))),
    }
}

/// Waits (on the runtime, holding no thread) for a connection's header, at most
/// [`HEADER_DEADLINE`], then hands it to [`handle`].
async fn handshake(stream: tokio::net::UnixStream, state: Arc<State>, rt: tokio::runtime::Handle) {
    let Ok(std_stream) = stream.into_std() else {
        return;
    };
    let (uid, gid, pid) = match peer_of(&std_stream) {
        Ok(c) => c,
        Err(e) => {
            return refuse(
                &std_stream,
                ErrorKind::Internal,
                &format!("no peer credentials: {e}"),
            )
        }
    };
    let peer = PeerInfo {
        conn: 0,
        uid,
        gid,
        pid,
    };
    if let Err(m) = state.access.check(&peer) {
        return refuse(&std_stream, ErrorKind::Denied, &m);
    }
    let Some(waiting) = Waiting::enter(uid) else {
        return refuse(
            &std_stream,
            ErrorKind::Denied,
            &format!(
                "uid {uid} has {MAX_WAITING_PER_UID} side-channel connections waiting to send their header; send it at once after connecting"
            ),
        );
    };
    let Ok(stream) = tokio::net::UnixStream::from_std(std_stream) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + HEADER_DEADLINE;
    let received = loop {
        if tokio::time::timeout_at(deadline, stream.readable())
            .await
            .is_err()
        {
            let Ok(s) = stream.into_std() else { return };
            return refuse(
                &s,
                ErrorKind::InvalidArgument,
                &format!(
                    "no header within {} s of connecting",
                    HEADER_DEADLINE.as_secs()
                ),
            );
        }
        match stream.try_io(tokio::io::Interest::READABLE, || receive(&stream)) {
            Ok(r) => break r,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                let Ok(s) = stream.into_std() else { return };
                return refuse(&s, ErrorKind::Internal, &format!("recvmsg: {e}"));
            }
        }
    };
    drop(waiting);
    let Ok(std_stream) = stream.into_std() else {
        return;
    };
    let _ = std_stream.set_nonblocking(false);
    let _ = std_stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = std_stream.set_write_timeout(Some(Duration::from_secs(5)));
    match received {
        Ok((data, fds)) => handle(std_stream, peer, data, fds, state, rt),
        Err(m) => refuse(&std_stream, ErrorKind::InvalidArgument, &m),
    }
}

/// Checks a received header against its session and answers: tickets for its descriptors, or
/// a transfer channel for a header of none. Nothing here waits on the client.
fn handle(
    stream: std::os::unix::net::UnixStream,
    peer: PeerInfo,
    data: Vec<u8>,
    fds: Vec<OwnedFd>,
    state: Arc<State>,
    rt: tokio::runtime::Handle,
) {
    let sessions = &state.sessions;
    let PeerInfo { uid, pid, .. } = peer;
    let header = match FdHeader::decode(&data) {
        Ok(h) => h,
        Err(e) => return refuse(&stream, ErrorKind::InvalidArgument, &e.to_string()),
    };
    if header.count as usize != fds.len() {
        return refuse(
            &stream,
            ErrorKind::InvalidArgument,
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
            ErrorKind::SessionLost,
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
            ErrorKind::Denied,
            &format!("session {} belongs to another client", header.session_id),
        );
    }
    if header.count == 0 {
        // A transfer channel: it lives as long as its connection, on a thread of its own
        // (not on the blocking pool, which serves short jobs); that thread answers.
        let sid = cs.id;
        if let Err(e) = std::thread::Builder::new()
            .name(format!("umbp-chan-r{sid}"))
            .spawn(move || channel::serve(state, cs, stream, rt))
        {
            tracing::warn!(session = sid, "transfer channel: no reader thread: {e}");
        }
        return;
    }
    let tickets = match cs.add_tickets(fds) {
        Ok(t) => t,
        Err(m) => return refuse(&stream, ErrorKind::Registration, &m),
    };
    let mut reply = Vec::with_capacity(tickets.len() * 8);
    for t in tickets {
        reply.extend_from_slice(&t.to_le_bytes());
    }
    // The reply fits the socket's buffer; the client reads it after this end has closed.
    let mut s = &stream;
    if let Err(e) = s.write_all(&reply) {
        tracing::warn!("descriptor side channel: reply failed: {e}");
    }
}
