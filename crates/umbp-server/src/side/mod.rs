//! The descriptor side channel: gRPC cannot carry file descriptors, so clients pass their
//! memfds and exported CUDA allocations over a second Unix socket beside the gRPC one
//! (`<socket>.fds`) with `SCM_RIGHTS`, proving their session with its secret, and get one
//! ticket per descriptor to name in the registration request.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use umbp_core::ErrorKind;
use umbp_proto::FdHeader;

use crate::budget::{Charge, Silent};
use crate::listen::{peer_of, PeerInfo};
use crate::ratelog::{RateLimited, ACCEPT_BACKOFF};
use crate::state::State;

mod channel;
mod refusal;

use refusal::refuse;

/// Accepts side-channel connections until `stop` changes. While the total descriptor budget
/// is spent nothing is accepted (connections wait in the kernel's backlog).
pub(crate) async fn serve(
    listener: tokio::net::UnixListener,
    state: Arc<State>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => return,
            r = async {
                state.budget.room().await;
                listener.accept().await
            } => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                ACCEPT_FAILED.log(|skipped| {
                    tracing::warn!(
                        skipped,
                        "descriptor side channel: accept failed: {e}; retrying in 100 ms"
                    );
                });
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Charged now when there is room (the usual case: no waiting); otherwise it waits for
        // its budget on a task, in one of a bounded number of places.
        let now = match stream.peer_cred() {
            Ok(c) => state.budget.try_now(c.uid(), 1).ok(),
            Err(_) => None,
        };
        let wait = match now {
            Some(c) => Admission::Charged(c),
            None => match state.budget.park() {
                Some(p) => Admission::Waiting(p),
                None => {
                    let Ok(s) = stream.into_std() else { continue };
                    refuse(
                        &s,
                        ErrorKind::Resource,
                        &format!(
                            "{} connections wait for their descriptor budget already; try again",
                            crate::budget::MAX_PARKED
                        ),
                    );
                    continue;
                }
            },
        };
        let state = Arc::clone(&state);
        let rt = tokio::runtime::Handle::current();
        tokio::spawn(handshake(stream, state, rt, wait));
    }
}

static ACCEPT_FAILED: RateLimited = RateLimited::new();

/// A new connection's descriptor: charged already, or waiting for its budget in a place.
enum Admission {
    Charged(Charge),
    Waiting(crate::budget::Counted),
}

/// A header's bytes and the descriptors that came with it.
type Received = (Vec<u8>, Vec<OwnedFd>);

/// Receives one header with at most `max_fds` descriptors without blocking (`WouldBlock`
/// when nothing has come yet), closing every descriptor on any error.
fn receive(stream: &impl AsFd, max_fds: usize) -> std::io::Result<Result<Received, String>> {
    let mut data = vec![0u8; FdHeader::BYTES + 1];
    match umbp_unix::fdpass::recv_with_fds(stream, &mut data, max_fds, true) {
        Ok(got) => {
            data.truncate(got.len);
            Ok(Ok((data, got.fds)))
        }
        Err(e) if e.would_block() => Err(e.to_io()),
        Err(umbp_unix::UnixError::TooManyFds { .. }) => Ok(Err(format!(
            "more descriptors than the {max_fds} the header announced (or the server could not take them)"
        ))),
        Err(e) => Ok(Err(format!("recvmsg: {}", e.to_io()))),
    }
}

/// What a connection's first bytes came to.
enum First {
    /// The header is there (not read yet): the descriptors it announces.
    Header(usize),
    /// Not a header; refuse with this.
    Bad(String),
    /// The peer closed (or the connection was closed for its silence).
    Closed,
}

/// Looks at the header without taking it (nor its descriptors, which stay in the socket and
/// cost the server nothing until received): `WouldBlock` until something came.
fn peek_header(stream: &impl AsFd) -> std::io::Result<First> {
    let mut b = [0u8; FdHeader::BYTES];
    match umbp_unix::socket::recv_nowait(stream, &mut b, true) {
        Ok(0) => Ok(First::Closed),
        // A client sends its header in one message: what came is all there is.
        Ok(n) if n < FdHeader::BYTES => Ok(First::Bad(
            FdHeader::decode(&b[..n]).map_or_else(|e| e.to_string(), |_| String::new()),
        )),
        Ok(_) => Ok(match FdHeader::decode(&b) {
            Ok(h) => First::Header(h.count as usize),
            Err(e) => First::Bad(e.to_string()),
        }),
        Err(e) if e.would_block() => Err(e.to_io()),
        Err(e) => Ok(First::Bad(format!("recv: {}", e.to_io()))),
    }
}

/// Takes a connection's descriptor budget, waits (on the runtime, holding no thread) for its
/// header, at most [`crate::budget::HANDSHAKE_DEADLINE`] (sooner when the slot is needed: see `budget`),
/// takes the budget of the descriptors it announces, receives them and hands them to
/// [`handle`].
async fn handshake(
    stream: tokio::net::UnixStream,
    state: Arc<State>,
    rt: tokio::runtime::Handle,
    admission: Admission,
) {
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
        refused: None,
    };
    if let Err(m) = state.access.check(&peer) {
        return refuse(&std_stream, ErrorKind::Denied, &m);
    }
    let mut charge = match admission {
        Admission::Charged(c) => c,
        Admission::Waiting(place) => match state.budget.take(uid, 1).await {
            Ok(c) => {
                drop(place);
                c
            }
            Err(short) => return refuse(&std_stream, ErrorKind::Resource, &short.to_string()),
        },
    };
    let Ok(stream) = tokio::net::UnixStream::from_std(std_stream) else {
        return;
    };
    let pending = state
        .budget
        .handshakes
        .enter(uid, stream.as_raw_fd(), Silent::Side);
    let first = loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_io(tokio::io::Interest::READABLE, || peek_header(&stream)) {
            Ok(f) => break f,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => break First::Bad(format!("recv: {e}")),
        }
    };
    // Heard from (or gone): out of the silent connections before anything may close it.
    drop(pending);
    let Ok(std_stream) = stream.into_std() else {
        return;
    };
    let count = match first {
        First::Header(n) => n,
        First::Bad(m) => return refuse(&std_stream, ErrorKind::InvalidArgument, &m),
        First::Closed => return,
    };
    // The descriptors announced (or, for a transfer channel, the three copies of the socket
    // its threads hold), before any is taken in.
    let more = if count == 0 { CHANNEL_FDS } else { count };
    match state.budget.take(uid, more).await {
        Ok(c) => charge.merge(c),
        Err(short) => return refuse(&std_stream, ErrorKind::Resource, &short.to_string()),
    }
    let received = match receive(&std_stream, count) {
        Ok(r) => r,
        Err(e) => Err(format!("recvmsg: {e}")),
    };
    let _ = std_stream.set_nonblocking(false);
    let _ = std_stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = std_stream.set_write_timeout(Some(Duration::from_secs(5)));
    match received {
        Ok((data, fds)) => handle(std_stream, peer, data, fds, charge, state, rt),
        Err(m) => refuse(&std_stream, ErrorKind::InvalidArgument, &m),
    }
}

/// Descriptors a transfer channel holds besides its connection: three copies of the socket
/// (its writer's, its reply path's, and the one its session shuts down at release).
const CHANNEL_FDS: usize = 3;

/// Checks a received header against its session and answers: tickets for its descriptors, or
/// a transfer channel for a header of none. Nothing here waits on the client.
fn handle(
    stream: std::os::unix::net::UnixStream,
    peer: PeerInfo,
    data: Vec<u8>,
    fds: Vec<OwnedFd>,
    mut charge: Charge,
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
            .spawn(move || channel::serve(state, cs, stream, rt, charge))
        {
            tracing::warn!(session = sid, "transfer channel: no reader thread: {e}");
        }
        return;
    }
    // The connection's own descriptor goes with this answer; the rest stay with the tickets.
    charge.shrink_to(1 + fds.len());
    let kept = charge.split(fds.len());
    let tickets = match cs.add_tickets(fds, kept) {
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
