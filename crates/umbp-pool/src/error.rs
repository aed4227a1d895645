use thiserror::Error;
use umbp_core::CoreError;
use umbp_core::ErrorKind;

/// Errors of the host-DRAM pool.
#[derive(Debug, Error)]
pub enum PoolError {
    /// A configuration option is invalid.
    #[error(transparent)]
    Config(#[from] CoreError),
    /// The kernel refused the memory.
    #[error("could not map {bytes} bytes of pool memory ({what}): {source}; lower capacity_bytes or free memory")]
    Map {
        /// How many bytes were asked for.
        bytes: u64,
        /// Which call failed.
        what: &'static str,
        /// The system error.
        source: std::io::Error,
    },
    /// The pool has no room for the object, even after evicting everything it may evict.
    #[error("pool full: no room for an object of {requested} bytes (pool capacity {capacity}, {pinned_or_writing} bytes pinned or being written); retry later")]
    Full {
        /// Bytes requested.
        requested: u64,
        /// Usable capacity.
        capacity: u64,
        /// Bytes held by pinned objects and open reservations.
        pinned_or_writing: u64,
    },
    /// The object can never fit.
    #[error("an object of {requested} bytes can never fit in this pool (largest possible object {max} bytes); raise capacity_bytes")]
    TooLarge {
        /// Bytes requested.
        requested: u64,
        /// The largest object the pool can hold.
        max: u64,
    },
    /// A thread the pool needs could not be started.
    #[error("could not start the pool's {thread} thread: {source}; the process is at its thread or memory limit (check `ulimit -u` and the container's pids limit)")]
    Spawn {
        /// The thread.
        thread: &'static str,
        /// The system error.
        source: std::io::Error,
    },
    /// A client's shared-memory descriptor cannot be mapped by the server (see
    /// [`crate::shared_fd`]); the reason says what the client must change.
    #[error("cannot map the client's shared memory: {reason}")]
    SharedFd {
        /// What is wrong, and what to change.
        reason: String,
    },
    /// The pool was closed.
    #[error("the pool is closed")]
    Closed,
    /// A handed-over pool (memory and image) that this pool cannot take over.
    #[error("cannot take the pool over: {reason}")]
    Image {
        /// Why, and what to change.
        reason: String,
    },
}

impl PoolError {
    /// The error's kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            PoolError::Config(e) => e.kind(),
            PoolError::TooLarge { .. } => ErrorKind::InvalidArgument,
            PoolError::Map { .. } => ErrorKind::Resource,
            PoolError::Full { .. } => ErrorKind::PoolFull,
            PoolError::Spawn { .. } => ErrorKind::Internal,
            PoolError::SharedFd { .. } => ErrorKind::Registration,
            PoolError::Closed => ErrorKind::Closed,
            PoolError::Image { .. } => ErrorKind::InvalidArgument,
        }
    }
}
