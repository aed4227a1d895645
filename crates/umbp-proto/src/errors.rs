//! How a failure's [`ErrorKind`] crosses each transport, written once for both ends:
//!
//! * gRPC: [`status`] makes the server's status (the code follows the kind; the kind itself
//!   rides in the status details as an [`v1::ErrorDetail`]); [`kind_of_status`] reads it back,
//!   falling back to the code for statuses the server did not make (a broken connection).
//! * transfer channel: a [`v1::ChannelReply`] carries `code`, `message` and `kind`
//!   ([`channel_error`], [`kind_of_channel_reply`]).
//! * descriptor side channel: a refusal is [`FD_REFUSED`], the kind as a little-endian `u32`,
//!   then the message ([`encode_refusal`], [`decode_refusal`]).

use prost::Message;
use tonic::{Code, Status};
use umbp_core::ErrorKind;

use crate::{v1, FD_REFUSED};

/// The gRPC code a kind is sent with (for tools that read only codes).
pub fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::PoolFull | ErrorKind::Resource => Code::ResourceExhausted,
        ErrorKind::Registration | ErrorKind::SessionLost | ErrorKind::Device => {
            Code::FailedPrecondition
        }
        ErrorKind::Unavailable | ErrorKind::Closed => Code::Unavailable,
        ErrorKind::Timeout => Code::DeadlineExceeded,
        ErrorKind::Denied => Code::PermissionDenied,
        ErrorKind::DeviceLost | ErrorKind::TransferFailed | ErrorKind::Internal => Code::Internal,
    }
}

/// The status of a failure of kind `kind`: its code follows the kind, its details carry it.
pub fn status(kind: ErrorKind, message: impl Into<String>) -> Status {
    let detail = v1::ErrorDetail { kind: kind.code() }.encode_to_vec();
    Status::with_details(code_of(kind), message.into(), detail.into())
}

/// The kind of a status: the one its details carry, else (a status the server did not make:
/// the connection broke, the call was cancelled) the kind its code suggests.
pub fn kind_of_status(s: &Status) -> ErrorKind {
    v1::ErrorDetail::decode(s.details())
        .ok()
        .and_then(|d| ErrorKind::from_code(d.kind))
        .unwrap_or_else(|| kind_of_code(s.code()))
}

/// The kind a bare gRPC code suggests (no details came with it).
fn kind_of_code(code: Code) -> ErrorKind {
    match code {
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted => {
            ErrorKind::Unavailable
        }
        Code::InvalidArgument | Code::OutOfRange | Code::AlreadyExists => {
            ErrorKind::InvalidArgument
        }
        Code::NotFound => ErrorKind::NotFound,
        Code::ResourceExhausted => ErrorKind::Resource,
        Code::DeadlineExceeded => ErrorKind::Unavailable,
        Code::PermissionDenied | Code::Unauthenticated | Code::Unimplemented => ErrorKind::Denied,
        Code::FailedPrecondition => ErrorKind::Registration,
        Code::Ok | Code::Internal | Code::DataLoss => ErrorKind::Internal,
    }
}

/// The channel reply that fails transfer `transfer_id` as a whole.
pub fn channel_error(
    transfer_id: u64,
    kind: ErrorKind,
    message: impl Into<String>,
) -> v1::ChannelReply {
    v1::ChannelReply {
        transfer_id,
        reply: None,
        code: code_of(kind) as i32,
        message: message.into(),
        kind: kind.code(),
    }
}

/// The kind of a channel reply that carries an error (`code` non-zero).
pub fn kind_of_channel_reply(r: &v1::ChannelReply) -> ErrorKind {
    ErrorKind::from_code(r.kind).unwrap_or_else(|| kind_of_code(Code::from_i32(r.code)))
}

/// A side-channel refusal: [`FD_REFUSED`], the kind, the message.
pub fn encode_refusal(kind: ErrorKind, message: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + message.len());
    b.extend_from_slice(&FD_REFUSED.to_le_bytes());
    b.extend_from_slice(&kind.code().to_le_bytes());
    b.extend_from_slice(message.as_bytes());
    b
}

/// The kind and message of side-channel answer `b` if it is a refusal (None: tickets).
pub fn decode_refusal(b: &[u8]) -> Option<(ErrorKind, String)> {
    let rest = b.strip_prefix(&FD_REFUSED.to_le_bytes()[..])?;
    let (kind, message) = match rest.split_first_chunk::<4>() {
        Some((k, m)) => (
            ErrorKind::from_code(u32::from_le_bytes(*k)).unwrap_or(ErrorKind::Internal),
            m,
        ),
        None => (ErrorKind::Internal, rest),
    };
    Some((kind, String::from_utf8_lossy(message).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_each_transport() {
        for k in ErrorKind::ALL {
            let s = status(k, "why");
            assert_eq!(kind_of_status(&s), k, "gRPC");
            assert_eq!(s.message(), "why");
            let frame = channel_error(7, k, "why").encode_to_vec();
            let r = v1::ChannelReply::decode(frame.as_slice()).unwrap();
            assert_eq!(
                (kind_of_channel_reply(&r), r.transfer_id),
                (k, 7),
                "channel"
            );
            assert_ne!(r.code, 0, "an error reply has a code");
            assert_eq!(
                decode_refusal(&encode_refusal(k, "why")),
                Some((k, "why".to_string())),
                "side channel"
            );
        }
    }

    #[test]
    fn statuses_without_details_read_by_code() {
        assert_eq!(
            kind_of_status(&Status::unavailable("connection refused")),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind_of_status(&Status::cancelled("")),
            ErrorKind::Unavailable
        );
        // The message is never read: these words mean nothing without a detail.
        assert_eq!(
            kind_of_status(&Status::failed_precondition("session 1 is not attached")),
            ErrorKind::Registration
        );
    }

    #[test]
    fn tickets_are_not_refusals() {
        assert_eq!(decode_refusal(&5u64.to_le_bytes()), None);
        assert_eq!(decode_refusal(&[]), None);
    }
}
