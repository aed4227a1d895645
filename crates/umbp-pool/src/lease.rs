//! Lookup leases: a hit a lookup reports stays loadable until its load, or until its lease
//! runs out (then it is counted as expired).
//!
//! Each lookup that reports a key as a hit takes one lease on its object; each load of the
//! key ([`crate::Pool::get`]) gives one back. An object with leases is skipped by every
//! eviction (the background evictor, a full pool's reservation, the whole-segment fallback)
//! until its last lease is given back or the newest runs out, `lookup_lease_ms` after the
//! last lookup that took one. Leases never pin for long: they are bounded in time, and the
//! bytes of leased objects in [`LeaseBook::max_bytes`] (half the pool): a lease past that is
//! refused, and the lookup reports a miss for that key instead of a hit it cannot promise.
//! A removed object's leases end with it (`evict`, `clear`: the caller's choice).
//!
//! Leases that run out are counted when they do: by the background evictor's sweep (every
//! 100 ms at most), or earlier when the object is loaded, looked up or evicted. Leases are
//! kept per index shard beside its entries ([`Leases`]); the counters and the clock are the
//! pool's ([`LeaseBook`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use std::collections::HashMap;

/// The pool-wide side of leases: how long they last, their bound, the clock and counters.
#[derive(Debug)]
pub(crate) struct LeaseBook {
    /// How long a lease lasts, in milliseconds; 0: lookups take no leases.
    pub ms: u64,
    /// Bytes of leased objects may not pass this.
    pub max_bytes: u64,
    epoch: Instant,
    /// Added to the clock (tests move it on instead of waiting).
    skew_ms: AtomicU64,
    /// Bytes of the objects that hold leases now (expired ones until they are counted).
    pub bytes: AtomicU64,
    /// Leases outstanding (neither given back, expired nor ended).
    pub active: AtomicU64,
    pub granted: AtomicU64,
    pub released: AtomicU64,
    pub expired: AtomicU64,
    pub refused: AtomicU64,
    pub ended: AtomicU64,
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn sub(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}

impl LeaseBook {
    pub fn new(ms: u64, max_bytes: u64) -> LeaseBook {
        LeaseBook {
            ms,
            max_bytes,
            epoch: Instant::now(),
            skew_ms: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            active: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            released: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            ended: AtomicU64::new(0),
        }
    }

    /// Whether lookups take leases.
    pub fn on(&self) -> bool {
        self.ms > 0
    }

    /// The lease clock, in milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + self.skew_ms.load(Ordering::Relaxed)
    }

    /// Moves the clock on by `ms` (tests).
    pub fn advance(&self, ms: u64) {
        add(&self.skew_ms, ms);
    }

    /// Whether any object holds a lease (or an expired one not yet counted).
    pub fn any(&self) -> bool {
        self.bytes.load(Ordering::Relaxed) > 0
    }

    /// Takes `len` bytes under the bound; false when they do not fit.
    fn take_bytes(&self, len: u64) -> bool {
        let mut cur = self.bytes.load(Ordering::Relaxed);
        loop {
            if cur + len > self.max_bytes {
                return false;
            }
            match self.bytes.compare_exchange_weak(
                cur,
                cur + len,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    /// Leases outstanding on the object.
    count: u32,
    /// Grants on this record so far (wrapping): tells [`Leases::take_back`] whether another
    /// grant came after the one it undoes.
    seq: u32,
    /// When the newest runs out (lease clock).
    until: u64,
    /// The object's bytes.
    len: u64,
}

/// What one [`Leases::grant`] changed, so that [`Leases::take_back`] can undo exactly it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    /// The record's expiry before this grant extended it.
    prev_until: u64,
    /// The record's `seq` this grant left.
    seq: u32,
}

/// One index shard's leases, by entry id. Callers hold the shard's lock.
#[derive(Debug)]
pub(crate) struct Leases {
    map: HashMap<u32, Lease>,
    book: Arc<LeaseBook>,
}

impl Leases {
    pub fn new(book: Arc<LeaseBook>) -> Leases {
        Leases {
            map: HashMap::new(),
            book,
        }
    }

    /// Whether entry `idx` is protected from eviction now.
    #[inline]
    pub fn holds(&self, idx: u32) -> bool {
        if self.map.is_empty() {
            return false;
        }
        self.map
            .get(&idx)
            .is_some_and(|l| l.until > self.book.now_ms())
    }

    /// Counts the leases of `idx` as expired and drops them, when they ran out by `now`;
    /// whether they had.
    fn expire_if_due(&mut self, idx: u32, now: u64) -> bool {
        let Some(l) = self.map.get(&idx).copied() else {
            return false;
        };
        if l.until > now {
            return false;
        }
        self.map.remove(&idx);
        self.forget(l, &self.book.expired);
        true
    }

    /// Drops the book's count of a lease record, adding its leases to `to`.
    fn forget(&self, l: Lease, to: &AtomicU64) {
        let b = &self.book;
        add(to, u64::from(l.count));
        sub(&b.active, u64::from(l.count));
        sub(&b.bytes, l.len);
    }

    /// Takes one lease on `idx` (an object of `len` bytes); `None` when the bound on leased
    /// bytes refuses it (counted).
    pub fn grant(&mut self, idx: u32, len: u64) -> Option<Grant> {
        let b = Arc::clone(&self.book);
        let now = b.now_ms();
        self.expire_if_due(idx, now);
        let until = now + b.ms;
        let grant = if let Some(l) = self.map.get_mut(&idx) {
            let g = Grant {
                prev_until: l.until,
                seq: l.seq.wrapping_add(1),
            };
            l.count += 1;
            l.seq = g.seq;
            l.until = until;
            g
        } else {
            if !b.take_bytes(len) {
                add(&b.refused, 1);
                return None;
            }
            self.map.insert(
                idx,
                Lease {
                    count: 1,
                    seq: 0,
                    until,
                    len,
                },
            );
            Grant {
                prev_until: 0,
                seq: 0,
            }
        };
        add(&b.granted, 1);
        add(&b.active, 1);
        Some(grant)
    }

    /// Takes back the lease `g` that [`Leases::grant`] gave on `idx` (the lookup did not
    /// report the key after all): as if it had never been granted, so the record's expiry
    /// goes back to what it was unless another grant has extended it since.
    pub fn take_back(&mut self, idx: u32, g: Grant) {
        let Some(l) = self.map.get_mut(&idx) else {
            return;
        };
        if l.seq == g.seq {
            l.until = g.prev_until;
        }
        l.count -= 1;
        let l = *l;
        let b = &self.book;
        sub(&b.granted, 1);
        sub(&b.active, 1);
        if l.count == 0 {
            self.map.remove(&idx);
            sub(&b.bytes, l.len);
        }
    }

    /// A load of `idx` uses one of its leases (counted as given back), unless they ran out.
    pub fn release(&mut self, idx: u32) {
        if self.map.is_empty() {
            return;
        }
        let now = self.book.now_ms();
        if self.expire_if_due(idx, now) {
            return;
        }
        let Some(l) = self.map.get_mut(&idx) else {
            return;
        };
        l.count -= 1;
        let l = *l;
        let b = &self.book;
        add(&b.released, 1);
        sub(&b.active, 1);
        if l.count == 0 {
            self.map.remove(&idx);
            sub(&b.bytes, l.len);
        }
    }

    /// Entry `idx` leaves the index: its leases end (counted as expired when they had run
    /// out, else as ended).
    pub fn end(&mut self, idx: u32) {
        if self.map.is_empty() {
            return;
        }
        let now = self.book.now_ms();
        if self.expire_if_due(idx, now) {
            return;
        }
        if let Some(l) = self.map.remove(&idx) {
            self.forget(l, &self.book.ended);
        }
    }

    /// Counts and drops every lease that ran out.
    pub fn sweep(&mut self) {
        if self.map.is_empty() {
            return;
        }
        let now = self.book.now_ms();
        let book = Arc::clone(&self.book);
        self.map.retain(|_, l| {
            if l.until > now {
                return true;
            }
            add(&book.expired, u64::from(l.count));
            sub(&book.active, u64::from(l.count));
            sub(&book.bytes, l.len);
            false
        });
    }

    /// Bytes of metadata.
    pub fn metadata_bytes(&self) -> usize {
        self.map.capacity() * (std::mem::size_of::<Lease>() + 5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_given_back_by_loads_and_expire_counted() {
        let book = Arc::new(LeaseBook::new(1000, 100));
        let mut l = Leases::new(Arc::clone(&book));
        assert!(l.grant(1, 40).is_some());
        assert!(l.grant(1, 40).is_some());
        assert!(l.grant(2, 40).is_some());
        // 120 bytes would pass the bound of 100: refused.
        assert!(l.grant(3, 40).is_none());
        assert!(l.holds(1) && l.holds(2) && !l.holds(3));
        l.release(1);
        assert!(l.holds(1), "one lease of two given back");
        l.release(1);
        assert!(!l.holds(1));
        book.advance(1000);
        assert!(!l.holds(2), "ran out");
        l.sweep();
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(
            (
                g(&book.granted),
                g(&book.released),
                g(&book.expired),
                g(&book.refused)
            ),
            (3, 2, 1, 1)
        );
        assert_eq!((g(&book.active), g(&book.bytes)), (0, 0));
        // A lease taken back leaves no trace; one ended with its object counts as ended.
        let grant = l.grant(4, 10).unwrap();
        l.take_back(4, grant);
        assert!(l.grant(5, 10).is_some());
        l.end(5);
        assert_eq!((g(&book.granted), g(&book.ended)), (4, 1));
        assert_eq!((g(&book.active), g(&book.bytes)), (0, 0));
    }

    /// A prefix lookup leases past its first refused key and takes those leases back: the
    /// expiry of an object leased before must be what it was, or a load after that earlier
    /// lease ran out would still find it leased (found by tests/lease_model.rs).
    #[test]
    fn a_lease_taken_back_leaves_the_earlier_expiry() {
        let book = Arc::new(LeaseBook::new(1000, 1000));
        let mut l = Leases::new(Arc::clone(&book));
        assert!(l.grant(1, 10).is_some()); // runs out at 1000
        book.advance(500);
        let later = l.grant(1, 10).unwrap(); // would run out at 1500
        l.take_back(1, later);
        book.advance(500);
        assert!(!l.holds(1), "the first lease ran out at 1000");
        // Undone after another grant extended it: that grant's expiry stays.
        let mut l = Leases::new(Arc::clone(&book));
        let first = l.grant(2, 10).unwrap();
        book.advance(100);
        assert!(l.grant(2, 10).is_some());
        l.take_back(2, first);
        book.advance(950);
        assert!(
            l.holds(2),
            "the second grant's lease runs until 1050 after it"
        );
    }
}
