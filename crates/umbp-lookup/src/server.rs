//! The worker side: serves lookups on a Unix socket.
//!
//! One thread per server runs an epoll loop over the listening socket, every connection and an
//! eventfd that [`LookupServer::shutdown`] signals. Sockets are non-blocking, so no client can
//! hold the thread: a reply the client does not read waits in that connection's buffer (and
//! the connection reads nothing more until it is sent), a connection that makes no progress
//! for [`ServerLimits::io_timeout`] or sits idle for [`ServerLimits::idle_timeout`] is closed,
//! and at [`ServerLimits::max_connections`] the longest-idle connection makes room for a new
//! one. Requests are answered on the loop's thread, in chunks, so one request's memory stays
//! small whatever its size. Idle connections cost no thread and no wake-up.
//!
//! The served trait and the limits are in `target`, the system calls in `sys` and the loop
//! itself in `event_loop`; this file binds the socket and owns the thread.

mod event_loop;
mod sys;
mod target;

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;
use umbp_unix::epoll::Epoll;
use umbp_unix::eventfd::EventFd;

use crate::protocol::LookupError;
use event_loop::EventLoop;
use sys::{signal, IN, LISTENER, WAKE};

pub use target::{LookupTarget, ServerLimits};

/// A running lookup service. Stops, and removes its socket, on [`LookupServer::shutdown`] or
/// drop.
#[derive(Debug)]
pub struct LookupServer {
    path: PathBuf,
    /// `(device, inode)` of the socket file this server bound: only that file is removed.
    bound: (u64, u64),
    /// The process that started the service (a forked child has no service thread).
    pid: u32,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl LookupServer {
    /// Binds `path` and serves `target` on a background thread with the default
    /// [`ServerLimits`]. A stale socket file (nothing listening) is replaced; a live one is an
    /// error ([`LookupError::InUse`]); anything else at the path is left alone and is an error
    /// ([`LookupError::NotASocket`]).
    pub fn bind(path: &Path, target: Arc<dyn LookupTarget>) -> Result<LookupServer, LookupError> {
        Self::bind_with_limits(path, target, ServerLimits::default())
    }

    /// [`LookupServer::bind`] with other limits.
    pub fn bind_with_limits(
        path: &Path,
        target: Arc<dyn LookupTarget>,
        limits: ServerLimits,
    ) -> Result<LookupServer, LookupError> {
        let io = |source| LookupError::Io {
            path: path.display().to_string(),
            source,
        };
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                if UnixStream::connect(path).is_ok() {
                    return Err(LookupError::InUse(path.display().to_string()));
                }
                std::fs::remove_file(path).map_err(io)?;
            }
            Ok(_) => return Err(LookupError::NotASocket(path.display().to_string())),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
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
        let bound = std::fs::symlink_metadata(path)
            .map(|m| (m.dev(), m.ino()))
            .map_err(io)?;
        let unbind = |e: std::io::Error| {
            unlink_if_same(path, bound);
            io(e)
        };
        listener.set_nonblocking(true).map_err(unbind)?;
        let wake = Arc::new(EventFd::new(true).map_err(|e| unbind(e.into()))?);
        let ep = Epoll::new().map_err(|e| unbind(e.into()))?;
        ep.add(&listener, LISTENER, IN)
            .map_err(|e| unbind(e.into()))?;
        ep.add(&*wake, WAKE, IN).map_err(|e| unbind(e.into()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut event_loop = EventLoop::new(
            ep,
            listener,
            Arc::clone(&wake),
            Arc::clone(&stop),
            target,
            limits,
        );
        let thread = std::thread::Builder::new()
            .name("umbp-lookup".into())
            .spawn(move || event_loop.run())
            .map_err(unbind)?;
        log::info!("umbp: lookup service listening on {}", path.display());
        Ok(LookupServer {
            path: path.to_owned(),
            bound,
            pid: std::process::id(),
            stop,
            wake,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting and serving, closes every connection and removes the socket file if it
    /// is still the one this server bound. Never waits on a client: it returns once a request
    /// being answered (if any) is done. Idempotent; does nothing in a forked child (the
    /// service is its parent's).
    pub fn shutdown(&self) {
        if std::process::id() != self.pid {
            return;
        }
        self.stop.store(true, Ordering::Release);
        signal(&self.wake);
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
            unlink_if_same(&self.path, self.bound);
        }
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Removes `path` only if it is still the file `(dev, ino)`: a newer server's socket at the
/// same path stays.
fn unlink_if_same(path: &Path, (dev, ino): (u64, u64)) {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.dev() == dev && m.ino() == ino {
            let _ = std::fs::remove_file(path);
        }
    }
}
