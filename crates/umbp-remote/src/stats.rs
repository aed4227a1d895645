//! The remote tier's counters: the atomics its threads bump ([`Counters`]) and the
//! snapshot callers read ([`RemoteStats`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

umbp_core::counter_set! {
    /// Counters of the remote tier.
    pub struct RemoteStats: "remote" {
        /// Keys the pool missed that were asked of the remote store.
        counter lookup_keys: u64,
        /// Objects fetched, checked and put in the pool.
        counter hits: u64,
        /// Keys the remote store did not have.
        counter misses: u64,
        /// Values rejected by their header or checksum (counted as misses too).
        counter corrupt: u64,
        /// Lookups that gave up waiting after the timeout.
        counter timeouts: u64,
        /// Lookups answered without asking because the remote was down (back-off) or busy.
        counter skipped_lookups: u64,
        /// Bytes fetched into the pool.
        counter bytes_fetched: u64 as "fetched_bytes",
        /// Objects written.
        counter writes: u64,
        /// Bytes written (payloads).
        counter bytes_written: u64 as "written_bytes",
        /// Objects not written: backlog full, or the remote down or failing.
        counter writes_dropped: u64,
        /// Objects that left the pool before their turn to be written.
        counter writes_evicted: u64,
        /// Failed requests (connects, commands, timeouts).
        counter errors: u64,
        /// Whether the last request succeeded.
        flag connected: bool,
        /// Bytes waiting to be written.
        gauge backlog_bytes: u64,
    }
}

/// The live counters behind [`RemoteStats`], plus what `flush` needs to know.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) lookup_keys: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) skipped_lookups: AtomicU64,
    pub(crate) bytes_fetched: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) writes_dropped: AtomicU64,
    pub(crate) writes_evicted: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) connected: AtomicBool,
    pub(crate) backlog_bytes: AtomicU64,
    /// Pool commits the writer has taken from the pool's queue.
    pub(crate) commits_seen: AtomicU64,
    /// The writer holds a batch it has not finished sending.
    pub(crate) writing: AtomicBool,
}

/// Adds `n` to the counter `c`.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    /// A snapshot of the counters.
    pub(crate) fn snapshot(&self) -> RemoteStats {
        let c = self;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            lookup_keys: l(&c.lookup_keys),
            hits: l(&c.hits),
            misses: l(&c.misses),
            corrupt: l(&c.corrupt),
            timeouts: l(&c.timeouts),
            skipped_lookups: l(&c.skipped_lookups),
            bytes_fetched: l(&c.bytes_fetched),
            writes: l(&c.writes),
            bytes_written: l(&c.bytes_written),
            writes_dropped: l(&c.writes_dropped),
            writes_evicted: l(&c.writes_evicted),
            errors: l(&c.errors),
            connected: c.connected.load(Ordering::Relaxed),
            backlog_bytes: l(&c.backlog_bytes),
        }
    }
}
