//! The scheduler side: asks every worker of the engine at once.

use std::io::ErrorKind;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::protocol::{self, LookupError, Op, REP_MAGIC, REQ_MAGIC};
use crate::shm::ShmWriter;

/// How long a late answer is waited for in the background before the connection is dropped.
const DRAIN_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Endpoint {
    path: PathBuf,
    /// An idle connection, and whether the shared hash buffer is attached to it.
    conn: Mutex<Option<(UnixStream, bool)>>,
    /// A request timed out and its answer has not arrived yet.
    stalled: AtomicBool,
    last_warning: Mutex<Option<Instant>>,
}

impl Endpoint {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn io(&self, source: std::io::Error) -> LookupError {
        LookupError::Io {
            path: self.name(),
            source,
        }
    }

    /// Logs at most one warning every 30 s per worker.
    fn warn(&self, e: &LookupError) {
        let mut last = self.last_warning.lock();
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(30)) {
            *last = Some(Instant::now());
            log::warn!("umbp: lookup counted as a miss: {e}");
        }
    }

    fn take_conn(&self) -> Result<(UnixStream, bool), LookupError> {
        if let Some(c) = self.conn.lock().take() {
            // The worker closes idle connections: reconnect rather than miss.
            if still_open(&c.0) {
                return Ok(c);
            }
        }
        let c = UnixStream::connect(&self.path).map_err(|e| self.io(e))?;
        // Nothing (no request, no descriptor) goes to a peer before its credentials are
        // checked: another user may have bound this path while no worker served it.
        check_peer(&c).map_err(|e| self.io(e))?;
        // A long prompt's hashes are hundreds of KiB: let one write hold them, so the request
        // to every worker is out before any worker has to be scheduled to drain it.
        set_buffers(&c, 4 << 20, 0);
        Ok((c, false))
    }

    fn put_back(&self, c: (UnixStream, bool)) {
        let mut slot = self.conn.lock();
        if slot.is_none() {
            *slot = Some(c);
        }
    }
}

/// Sends lookups to every worker's service and combines the answers.
#[derive(Debug)]
pub struct LookupClient {
    endpoints: Vec<Arc<Endpoint>>,
    timeout: Duration,
    /// The shared hash buffer (created on first use; None if it could not be).
    shm: Mutex<Option<Option<ShmWriter>>>,
}

enum Sent {
    Ready((UnixStream, bool)),
    Failed(LookupError),
}

/// Requests at least this large send their hashes through the shared buffer.
const SHM_MIN: usize = 16 << 10;

/// What one call sends.
#[derive(Clone, Copy)]
enum Payload<'a> {
    /// An ordinary frame body.
    Body(&'a [u8]),
    /// Hashes already written to the shared buffer: `(group, hash_len, bytes)`.
    Shared(u32, u32, u64),
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

impl LookupClient {
    /// A client of the services at `paths`, each answer awaited at most `timeout`.
    pub fn new(paths: Vec<PathBuf>, timeout: Duration) -> Self {
        LookupClient {
            endpoints: paths
                .into_iter()
                .map(|path| {
                    Arc::new(Endpoint {
                        path,
                        conn: Mutex::new(None),
                        stalled: AtomicBool::new(false),
                        last_warning: Mutex::new(None),
                    })
                })
                .collect(),
            timeout,
            shm: Mutex::new(None),
        }
    }

    /// The socket paths, in worker order.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.endpoints.iter().map(|e| e.path.clone()).collect()
    }

    /// Sends `op` with `body` to every worker, then collects the answers, all within
    /// `timeout`. A worker that does not answer in time is marked stalled; its answer is
    /// drained in the background, and until then calls to it fail at once.
    fn call_all(
        &self,
        op: Op,
        body: &[u8],
        timeout: Duration,
    ) -> Vec<Result<Vec<u8>, LookupError>> {
        self.call_all_payload(op, Payload::Body(body), None, timeout)
    }

    /// Sends a hash request (`PrefixHits` / `Exists` / `Holds`), through the shared buffer when it is
    /// large and the buffer exists.
    fn call_hashes(
        &self,
        op: Op,
        group: u32,
        packed: &[u8],
        hash_len: usize,
    ) -> Vec<Result<Vec<u8>, LookupError>> {
        if packed.len() >= SHM_MIN && packed.len() <= crate::shm::SHM_BYTES {
            let mut shm = self.shm.lock();
            let writer = shm.get_or_insert_with(|| match ShmWriter::new() {
                Ok(w) => Some(w),
                Err(e) => {
                    log::warn!(
                        "umbp: no shared lookup buffer ({e}); hashes go through the sockets"
                    );
                    None
                }
            });
            if let Some(w) = writer.as_mut() {
                w.write(packed);
                let shm_op = match op {
                    Op::PrefixHits => Op::PrefixHitsShm,
                    Op::Holds => Op::HoldsShm,
                    _ => Op::ExistsShm,
                };
                let payload = Payload::Shared(group, hash_len as u32, packed.len() as u64);
                // The lock stays held until every answer is in: the buffer is this call's.
                return self.call_all_payload(shm_op, payload, Some(w.fd()), self.timeout);
            }
        }
        let body = protocol::hashes_body(group, hash_len as u32, packed);
        self.call_all(op, &body, self.timeout)
    }

    fn call_all_payload(
        &self,
        op: Op,
        payload: Payload<'_>,
        shm_fd: Option<std::os::fd::RawFd>,
        timeout: Duration,
    ) -> Vec<Result<Vec<u8>, LookupError>> {
        let deadline = Instant::now() + timeout;
        let sent: Vec<Sent> = self
            .endpoints
            .iter()
            .map(|ep| {
                if ep.stalled.load(Ordering::Acquire) {
                    return Sent::Failed(LookupError::Timeout {
                        path: ep.name(),
                        ms: timeout.as_millis() as u64,
                    });
                }
                let (mut c, mut attached) = match ep.take_conn() {
                    Ok(c) => c,
                    Err(e) => return Sent::Failed(e),
                };
                if let Err(e) = c.set_write_timeout(Some(remaining(deadline))) {
                    return Sent::Failed(ep.io(e));
                }
                let r = match payload {
                    Payload::Body(body) => protocol::write_frame(&mut c, REQ_MAGIC, op as u8, body),
                    Payload::Shared(group, hash_len, len) => {
                        if !attached {
                            if let Err(e) = attach(
                                &mut c,
                                shm_fd.expect("shared payload has a buffer"),
                                deadline,
                            ) {
                                return Sent::Failed(ep.io(e));
                            }
                            attached = true;
                        }
                        let body = protocol::shm_body(group, hash_len, 0, len);
                        protocol::write_frame(&mut c, REQ_MAGIC, op as u8, &body)
                    }
                };
                match r {
                    Ok(()) => Sent::Ready((c, attached)),
                    Err(e) => Sent::Failed(ep.io(e)),
                }
            })
            .collect();
        sent.into_iter()
            .zip(&self.endpoints)
            .map(|(s, ep)| {
                let (mut c, attached) = match s {
                    Sent::Ready(c) => c,
                    Sent::Failed(e) => return Err(e),
                };
                if let Err(e) = c.set_read_timeout(Some(remaining(deadline))) {
                    return Err(ep.io(e));
                }
                let reply = protocol::read_frame(&mut c, REP_MAGIC);
                let c = (c, attached);
                match reply {
                    Ok(Some((0, body))) => {
                        ep.put_back(c);
                        Ok(body)
                    }
                    Ok(Some((_, msg))) => {
                        ep.put_back(c);
                        Err(LookupError::Remote {
                            path: ep.name(),
                            message: String::from_utf8_lossy(&msg).into_owned(),
                        })
                    }
                    Ok(None) => Err(LookupError::Protocol {
                        path: ep.name(),
                        message: "the worker closed the connection".into(),
                    }),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        drain_in_background(Arc::clone(ep), c);
                        Err(LookupError::Timeout {
                            path: ep.name(),
                            ms: timeout.as_millis() as u64,
                        })
                    }
                    Err(e) => Err(ep.io(e)),
                }
            })
            .collect()
    }

    /// How many blocks, from the first, every worker holds (the smallest answer). Any worker
    /// that is down, stalled or late makes it 0: a miss, never a hang.
    pub fn prefix_hits(&self, group: u32, packed_hashes: &[u8], hash_len: usize) -> u32 {
        if packed_hashes.is_empty() || self.endpoints.is_empty() {
            return 0;
        }
        let mut min = u32::MAX;
        let answers = self.call_hashes(Op::PrefixHits, group, packed_hashes, hash_len);
        let asked = packed_hashes.len() / hash_len.max(1);
        for (r, ep) in answers.into_iter().zip(&self.endpoints) {
            match r.and_then(|b| {
                let n =
                    b.try_into()
                        .map(u32::from_le_bytes)
                        .map_err(|_| LookupError::Protocol {
                            path: ep.name(),
                            message: "prefix answer is not 4 bytes".into(),
                        })?;
                // An answer of more blocks than were asked about is malformed: a miss (vLLM's
                // scheduler must never be told of more hits than the request has blocks).
                if n as usize > asked {
                    return Err(LookupError::Protocol {
                        path: ep.name(),
                        message: format!("prefix answer of {n} blocks for {asked} asked"),
                    });
                }
                Ok(n)
            }) {
                Ok(n) => min = min.min(n),
                Err(e) => {
                    ep.warn(&e);
                    return 0;
                }
            }
        }
        min
    }

    /// Which blocks every worker holds. Any failure makes every block a miss.
    pub fn exists_all(&self, group: u32, packed_hashes: &[u8], hash_len: usize) -> Vec<bool> {
        let n = packed_hashes.len() / hash_len.max(1);
        self.all_hold(Op::Exists, group, packed_hashes, hash_len)
            .unwrap_or_else(|| vec![false; n])
    }

    /// Which blocks every worker's pool holds now, taking no lease and reading no lower tier
    /// (for watching which stored blocks were evicted; a lookup a load follows is
    /// [`exists_all`](Self::exists_all)). `None` when a worker did not answer: nothing can
    /// be said then, and nothing should be reported removed.
    pub fn holds_all(
        &self,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Option<Vec<bool>> {
        self.all_hold(Op::Holds, group, packed_hashes, hash_len)
    }

    /// Per block, whether every worker answered 1 to `op` (`Exists` or `Holds`); `None` on
    /// any failure.
    fn all_hold(
        &self,
        op: Op,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Option<Vec<bool>> {
        let n = packed_hashes.len() / hash_len.max(1);
        if self.endpoints.is_empty() || n == 0 {
            // No worker holds anything: never report blocks no one was asked about.
            return Some(vec![false; n]);
        }
        let mut all = vec![true; n];
        let answers = self.call_hashes(op, group, packed_hashes, hash_len);
        for (r, ep) in answers.into_iter().zip(&self.endpoints) {
            match r {
                Ok(b) if b.len() == n && b.iter().all(|&x| x <= 1) => {
                    for (a, x) in all.iter_mut().zip(b) {
                        *a &= x != 0;
                    }
                }
                Ok(_) => {
                    ep.warn(&LookupError::Protocol {
                        path: ep.name(),
                        message: format!("{op:?} answer has the wrong length or values"),
                    });
                    return None;
                }
                Err(e) => {
                    ep.warn(&e);
                    return None;
                }
            }
        }
        Some(all)
    }

    /// Clears every worker's pool; returns the objects removed. Tries every worker, and
    /// reports the first failure after trying them all.
    pub fn clear(&self, timeout: Duration) -> Result<u64, LookupError> {
        let mut total = 0;
        let mut first_err = None;
        for (r, ep) in self
            .call_all(Op::Clear, &[], timeout)
            .into_iter()
            .zip(&self.endpoints)
        {
            match r.map(|b| b.try_into().map(u64::from_le_bytes)) {
                Ok(Ok(n)) => total = u64::saturating_add(total, n),
                Ok(Err(_)) => {
                    first_err.get_or_insert(LookupError::Protocol {
                        path: ep.name(),
                        message: "clear answer is not 8 bytes".into(),
                    });
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(total), Err)
    }

    /// Waits until every worker answers a ping, or fails after `timeout` naming the first
    /// worker that did not.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Vec<String>, LookupError> {
        let deadline = Instant::now() + timeout;
        loop {
            let answers = self.call_all(
                Op::Ping,
                &[],
                remaining(deadline).min(Duration::from_secs(1)),
            );
            match answers.into_iter().collect::<Result<Vec<_>, _>>() {
                Ok(v) => {
                    return Ok(v
                        .into_iter()
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .collect())
                }
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Whether an idle connection is still usable: nothing to read and not closed by the worker.
fn still_open(s: &UnixStream) -> bool {
    let mut b = [0u8; 1];
    umbp_unix::socket::recv_nowait(s, &mut b, true).is_err_and(|e| e.would_block())
}

/// Checks that the process serving `c` runs as this user or as root (`SO_PEERCRED`).
fn check_peer(c: &UnixStream) -> std::io::Result<()> {
    let cred = umbp_unix::peer::peer_credentials(c)?;
    let me = umbp_unix::peer::effective_uid();
    if cred.uid == me || cred.uid == 0 {
        return Ok(());
    }
    Err(std::io::Error::new(
        ErrorKind::PermissionDenied,
        format!(
            "the socket is served by uid {} (pid {}), not by this user (uid {me}) or root: \
             refused without sending anything; another user may have taken the path, so \
             remove it or set lookup_dir to a directory only this user can write",
            cred.uid, cred.pid
        ),
    ))
}

/// A read-only descriptor of the shared buffer `fd` (a new open file description through
/// `/proc/self/fd`): a worker can map it only for reading, never write into our buffer.
fn read_only(fd: std::os::fd::RawFd) -> std::io::Result<std::fs::File> {
    std::fs::File::open(format!("/proc/self/fd/{fd}"))
}

/// Best-effort socket buffer sizes (the kernel caps them at its own limits).
pub(crate) fn set_buffers(s: &UnixStream, send: usize, recv: usize) {
    if send > 0 {
        let _ = umbp_unix::socket::set_send_buffer(s, send);
    }
    if recv > 0 {
        let _ = umbp_unix::socket::set_recv_buffer(s, recv);
    }
}

/// Hands the shared buffer to a worker and waits for its acknowledgement.
fn attach(c: &mut UnixStream, fd: std::os::fd::RawFd, deadline: Instant) -> std::io::Result<()> {
    let frame = protocol::header(REQ_MAGIC, Op::AttachShm as u8, 0);
    let ro = read_only(fd)?;
    crate::shm::send_with_fd(c, &frame, std::os::fd::AsFd::as_fd(&ro))?;
    drop(ro);
    c.set_read_timeout(Some(remaining(deadline)))?;
    match protocol::read_frame(c, REP_MAGIC)? {
        Some((0, _)) => Ok(()),
        Some((_, msg)) => Err(std::io::Error::other(
            String::from_utf8_lossy(&msg).into_owned(),
        )),
        None => Err(std::io::ErrorKind::UnexpectedEof.into()),
    }
}

fn drain_in_background(ep: Arc<Endpoint>, c: (UnixStream, bool)) {
    let (mut c, attached) = c;
    ep.stalled.store(true, Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("umbp-lookup-drain".into())
        .spawn({
            let ep = Arc::clone(&ep);
            move || {
                let start = Instant::now();
                let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
                loop {
                    match protocol::read_frame(&mut c, REP_MAGIC) {
                        Ok(Some(_)) => {
                            log::info!("umbp: late lookup answer from {} arrived after {:?}; lookups to it resume", ep.name(), start.elapsed());
                            ep.put_back((c, attached));
                            break;
                        }
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
                                && start.elapsed() < DRAIN_LIMIT => {}
                        _ => break,
                    }
                }
                ep.stalled.store(false, Ordering::Release);
            }
        });
    if spawned.is_err() {
        ep.stalled.store(false, Ordering::Release);
    }
}
