//! The standalone server's gRPC API and the conventions both ends share.
//!
//! The service is generated from `proto/umbp/v1/store.proto` at build time by protox and
//! tonic-prost-build (no `protoc` needed). Besides the generated types this crate holds what
//! the server and its clients must agree on: the protocol version, how an endpoint is written
//! ([`Endpoint::parse`]), where the descriptor side channel lives, and the side channel's
//! message format.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

pub mod channel;
pub mod completion;
pub mod counters;
pub mod errors;
pub mod outcomes;
pub mod peer;

use thiserror::Error;
use umbp_core::ErrorKind;

/// The generated messages, client and server of `umbp.v1`.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod v1 {
    tonic::include_proto!("umbp.v1");
}

/// Version of the protocol (bumped on incompatible changes; the server refuses other versions
/// at attach). 2: every refusal carries its [`umbp_core::ErrorKind`] (see [`errors`]). 3: a
/// key's status may be `KEY_STATUS_SKIPPED` (the store admission kept no copy), which a
/// protocol-2 client would refuse as malformed. 4: a store may ask to be kept on first sighting
/// (`TransferRequest.admit_now`), which a protocol-3 server would silently ignore.
pub const PROTOCOL: u32 = 4;

/// Bytes of a block key on the wire.
pub const KEY_BYTES: usize = 64;

/// The endpoint the server listens on and the tools connect to when none is given.
pub use umbp_core::address::DEFAULT_ENDPOINT;

/// Largest gRPC message either end accepts by default (a transfer of 65,536 keys is 4 MiB of
/// keys and 512 KiB of block ids).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Bytes of a session's side-channel secret.
pub const SECRET_BYTES: usize = 16;

/// Most descriptors one side-channel message carries.
pub const MAX_FDS_PER_MESSAGE: usize = 64;

/// Errors of endpoint parsing and the side channel's wire format.
#[derive(Debug, Error)]
pub enum ProtoError {
    /// The endpoint is not a Unix socket address (`umbp_core::address::socket_path` says why).
    #[error(transparent)]
    Endpoint(#[from] umbp_core::CoreError),
    /// A side-channel message is malformed.
    #[error("descriptor side channel: {0}")]
    SideChannel(String),
    /// A completion page's memory does not fit the format.
    #[error("completion page: {0}")]
    CompletionPage(String),
}

impl ProtoError {
    /// The error's kind: always [`ErrorKind::InvalidArgument`] (a malformed endpoint or
    /// message).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }
}

/// Where the server listens: a Unix-domain socket, and beside it the descriptor side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    path: PathBuf,
}

impl Endpoint {
    /// Parses `unix:///abs/path` or `/abs/path` ([`umbp_core::address::socket_path`], the one
    /// endpoint parser). TCP addresses and relative paths are refused: the server is
    /// node-local, and descriptors and peer credentials need a Unix socket.
    pub fn parse(s: &str) -> Result<Self, ProtoError> {
        let path = umbp_core::address::socket_path(s)?;
        Ok(Endpoint {
            path: PathBuf::from(path),
        })
    }

    /// The gRPC socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptor side channel's path: the socket's path with `.fds` appended.
    pub fn fd_socket(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".fds");
        PathBuf::from(p)
    }

    /// `unix://` and the path.
    pub fn uri(&self) -> String {
        format!("unix://{}", self.path.display())
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unix://{}", self.path.display())
    }
}

/// The side channel's request header: the session, its secret and how many descriptors ride
/// along (in one `SCM_RIGHTS` control message). The reply is one little-endian `u64` ticket
/// per descriptor, or, when refused, `u64::MAX` followed by a UTF-8 message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdHeader {
    /// The session the descriptors are for.
    pub session_id: u64,
    /// The session's secret from `AttachReply`.
    pub secret: [u8; SECRET_BYTES],
    /// Descriptors attached; 0 (and none attached) turns the connection into the session's
    /// transfer channel (see [`channel`]).
    pub count: u32,
}

impl FdHeader {
    /// Bytes of an encoded header.
    pub const BYTES: usize = 8 + SECRET_BYTES + 4;

    /// Little-endian encoding.
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&self.session_id.to_le_bytes());
        b[8..8 + SECRET_BYTES].copy_from_slice(&self.secret);
        b[8 + SECRET_BYTES..].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Decodes a header, refusing a wrong length or descriptor count.
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        if b.len() != Self::BYTES {
            return Err(ProtoError::SideChannel(format!(
                "header has {} bytes, expected {}",
                b.len(),
                Self::BYTES
            )));
        }
        let mut secret = [0u8; SECRET_BYTES];
        secret.copy_from_slice(&b[8..8 + SECRET_BYTES]);
        let count = u32::from_le_bytes(b[8 + SECRET_BYTES..].try_into().expect("4 bytes"));
        if count as usize > MAX_FDS_PER_MESSAGE {
            return Err(ProtoError::SideChannel(format!(
                "{count} descriptors announced; send 1 to {MAX_FDS_PER_MESSAGE} per message (0 opens a transfer channel)"
            )));
        }
        Ok(FdHeader {
            session_id: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            secret,
            count,
        })
    }
}

/// The ticket value that marks a refused side-channel request.
pub const FD_REFUSED: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_unix_paths_only() {
        let e = Endpoint::parse("unix:///run/umbp/node.grpc.sock").unwrap();
        assert_eq!(e.path(), Path::new("/run/umbp/node.grpc.sock"));
        assert_eq!(e.fd_socket(), PathBuf::from("/run/umbp/node.grpc.sock.fds"));
        assert_eq!(e, Endpoint::parse("/run/umbp/node.grpc.sock").unwrap());
        assert_eq!(e.to_string(), "unix:///run/umbp/node.grpc.sock");
        for bad in [
            "",
            "tcp://127.0.0.1:5000",
            "http://h:1",
            "relative.sock",
            "unix://x.sock",
            "unix://",
            "/dir/",
        ] {
            let err = Endpoint::parse(bad).unwrap_err().to_string();
            assert!(err.contains("absolute socket path"), "{bad}: {err}");
        }
        let long = format!("/{}", "a".repeat(110));
        assert!(Endpoint::parse(&long)
            .unwrap_err()
            .to_string()
            .contains("longer"));
    }

    #[test]
    fn fd_headers_round_trip_and_refuse_garbage() {
        let h = FdHeader {
            session_id: 7,
            secret: [3; SECRET_BYTES],
            count: 2,
        };
        assert_eq!(FdHeader::decode(&h.encode()).unwrap(), h);
        assert!(FdHeader::decode(&[0; 5]).is_err());
        // No descriptors: a transfer channel's opening.
        let mut zero = h;
        zero.count = 0;
        assert_eq!(FdHeader::decode(&zero.encode()).unwrap(), zero);
        let mut many = h;
        many.count = 1000;
        assert!(FdHeader::decode(&many.encode()).is_err());
    }
}
