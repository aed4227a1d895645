//! How the server refuses: a store error's status (its kind in the details), and the checks
//! of wire input shared by several requests.

use tonic::Status;
use umbp_core::{BlockKey, ErrorKind};
use umbp_proto::errors::status;
use umbp_proto::KEY_BYTES;
use umbp_store::StoreError;

/// The gRPC status of a store error: its kind (in the details, and as the code), and the
/// message that says what to change. A released session is the client's lost session.
pub(crate) fn status_of(e: &StoreError) -> Status {
    let kind = match e {
        StoreError::SessionReleased(_) => ErrorKind::SessionLost,
        e => e.kind(),
    };
    status(kind, e.to_string())
}

pub(crate) fn invalid(msg: impl Into<String>) -> Status {
    status(ErrorKind::InvalidArgument, msg)
}

/// Splits packed 64-byte keys.
pub(crate) fn unpack_keys(b: &[u8], what: &str) -> Result<Vec<BlockKey>, Status> {
    if !b.len().is_multiple_of(KEY_BYTES) {
        return Err(invalid(format!(
            "{what}: {} bytes is not a whole number of {KEY_BYTES}-byte keys",
            b.len()
        )));
    }
    Ok(b.chunks_exact(KEY_BYTES)
        .map(|c| BlockKey::from_bytes(c.try_into().expect("64 bytes")))
        .collect())
}
