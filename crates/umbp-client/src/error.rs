//! The client's one error type, and its [`Result`].

use std::time::Duration;

use thiserror::Error;
use umbp_core::ErrorKind;
use umbp_cuda_driver::CudaError;
use umbp_proto::ProtoError;

/// Result of the client.
pub type Result<T> = std::result::Result<T, ClientError>;

/// Errors of the standalone client.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The endpoint is not a Unix socket address.
    #[error(transparent)]
    Endpoint(#[from] ProtoError),
    /// No server answered within the startup timeout.
    #[error("no UMBP server answers at {endpoint} after {waited:?} (last error: {last}); start umbp_standalone_server with --address {endpoint}, or fix `endpoint`")]
    Unreachable {
        /// Where the client looked.
        endpoint: String,
        /// How long it tried.
        waited: Duration,
        /// The last failure.
        last: String,
    },
    /// The server went away (or restarted); the next call attaches again by itself.
    #[error("the UMBP server at {endpoint} is not reachable: {reason}")]
    Disconnected {
        /// The server's address.
        endpoint: String,
        /// What failed.
        reason: String,
    },
    /// The server refused the request; the message says why and what to change, the kind
    /// (sent by the server) what kind of problem it is.
    #[error("the UMBP server refused {call}: {message} ({kind})")]
    Refused {
        /// The call.
        call: &'static str,
        /// The kind of problem, as the server sent it.
        kind: ErrorKind,
        /// The server's message.
        message: String,
    },
    /// A call did not finish in time.
    #[error("{what} did not finish within {ms} ms")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The limit.
        ms: u64,
    },
    /// An earlier call of the same kind is still unanswered past its deadline: calls fail at
    /// once until it is answered, so a stalled server cannot pile up work.
    #[error("an earlier {what} is still unanswered by the server past its deadline; failing at once until it is answered")]
    Stalled {
        /// Lookups or transfers.
        what: &'static str,
    },
    /// Bad input, found before anything was sent.
    #[error("{0}")]
    Invalid(String),
    /// Memory named (by address or region id) that this client has not registered, found
    /// before anything was sent.
    #[error("{0}")]
    Unregistered(String),
    /// Memory overlapping a region this client registered already, found before anything
    /// was sent.
    #[error("{0}")]
    Overlapping(String),
    /// A layout (or group) id this client does not know, found before anything was sent.
    #[error("{0}")]
    UnknownLayout(String),
    /// A failure inside the client (a task that panicked).
    #[error("{0}")]
    Internal(String),
    /// The process at the server's socket runs as another user: nothing was sent to it.
    #[error("the UMBP server socket {path} is served by uid {uid} (pid {pid}), not by this user (uid {me}), root or a uid in UMBP_SERVER_UIDS: refused without sending anything. Another user may have bound the path while no server ran: remove it and start the server at a path only trusted users can create, or list the server's uid in UMBP_SERVER_UIDS")]
    UntrustedServer {
        /// The socket.
        path: String,
        /// The uid serving it.
        uid: u32,
        /// The process serving it (0: in another pid namespace).
        pid: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// The client was created in another process (before a fork).
    #[error("this StandaloneClient was created in process {created}, not in this one ({now}); a forked process must create its own client")]
    Forked {
        /// The creating process.
        created: u32,
        /// This process.
        now: u32,
    },
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
    /// CUDA memory could not be exported.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    // Host memory that could not be shared (`host_share`).
    /// The address or length cannot describe memory.
    #[error("cannot share {len} bytes at {addr:#x}: {reason}")]
    ShareBadRange {
        /// Start of the range asked for.
        addr: u64,
        /// Its length.
        len: u64,
        /// What is wrong, and what to change.
        reason: String,
    },
    /// Part of the range is not mapped in this process.
    #[error(
        "cannot share {len} bytes at {addr:#x}: nothing is mapped at {at:#x}; pass the address \
         and length of memory this process holds (a tensor's data_ptr() and its size in bytes)"
    )]
    ShareNotMapped {
        /// Start of the range asked for.
        addr: u64,
        /// Its length.
        len: u64,
        /// The first address in it that is not mapped.
        at: u64,
    },
    /// The range lies in memory that cannot be moved onto a memfd.
    #[error(
        "cannot share {len} bytes at {addr:#x}: the mapping {start:#x}-{end:#x} is {what}; {fix}"
    )]
    ShareUnsupported {
        /// Start of the range asked for.
        addr: u64,
        /// Its length.
        len: u64,
        /// Start of the offending mapping.
        start: u64,
        /// End of the offending mapping.
        end: u64,
        /// What the mapping is.
        what: String,
        /// What to do instead.
        fix: String,
    },
    /// A system call failed.
    #[error("cannot share {len} bytes of host memory: {call} failed: {source}; {fix}")]
    ShareSystem {
        /// Bytes being shared or allocated.
        len: u64,
        /// The call that failed.
        call: &'static str,
        /// The system error.
        source: std::io::Error,
        /// What to change.
        fix: String,
    },
    /// This process's memory map could not be read.
    #[error(
        "cannot read this process's memory map (/proc/self/smaps): {0}; share_host_range needs \
         /proc mounted (or allocate the cache with alloc_shared_host, which does not)"
    )]
    ShareProc(#[source] std::io::Error),
    /// The client's runtime thread could not be started.
    #[error("cannot start the client's runtime: {0}; the process is at its thread or memory limit (check `ulimit -u` and the container's pids limit)")]
    Runtime(#[source] std::io::Error),
    /// Local I/O with the server (its sockets, the side channel) failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl ClientError {
    /// The error of `call` that the server (or the connection) failed with `kind` and
    /// `message`, whatever the transport: the server or the connection gone is
    /// [`ClientError::Disconnected`], anything else a refusal of that kind.
    pub(crate) fn from_server(
        call: &'static str,
        endpoint: &umbp_proto::Endpoint,
        kind: ErrorKind,
        message: String,
    ) -> ClientError {
        match kind {
            ErrorKind::Unavailable => ClientError::Disconnected {
                endpoint: endpoint.to_string(),
                reason: message,
            },
            kind => ClientError::Refused {
                call,
                kind,
                message,
            },
        }
    }

    /// The error's kind: what the bindings choose an exception class by, and what decides
    /// whether the client attaches again.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Endpoint(e) => e.kind(),
            ClientError::Invalid(_) | ClientError::UntrustedServer { .. } => {
                ErrorKind::InvalidArgument
            }
            ClientError::Unregistered(_) | ClientError::Overlapping(_) => ErrorKind::Registration,
            ClientError::UnknownLayout(_) => ErrorKind::NotFound,
            ClientError::Internal(_) => ErrorKind::Internal,
            ClientError::Unreachable { .. }
            | ClientError::Disconnected { .. }
            | ClientError::Stalled { .. }
            | ClientError::Io { .. } => ErrorKind::Unavailable,
            // A transfer's wait leaves the transfer running; any other call that ran past its
            // deadline means the server did not answer.
            ClientError::Timeout { what, .. } if *what == "transfer" => ErrorKind::Timeout,
            ClientError::Timeout { .. } => ErrorKind::Unavailable,
            ClientError::Refused { kind, .. } => *kind,
            ClientError::Forked { .. } | ClientError::Closed => ErrorKind::Closed,
            ClientError::Cuda(e) => e.kind(),
            ClientError::ShareBadRange { .. }
            | ClientError::ShareNotMapped { .. }
            | ClientError::ShareUnsupported { .. }
            | ClientError::ShareSystem { .. }
            | ClientError::ShareProc(_) => ErrorKind::Registration,
            ClientError::Runtime(_) => ErrorKind::Internal,
        }
    }
}
