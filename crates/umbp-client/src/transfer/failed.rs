//! Transfers that failed as a whole: every key of one reads [`FailureKind::Server`], and the
//! client logs such failures at most once per [`LOG_EVERY`], with how many it did not log.
//!
//! A transfer fails as a whole when the server cannot take it (gone, restarting, or stalled
//! on an earlier transfer: the call then answers at once) or when the server went away (or
//! refused the transfer) before answering. Either way its keys failed, and that is what the
//! caller reads: a failed load is recomputed, a failed store is only a future miss. Only a
//! wait that runs out while the transfer is still pending is an error (its memory may still
//! be written).

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::{FailureKind, KeyOutcome};

/// How often, at most, the client logs failed transfers.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// Every key of a transfer of `keys` keys that failed as a whole saying `message`.
pub(crate) fn every_key_failed(keys: usize, message: &str) -> Vec<KeyOutcome> {
    vec![KeyOutcome::failed(FailureKind::Server, message); keys]
}

/// The client's log of transfers that failed as a whole.
#[derive(Debug, Default)]
pub(crate) struct FailureLog {
    /// When the last message was logged, and how many failures were not logged since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl FailureLog {
    /// Notes a transfer with the server at `endpoint` that failed as a whole with `message`:
    /// logged unless another was logged less than [`LOG_EVERY`] ago.
    pub(crate) fn note(&self, endpoint: &str, message: &str) {
        let skipped = {
            let mut s = self.state.lock();
            let now = Instant::now();
            if s.0.is_some_and(|last| now.duration_since(last) < LOG_EVERY) {
                s.1 += 1;
                return;
            }
            s.0 = Some(now);
            std::mem::take(&mut s.1)
        };
        let more = if skipped > 0 {
            format!(" ({skipped} more since the last message)")
        } else {
            String::new()
        };
        log::warn!(
            "umbp: transfers with the UMBP server at {endpoint} failed{more}: {message}; every key of such a transfer failed"
        );
    }

    /// Failures noted but not logged since the last message.
    #[cfg(test)]
    fn skipped(&self) -> u64 {
        self.state.lock().1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_fails_with_the_message() {
        let v = every_key_failed(3, "gone");
        assert_eq!(v.len(), 3);
        assert!(v.iter().all(|o| o
            .failure()
            .is_some_and(|f| f.kind == FailureKind::Server && f.message == "gone")));
    }

    #[test]
    fn failures_within_the_interval_are_counted_not_logged() {
        let log = FailureLog::default();
        log.note("unix:///x", "gone");
        log.note("unix:///x", "gone");
        log.note("unix:///x", "gone");
        assert_eq!(log.skipped(), 2);
    }
}
