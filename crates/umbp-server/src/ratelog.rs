//! Log lines that clients can cause, at most one a second per kind: a flood of bad
//! connections or requests must not fill the disk (a loop on `EMFILE` once wrote 400,000 lines
//! a second). The lines skipped are counted into the next one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// One kind of line, limited to one a second.
pub(crate) struct RateLimited {
    last: Mutex<Option<Instant>>,
    skipped: AtomicU64,
}

impl RateLimited {
    pub(crate) const fn new() -> Self {
        RateLimited {
            last: Mutex::new(None),
            skipped: AtomicU64::new(0),
        }
    }

    /// Calls `log` with the number of lines skipped since the last one, unless a line of this
    /// kind was logged less than a second ago (then only counts it).
    pub(crate) fn log(&self, log: impl FnOnce(u64)) {
        let now = Instant::now();
        {
            let mut last = self.last.lock();
            if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
                self.skipped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            *last = Some(now);
        }
        log(self.skipped.swap(0, Ordering::Relaxed));
    }
}

/// How long an accept loop waits after a failed `accept` (out of descriptors, say) before it
/// tries again, instead of spinning.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_and_the_rest_counted() {
        let r = RateLimited::new();
        let mut lines = Vec::new();
        for _ in 0..1000 {
            r.log(|skipped| lines.push(skipped));
        }
        assert_eq!(lines, vec![0]);
        *r.last.lock() = Some(Instant::now() - Duration::from_secs(2));
        r.log(|skipped| lines.push(skipped));
        assert_eq!(lines, vec![0, 999]);
    }
}
