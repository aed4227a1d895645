//! Kept objects: an object a caller asked to keep is skipped by every eviction until its keep
//! runs out or is released (the pins of agents' KV that pause between turns; the product's
//! `pin`). Not to be confused with [`crate::index::Entry::pins`], the count of copies reading
//! an object right now.
//!
//! A keep is a lease with a caller-chosen expiry: renewable (keeping a kept object again sets
//! its expiry anew), released by [`crate::Pool::release_kept`], ended with its object (an
//! explicit `evict`, `clear` or `clear_namespace`: the caller's choice). Keeps are bounded in
//! bytes per key namespace ([`KeepBook::per_namespace`]) and for the whole pool
//! ([`KeepBook::max_bytes`]), so that one tenant cannot keep the pool full: a keep past either
//! bound is refused and counted, and the object stays evictable.
//!
//! Keeps are kept per index shard beside its entries ([`Keeps`], under the shard's lock); the
//! bounds, the counters and the per-namespace bytes are the pool's ([`KeepBook`]), on the
//! lease clock ([`LeaseBook::now_ms`]), so tests move both on together.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use umbp_core::PinOutcome;

use crate::lease::{add, sub, LeaseBook};

umbp_core::counter_set! {
    /// Counters of kept objects (callers' pins).
    pub struct KeepStats: "pins" {
        /// Objects pinned now (expired ones until they are counted).
        gauge pinned: u64,
        /// Bytes of the objects pinned now.
        gauge pinned_bytes: u64,
        /// Pins of objects that were not pinned.
        counter granted: u64,
        /// Pins of objects that were pinned already (expiry set anew).
        counter renewed: u64,
        /// Pins released by their holder.
        counter released: u64,
        /// Pins that ran out.
        counter expired: u64,
        /// Pins refused by a bound (the namespace's or the pool's pinned bytes).
        counter refused: u64,
        /// Pins that ended with their object (evicted on request, or cleared).
        counter ended: u64,
    }
}

/// The pool-wide side of keeps: the bounds, the clock, the counters.
#[derive(Debug)]
pub(crate) struct KeepBook {
    /// Bytes one key namespace may keep.
    pub per_namespace: u64,
    /// Bytes every namespace together may keep.
    pub max_bytes: u64,
    clock: Arc<LeaseBook>,
    /// Kept bytes by namespace (taken on keeps and their ends only, never on lookups).
    by_namespace: Mutex<HashMap<[u8; 16], u64>>,
    bytes: AtomicU64,
    active: AtomicU64,
    granted: AtomicU64,
    renewed: AtomicU64,
    released: AtomicU64,
    expired: AtomicU64,
    refused: AtomicU64,
    ended: AtomicU64,
}

impl KeepBook {
    pub fn new(per_namespace: u64, max_bytes: u64, clock: Arc<LeaseBook>) -> KeepBook {
        KeepBook {
            per_namespace,
            max_bytes,
            clock,
            by_namespace: Mutex::new(HashMap::new()),
            bytes: AtomicU64::new(0),
            active: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            released: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            ended: AtomicU64::new(0),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Whether any object is kept (or an expired keep is not yet counted).
    pub fn any(&self) -> bool {
        self.active.load(Ordering::Relaxed) > 0
    }

    /// Takes `len` bytes for `ns` under both bounds; false (counted) when they do not fit.
    fn take(&self, ns: [u8; 16], len: u64) -> bool {
        let mut by = self.by_namespace.lock();
        let mine = by.get(&ns).copied().unwrap_or(0);
        let all = self.bytes.load(Ordering::Relaxed);
        if mine + len > self.per_namespace || all + len > self.max_bytes {
            add(&self.refused, 1);
            return false;
        }
        by.insert(ns, mine + len);
        add(&self.bytes, len);
        add(&self.active, 1);
        true
    }

    /// Gives back what [`KeepBook::take`] took, counting the keep's end in `to`.
    fn give(&self, k: &Kept, to: &AtomicU64) {
        let mut by = self.by_namespace.lock();
        if let Some(b) = by.get_mut(&k.ns) {
            *b -= k.len.min(*b);
            if *b == 0 {
                by.remove(&k.ns);
            }
        }
        sub(&self.bytes, k.len);
        sub(&self.active, 1);
        add(to, 1);
    }

    /// Kept bytes of namespace `ns` now.
    pub fn namespace_bytes(&self, ns: &[u8; 16]) -> u64 {
        self.by_namespace.lock().get(ns).copied().unwrap_or(0)
    }

    pub fn stats(&self) -> KeepStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        KeepStats {
            pinned: r(&self.active),
            pinned_bytes: r(&self.bytes),
            granted: r(&self.granted),
            renewed: r(&self.renewed),
            released: r(&self.released),
            expired: r(&self.expired),
            refused: r(&self.refused),
            ended: r(&self.ended),
        }
    }
}

/// The pins of one key namespace, as `umbp pins` lists them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NamespacePins {
    /// The namespace's id (the first 16 bytes of its keys: `KeyBuilder::namespace_id`).
    pub namespace_id: [u8; 16],
    /// Objects pinned now.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Milliseconds until the soonest of them runs out.
    pub soonest_ms: u64,
    /// Milliseconds until the last of them runs out.
    pub latest_ms: u64,
}

#[derive(Debug, Clone, Copy)]
struct Kept {
    /// When it runs out (lease clock).
    until: u64,
    len: u64,
    ns: [u8; 16],
}

/// One index shard's kept objects, by entry id. Callers hold the shard's lock.
#[derive(Debug)]
pub(crate) struct Keeps {
    map: HashMap<u32, Kept>,
    book: Arc<KeepBook>,
}

impl Keeps {
    pub fn new(book: Arc<KeepBook>) -> Keeps {
        Keeps {
            map: HashMap::new(),
            book,
        }
    }

    /// Whether entry `idx` is kept now.
    #[inline]
    pub fn holds(&self, idx: u32) -> bool {
        if self.map.is_empty() {
            return false;
        }
        self.map
            .get(&idx)
            .is_some_and(|k| k.until > self.book.now_ms())
    }

    /// Adds this shard's live keeps to `out`, by namespace.
    pub fn summarize(&self, out: &mut HashMap<[u8; 16], NamespacePins>) {
        let now = self.book.now_ms();
        for k in self.map.values().filter(|k| k.until > now) {
            let left = k.until - now;
            let e = out.entry(k.ns).or_insert(NamespacePins {
                namespace_id: k.ns,
                soonest_ms: u64::MAX,
                ..NamespacePins::default()
            });
            e.objects += 1;
            e.bytes += k.len;
            e.soonest_ms = e.soonest_ms.min(left);
            e.latest_ms = e.latest_ms.max(left);
        }
    }

    /// Milliseconds entry `idx`'s keep has left (0: not kept, or run out).
    pub fn left_ms(&self, idx: u32) -> u64 {
        self.map
            .get(&idx)
            .map_or(0, |k| k.until.saturating_sub(self.book.now_ms()))
    }

    /// Keeps entry `idx` (an object of `len` bytes in namespace `ns`) for `ttl_ms` from now.
    pub fn keep(&mut self, idx: u32, len: u64, ns: [u8; 16], ttl_ms: u64) -> PinOutcome {
        let now = self.book.now_ms();
        let until = now.saturating_add(ttl_ms);
        if let Some(k) = self.map.get_mut(&idx) {
            if k.until > now {
                k.until = until;
                add(&self.book.renewed, 1);
                return PinOutcome::Renewed;
            }
            // Ran out and not yet counted: counted now, then kept anew below.
            let k = self.map.remove(&idx).expect("present above");
            self.book.give(&k, &self.book.expired);
        }
        if !self.book.take(ns, len) {
            return PinOutcome::Refused;
        }
        add(&self.book.granted, 1);
        self.map.insert(idx, Kept { until, len, ns });
        PinOutcome::Pinned
    }

    /// Releases the keep of `idx`; whether it was kept (a keep that had run out is counted
    /// as expired and reported not kept).
    pub fn release(&mut self, idx: u32) -> bool {
        let Some(k) = self.map.remove(&idx) else {
            return false;
        };
        if k.until <= self.book.now_ms() {
            self.book.give(&k, &self.book.expired);
            return false;
        }
        self.book.give(&k, &self.book.released);
        true
    }

    /// Entry `idx` leaves the index: its keep ends (counted as expired when it had run out).
    pub fn end(&mut self, idx: u32) {
        if self.map.is_empty() {
            return;
        }
        if let Some(k) = self.map.remove(&idx) {
            let to = if k.until <= self.book.now_ms() {
                &self.book.expired
            } else {
                &self.book.ended
            };
            self.book.give(&k, to);
        }
    }

    /// Counts and drops every keep that ran out.
    pub fn sweep(&mut self) {
        if self.map.is_empty() {
            return;
        }
        let now = self.book.now_ms();
        let book = Arc::clone(&self.book);
        self.map.retain(|_, k| {
            if k.until > now {
                return true;
            }
            book.give(k, &book.expired);
            false
        });
    }

    /// Bytes of metadata.
    pub fn metadata_bytes(&self) -> usize {
        self.map.capacity() * (std::mem::size_of::<Kept>() + 5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(per_ns: u64, max: u64) -> (Arc<LeaseBook>, Arc<KeepBook>) {
        let clock = Arc::new(LeaseBook::new(0, 0));
        let b = Arc::new(KeepBook::new(per_ns, max, Arc::clone(&clock)));
        (clock, b)
    }

    #[test]
    fn keeps_run_out_renew_and_release_counted() {
        let (clock, b) = book(1000, 1000);
        let mut k = Keeps::new(Arc::clone(&b));
        let ns = [1; 16];
        assert_eq!(k.keep(7, 100, ns, 50), PinOutcome::Pinned);
        assert!(k.holds(7) && !k.holds(8));
        clock.advance(40);
        assert_eq!(k.keep(7, 100, ns, 50), PinOutcome::Renewed);
        clock.advance(40); // 80 ms after the first keep, 40 after the renewal
        assert!(k.holds(7));
        clock.advance(10);
        assert!(!k.holds(7), "ran out 50 ms after its renewal");
        k.sweep();
        let s = b.stats();
        assert_eq!(
            (s.pinned, s.pinned_bytes, s.granted, s.renewed, s.expired),
            (0, 0, 1, 1, 1)
        );
        assert_eq!(k.keep(7, 100, ns, 50), PinOutcome::Pinned);
        assert!(k.release(7) && !k.release(7));
        k.keep(9, 100, ns, 50);
        k.end(9);
        let s = b.stats();
        assert_eq!(
            (s.released, s.ended, s.pinned, s.pinned_bytes),
            (1, 1, 0, 0)
        );
        assert_eq!(b.namespace_bytes(&ns), 0);
    }

    #[test]
    fn bounds_per_namespace_and_for_the_pool_refuse_and_count() {
        let (_clock, b) = book(250, 400);
        let mut k = Keeps::new(Arc::clone(&b));
        let (a, c) = ([1; 16], [2; 16]);
        assert_eq!(k.keep(1, 100, a, 1000), PinOutcome::Pinned);
        assert_eq!(k.keep(2, 100, a, 1000), PinOutcome::Pinned);
        assert_eq!(k.keep(3, 100, a, 1000), PinOutcome::Refused, "a's 250");
        assert_eq!(k.keep(4, 100, c, 1000), PinOutcome::Pinned);
        assert_eq!(
            k.keep(5, 150, c, 1000),
            PinOutcome::Refused,
            "the pool's 400"
        );
        assert_eq!(k.keep(5, 100, c, 1000), PinOutcome::Pinned);
        assert_eq!((b.namespace_bytes(&a), b.namespace_bytes(&c)), (200, 200));
        assert!(!k.holds(3));
        assert_eq!(b.stats().refused, 2);
        k.release(1);
        assert_eq!(k.keep(3, 100, a, 1000), PinOutcome::Pinned, "room again");
    }
}
