//! The worker side: serves lookups on a Unix socket.

use std::io::ErrorKind;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::protocol::{self, LookupError, Op, REP_MAGIC, REQ_MAGIC};
use crate::shm::{self, ShmReader};

/// What a lookup server answers from (the worker's store).
pub trait LookupTarget: Send + Sync + 'static {
    /// How many of the blocks, from the first, this worker holds.
    fn prefix_hits(&self, group: u32, packed_hashes: &[u8], hash_len: usize)
        -> Result<u32, String>;
    /// Which blocks this worker holds.
    fn exists(
        &self,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Result<Vec<bool>, String>;
    /// Removes every object; returns how many.
    fn clear(&self) -> u64;
    /// A short description of the worker (for `Ping`).
    fn describe(&self) -> String;
}

/// A running lookup service. Stops, and removes its socket, on [`LookupServer::shutdown`] or
/// drop.
#[derive(Debug)]
pub struct LookupServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

const POLL: Duration = Duration::from_millis(50);

impl LookupServer {
    /// Binds `path` and serves `target` on background threads. A stale socket file (nothing
    /// listening) is replaced; a live one is an error ([`LookupError::InUse`]).
    pub fn bind(path: &Path, target: Arc<dyn LookupTarget>) -> Result<LookupServer, LookupError> {
        let io = |source| LookupError::Io {
            path: path.display().to_string(),
            source,
        };
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(LookupError::InUse(path.display().to_string()));
            }
            std::fs::remove_file(path).map_err(io)?;
        }
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() && !dir.is_dir() {
                return Err(io(std::io::Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "directory {} does not exist; create it or set lookup_dir",
                        dir.display()
                    ),
                )));
            }
        }
        let listener = UnixListener::bind(path).map_err(io)?;
        listener.set_nonblocking(true).map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let accept = std::thread::Builder::new()
            .name("umbp-lookup".into())
            .spawn(move || accept_loop(listener, target, stop2))
            .map_err(io)?;
        log::info!("umbp: lookup service listening on {}", path.display());
        Ok(LookupServer {
            path: path.to_owned(),
            stop,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting and serving, and removes the socket file. Idempotent.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.accept.lock().take() {
            let _ = h.join();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: UnixListener, target: Arc<dyn LookupTarget>, stop: Arc<AtomicBool>) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if peer_is_foreign(&stream) {
                    continue;
                }
                let (target, stop) = (Arc::clone(&target), Arc::clone(&stop));
                match std::thread::Builder::new()
                    .name("umbp-lookup-conn".into())
                    .spawn(move || serve(stream, target.as_ref(), &stop))
                {
                    Ok(h) => conns.push(h),
                    Err(e) => {
                        log::warn!("umbp: lookup service cannot start a connection thread: {e}")
                    }
                }
                conns.retain(|h| !h.is_finished());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => {
                log::warn!("umbp: lookup service accept failed: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
    for h in conns {
        let _ = h.join();
    }
}

/// Only processes of the same user may ask: the socket lives in a shared directory.
fn peer_is_foreign(stream: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes one `ucred` into `cred`, whose size we pass in `len`.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    let foreign = rc == 0 && cred.uid != me && cred.uid != 0;
    if foreign {
        log::warn!(
            "umbp: refused a lookup connection from uid {} (pid {})",
            cred.uid,
            cred.pid
        );
    }
    foreign
}

fn serve(mut stream: UnixStream, target: &dyn LookupTarget, stop: &AtomicBool) {
    if stream.set_nonblocking(false).is_err() || stream.set_read_timeout(Some(POLL)).is_err() {
        return;
    }
    crate::client::set_buffer(&stream, libc::SO_RCVBUF, 4 << 20);
    let mut shared: Option<ShmReader> = None;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        // The first bytes of a frame are read with recvmsg: an attached memfd arrives there.
        let mut h = [0u8; 12];
        let (got, fd) = match shm::recv_with_fd(&stream, &mut h) {
            Ok((0, _)) => return,
            Ok(x) => x,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => return,
        };
        let (code, body) = match protocol::finish_frame(&mut stream, REQ_MAGIC, h, got) {
            Ok(f) => f,
            Err(e) => {
                log::debug!("umbp: lookup connection closed: {e}");
                return;
            }
        };
        let hashes_from_shm =
            |shared: &Option<ShmReader>| -> Result<(u32, usize, Vec<u8>), String> {
                let (g, hl, off, len) = protocol::parse_shm_body(&body)?;
                let hl = hl as usize;
                let buf = shared
                    .as_ref()
                    .ok_or("no shared buffer is attached to this connection")?
                    .read(off, len)?;
                if hl == 0 || hl > 32 || !buf.len().is_multiple_of(hl) {
                    return Err(format!(
                        "{} hash bytes are not whole {hl}-byte hashes (1..=32)",
                        buf.len()
                    ));
                }
                Ok((g, hl, buf))
            };
        let reply = match Op::from_u8(code) {
            Some(Op::Ping) => Ok(target.describe().into_bytes()),
            Some(Op::PrefixHits) => protocol::parse_hashes_body(&body)
                .and_then(|(g, hl, p)| target.prefix_hits(g, p, hl))
                .map(|n| n.to_le_bytes().to_vec()),
            Some(Op::Exists) => protocol::parse_hashes_body(&body)
                .and_then(|(g, hl, p)| target.exists(g, p, hl))
                .map(|v| v.into_iter().map(u8::from).collect()),
            Some(Op::Clear) => Ok(target.clear().to_le_bytes().to_vec()),
            Some(Op::AttachShm) => match fd.map(ShmReader::map) {
                Some(Ok(r)) => {
                    shared = Some(r);
                    Ok(Vec::new())
                }
                Some(Err(e)) => Err(format!("cannot map the shared buffer: {e}")),
                None => Err("AttachShm carried no descriptor".into()),
            },
            Some(Op::PrefixHitsShm) => hashes_from_shm(&shared)
                .and_then(|(g, hl, p)| target.prefix_hits(g, &p, hl))
                .map(|n| n.to_le_bytes().to_vec()),
            Some(Op::ExistsShm) => hashes_from_shm(&shared)
                .and_then(|(g, hl, p)| target.exists(g, &p, hl))
                .map(|v| v.into_iter().map(u8::from).collect()),
            None => Err(format!("unknown operation {code}")),
        };
        let sent = match reply {
            Ok(b) => protocol::write_frame(&mut stream, REP_MAGIC, 0, &b),
            Err(m) => protocol::write_frame(&mut stream, REP_MAGIC, 1, m.as_bytes()),
        };
        if sent.is_err() {
            return;
        }
    }
}
