//! Watching a client's process through a pidfd: when it exits, its session ends even if its
//! connection lives on (inherited by a forked child, say). No pings.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;

use crate::sessions::{EndReason, Sessions};

/// `pidfd_open(2)`: a descriptor that becomes readable when process `pid` exits.
fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    Ok(umbp_unix::process::pidfd_open(pid)?)
}

/// Ends session `session` when process `pid` exits (or stops watching when the session ends
/// first). Without a pid (another pid namespace) or pidfds (kernels before 5.3), the
/// connection closing is what ends it.
pub(crate) fn watch(pid: u32, session: u64, sessions: Arc<Sessions>) {
    if pid == 0 {
        return;
    }
    let registered = pidfd_open(pid).and_then(|fd| {
        // SAFETY: an OwnedFd stays open, and is the same descriptor, for as long as the
        // AsyncFd that owns it lives.
        unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| std::io::Error::other(e.to_string()))
    });
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::debug!(
                pid,
                "no pidfd ({e}); the session ends when its connection closes"
            );
            return;
        }
    };
    let Some(cs) = sessions.get_any(session) else {
        return;
    };
    tokio::spawn(async move {
        tokio::select! {
            r = fd.readable() => {
                if r.is_ok() {
                    tracing::debug!(pid, session, fd = fd.get_ref().as_raw_fd(), "client process exited");
                    sessions.end(session, EndReason::ProcessExited);
                }
            }
            _ = cs.ended.notified() => {}
        }
    });
}
