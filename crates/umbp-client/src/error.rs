//! The client's one error type.

use std::time::Duration;

use thiserror::Error;
use umbp_cuda::CudaError;
use umbp_proto::ProtoError;

use crate::host_share::HostShareError;

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
    /// The server refused the request; the message says why and what to change.
    #[error("the UMBP server refused {call}: {message} ({code})")]
    Refused {
        /// The call.
        call: &'static str,
        /// The gRPC status code's name.
        code: String,
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
    /// Host memory could not be shared.
    #[error(transparent)]
    HostShare(#[from] HostShareError),
    /// Local I/O (runtime, side channel) failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl ClientError {
    /// Whether the server (or the connection to it) is what failed, rather than the request.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            ClientError::Unreachable { .. }
                | ClientError::Disconnected { .. }
                | ClientError::Timeout { .. }
                | ClientError::Stalled { .. }
        )
    }
}
