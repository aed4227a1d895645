//! When a transfer's answer should come, so that its caller is awake for it.
//!
//! A caller waiting on the completion page sleeps on its futex and the server's copy worker
//! wakes it; on the H200 machine (a VM) the wake-up is a good part of the ~100 µs that a
//! transfer through the server took beyond the same copy in embedded mode. Knowing roughly
//! how long transfers of a layout take, the caller sleeps on the futex (any answer still wakes
//! it) until shortly before the answer is due, then watches the page word itself for a
//! moment, and goes back to sleeping on the futex if the answer is late.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Wake this long before the answer is due.
pub(crate) const EARLY: Duration = Duration::from_micros(150);
/// Watch the page at most this long past the due time, then sleep on the futex again.
pub(crate) const WATCH_PAST: Duration = Duration::from_micros(300);
/// Expect the answer a little sooner than the average says.
const OPTIMISM: f64 = 0.9;
/// Weight of a new transfer in the running average.
const ALPHA: f64 = 0.25;

/// What transfers are told apart by: layout, group, and whether a store.
pub(crate) type EtaKey = (u32, u32, bool);

/// Recent nanoseconds per key of a client's transfers, per [`EtaKey`].
#[derive(Debug, Default)]
pub(crate) struct TransferEta {
    ns_per_key: Mutex<HashMap<EtaKey, f64>>,
}

impl TransferEta {
    /// When a transfer of `keys` keys sent at `sent` should be answered (None: no transfer
    /// like it has been seen yet).
    pub(crate) fn due(&self, key: EtaKey, keys: usize, sent: Instant) -> Option<Instant> {
        let ns = *self.ns_per_key.lock().get(&key)?;
        Some(sent + Duration::from_nanos((ns * keys as f64 * OPTIMISM) as u64))
    }

    /// Notes that a transfer of `keys` keys was answered `took` after it was sent.
    pub(crate) fn answered(&self, key: EtaKey, keys: usize, took: Duration) {
        if keys == 0 {
            return;
        }
        let sample = took.as_nanos() as f64 / keys as f64;
        let mut m = self.ns_per_key.lock();
        let v = m.entry(key).or_insert(sample);
        *v = (1.0 - ALPHA) * *v + ALPHA * sample;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_follows_the_recent_transfers_of_the_same_kind() {
        let eta = TransferEta::default();
        let t0 = Instant::now();
        assert_eq!(eta.due((1, 0, true), 100, t0), None);
        eta.answered((1, 0, true), 100, Duration::from_micros(1000));
        let due = eta.due((1, 0, true), 100, t0).unwrap() - t0;
        assert!(due > Duration::from_micros(800) && due < Duration::from_micros(1000));
        // Twice the keys: twice the time; another layout or direction: not known.
        let due2 = eta.due((1, 0, true), 200, t0).unwrap() - t0;
        assert!(
            due2 > 2 * due - Duration::from_micros(2) && due2 < 2 * due + Duration::from_micros(2)
        );
        assert_eq!(eta.due((1, 0, false), 100, t0), None);
        assert_eq!(eta.due((2, 0, true), 100, t0), None);
        // Slower transfers move the estimate a quarter of the way each.
        eta.answered((1, 0, true), 100, Duration::from_micros(2000));
        let due3 = eta.due((1, 0, true), 100, t0).unwrap() - t0;
        assert!(due3 > due && due3 < Duration::from_micros(1200));
    }
}
