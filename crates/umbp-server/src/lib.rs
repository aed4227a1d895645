//! The UMBP standalone server: one DRAM pool per node, shared by every engine and worker on
//! the host, served over gRPC on a Unix-domain socket.
//!
//! - **Sessions** ([`sessions`]): each client attaches and owns its registrations, layouts
//!   and transfers; they are released the moment its connection closes or its process exits.
//! - **No KV bytes on the socket**: clients register memory the server can reach itself (a
//!   sealed memfd for host memory, CUDA IPC handles or exported VMM descriptors for GPU
//!   memory), passing descriptors over a side channel ([`fdchan`]); the server's copy engine
//!   moves the bytes, the same code path embedded mode uses (`umbp_store`).
//! - **Restarts**: every start has a new boot id; clients that see one re-attach and
//!   re-register by themselves.
//! - **Parallel clients**: no global lock; each session's transfers run on the shared copy
//!   workers and the GPU's copy engines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio_stream::StreamExt;
use umbp_proto::Endpoint;
use umbp_store::{EmbeddedStore, StoreConfig, StoreError};

mod channel;
mod fdchan;
mod listen;
mod memory;
mod metrics;
mod pidwatch;
mod ratelog;
mod service;
mod sessions;

pub use listen::PeerInfo;

/// Errors of the server.
#[derive(Debug, Error)]
pub enum ServerError {
    /// The configuration is invalid.
    #[error("{0}")]
    Config(String),
    /// The socket could not be bound.
    #[error("cannot listen on {path}: {reason}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Another server answers at the address.
    #[error(
        "a live UMBP server already listens on {0}; stop it first or choose another --address"
    )]
    LiveServer(PathBuf),
    /// The store could not be created.
    #[error("cannot create the pool: {0}")]
    Store(#[from] StoreError),
    /// Serving failed.
    #[error("serving failed: {0}")]
    Serve(String),
}

/// Who may use the server besides its own user.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The server's own uid (always allowed).
    pub own_uid: u32,
    /// Other uids allowed.
    pub allow_uids: Vec<u32>,
    /// A group whose members are allowed (the socket is then group-accessible).
    pub allow_gid: Option<u32>,
}

impl Access {
    /// Refuses a peer that is neither the server's user, an allowed uid, nor (by primary or
    /// supplementary group) in the allowed group.
    pub fn check(&self, p: &PeerInfo) -> Result<(), String> {
        if p.uid == self.own_uid || self.allow_uids.contains(&p.uid) {
            return Ok(());
        }
        if let Some(g) = self.allow_gid {
            if p.gid == g || (p.pid != 0 && supplementary_groups(p.pid).contains(&g)) {
                return Ok(());
            }
        }
        Err(format!(
            "uid {} (pid {}) may not use this server, which runs as uid {}; start the server with --allow-uid {} (or --allow-group with a group of that user)",
            p.uid, p.pid, self.own_uid, p.uid
        ))
    }
}

/// The supplementary groups of process `pid` (from /proc).
fn supplementary_groups(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                g.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// Mode of the socket files: only the server's user (0660 when a group is allowed).
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// How long in-flight transfers get to finish after SIGTERM before they are cancelled.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long a transfer channel's reader watches its socket before it blocks (zero: never).
pub const DEFAULT_BUSY_POLL: Duration = Duration::ZERO;

/// Copy threads of the server binary (`--workers`): it copies for every engine of the node,
/// so it has more than one engine's worker (the connector's `num_workers`).
pub const DEFAULT_COPY_WORKERS: usize = 8;

/// Everything that shapes a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen.
    pub endpoint: Endpoint,
    /// The pool, copy workers and default transfer timeout.
    pub store: StoreConfig,
    /// Mode of the socket files (0600 by default; 0660 when a group is allowed).
    pub socket_mode: u32,
    /// Who may connect.
    pub access: Access,
    /// How long in-flight transfers get to finish after SIGTERM before they are cancelled.
    pub shutdown_grace: Duration,
    /// Where to serve Prometheus metrics (off when None).
    pub metrics_address: Option<SocketAddr>,
    /// Allow a non-loopback metrics address.
    pub metrics_allow_remote: bool,
    /// Largest gRPC message accepted or sent.
    pub max_message_bytes: usize,
    /// How long a transfer channel's reader watches its socket, after the channel's last
    /// request or reply, before it blocks on the socket (zero: it always blocks). Watching
    /// spares the wake-up of a blocked thread on each transfer (tens of µs on a VM) at the cost
    /// of a core for that long after each transfer of each busy channel.
    pub busy_poll: Duration,
}

impl ServerConfig {
    /// Defaults for a pool of `capacity` bytes at `endpoint`.
    pub fn new(endpoint: Endpoint, capacity: u64) -> Self {
        ServerConfig {
            endpoint,
            store: StoreConfig {
                pool: umbp_core::PoolConfig::with_capacity(capacity),
                ..StoreConfig::default()
            },
            socket_mode: DEFAULT_SOCKET_MODE,
            access: Access {
                // SAFETY: getuid has no preconditions and cannot fail.
                own_uid: unsafe { libc::getuid() },
                ..Access::default()
            },
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            metrics_address: None,
            metrics_allow_remote: false,
            max_message_bytes: umbp_proto::DEFAULT_MAX_MESSAGE_BYTES,
            busy_poll: DEFAULT_BUSY_POLL,
        }
    }
}

/// 16 random bytes from the kernel.
pub(crate) fn random_bytes() -> [u8; 16] {
    let mut b = [0u8; 16];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most the remaining bytes of `b`.
        let n = unsafe {
            libc::getrandom(b[got..].as_mut_ptr() as *mut libc::c_void, b.len() - got, 0)
        };
        if n > 0 {
            got += n as usize;
        }
    }
    b
}

/// Serves until `shutdown` resolves, then stops: new transfers are refused, in-flight ones
/// get `shutdown_grace` to finish, then every session is released, the socket files are
/// removed and the pool is closed.
pub async fn serve(
    cfg: ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    cfg.store.validate()?;
    let path = cfg.endpoint.path().to_path_buf();
    let fd_path = cfg.endpoint.fd_socket();
    let listener = listen::bind(&path, cfg.socket_mode)?;
    let listener_ino = listen::inode(&path);
    let fd_listener = match listen::bind(&fd_path, cfg.socket_mode) {
        Ok(l) => l,
        Err(e) => {
            listen::unlink_if_ours(&path, listener_ino);
            return Err(e);
        }
    };
    let fd_ino = listen::inode(&fd_path);
    let unlink = || {
        listen::unlink_if_ours(&path, listener_ino);
        listen::unlink_if_ours(&fd_path, fd_ino);
    };
    if let Some(g) = cfg.access.allow_gid {
        for p in [&path, &fd_path] {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .expect("no NUL in a parsed path");
            // SAFETY: a NUL-terminated path; -1 keeps the owner.
            if unsafe { libc::chown(c.as_ptr(), u32::MAX, g) } != 0 {
                unlink();
                return Err(ServerError::Config(format!(
                    "cannot give {} to group {g}: {}",
                    p.display(),
                    std::io::Error::last_os_error()
                )));
            }
        }
    }
    let t = Instant::now();
    let store = match EmbeddedStore::new(cfg.store.clone()) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            unlink();
            return Err(e.into());
        }
    };
    let boot_id = umbp_core::key::hex(&random_bytes()[..8]);
    let m = Arc::new(metrics::Metrics::default());
    let sessions = Arc::new(sessions::Sessions::new(Arc::clone(&store), Arc::clone(&m)));
    let state = Arc::new(service::State {
        store: Arc::clone(&store),
        sessions: Arc::clone(&sessions),
        metrics: Arc::clone(&m),
        boot_id: boot_id.clone(),
        started: Instant::now(),
        access: cfg.access.clone(),
        endpoint: cfg.endpoint.clone(),
        max_message_bytes: cfg.max_message_bytes,
        busy_poll: cfg.busy_poll,
        draining: AtomicBool::new(false),
        in_flight: AtomicU64::new(0),
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    if let Some(addr) = cfg.metrics_address {
        let l = match metrics::bind(addr, cfg.metrics_allow_remote).await {
            Ok(l) => l,
            Err(e) => {
                unlink();
                return Err(e);
            }
        };
        let st = Arc::clone(&state);
        let render: Arc<dyn Fn() -> String + Send + Sync> =
            Arc::new(move || st.metrics.render(&st.gauges()));
        tracing::info!(%addr, "Prometheus metrics at http://{addr}/metrics");
        tasks.push(tokio::spawn(metrics::serve(l, render, stop_rx.clone())));
    }
    tasks.push(tokio::spawn(fdchan::serve(
        fd_listener,
        Arc::clone(&state),
        stop_rx.clone(),
    )));
    let p = store.stats()?;
    tracing::info!(
        address = %cfg.endpoint,
        boot_id = %boot_id,
        capacity_bytes = p.capacity_bytes,
        placement = ?p.placement,
        workers = cfg.store.num_workers,
        took_ms = t.elapsed().as_millis() as u64,
        "UMBP standalone server ready"
    );
    let on_close: listen::OnClose = {
        let s = Arc::clone(&sessions);
        Arc::new(move |conn| s.end_connection(conn))
    };
    static ACCEPT_FAILED: ratelog::RateLimited = ratelog::RateLimited::new();
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
        .then(move |r| {
            let accepted = r.and_then(|s| listen::accept(s, Arc::clone(&on_close)));
            async move {
                if let Err(e) = &accepted {
                    ACCEPT_FAILED.log(|skipped| {
                        tracing::warn!(skipped, "accept failed: {e}; retrying in 100 ms");
                    });
                    // Out of descriptors, say: wait for some to close rather than spin.
                    tokio::time::sleep(ratelog::ACCEPT_BACKOFF).await;
                }
                accepted
            }
        })
        .filter_map(|r| r.ok().map(Ok::<_, std::io::Error>));
    let svc = umbp_proto::v1::store_server::StoreServer::new(service::Service {
        state: Arc::clone(&state),
    })
    .max_decoding_message_size(cfg.max_message_bytes)
    .max_encoding_message_size(cfg.max_message_bytes);
    let (grace_tx, grace_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = {
        let state = Arc::clone(&state);
        async move {
            shutdown.await;
            tracing::info!("stopping: new transfers are refused, in-flight ones finish");
            state.draining.store(true, Ordering::Release);
            let _ = grace_tx.send(());
        }
    };
    let server = tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, drain);
    tokio::pin!(server);
    let served = tokio::select! {
        r = &mut server => Some(r),
        _ = grace_rx => None,
    };
    let result = match served {
        Some(r) => r.map_err(|e| ServerError::Serve(e.to_string())),
        None => {
            // The graceful shutdown waits for connections to end, and clients keep theirs
            // open: give in-flight transfers the grace period, then stop regardless.
            let deadline = Instant::now() + cfg.shutdown_grace;
            while state.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let left = state.in_flight.load(Ordering::Acquire);
            if left > 0 {
                tracing::warn!(
                    transfers = left,
                    "grace period over: cancelling transfers still in flight"
                );
            }
            match tokio::time::timeout(Duration::from_millis(100), &mut server).await {
                Ok(r) => r.map_err(|e| ServerError::Serve(e.to_string())),
                Err(_) => Ok(()),
            }
        }
    };
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    unlink();
    let st = Arc::clone(&sessions);
    let _ = tokio::task::spawn_blocking(move || st.end_all()).await;
    store.close();
    tracing::info!("stopped");
    result
}
