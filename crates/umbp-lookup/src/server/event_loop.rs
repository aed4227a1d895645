//! The service thread: one epoll loop over the listener, every connection and the wake-up;
//! accepting and evicting connections, reading and decoding requests, answering them in
//! chunks from the target and writing replies without ever blocking on a client.

use std::io::ErrorKind;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_unix::epoll::Epoll;
use umbp_unix::eventfd::EventFd;

use super::sys::{ERROR, FIRST_CONN, HANGUP, IN, LISTENER, OUT, WAKE};
use super::target::{LookupTarget, ServerLimits};
use crate::protocol::{self, Op, MAX_HASH_LEN, REP_MAGIC, REQ_MAGIC};
use crate::shm::{self, ShmReader};

/// Hashes handed to the target at once.
const CHUNK_KEYS: usize = 4096;
/// Bytes read from one connection per wake-up.
const READ_CHUNK: usize = 64 << 10;
/// Descriptors a connection may have received and not yet used.
const MAX_PENDING_FDS: usize = 1;

/// One client connection.
struct Conn {
    stream: UnixStream,
    /// Bytes received; those from `rpos` on are not decoded yet.
    rbuf: Vec<u8>,
    rpos: usize,
    /// Stream offset of `rbuf[rpos]`.
    rbase: u64,
    /// Descriptors received, each with the stream offset of the last byte it came with (it
    /// belongs to the frame that ends at or after that byte). Dropping one closes it.
    fds: Vec<(u64, OwnedFd)>,
    /// A reply not yet sent, and how much of it is.
    wbuf: Vec<u8>,
    wpos: usize,
    /// Close once the reply is sent (the request broke the protocol).
    close_after_write: bool,
    shared: Option<ShmReader>,
    /// Last time bytes moved either way.
    progress: Instant,
    /// The epoll interest currently registered.
    interest: u32,
}

impl Conn {
    fn busy(&self) -> bool {
        self.rpos < self.rbuf.len() || self.wpos < self.wbuf.len()
    }
}

pub(super) struct EventLoop {
    ep: Epoll,
    listener: UnixListener,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    target: Arc<dyn LookupTarget>,
    limits: ServerLimits,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    live: usize,
    /// Accepting paused (out of descriptors) until then.
    listener_paused_until: Option<Instant>,
    last_warning: Option<Instant>,
}

/// What a connection's event led to.
enum Next {
    Keep,
    Close(&'static str),
}

impl EventLoop {
    /// A loop over `ep`, on which `listener` and `wake` are registered already.
    pub(super) fn new(
        ep: Epoll,
        listener: UnixListener,
        wake: Arc<EventFd>,
        stop: Arc<AtomicBool>,
        target: Arc<dyn LookupTarget>,
        limits: ServerLimits,
    ) -> EventLoop {
        EventLoop {
            ep,
            listener,
            wake,
            stop,
            target,
            limits,
            conns: Vec::new(),
            free: Vec::new(),
            live: 0,
            listener_paused_until: None,
            last_warning: None,
        }
    }

    pub(super) fn run(&mut self) {
        let mut events = Vec::with_capacity(256);
        let sweep_every = self
            .limits
            .idle_timeout
            .min(self.limits.io_timeout)
            .div_f64(4.0)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        let mut next_sweep = Instant::now() + sweep_every;
        while !self.stop.load(Ordering::Acquire) {
            // Nothing to do between sweeps: with only idle connections this thread sleeps.
            let wait = if self.live == 0 && self.listener_paused_until.is_none() {
                None
            } else {
                // Whole milliseconds, at most a second.
                let ms = next_sweep
                    .saturating_duration_since(Instant::now())
                    .as_millis()
                    .min(1000) as u64;
                Some(Duration::from_millis(ms))
            };
            if let Err(e) = self.ep.wait(&mut events, 256, wait) {
                log::error!(
                    "umbp: lookup service stopped: epoll_wait failed: {}",
                    e.to_io()
                );
                return;
            }
            for &(token, flags) in &events {
                match token {
                    LISTENER => self.accept_all(),
                    WAKE => {
                        let _ = self.wake.drain();
                    }
                    t => self.on_conn((t - FIRST_CONN) as usize, flags),
                }
                if self.stop.load(Ordering::Acquire) {
                    break;
                }
            }
            let now = Instant::now();
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now + sweep_every;
            }
        }
        // Dropping the connections closes them, and every descriptor they received.
        self.conns.clear();
    }

    fn warn(&mut self, msg: std::fmt::Arguments<'_>) {
        if self
            .last_warning
            .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
        {
            self.last_warning = Some(Instant::now());
            log::warn!("umbp: lookup service: {msg}");
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if peer_is_foreign(&stream) {
                        continue;
                    }
                    if self.live >= self.limits.max_connections && !self.evict_idlest() {
                        let max = self.limits.max_connections;
                        self.warn(format_args!(
                            "refused a connection: all {max} connections are busy"
                        ));
                        continue;
                    }
                    self.add(stream);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors (EMFILE / ENFILE) or the like: make room if an idle
                    // connection can go, else pause accepting for a moment instead of spinning.
                    if !self.evict_idlest() {
                        self.warn(format_args!(
                            "accept failed: {e}; pausing accepts for 100 ms"
                        ));
                        let _ = self.ep.modify(&self.listener, LISTENER, 0);
                        self.listener_paused_until =
                            Some(Instant::now() + Duration::from_millis(100));
                        return;
                    }
                }
            }
        }
    }

    fn add(&mut self, stream: UnixStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        crate::client::set_buffers(&stream, 0, 4 << 20);
        let idx = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        if let Err(e) = self.ep.add(&stream, FIRST_CONN + idx as u64, IN) {
            self.free.push(idx);
            self.warn(format_args!("cannot watch a connection: {e}"));
            return;
        }
        self.conns[idx] = Some(Conn {
            stream,
            rbuf: Vec::new(),
            rpos: 0,
            rbase: 0,
            fds: Vec::new(),
            wbuf: Vec::new(),
            wpos: 0,
            close_after_write: false,
            shared: None,
            progress: Instant::now(),
            interest: IN,
        });
        self.live += 1;
    }

    fn close(&mut self, idx: usize, why: &str) {
        if let Some(c) = self.conns.get_mut(idx).and_then(Option::take) {
            log::debug!("umbp: lookup connection closed: {why}");
            drop(c);
            self.free.push(idx);
            self.live -= 1;
        }
    }

    /// Closes the connection idle the longest; false if every connection is busy.
    fn evict_idlest(&mut self) -> bool {
        let idlest = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
            .filter(|(_, c)| !c.busy())
            .min_by_key(|(_, c)| c.progress)
            .map(|(i, _)| i);
        match idlest {
            Some(i) => {
                self.close(i, "the connection limit was reached and it was the idlest");
                true
            }
            None => false,
        }
    }

    fn sweep(&mut self, now: Instant) {
        if self.listener_paused_until.is_some_and(|t| now >= t) {
            self.listener_paused_until = None;
            let _ = self.ep.modify(&self.listener, LISTENER, IN);
        }
        let ServerLimits {
            idle_timeout,
            io_timeout,
            ..
        } = self.limits;
        let expired: Vec<(usize, &'static str)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let c = c.as_ref()?;
                let quiet = now.saturating_duration_since(c.progress);
                if c.busy() && quiet > io_timeout {
                    Some((i, "no progress on a request or reply within io_timeout"))
                } else if !c.busy() && quiet > idle_timeout {
                    Some((i, "idle longer than idle_timeout"))
                } else {
                    None
                }
            })
            .collect();
        for (i, why) in expired {
            self.close(i, why);
        }
    }

    fn on_conn(&mut self, idx: usize, flags: u32) {
        let Some(mut c) = self.conns.get_mut(idx).and_then(Option::take) else {
            return;
        };
        let next = self.drive(&mut c, flags);
        // Drop the decoded bytes once per wake-up, not once per frame.
        c.rbuf.drain(..c.rpos);
        c.rpos = 0;
        self.conns[idx] = Some(c);
        match next {
            Next::Keep => {
                let c = self.conns[idx].as_mut().expect("just put back");
                let want = if c.wpos < c.wbuf.len() { OUT } else { IN };
                if want != c.interest {
                    if self
                        .ep
                        .modify(&c.stream, FIRST_CONN + idx as u64, want)
                        .is_err()
                    {
                        self.close(idx, "epoll_ctl failed");
                        return;
                    }
                    c.interest = want;
                }
            }
            Next::Close(why) => self.close(idx, why),
        }
    }

    /// Moves bytes and answers complete requests.
    fn drive(&self, c: &mut Conn, flags: u32) -> Next {
        if c.wpos < c.wbuf.len() {
            match flush(c) {
                Ok(true) => {}
                Ok(false) => return Next::Keep,
                Err(_) => return Next::Close("the client stopped reading"),
            }
            if c.close_after_write {
                return Next::Close("it broke the protocol");
            }
        } else if flags & (IN | HANGUP | ERROR) != 0 {
            let mut buf = vec![0u8; READ_CHUNK];
            match shm::recv_with_fds(c.stream.as_fd(), &mut buf) {
                Ok(r) if r.len == 0 => return Next::Close("end of stream"),
                Ok(r) => {
                    c.rbuf.extend_from_slice(&buf[..r.len]);
                    c.progress = Instant::now();
                    let last = c.rbase + (c.rbuf.len() - c.rpos) as u64 - 1;
                    if c.fds.len() + r.fds.len() > MAX_PENDING_FDS {
                        // Dropping them closes them; no frame takes more than one.
                        return Next::Close("it sent more descriptors than a frame takes");
                    }
                    c.fds.extend(r.fds.into_iter().map(|fd| (last, fd)));
                }
                Err(e) if e.would_block() || e.to_io().kind() == ErrorKind::Interrupted => {}
                Err(umbp_unix::UnixError::TooManyFds { .. }) => {
                    // They are closed; no frame takes more than one.
                    return Next::Close("it sent more descriptors than a frame takes");
                }
                Err(_) => return Next::Close("receive failed"),
            }
        }
        // Answer every complete request, as long as replies are sent right away.
        while c.wpos >= c.wbuf.len() {
            match self.decode_one(c) {
                Ok(None) => break,
                Ok(Some((status, body))) => {
                    c.wbuf.clear();
                    c.wbuf
                        .extend_from_slice(&protocol::header(REP_MAGIC, status, body.len()));
                    c.wbuf.extend_from_slice(&body);
                    c.wpos = 0;
                    match flush(c) {
                        Ok(true) => {}
                        Ok(false) => return Next::Keep,
                        Err(_) => return Next::Close("the client stopped reading"),
                    }
                }
                Err(fatal) => {
                    // Tell the client why, then close (best effort: never wait for it).
                    c.wbuf = protocol::header(REP_MAGIC, 1, fatal.len()).to_vec();
                    c.wbuf.extend_from_slice(fatal.as_bytes());
                    c.wpos = 0;
                    c.close_after_write = true;
                    return match flush(c) {
                        Ok(false) => Next::Keep,
                        _ => Next::Close("it broke the protocol"),
                    };
                }
            }
            if c.close_after_write {
                return Next::Close("it broke the protocol");
            }
        }
        Next::Keep
    }

    /// Decodes and answers the next complete frame in `c.rbuf`: `Ok(None)` if there is none
    /// yet, `Err` for a frame after which the connection cannot go on.
    fn decode_one(&self, c: &mut Conn) -> Result<Option<(u8, Vec<u8>)>, String> {
        let pending = &c.rbuf[c.rpos..];
        if pending.len() < 12 {
            return Ok(None);
        }
        let h: [u8; 12] = pending[..12].try_into().expect("12 bytes");
        let max_body = 8 + self.limits.max_keys.saturating_mul(MAX_HASH_LEN);
        let (code, len) = protocol::parse_header(&h, REQ_MAGIC, max_body).map_err(|m| {
            format!(
                "{m} (at most {} hashes of up to {MAX_HASH_LEN} bytes per request)",
                self.limits.max_keys
            )
        })?;
        let end = 12 + len;
        if pending.len() < end {
            return Ok(None);
        }
        let frame_end = c.rbase + end as u64;
        // The descriptors that came with this frame's bytes.
        let split = c
            .fds
            .iter()
            .position(|(at, _)| *at >= frame_end)
            .unwrap_or(c.fds.len());
        let mut fds: Vec<OwnedFd> = c.fds.drain(..split).map(|(_, fd)| fd).collect();
        let body: Vec<u8> = pending[12..end].to_vec();
        c.rpos += end;
        c.rbase = frame_end;
        let op = Op::from_u8(code);
        if op != Some(Op::AttachShm) && !fds.is_empty() {
            // Closed on return.
            return Ok(Some(err_reply(format!(
                "operation {code} takes no descriptor; {} closed",
                fds.len()
            ))));
        }
        // A panic in the store answers this request with an error; the service goes on.
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match op {
            Some(Op::Ping) => Ok(self.target.describe().into_bytes()),
            Some(Op::PrefixHits) => {
                protocol::parse_hashes_body(&body).and_then(|(g, hl, p)| self.prefix_hits(g, p, hl))
            }
            Some(Op::Exists) => {
                protocol::parse_hashes_body(&body).and_then(|(g, hl, p)| self.exists(g, p, hl))
            }
            Some(Op::Holds) => {
                protocol::parse_hashes_body(&body).and_then(|(g, hl, p)| self.holds(g, p, hl))
            }
            Some(Op::Clear) => Ok(self.target.clear().to_le_bytes().to_vec()),
            Some(Op::AttachShm) => match (fds.pop(), fds.is_empty()) {
                (Some(fd), true) => ShmReader::map(fd).map(|r| {
                    c.shared = Some(r);
                    Vec::new()
                }),
                (Some(_), false) => Err("AttachShm carried more than one descriptor".into()),
                (None, _) => Err("AttachShm carried no descriptor".into()),
            },
            Some(Op::PrefixHitsShm) => self
                .hashes_from_shm(c, &body)
                .and_then(|(g, hl, p)| self.prefix_hits(g, &p, hl)),
            Some(Op::ExistsShm) => self
                .hashes_from_shm(c, &body)
                .and_then(|(g, hl, p)| self.exists(g, &p, hl)),
            Some(Op::HoldsShm) => self
                .hashes_from_shm(c, &body)
                .and_then(|(g, hl, p)| self.holds(g, &p, hl)),
            None => Err(format!("unknown operation {code}")),
        }))
        .unwrap_or_else(|_| Err("the worker's store panicked answering this request".into()));
        Ok(Some(match reply {
            Ok(b) => (0, b),
            Err(m) => err_reply(m),
        }))
    }

    fn check_keys(&self, bytes: usize, hash_len: usize) -> Result<(), String> {
        let n = bytes / hash_len.max(1);
        if n > self.limits.max_keys {
            return Err(format!(
                "request of {n} hashes exceeds the limit of {} per request; split it",
                self.limits.max_keys
            ));
        }
        Ok(())
    }

    fn hashes_from_shm(&self, c: &Conn, body: &[u8]) -> Result<(u32, usize, Vec<u8>), String> {
        let (g, hl, off, len) = protocol::parse_shm_body(body)?;
        let hl = hl as usize;
        if hl == 0 || hl > MAX_HASH_LEN {
            return Err(format!("hash length {hl} is not 1..={MAX_HASH_LEN}"));
        }
        self.check_keys(usize::try_from(len).unwrap_or(usize::MAX), hl)?;
        let buf = c
            .shared
            .as_ref()
            .ok_or("no shared buffer is attached to this connection")?
            .read(off, len)?;
        if !buf.len().is_multiple_of(hl) {
            return Err(format!(
                "{} hash bytes are not whole {hl}-byte hashes",
                buf.len()
            ));
        }
        Ok((g, hl, buf))
    }

    fn prefix_hits(&self, group: u32, packed: &[u8], hl: usize) -> Result<Vec<u8>, String> {
        self.check_keys(packed.len(), hl)?;
        let mut hits = 0u32;
        for chunk in packed.chunks(CHUNK_KEYS * hl) {
            let n = self.target.prefix_hits(group, chunk, hl)?;
            let asked = (chunk.len() / hl) as u32;
            hits += n.min(asked);
            if n < asked {
                break;
            }
        }
        Ok(hits.to_le_bytes().to_vec())
    }

    fn exists(&self, group: u32, packed: &[u8], hl: usize) -> Result<Vec<u8>, String> {
        self.per_block(group, packed, hl, |g, c, h| self.target.exists(g, c, h))
    }

    fn holds(&self, group: u32, packed: &[u8], hl: usize) -> Result<Vec<u8>, String> {
        self.per_block(group, packed, hl, |g, c, h| self.target.holds(g, c, h))
    }

    /// One byte per block from `answer`, asked chunk by chunk.
    fn per_block(
        &self,
        group: u32,
        packed: &[u8],
        hl: usize,
        answer: impl Fn(u32, &[u8], usize) -> Result<Vec<bool>, String>,
    ) -> Result<Vec<u8>, String> {
        self.check_keys(packed.len(), hl)?;
        let mut out = Vec::with_capacity(packed.len() / hl);
        for chunk in packed.chunks(CHUNK_KEYS * hl) {
            let v = answer(group, chunk, hl)?;
            if v.len() != chunk.len() / hl {
                return Err(format!(
                    "the store answered {} of {} blocks",
                    v.len(),
                    chunk.len() / hl
                ));
            }
            out.extend(v.into_iter().map(u8::from));
        }
        Ok(out)
    }
}

fn err_reply(m: String) -> (u8, Vec<u8>) {
    (1, m.into_bytes())
}

/// Sends what it can of the pending reply without blocking: true once all of it is sent.
fn flush(c: &mut Conn) -> std::io::Result<bool> {
    while c.wpos < c.wbuf.len() {
        let rest = &c.wbuf[c.wpos..];
        let n = match umbp_unix::socket::send_nosignal(&c.stream, rest, true) {
            Ok(n) => n,
            Err(e) => {
                let e = e.to_io();
                return match e.kind() {
                    ErrorKind::WouldBlock => Ok(false),
                    ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
        };
        c.wpos += n;
        c.progress = Instant::now();
    }
    c.wbuf = Vec::new();
    c.wpos = 0;
    Ok(true)
}

/// Only processes of the same user may ask: the socket lives in a shared directory.
fn peer_is_foreign(stream: &UnixStream) -> bool {
    let cred = umbp_unix::peer::peer_credentials(stream);
    let me = umbp_unix::peer::real_uid();
    let foreign = cred.as_ref().map_or(true, |c| c.uid != me && c.uid != 0);
    if foreign {
        let (uid, pid) = cred.map_or((0, 0), |c| (c.uid, c.pid));
        log::warn!("umbp: refused a lookup connection from uid {uid} (pid {pid})");
    }
    foreign
}
