//! What shapes a server: where it listens, its pool, who may use it, its limits.

use std::net::SocketAddr;
use std::time::Duration;

use umbp_proto::Endpoint;
use umbp_store::StoreConfig;

use crate::peer::PeerInfo;

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
    /// Descriptors the clients of one uid may make the server hold, at most (None: half of
    /// the descriptors the server has for clients).
    pub max_fds_per_uid: Option<usize>,
    /// Keep the pool in a memfd and hand it to a server that takes over (`--take-over`, at
    /// `<endpoint>.handover`) or, under systemd, to the unit's descriptor store on SIGTERM.
    pub hand_over: bool,
    /// At start, take the pool of the server running at the endpoint (one started with
    /// `hand_over`), then serve in its place.
    pub take_over: bool,
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
                own_uid: umbp_unix::peer::real_uid(),
                ..Access::default()
            },
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            metrics_address: None,
            metrics_allow_remote: false,
            max_message_bytes: umbp_proto::DEFAULT_MAX_MESSAGE_BYTES,
            busy_poll: DEFAULT_BUSY_POLL,
            max_fds_per_uid: None,
            hand_over: false,
            take_over: false,
        }
    }
}
