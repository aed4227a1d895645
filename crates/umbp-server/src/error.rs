//! The server's one error type.

use std::path::PathBuf;

use thiserror::Error;
use umbp_core::CoreError;
use umbp_store::StoreError;

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

impl ServerError {
    /// The error's kind.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        use umbp_core::ErrorKind;
        match self {
            ServerError::Config(_) => ErrorKind::InvalidArgument,
            ServerError::Bind { .. } | ServerError::LiveServer(_) => ErrorKind::InvalidArgument,
            ServerError::Store(e) => e.kind(),
            ServerError::Serve(_) => ErrorKind::Internal,
        }
    }
}

impl From<CoreError> for ServerError {
    fn from(e: CoreError) -> Self {
        ServerError::Config(e.to_string())
    }
}
