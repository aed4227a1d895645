//! How the side channel refuses a connection: the refusal (its kind and why) written back, and
//! a rate-limited warning.

use std::io::Write;

use umbp_core::ErrorKind;

use crate::ratelog::RateLimited;

static REFUSED: RateLimited = RateLimited::new();

/// Writes the refusal of kind `kind` (see [`umbp_proto::errors::encode_refusal`]) to `s`,
/// then ends the stream so that the client reads it: what the client sent and the server did
/// not read is drained first (a socket closed with unread bytes is reset, and the client would
/// see "connection reset" instead of the reason). Descriptors in it are closed unread.
pub(crate) fn refuse(mut s: &std::os::unix::net::UnixStream, kind: ErrorKind, why: &str) {
    REFUSED.log(|skipped| tracing::warn!(skipped, "descriptor side channel: refused: {why}"));
    let _ = s.write_all(&umbp_proto::errors::encode_refusal(kind, why));
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut b = [0u8; 4096];
    for _ in 0..16 {
        match umbp_unix::socket::recv_nowait(s, &mut b, false) {
            Ok(1..) => {}
            _ => break,
        }
    }
}
