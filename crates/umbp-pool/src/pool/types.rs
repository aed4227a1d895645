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

/// A snapshot of the pool's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStats {
    /// Usable bytes.
    pub capacity_bytes: u64,
    /// Bytes allocated to objects and open reservations (rounded sizes).
    pub used_bytes: u64,
    /// Committed objects.
    pub objects: u64,
    /// Successful commits.
    pub puts: u64,
    /// Commits that lost to an earlier writer of the same key.
    pub duplicate_puts: u64,
    /// Pinned reads served.
    pub gets: u64,
    /// Keys found by lookups and reads.
    pub hits: u64,
    /// Keys not found by lookups and reads.
    pub misses: u64,
    /// Objects evicted.
    pub evictions: u64,
    /// The eviction policy.
    pub eviction_policy: EvictionPolicy,
    /// Objects evicted from S3-FIFO's small (probation) queue.
    pub evictions_small: u64,
    /// Objects evicted from the main queue (LRU's only one, S3-FIFO's main).
    pub evictions_main: u64,
    /// Objects the policy kept by moving them on instead of evicting them (S3-FIFO: used
    /// objects leaving the small queue for main, or going round main again).
    pub promotions: u64,
    /// Commits of keys S3-FIFO had evicted recently (its ghost set): stored straight in main.
    pub ghost_hits: u64,
    /// The store admission.
    pub store_admission: StoreAdmission,
    /// Commits the admission skipped ([`CommitOutcome::Skipped`]).
    pub admissions_skipped: u64,
    /// Commits stored on a key's first sighting because the writer asked for it
    /// ([`umbp_core::Admit::Now`]) where `on_reuse` would have skipped them.
    pub admissions_forced: u64,
    /// Whether objects are checksummed, and how many loads verify them.
    pub integrity: umbp_core::Integrity,
    /// Objects whose bytes were checked against their checksum.
    pub verified: u64,
    /// Objects whose bytes did not match their checksum (each removed, its load failed). The
    /// store's stats (umbp-store) add the objects its disk and remote tiers refused as damaged.
    pub corrupt_detected: u64,
    /// Keys the `on_reuse` admission remembers as seen once.
    pub admission_seen: u64,
    /// Bytes committed.
    pub bytes_in: u64,
    /// Bytes handed to pinned readers.
    pub bytes_out: u64,
    /// Reservations open now.
    pub reservations: u64,
    /// Objects pinned now.
    pub pinned: u64,
    /// Events dropped because a subscriber was not keeping up.
    pub events_dropped: u64,
    /// Allocator segment size.
    pub segment_bytes: u64,
    /// Segments serving no size class.
    pub free_segments: u64,
    /// Bytes of index and allocator metadata.
    pub metadata_bytes: u64,
    /// How the memory was placed.
    pub placement: Placement,
    /// How long a lookup's lease keeps a hit from eviction, in ms (0: no leases).
    pub lookup_lease_ms: u64,
    /// Leases taken by lookups (one per hit reported). Every lease is given back by a load
    /// (`leases_released`), expires (`leases_expired`), ends with its object
    /// (`leases_ended`) or is still outstanding (`leases_active`): `leases` is their sum.
    pub leases: u64,
    /// Leases given back by the loads that used them.
    pub leases_released: u64,
    /// Leases that ran out before a load used them (the object became evictable again).
    pub leases_expired: u64,
    /// Leases refused because leased objects held half the pool already (the lookup
    /// reported a miss for the key instead).
    pub leases_refused: u64,
    /// Leases that ended because their object was removed (`remove`, `clear`).
    pub leases_ended: u64,
    /// Leases outstanding now.
    pub leases_active: u64,
    /// Bytes of the objects that hold leases now.
    pub leased_bytes: u64,
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
