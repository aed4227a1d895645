//! The transfer channel (see [`umbp_proto::channel`]): a side-channel connection of one session
//! that carries its transfers without the gRPC runtime. A thread blocked on the socket reads
//! each request and submits its copy job (the same checks and the same job as the gRPC
//! `Transfer`, through [`Service::start_transfer`]); the job's end publishes the completion
//! page (when named) and hands the reply to a writer thread, so a copy worker never waits on
//! a client's socket. The channel ends with its connection, or when the session is released
//! (which shuts the socket down).

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tonic::{Code, Status};
use umbp_proto::channel::{read_frame, write_frame};
use umbp_proto::v1;

use crate::service::{Service, STOP_GRACE};
use crate::sessions::ClientSession;

/// Replies waiting for the writer at most; a client that leaves more unread loses its channel.
const WRITER_BACKLOG: usize = 4096;

/// Serves the channel of session `cs` on `stream` until it ends (runs on its own thread).
pub(crate) fn serve(
    svc: Service,
    cs: Arc<ClientSession>,
    stream: UnixStream,
    rt: tokio::runtime::Handle,
) {
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let writer_stream = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(
                session = cs.id,
                "transfer channel: cannot clone the socket: {e}"
            );
            return;
        }
    };
    // Kept with the session, which shuts it down at its release (ending both threads).
    match stream.as_fd().try_clone_to_owned() {
        Ok(fd) => cs.res.lock().channels.push(fd),
        Err(e) => {
            tracing::warn!(
                session = cs.id,
                "transfer channel: cannot keep the socket: {e}"
            );
            return;
        }
    }
    if cs.released.load(Ordering::Acquire) {
        return;
    }
    let (tx, rx) = sync_channel::<Vec<u8>>(WRITER_BACKLOG);
    let sid = cs.id;
    let writer = std::thread::Builder::new()
        .name(format!("umbp-chan-w{sid}"))
        .spawn(move || write_replies(writer_stream, rx, sid));
    if let Err(e) = writer {
        tracing::warn!(session = sid, "transfer channel: no writer thread: {e}");
        return;
    }
    tracing::debug!(session = sid, "transfer channel opened");
    let metrics = Arc::clone(&svc.state.metrics);
    metrics.channels_open.fetch_add(1, Ordering::Relaxed);
    let max = svc.state.max_message_bytes;
    let mut reader = &stream;
    loop {
        let frame = match read_frame(&mut reader, max) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(session = sid, "transfer channel closed: {e}");
                break;
            }
        };
        let t = Instant::now();
        let r = match v1::TransferRequest::decode(frame.as_slice()) {
            Ok(r) => r,
            Err(e) => {
                // The stream cannot be trusted past a frame that is not a request.
                let _ = tx.try_send(error_frame(
                    0,
                    &Status::invalid_argument(format!(
                        "a transfer channel frame is not a TransferRequest ({e}); the channel is closed"
                    )),
                ));
                svc.state.metrics.refused.fetch_add(1, Ordering::Relaxed);
                break;
            }
        };
        if r.session_id != sid {
            let _ = tx.try_send(error_frame(
                r.transfer_id,
                &Status::permission_denied(format!(
                    "session {} is not this channel's (session {sid})",
                    r.session_id
                )),
            ));
            svc.state.metrics.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        metrics.channel_transfers.fetch_add(1, Ordering::Relaxed);
        if !start(&svc, &cs, r, t, &tx, &rt) {
            break;
        }
    }
    // The writer sends what is still to come (a refusal just queued, the replies of jobs in
    // flight) and then shuts the socket down, which tells the client the channel ended.
    drop(tx);
    metrics.channels_open.fetch_sub(1, Ordering::Relaxed);
    tracing::debug!(session = sid, "transfer channel ended");
}

/// Starts one transfer; false when the channel must end (its writer is gone or overrun).
fn start(
    svc: &Service,
    cs: &Arc<ClientSession>,
    r: v1::TransferRequest,
    t: Instant,
    tx: &SyncSender<Vec<u8>>,
    rt: &tokio::runtime::Handle,
) -> bool {
    let id = r.transfer_id;
    let started = match svc.start_transfer(cs, &r, t) {
        Ok(s) => s,
        Err(s) => return send(tx, error_frame(id, &s), cs.id),
    };
    let st = Arc::clone(&svc.state);
    st.in_flight.fetch_add(1, Ordering::Relaxed);
    let job = started.job.clone();
    if id != 0 {
        cs.transfers.lock().insert(id, job.clone());
    }
    let timeout = if r.timeout_ms == 0 {
        st.store.timeout()
    } else {
        Duration::from_millis(r.timeout_ms as u64)
    };
    // Set by the deadline task before it cancels; `answered` makes the reply go out once.
    let timed_out = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicBool::new(false));
    let started = Arc::new(started);
    {
        let (st, cs, tx) = (Arc::clone(&st), Arc::clone(cs), tx.clone());
        let (timed_out, answered, started) = (
            Arc::clone(&timed_out),
            Arc::clone(&answered),
            Arc::clone(&started),
        );
        job.on_done(move |results| {
            if id != 0 {
                cs.transfers.lock().remove(&id);
            }
            st.in_flight.fetch_sub(1, Ordering::Relaxed);
            if answered.swap(true, Ordering::AcqRel) {
                return;
            }
            let reply = st.reply_of(&started, &results, timed_out.load(Ordering::Acquire));
            let frame = v1::ChannelReply {
                transfer_id: id,
                reply: Some(reply),
                code: 0,
                message: String::new(),
            }
            .encode_to_vec();
            // Never blocks the copy worker: an overrun channel is shut down instead.
            send(&tx, frame, cs.id);
        });
    }
    if !job.is_done() {
        let tx = tx.clone();
        let sid = cs.id;
        rt.spawn(async move {
            if tokio::time::timeout(timeout, job.finished()).await.is_ok() {
                return;
            }
            timed_out.store(true, Ordering::Release);
            job.cancel();
            if tokio::time::timeout(STOP_GRACE, job.finished()).await.is_err()
                && !answered.swap(true, Ordering::AcqRel)
            {
                let s = Status::deadline_exceeded(format!(
                    "the transfer did not finish within {} ms nor stop {} s after it was cancelled; its memory may still be written",
                    timeout.as_millis(),
                    STOP_GRACE.as_secs()
                ));
                send(&tx, error_frame(id, &s), sid);
            }
        });
    }
    true
}

/// Queues `frame` for the writer; false (and the channel is to end) when it cannot take it.
fn send(tx: &SyncSender<Vec<u8>>, frame: Vec<u8>, sid: u64) -> bool {
    match tx.try_send(frame) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            tracing::warn!(
                session = sid,
                "transfer channel: {WRITER_BACKLOG} replies unread; the channel is closed"
            );
            false
        }
        Err(TrySendError::Disconnected(_)) => false,
    }
}

fn error_frame(transfer_id: u64, s: &Status) -> Vec<u8> {
    v1::ChannelReply {
        transfer_id,
        reply: None,
        code: if s.code() == Code::Ok {
            Code::Internal as i32
        } else {
            s.code() as i32
        },
        message: s.message().to_string(),
    }
    .encode_to_vec()
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
