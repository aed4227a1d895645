//! The store's one error type.

use thiserror::Error;
use umbp_copy::{CopyError, RegionId};
use umbp_core::{CoreError, ErrorKind};
use umbp_cuda::CudaError;
use umbp_pool::PoolError;
use umbp_remote::RemoteError;

use crate::ids::{LayoutId, SessionId};

/// Errors of the store.
#[derive(Debug, Error)]
pub enum StoreError {
    /// Invalid configuration or input.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A copy failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// No layout with this id.
    #[error("no KV layout with id {0}; register the layout first")]
    UnknownLayout(LayoutId),
    /// A memory registration of another session was named.
    #[error("memory region {0} was registered by another session; a session uses and deregisters only its own registrations")]
    ForeignRegion(RegionId),
    /// The store was closed.
    #[error("the store is closed")]
    Closed,
    /// The session was released (its client detached or went away).
    #[error("session {0} was released; attach again")]
    SessionReleased(SessionId),
    /// The CUDA backend failed (or there is no CUDA).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The remote tier's configuration is unusable.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The disk tier cannot start.
    #[error(transparent)]
    Disk(#[from] umbp_disk::DiskError),
    /// Host memory to register is not mapped readable and writable in this process.
    #[error("cannot register host memory {addr:#x}+{len}: {reason}; pass the address and byte size of a live, writable allocation (e.g. a tensor's data_ptr() and its storage's nbytes())")]
    Unmapped {
        /// Start of the range.
        addr: u64,
        /// Bytes.
        len: u64,
        /// What is wrong with it.
        reason: String,
    },
}

impl StoreError {
    /// The error's kind. A released session is [`ErrorKind::Closed`] here; the server, whose
    /// sessions belong to clients, reports it to them as [`ErrorKind::SessionLost`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Core(e) => e.kind(),
            StoreError::Pool(e) => e.kind(),
            StoreError::Copy(e) => e.kind(),
            StoreError::Cuda(e) => e.kind(),
            StoreError::Remote(e) => e.kind(),
            StoreError::Disk(e) => e.kind(),
            StoreError::UnknownLayout(_) => ErrorKind::NotFound,
            StoreError::ForeignRegion(_) | StoreError::Unmapped { .. } => ErrorKind::Registration,
            StoreError::Closed | StoreError::SessionReleased(_) => ErrorKind::Closed,
        }
    }
}
