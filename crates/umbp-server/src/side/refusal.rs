//! How the side channel refuses a connection: the refusal (its kind and why) written back, and
//! a rate-limited warning.

use std::io::Write;

use umbp_core::ErrorKind;

use crate::ratelog::RateLimited;

static REFUSED: RateLimited = RateLimited::new();

/// Writes the refusal of kind `kind` (see [`umbp_proto::errors::encode_refusal`]) to `s`.
pub(crate) fn refuse(mut s: &std::os::unix::net::UnixStream, kind: ErrorKind, why: &str) {
    REFUSED.log(|skipped| tracing::warn!(skipped, "descriptor side channel: refused: {why}"));
    let _ = s.write_all(&umbp_proto::errors::encode_refusal(kind, why));
}
