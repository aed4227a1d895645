//! The transfer channel (see [`umbp_proto::channel`]): a side-channel connection of one session
//! that carries its transfers without the gRPC runtime. A thread blocked on the socket reads
//! each request and submits its copy job (the same checks and the same job as the gRPC
//! `Transfer`, through [`transfer::run`]); the job's end publishes the completion
//! page (when named) and hands the reply to a writer thread, so a copy worker never waits on
//! a client's socket. The channel ends with its connection, or when the session is released
//! (which shuts the socket down).

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tonic::Status;
use umbp_core::ErrorKind;
use umbp_proto::channel::{read_frame_len, write_frame, CHANNEL_OPENED};
use umbp_proto::completion::monotonic_ns;
use umbp_proto::{errors, v1};
use umbp_unix::eventfd::EventFd;

use crate::sessions::ClientSession;
use crate::state::State;
use crate::transfer;

/// Replies waiting for the writer at most; a client that leaves more unread loses its channel.
const WRITER_BACKLOG: usize = 4096;

/// Live transfer channels one session may have (a client opens one per attach).
pub(crate) const MAX_CHANNELS_PER_SESSION: usize = 4;

/// How long the rest of a request may take once its length has come: 5 s. A client writes a
/// request in one call, so its bytes come together; a frame announced and never finished ends
/// the channel instead of holding its buffer for ever.
pub(crate) const FRAME_DEADLINE: Duration = Duration::from_secs(5);

/// Reads one length-prefixed request from the channel: waits for its length as long as it
/// takes (an idle channel), then for the rest at most [`FRAME_DEADLINE`], holding only the
/// bytes that came (not the length announced). None when the client closed between frames.
fn read_request(
    stream: &UnixStream,
    max: usize,
    scratch: &mut [u8],
) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::{Error, ErrorKind};
    let Some(len) = read_frame_len(&mut &*stream, max)? else {
        return Ok(None);
    };
    let mut frame = Vec::new();
    let deadline = Instant::now() + FRAME_DEADLINE;
    while frame.len() < len {
        let want = scratch.len().min(len - frame.len());
        let e = match umbp_unix::socket::recv_nowait(stream, &mut scratch[..want], false) {
            Ok(0) => {
                return Err(Error::new(
                    ErrorKind::UnexpectedEof,
                    "the stream ended inside a frame",
                ))
            }
            Ok(n) => {
                frame.extend_from_slice(&scratch[..n]);
                continue;
            }
            Err(e) => e.to_io(),
        };
        match e.kind() {
            ErrorKind::Interrupted => {}
            ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(
                        ErrorKind::TimedOut,
                        format!(
                            "{} of a {len}-byte frame came within {} s",
                            frame.len(),
                            FRAME_DEADLINE.as_secs()
                        ),
                    ));
                }
                let slice = Duration::from_millis(left.as_millis().clamp(1, 60_000) as u64);
                // Only a wake-up: the next recv decides.
                let _ = umbp_unix::socket::wait_readable(&[stream.as_fd()], Some(slice));
            }
            _ => return Err(e),
        }
    }
    Ok(Some(frame))
}

/// What a channel's replies go through: the writer's queue, and the socket to shut down when
/// the queue overruns (which ends the channel on both sides, so no reply is lost silently).
#[derive(Clone)]
struct Replies {
    tx: SyncSender<Vec<u8>>,
    sock: Arc<UnixStream>,
    sid: u64,
    max: usize,
    /// When a reply was last queued (host monotonic clock, ns): the reader's busy poll
    /// watches the socket for a while after it, when the client's next request is likeliest.
    last_reply_ns: Arc<AtomicU64>,
    /// An eventfd the reader waits on beside the socket when it busy-polls: each reply wakes
    /// it (off the transfer's path: the client is still taking its answer), so that it is
    /// already watching when the client's next request comes.
    wake: Option<Arc<EventFd>>,
}

impl Replies {
    /// Queues `frame` for the writer; false when the channel has ended (or now ends: the
    /// writer is overrun, and the socket is shut down).
    fn send(&self, frame: Vec<u8>) -> bool {
        if let Some(w) = &self.wake {
            self.last_reply_ns.store(monotonic_ns(), Ordering::Relaxed);
            // A failure (never: the reader drains it) would only lose this wake-up.
            let _ = w.signal();
        }
        match self.tx.try_send(frame) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                tracing::warn!(
                    session = self.sid,
                    "transfer channel: {WRITER_BACKLOG} replies unread; the channel is closed"
                );
                let _ = self.sock.shutdown(std::net::Shutdown::Both);
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// The reply frame of transfer `id`; an error for it alone when the reply would exceed
    /// the message limit (the client could not read it).
    fn reply_frame(&self, id: u64, reply: v1::TransferReply) -> Vec<u8> {
        let frame = v1::ChannelReply {
            transfer_id: id,
            reply: Some(reply),
            code: 0,
            message: String::new(),
            kind: 0,
        }
        .encode_to_vec();
        if frame.len() <= self.max {
            return frame;
        }
        error_frame(
            id,
            ErrorKind::InvalidArgument, format!(
                "the reply ({} bytes) exceeds the message limit of {} bytes; transfer fewer keys at once or raise --max-message-bytes",
                frame.len(),
                self.max
            ),
        )
    }
}

/// Serves the channel of session `cs` on `stream` until it ends (runs on its own thread),
/// holding `_fds`, its descriptors' charge to the client's budget.
pub(crate) fn serve(
    st: Arc<State>,
    cs: Arc<ClientSession>,
    stream: UnixStream,
    rt: tokio::runtime::Handle,
    _fds: crate::budget::Charge,
) {
    let sid = cs.id;
    let refuse = |kind, why: &str| super::refusal::refuse(&stream, kind, why);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let (Ok(writer_stream), Ok(sock), Ok(kept)) = (
        stream.try_clone(),
        stream.try_clone(),
        stream.as_fd().try_clone_to_owned(),
    ) else {
        return refuse(
            ErrorKind::Internal,
            "the server cannot duplicate the socket (descriptor limit?)",
        );
    };
    // Kept with the session, which shuts it down at its release (ending both threads).
    let token = {
        let mut res = cs.res.lock();
        if res.channels.len() >= MAX_CHANNELS_PER_SESSION {
            drop(res);
            return refuse(
                ErrorKind::Denied,
                &format!(
                    "session {sid} has {MAX_CHANNELS_PER_SESSION} transfer channels open already"
                ),
            );
        }
        let t = cs.next_channel_token();
        res.channels.push((t, kept));
        t
    };
    let forget = || cs.res.lock().channels.retain(|(t, _)| *t != token);
    if cs.released.load(Ordering::Acquire) {
        forget();
        return refuse(ErrorKind::SessionLost, &format!("session {sid} has ended"));
    }
    let (tx, rx) = sync_channel::<Vec<u8>>(WRITER_BACKLOG);
    let writer = std::thread::Builder::new()
        .name(format!("umbp-chan-w{sid}"))
        .spawn(move || write_replies(writer_stream, rx, sid));
    if let Err(e) = writer {
        forget();
        return refuse(
            ErrorKind::Internal,
            &format!("the server cannot start a thread: {e}"),
        );
    }
    let _ = stream.set_read_timeout(None);
    {
        let mut w = &stream;
        if std::io::Write::write_all(&mut w, &CHANNEL_OPENED.to_le_bytes()).is_err() {
            forget();
            return;
        }
    }
    tracing::debug!(session = sid, "transfer channel opened");
    let metrics = Arc::clone(&st.metrics);
    metrics.channels_open.fetch_add(1, Ordering::Relaxed);
    let max = st.max_message_bytes;
    let replies = Replies {
        tx,
        sock: Arc::new(sock),
        sid,
        max,
        last_reply_ns: Arc::new(AtomicU64::new(0)),
        wake: if st.busy_poll.is_zero() {
            None
        } else {
            new_eventfd(sid)
        },
    };
    let busy_poll_ns = st.busy_poll.as_nanos() as u64;
    let mut scratch = vec![0u8; 64 << 10];
    let mut last_request_ns = 0u64;
    loop {
        if let Some(w) = &replies.wake {
            wait_readable(
                &stream,
                w,
                busy_poll_ns,
                last_request_ns,
                &replies.last_reply_ns,
            );
        }
        let frame = match read_request(&stream, max, &mut scratch) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                tracing::warn!(session = sid, "transfer channel closed: {e}");
                break;
            }
            Err(e) => {
                tracing::debug!(session = sid, "transfer channel closed: {e}");
                break;
            }
        };
        let t = Instant::now();
        if replies.wake.is_some() {
            last_request_ns = monotonic_ns();
        }
        let r = match v1::TransferRequest::decode(frame.as_slice()) {
            Ok(r) => r,
            Err(e) => {
                // The stream cannot be trusted past a frame that is not a request.
                replies.send(error_frame(
                    0,
                    ErrorKind::InvalidArgument, format!(
                        "a transfer channel frame is not a TransferRequest ({e}); the channel is closed"
                    ),
                ));
                metrics.refused.fetch_add(1, Ordering::Relaxed);
                break;
            }
        };
        if r.session_id != sid {
            metrics.refused.fetch_add(1, Ordering::Relaxed);
            let refused = error_frame(
                r.transfer_id,
                ErrorKind::Denied,
                format!(
                    "session {} is not this channel's (session {sid})",
                    r.session_id
                ),
            );
            if replies.send(refused) {
                continue;
            }
            break;
        }
        // A session that ended (its release may still be running) takes no more transfers.
        if cs.released.load(Ordering::Acquire) || st.sessions.get_any(sid).is_none() {
            replies.send(error_frame(
                r.transfer_id,
                ErrorKind::SessionLost,
                format!(
                    "session {sid} is not attached (server boot {}); attach again",
                    st.boot_id
                ),
            ));
            break;
        }
        metrics.channel_transfers.fetch_add(1, Ordering::Relaxed);
        if !start(&st, &cs, r, t, &replies, &rt) {
            break;
        }
    }
    // No more requests are read: the client's next write fails at once (and goes over gRPC).
    // The writer sends what is still to come (a refusal just queued, the replies of jobs in
    // flight) and then shuts the socket down, which tells the client the channel ended.
    let _ = stream.shutdown(std::net::Shutdown::Read);
    drop(replies);
    forget();
    metrics.channels_open.fetch_sub(1, Ordering::Relaxed);
    tracing::debug!(session = sid, "transfer channel ended");
}

/// Starts one transfer ([`transfer::run`]); its reply (or its failure) is queued for the
/// writer when it ends. False when the channel must end (its writer is gone or overrun).
fn start(
    st: &Arc<State>,
    cs: &Arc<ClientSession>,
    r: v1::TransferRequest,
    t: Instant,
    replies: &Replies,
    rt: &tokio::runtime::Handle,
) -> bool {
    let id = r.transfer_id;
    let answer = {
        let replies = replies.clone();
        // Runs on the copy worker that finishes the job, or on the deadline task: never
        // blocks (an overrun channel is shut down instead).
        move |outcome: transfer::Outcome| {
            let frame = match outcome {
                Ok(reply) => replies.reply_frame(id, reply),
                Err(s) => status_frame(id, &s),
            };
            replies.send(frame);
        }
    };
    match transfer::run(st, cs, &r, t, rt, answer) {
        Ok(_) => true,
        Err(s) => replies.send(status_frame(id, &s)),
    }
}

/// The eventfd of a busy-polling channel; None (the channel blocks on its socket) when the
/// host refuses one.
fn new_eventfd(sid: u64) -> Option<Arc<EventFd>> {
    match EventFd::new(true) {
        Ok(e) => Some(Arc::new(e)),
        Err(e) => {
            tracing::warn!(
                session = sid,
                "transfer channel: no eventfd ({}); this channel does not busy-poll",
                e.to_io()
            );
            None
        }
    }
}

/// Returns when `stream` has something to read (or has ended): watching it for `busy_ns`
/// after the channel's last request or reply, and otherwise blocked on it and on `wake`,
/// which each reply sets (then it watches again).
fn wait_readable(
    stream: &UnixStream,
    wake: &EventFd,
    busy_ns: u64,
    last_request_ns: u64,
    last_reply_ns: &AtomicU64,
) {
    loop {
        let since = last_request_ns.max(last_reply_ns.load(Ordering::Relaxed));
        if poll_readable(stream, since.saturating_add(busy_ns)) {
            return;
        }
        match umbp_unix::socket::wait_readable(&[stream.as_fd(), wake.as_fd()], None) {
            Ok(r) if r[0] => return,
            Ok(_) => {}
            Err(_) => return, // the read reports what is wrong
        }
        let _ = wake.drain();
    }
}

/// Watches `stream` without blocking until it has something to read (or has ended) or the
/// host's monotonic clock passes `until_ns`; the blocking read that follows then finds the
/// request at once instead of sleeping until the kernel wakes this thread (tens of µs on a
/// VM). Costs this thread's core for as long as it watches. True when there is something
/// to read.
fn poll_readable(stream: &UnixStream, until_ns: u64) -> bool {
    let mut byte = [0u8; 1];
    let mut spins = 0u32;
    loop {
        // MSG_PEEK leaves the byte for the read that follows; MSG_DONTWAIT keeps the
        // descriptor's blocking mode (which the writer thread shares) as it is.
        match umbp_unix::socket::recv_nowait(stream, &mut byte, true) {
            Ok(_) => return true, // a request, or the end of the stream
            Err(e) if !e.would_block() => return true, // the read reports it
            Err(_) => {}
        }
        if spins.is_multiple_of(16) && monotonic_ns() >= until_ns {
            return false;
        }
        spins = spins.wrapping_add(1);
        std::hint::spin_loop();
    }
}

fn error_frame(transfer_id: u64, kind: ErrorKind, message: impl Into<String>) -> Vec<u8> {
    errors::channel_error(transfer_id, kind, message).encode_to_vec()
}

/// The reply frame of a transfer refused with `s` (made by [`crate::transfer`], kind in its
/// details).
fn status_frame(transfer_id: u64, s: &Status) -> Vec<u8> {
    error_frame(transfer_id, errors::kind_of_status(s), s.message())
}

fn write_replies(mut s: UnixStream, rx: Receiver<Vec<u8>>, sid: u64) {
    for frame in rx {
        if let Err(e) = write_frame(&mut s, &frame) {
            tracing::debug!(session = sid, "transfer channel: reply not sent: {e}");
            break;
        }
    }
    // Unblocks the reader too (a client that stopped reading loses its channel).
    let _ = s.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_busy_poll_sees_a_request_that_comes_while_it_watches_and_gives_up_after() {
        let (a, mut b) = UnixStream::pair().unwrap();
        // Nothing comes: it gives up once the window has passed, having read nothing.
        let t = Instant::now();
        assert!(!poll_readable(&a, monotonic_ns() + 5 * MS));
        assert!(t.elapsed() >= Duration::from_millis(5));
        assert!(!poll_readable(&a, 0), "a window already past is one look");
        // A request that comes while it watches is seen, and left for the read.
        let w = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            b.write_all(&[7, 8]).unwrap();
            b
        });
        assert!(poll_readable(&a, monotonic_ns() + 5_000 * MS));
        let mut buf = [0u8; 2];
        std::io::Read::read_exact(&mut &a, &mut buf).unwrap();
        assert_eq!(buf, [7, 8]);
        // The end of the stream is something to read too (the read then reports it).
        drop(w.join().unwrap());
        assert!(poll_readable(&a, monotonic_ns() + 5_000 * MS));
    }

    #[test]
    fn a_reply_wakes_the_reader_to_watch_again_and_a_request_ends_the_wait() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let wake = new_eventfd(1).expect("eventfd");
        let last_reply = Arc::new(AtomicU64::new(0));
        let (wake2, last2) = (Arc::clone(&wake), Arc::clone(&last_reply));
        let w = std::thread::spawn(move || {
            // A reply first: the reader wakes and watches for 50 ms, in which the request
            // comes.
            std::thread::sleep(Duration::from_millis(20));
            last2.store(monotonic_ns(), Ordering::Relaxed);
            wake2.signal().unwrap();
            std::thread::sleep(Duration::from_millis(10));
            b.write_all(&[1]).unwrap();
            b
        });
        let t = Instant::now();
        wait_readable(&a, &wake, 50 * MS, 0, &last_reply);
        assert!(
            t.elapsed() >= Duration::from_millis(25),
            "{:?}",
            t.elapsed()
        );
        let mut buf = [0u8; 1];
        std::io::Read::read_exact(&mut &a, &mut buf).unwrap();
        // The channel's socket shut down (a released session): the wait ends.
        let b = w.join().unwrap();
        b.shutdown(std::net::Shutdown::Both).unwrap();
        wait_readable(&a, &wake, 50 * MS, monotonic_ns(), &last_reply);
    }
}
