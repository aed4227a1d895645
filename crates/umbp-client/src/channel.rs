//! The client's transfer channel (see [`umbp_proto::channel`]): transfers written by the
//! calling thread itself to a socket a server thread is blocked on, replies read by one reader
//! thread of the client. gRPC stays for everything else, and for transfers whenever the
//! channel is not there: the server refused it (at its limit of channels per session, or out
//! of descriptors or threads), it closed, or `transfer_channel` is off. (Protocol 2 servers
//! all open channels: a server of another version refuses to attach at all.)

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prost::Message;
use umbp_core::KeyOutcome;
use umbp_proto::channel::{encode_frame, read_frame, CHANNEL_OPENED};
use umbp_proto::completion::REPLIED;
use umbp_proto::{errors, v1, Endpoint, FdHeader, SECRET_BYTES};

use crate::completions::Lease;
use crate::error::{ClientError, Result as ClientResult};
use crate::transfer::answer::{decode_reply, Slot, TransferTiming};
// The last handle of a client may be dropped on the reader thread (with an answered
// transfer); the client's drop copes: it is no runtime thread, and it closes this channel,
// which this loop then reads as its end.

/// Longest a write of one request may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A transfer sent on the channel and not answered yet.
pub(crate) struct Pending {
    pub(crate) slot: Arc<Slot>,
    pub(crate) lease: Option<Arc<Lease>>,
    pub(crate) sent: Instant,
    pub(crate) keys: usize,
    /// Keeps the client alive until the server answers, as a gRPC transfer's task does:
    /// dropping every handle does not cancel a transfer (its session stays attached). The
    /// client's shared state, held as `Any`: this file sits below the client and does not
    /// name it.
    pub(crate) _client: Arc<dyn std::any::Any + Send + Sync>,
}

/// One session's transfer channel.
#[derive(Debug)]
pub(crate) struct TransferChannel {
    writer: Mutex<UnixStream>,
    /// The same socket, to shut down without waiting for a write in progress.
    shut: UnixStream,
    /// Largest request frame (larger ones go over gRPC, which refuses them with a message).
    max: usize,
    pending: Mutex<HashMap<u64, Pending>>,
    dead: AtomicBool,
    endpoint: Endpoint,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({} keys)", self.keys)
    }
}

impl TransferChannel {
    /// Opens the channel of session `session_id` at the side channel `path`; None when the
    /// server refuses it (at a limit: the reason and its kind are logged).
    pub(crate) fn open(
        path: &Path,
        session_id: u64,
        secret: &[u8; SECRET_BYTES],
        max_message_bytes: usize,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<Self>>, ClientError> {
        let io = |what| move |source| ClientError::Io { what, source };
        let mut s = UnixStream::connect(path).map_err(io("connecting the transfer channel"))?;
        crate::peer::check_server(std::os::fd::AsFd::as_fd(&s), path)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(io("transfer channel"))?;
        let header = FdHeader {
            session_id,
            secret: *secret,
            count: 0,
        }
        .encode();
        s.write_all(&header)
            .map_err(io("opening the transfer channel"))?;
        let mut ack = [0u8; 8];
        s.read_exact(&mut ack)
            .map_err(io("reading the transfer channel's answer"))?;
        if ack != CHANNEL_OPENED.to_le_bytes() {
            let mut answer = ack.to_vec();
            let _ = s.read_to_end(&mut answer);
            let why = match errors::decode_refusal(&answer) {
                Some((kind, message)) => format!("{message} ({kind})"),
                None => "an unexpected answer".into(),
            };
            log::info!("umbp: the server at {endpoint} opened no transfer channel ({why}); transfers go over gRPC");
            return Ok(None);
        }
        s.set_read_timeout(None).map_err(io("transfer channel"))?;
        // A server that stops reading fails the write (and closes the channel) rather than
        // holding the caller.
        s.set_write_timeout(Some(WRITE_TIMEOUT))
            .map_err(io("transfer channel"))?;
        let reader = s.try_clone().map_err(io("transfer channel"))?;
        let shut = s.try_clone().map_err(io("transfer channel"))?;
        let ch = Arc::new(TransferChannel {
            writer: Mutex::new(s),
            shut,
            max: max_message_bytes,
            pending: Mutex::new(HashMap::new()),
            dead: AtomicBool::new(false),
            endpoint: endpoint.clone(),
        });
        let c2 = Arc::clone(&ch);
        std::thread::Builder::new()
            .name("umbp-client-chan".into())
            .spawn(move || c2.read_replies(reader, max_message_bytes))
            .map_err(io("starting the transfer channel's reader"))?;
        Ok(Some(ch))
    }

    /// Whether the channel still carries transfers.
    pub(crate) fn is_open(&self) -> bool {
        !self.dead.load(Ordering::Acquire)
    }

    /// Sends `req` from this thread; on failure the channel is closed and `p` comes back (the
    /// caller sends the transfer another way).
    pub(crate) fn send(&self, req: &v1::TransferRequest, p: Pending) -> Result<(), Pending> {
        let id = req.transfer_id;
        if req.encoded_len() > self.max {
            return Err(p);
        }
        let frame = encode_frame(req);
        // Known before the reply can come.
        self.pending.lock().insert(id, p);
        let sent = {
            let w = self.writer.lock();
            self.is_open() && NoSigPipe(&w).write_all(&frame).is_ok()
        };
        if sent {
            return Ok(());
        }
        let p = self.pending.lock().remove(&id);
        self.close();
        match p {
            Some(p) => Err(p),
            // The reader already failed it (the channel closed meanwhile): answered.
            None => Ok(()),
        }
    }

    /// Closes the channel: pending transfers fail as disconnected, the reader ends.
    pub(crate) fn close(&self) {
        self.dead.store(true, Ordering::Release);
        let _ = self.shut.shutdown(std::net::Shutdown::Both);
    }

    fn read_replies(self: Arc<Self>, mut s: UnixStream, max: usize) {
        let why = loop {
            let frame = match read_frame(&mut s, max) {
                Ok(Some(f)) => f,
                Ok(None) => break "the server closed it".to_string(),
                Err(e) => break e.to_string(),
            };
            let r = match v1::ChannelReply::decode(frame.as_slice()) {
                Ok(r) => r,
                Err(e) => break format!("a reply that does not decode ({e})"),
            };
            let Some(p) = self.pending.lock().remove(&r.transfer_id) else {
                // A refusal of a frame the server could not read names transfer 0.
                if r.code != 0 {
                    log::warn!("umbp: the transfer channel was refused: {}", r.message);
                }
                continue;
            };
            let out = match r.reply {
                Some(reply) if r.code == 0 => {
                    *p.slot.timing.lock() = Some(TransferTiming {
                        round_trip: p.sent.elapsed(),
                        server: Duration::from_micros(reply.server_micros),
                        copy: Duration::from_micros(reply.copy_micros),
                        completion_page: false,
                        to_server: None,
                        to_caller: None,
                    });
                    decode_reply(reply, p.keys)
                }
                _ => Err(channel_error(&self.endpoint, r)),
            };
            answer(p, out);
        };
        self.dead.store(true, Ordering::Release);
        let _ = s.shutdown(std::net::Shutdown::Both);
        let left: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        if !left.is_empty() {
            log::warn!(
                "umbp: the transfer channel to {} ended ({why}); {} transfer(s) in flight on it fail",
                self.endpoint,
                left.len()
            );
        }
        for p in left {
            answer(
                p,
                Err(ClientError::Disconnected {
                    endpoint: self.endpoint.to_string(),
                    reason: format!("the transfer channel ended: {why}"),
                }),
            );
        }
    }
}

/// Writes with `MSG_NOSIGNAL`: a server that went away fails the write (EPIPE) instead of
/// raising SIGPIPE in a host process that does not ignore it.
struct NoSigPipe<'a>(&'a UnixStream);

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(umbp_unix::socket::send_nosignal(self.0, buf, false)?)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn answer(p: Pending, out: ClientResult<Vec<KeyOutcome>>) {
    p.slot.fill(out);
    if let Some(l) = p.lease {
        l.page().settle(l.slot, l.seq, REPLIED);
    }
}

/// The error of a transfer the server failed (or refused) on the channel, by the kind it
/// sent: the server going away is [`ClientError::Disconnected`], anything else a refusal.
fn channel_error(endpoint: &Endpoint, r: v1::ChannelReply) -> ClientError {
    let kind = errors::kind_of_channel_reply(&r);
    ClientError::from_server("transfer", endpoint, kind, r.message)
}
