//! The listening socket: binding (stale sockets replaced, live ones never stolen), its mode,
//! and accepted connections that know their peer, are charged to its descriptor budget
//! (`budget`) and tell the server when they close.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use std::os::fd::AsRawFd;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::server::Connected;

use crate::budget::{Budget, Charge, Counted, Pending, Silent};
use crate::config::Access;
use crate::error::ServerError;
use crate::ratelog::{RateLimited, ACCEPT_BACKOFF};

pub use crate::peer::PeerInfo;

/// Called with the connection's id when a connection closes.
pub(crate) type OnClose = Arc<dyn Fn(u64) + Send + Sync>;

/// An accepted connection: the stream, its peer, and a hook run when it is dropped (the
/// connection closed, or the server dropped it).
pub(crate) struct PeerConn {
    /// While it has sent nothing (or, refused, until it is closed): its entry among the
    /// silent connections, removed before the stream closes.
    pending: Option<Pending>,
    /// Whether its first bytes end its silence (not for a refused one, closed regardless).
    heard_clears: bool,
    stream: UnixStream,
    peer: PeerInfo,
    on_close: OnClose,
    _charge: Option<Charge>,
    _lingering: Option<Counted>,
}

impl std::fmt::Debug for PeerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerConn")
            .field("peer", &self.peer)
            .finish()
    }
}

impl Drop for PeerConn {
    fn drop(&mut self) {
        // Out of the silent connections before the descriptor closes (nobody may shut down a
        // reused number).
        self.pending = None;
        (self.on_close)(self.peer.conn);
    }
}

impl Connected for PeerConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer
    }
}

impl AsyncRead for PeerConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if self.heard_clears && self.pending.is_some() && buf.filled().len() > before {
            // Heard from: no longer silent.
            self.pending = None;
        }
        r
    }
}

impl AsyncWrite for PeerConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
static ACCEPT_FAILED: RateLimited = RateLimited::new();
static NO_SLOT: RateLimited = RateLimited::new();

/// What the gRPC accept loop needs.
pub(crate) struct Acceptor {
    pub(crate) budget: Arc<Budget>,
    pub(crate) access: Access,
    pub(crate) on_close: OnClose,
}

/// Accepts gRPC connections until `stop` changes, handing each, charged to its uid's
/// descriptor budget, to `tx`. While the total budget is spent nothing is accepted: new
/// connections wait in the kernel's backlog. A connection that waits for its uid's budget
/// waits on a task of its own (at most [`crate::budget::MAX_PARKED`] at once); one that gets
/// none is still served, every request refused with the reason, and closed after
/// [`crate::budget::REFUSED_LINGER`].
pub(crate) async fn accept_loop(
    listener: UnixListener,
    a: Acceptor,
    tx: tokio::sync::mpsc::Sender<io::Result<PeerConn>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let a = Arc::new(a);
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => return,
            r = async {
                a.budget.room().await;
                listener.accept().await
            } => r,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                ACCEPT_FAILED.log(|skipped| {
                    tracing::warn!(skipped, "accept failed: {e}; retrying in 100 ms");
                });
                // Out of descriptors, say: wait for some to close rather than spin.
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Charged now when there is room (the usual case); otherwise it waits for its budget
        // on a task, in one of a bounded number of places.
        let now = match stream.peer_cred() {
            Ok(c) if a.access.check(&creds(&c, 0)).is_ok() => a.budget.try_now(c.uid(), 1).ok(),
            _ => None,
        };
        let parked = match now {
            Some(_) => None,
            None => match a.budget.park() {
                Some(p) => Some(p),
                None => {
                    NO_SLOT.log(|skipped| {
                        tracing::warn!(
                            skipped,
                            "a connection closed at once: {} connections wait for their descriptor budget already",
                            crate::budget::MAX_PARKED
                        );
                    });
                    continue;
                }
            },
        };
        let (a, tx) = (Arc::clone(&a), tx.clone());
        tokio::spawn(async move {
            if let Ok(Some(conn)) = admit(stream, &a, now).await {
                drop(parked);
                let _ = tx.send(Ok(conn)).await;
            }
        });
    }
}

/// Charges a new connection to its uid (waiting as [`Budget::take`] does) and wraps it; a
/// refused one is wrapped to be answered with the reason, or dropped (`None`) when too many
/// refused ones are open already.
async fn admit(
    stream: UnixStream,
    a: &Acceptor,
    now: Option<Charge>,
) -> io::Result<Option<PeerConn>> {
    let cred = stream.peer_cred()?;
    let mut peer = creds(&cred, NEXT_CONN.fetch_add(1, Ordering::Relaxed));
    // A uid that may not use the server gets no budget: its requests are refused by
    // `Access::check`, and the connection closed soon.
    let charge = if now.is_some() {
        now
    } else if a.access.check(&peer).is_ok() {
        match a.budget.take(peer.uid, 1).await {
            Ok(c) => Some(c),
            Err(short) => {
                NO_SLOT.log(|skipped| {
                    tracing::warn!(skipped, uid = peer.uid, "connection refused: {short}");
                });
                peer.refused = Some(short);
                None
            }
        }
    } else {
        None
    };
    let hs = &a.budget.handshakes;
    let fd = stream.as_raw_fd();
    let (pending, lingering) = match charge {
        Some(_) => (hs.enter(peer.uid, fd, Silent::Grpc), None),
        None => {
            let Some(slot) = a.budget.linger() else {
                return Ok(None);
            };
            (hs.enter(peer.uid, fd, Silent::Refused), Some(slot))
        }
    };
    Ok(Some(PeerConn {
        heard_clears: charge.is_some(),
        pending: Some(pending),
        stream,
        peer,
        on_close: Arc::clone(&a.on_close),
        _charge: charge,
        _lingering: lingering,
    }))
}

/// A connection's peer as `PeerInfo` (connection number `conn`).
fn creds(c: &tokio::net::unix::UCred, conn: u64) -> PeerInfo {
    PeerInfo {
        conn,
        uid: c.uid(),
        gid: c.gid(),
        pid: c.pid().map_or(0, |p| p.max(0) as u32),
        refused: None,
    }
}

/// The credentials of a std Unix stream's peer (`SO_PEERCRED`): uid, gid, pid.
pub(crate) fn peer_of(stream: &std::os::unix::net::UnixStream) -> io::Result<(u32, u32, u32)> {
    let c = umbp_proto::peer::peer_credentials(std::os::fd::AsFd::as_fd(stream))?;
    Ok((c.uid, c.gid, c.pid))
}

/// Binds a Unix socket at `path` with permissions `mode`.
///
/// A file already at `path` is replaced only when it is a socket nobody answers on (a killed
/// server's leftover); a socket with a live server behind it is never taken over, and any
/// other kind of file is left alone. The mode is set on the socket file before anyone can
/// connect (the socket is bound under a restrictive umask, then chmod'ed).
pub(crate) fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    let bind_err = |reason: String| ServerError::Bind {
        path: path.to_path_buf(),
        reason,
    };
    if let Some(dir) = path.parent() {
        if !dir.is_dir() {
            return Err(bind_err(format!(
                "directory {} does not exist; create it (e.g. mkdir -p {0}) or choose another address",
                dir.display()
            )));
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.file_type().is_socket() {
                return Err(bind_err(
                    "a file that is not a socket is in the way; remove it or choose another address"
                        .into(),
                ));
            }
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(ServerError::LiveServer(path.to_path_buf())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    log::warn!(
                        "umbp server: {} is a stale socket (nobody answers it); replacing it",
                        path.display()
                    );
                    std::fs::remove_file(path)
                        .map_err(|e| bind_err(format!("cannot remove the stale socket: {e}")))?;
                }
                Err(e) => {
                    return Err(bind_err(format!(
                        "a socket is there and connecting to it failed ({e}); remove it if no server uses it"
                    )))
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e.to_string())),
    }
    // Nobody may connect between bind and chmod: bind with everything masked but the owner.
    let bound =
        umbp_unix::process::with_umask(0o177, || std::os::unix::net::UnixListener::bind(path));
    let listener = bound.map_err(|e| bind_err(e.to_string()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| bind_err(format!("cannot set mode {mode:o}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| bind_err(e.to_string()))?;
    UnixListener::from_std(listener).map_err(|e| bind_err(e.to_string()))
}

/// Removes the socket file at `path` if it is still the one this server bound (same inode).
pub(crate) fn unlink_if_ours(path: &Path, ino: Option<u64>) {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(meta), Some(ino)) = (std::fs::symlink_metadata(path), ino) {
        if meta.ino() == ino {
            if let Err(e) = std::fs::remove_file(path) {
                log::warn!("umbp server: cannot remove {}: {e}", path.display());
            }
        }
    }
}

/// The inode of the file at `path`.
pub(crate) fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}
