//! The remote tier's one error type: what can go wrong while setting it up. Once running,
//! its operations never fail the caller; they miss.

use thiserror::Error;
use umbp_core::ErrorKind;

/// Errors of the remote tier's set-up (its operations never fail the caller: they miss).
#[derive(Debug, Error)]
pub enum RemoteError {
    /// `remote_url` cannot be used.
    #[error("remote_url {url:?}: {why}")]
    Url {
        /// The URL, password redacted.
        url: String,
        /// What is wrong and what to write instead.
        why: String,
    },
    /// Another setting is out of range.
    #[error("{name}: {why}")]
    Setting {
        /// The option's name.
        name: &'static str,
        /// What to change.
        why: String,
    },
    /// The Redis client refused the configuration.
    #[error("the Redis client refused the remote tier's configuration: {0}")]
    Client(String),
    /// A thread could not be started.
    #[error("cannot start the remote tier's {what} thread: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

impl RemoteError {
    /// The error's kind: a thread that cannot start is [`ErrorKind::Internal`]; the rest are
    /// settings to change ([`ErrorKind::InvalidArgument`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            RemoteError::Thread { .. } => ErrorKind::Internal,
            RemoteError::Url { .. } | RemoteError::Setting { .. } | RemoteError::Client(_) => {
                ErrorKind::InvalidArgument
            }
        }
    }
}
