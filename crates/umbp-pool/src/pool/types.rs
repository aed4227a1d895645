//! The pool's public value types: what a commit did, the events subscribers get, and the
//! statistics snapshot.

use umbp_core::BlockKey;

use crate::region::Placement;
use umbp_core::caching::{EvictionPolicy, StoreAdmission};

/// Why an object left the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveCause {
    /// Evicted to make room.
    Evicted,
    /// Removed by key.
    Removed,
    /// Removed by a clear.
    Cleared,
    /// Removed because its bytes failed their checksum.
    Corrupt,
}

/// How an evicted object is handed to the spill hook ([`Pool::set_spill`](super::Pool::set_spill)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpillKind {
    /// Taken by the watermark eviction (the background evictor): the hook may keep the pin
    /// until the object is written; its memory is freed when the pin goes.
    Behind,
    /// Taken by a reservation that found the pool full (the synchronous eviction), which needs
    /// the memory now: the hook must drop the pin before it returns (copy the bytes out, or
    /// drop the object), or the reservation evicts more.
    Now,
}

/// A change to the set of stored keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    /// An object was committed.
    Stored {
        /// Its key.
        key: BlockKey,
        /// Its size.
        bytes: u64,
    },
    /// An object left the pool.
    Removed {
        /// Its key.
        key: BlockKey,
        /// Why.
        cause: RemoveCause,
    },
}

/// Result of a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// This writer's object is now visible.
    Stored,
    /// Another writer committed the key first; this object was discarded.
    AlreadyPresent,
    /// The store admission did not admit the key (`on_reuse`: first time seen); this object
    /// was discarded.
    Skipped,
}

umbp_core::counter_set! {
    /// The pool's counters and readings: one group (`pool`) from which the wire, Python's
    /// stats dicts, Prometheus (`umbp_pool_*`) and `umbp stats` are rendered.
    pub struct PoolCounters: "pool" {
        /// Usable bytes of the pool.
        gauge capacity_bytes: u64,
        /// Bytes held by objects and open reservations (rounded sizes).
        gauge used_bytes: u64,
        /// Objects in the pool.
        gauge objects: u64,
        /// Successful commits.
        counter puts: u64,
        /// Commits that lost to an earlier writer of the same key.
        counter duplicate_puts: u64,
        /// Pinned reads served.
        counter gets: u64,
        /// Keys found by lookups and loads.
        counter hits: u64,
        /// Keys not found by lookups and loads.
        counter misses: u64,
        /// Objects evicted.
        counter evictions: u64,
        /// Objects evicted from S3-FIFO's small (probation) queue.
        counter evictions_small: u64,
        /// Objects evicted from the main queue (LRU's only one, S3-FIFO's main).
        counter evictions_main: u64,
        /// Objects S3-FIFO kept by moving them on instead of evicting them (used objects
        /// leaving the small queue for main, or going round main again).
        counter promotions: u64,
        /// Objects stored again soon after S3-FIFO evicted them (its ghost set): stored
        /// straight in its main queue.
        counter ghost_hits: u64,
        /// Stores not kept by store_admission=on_reuse (the key's first sighting).
        counter admissions_skipped: u64,
        /// Stores kept on the key's first sighting because the writer asked (admit_now: a
        /// request's priority or umbp_store=now) where store_admission=on_reuse would not.
        counter admissions_forced: u64,
        /// Keys the on_reuse admission remembers as seen once.
        gauge admission_seen: u64,
        /// Objects whose bytes a load checked against their checksum (integrity).
        counter verified: u64,
        /// Objects whose bytes did not match their checksum (each removed, its load failed).
        /// The store's stats add the objects its disk and remote tiers refused as damaged.
        counter corrupt_detected: u64,
        /// Bytes committed.
        counter bytes_in: u64,
        /// Bytes handed to pinned readers.
        counter bytes_out: u64,
        /// Reservations open now.
        gauge reservations: u64,
        /// Objects pinned by loads now.
        gauge pinned: u64 as "pinned_objects",
        /// Pool events dropped because a subscriber was not keeping up.
        counter events_dropped: u64,
        /// The allocator's segment size.
        gauge segment_bytes: u64,
        /// Allocator segments serving no size class.
        gauge free_segments: u64,
        /// Bytes of index and allocator metadata.
        gauge metadata_bytes: u64,
        /// Leases lookups took on the hits they reported (kept from eviction until loaded).
        /// Every lease is given back by a load, expires, ends with its object or is still
        /// outstanding: this is their sum.
        counter leases: u64,
        /// Lookup leases given back by the loads that used them.
        counter leases_released: u64,
        /// Lookup leases that ran out before a load used them.
        counter leases_expired: u64,
        /// Lookup leases refused because leased objects held half the pool (reported as
        /// misses).
        counter leases_refused: u64,
        /// Lookup leases that ended with their object (removed or cleared).
        counter leases_ended: u64,
        /// Lookup leases outstanding now.
        gauge leases_active: u64,
        /// Bytes of the objects that hold lookup leases now.
        gauge leased_bytes: u64,
    }
}

/// A snapshot of the pool: its settings and its [`PoolCounters`] (which it dereferences to, so
/// `stats.hits` reads a counter).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStats {
    /// Every counter and reading.
    pub counters: PoolCounters,
    /// The eviction policy.
    pub eviction_policy: EvictionPolicy,
    /// The store admission.
    pub store_admission: StoreAdmission,
    /// Whether objects are checksummed, and how many loads verify them.
    pub integrity: umbp_core::Integrity,
    /// How the memory was placed.
    pub placement: Placement,
    /// How long a lookup's lease keeps a hit from eviction, in ms (0: no leases).
    pub lookup_lease_ms: u64,
}

impl std::ops::Deref for PoolStats {
    type Target = PoolCounters;

    fn deref(&self) -> &PoolCounters {
        &self.counters
    }
}

impl std::ops::DerefMut for PoolStats {
    fn deref_mut(&mut self) -> &mut PoolCounters {
        &mut self.counters
    }
}

/// What [`Pool::adopt`](super::Pool::adopt) took over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// The image's generation + 1: how many hand-overs this pool's memory has been through.
    pub generation: u64,
    /// Objects taken over.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of them, pinned ones (their pins carried with the time they had left).
    pub pinned: u64,
}
