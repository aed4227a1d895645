use thiserror::Error;
use umbp_core::CoreError;
use umbp_core::ErrorKind;
use umbp_pool::PoolError;

/// Errors of the copy engine.
#[derive(Debug, Error)]
pub enum CopyError {
    /// Bad input from the caller (layout, block ids, hashes).
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A memory registration is malformed or collides with another.
    #[error("cannot register memory {addr:#x}+{len}: {reason}")]
    BadRegistration {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// What is wrong.
        reason: String,
    },
    /// No registration with this id.
    #[error(
        "no memory registration with id {0}; it was never registered or was already deregistered"
    )]
    UnknownRegion(u64),
    /// A registration is still used by transfers in flight.
    #[error("memory registration {id} is still used by {in_flight} transfer(s) in flight; wait for them or cancel them before deregistering")]
    RegionBusy {
        /// The registration.
        id: u64,
        /// Jobs holding it.
        in_flight: usize,
    },
    /// A job did not finish in time.
    #[error("transfer did not finish within {ms} ms; it is still running (poll, wait again or cancel it)")]
    Timeout {
        /// The deadline in milliseconds.
        ms: u64,
    },
    /// The engine is shut down.
    #[error("the copy engine is closed")]
    Closed,
    /// A worker thread could not be started.
    #[error("could not start copy worker thread {thread}: {source}; the process is at its thread or memory limit (check `ulimit -u` and the container's pids limit, or lower num_workers)")]
    Spawn {
        /// The thread.
        thread: String,
        /// The system error.
        source: std::io::Error,
    },
    /// Arguments do not fit together.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

impl CopyError {
    /// The error's kind. A pool failure inside a transfer fails the transfer
    /// ([`ErrorKind::TransferFailed`]) unless the pool was full or closed.
    pub fn kind(&self) -> ErrorKind {
        match self {
            CopyError::Core(e) => e.kind(),
            CopyError::Pool(p) => match p.kind() {
                k @ (ErrorKind::PoolFull | ErrorKind::Closed) => k,
                _ => ErrorKind::TransferFailed,
            },
            CopyError::BadRegistration { .. }
            | CopyError::UnknownRegion(_)
            | CopyError::RegionBusy { .. } => ErrorKind::Registration,
            CopyError::Timeout { .. } => ErrorKind::Timeout,
            CopyError::Closed => ErrorKind::Closed,
            CopyError::Spawn { .. } => ErrorKind::Internal,
            CopyError::InvalidRequest(_) => ErrorKind::InvalidArgument,
        }
    }
}
