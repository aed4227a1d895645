//! The UMBP host-DRAM pool.
//!
//! * [`region`]: one mapping of the configured capacity (anonymous or memfd), huge pages with a
//!   logged fallback, NUMA binding, and a parallel prefault with progress.
//! * [`alloc`]: a segmented slab allocator. Objects are rounded to size classes (at most 12.5%
//!   waste); each segment serves one class at a time and returns to the free list as soon as it
//!   empties, so a long churn of mixed sizes cannot strand memory in the wrong class. Objects
//!   larger than a segment take a run of whole segments.
//! * [`Pool`]: a sharded index (no global lock on the hot path) with reserve → write → commit,
//!   pinned reads, remove and clear; eviction by watermarks in a background thread, and
//!   just-enough synchronous eviction when an allocation cannot be met at once; stats and a stream
//!   of stored/removed key events.
//! * [`EvictionPolicy`]: which objects eviction takes first (scan-resistant S3-FIFO, the
//!   default, or exact LRU), one file per policy behind one trait; [`StoreAdmission`]: store
//!   every commit, or only keys seen before (`on_reuse`, within `admission_window` keys). All
//!   three are fields of the [`umbp_core::PoolConfig`] given to [`Pool::new`].
//! * Lookup leases (`lease`): a hit a lookup reports ([`Pool::prefix_hits_leased`],
//!   [`Pool::exists_many_leased`], [`Pool::lease_prefix_with`]) is skipped by eviction until
//!   a load ([`Pool::get`]) gives its lease back or the lease runs out (`lookup_lease_ms`),
//!   bounded to half the pool's bytes.
//! * [`image`]: the index a pool hands to the process taking its memory over
//!   ([`Pool::hand_over`], [`Pool::adopt`]), with the checks that refuse a damaged or foreign one.
//! * [`shared_fd`]: the standalone server's mapping of a client's KV cache (a sealed memfd the
//!   client sends), after [`check_shareable_fd`].
//!
//! `unsafe` is denied everywhere but in [`Reservation`] and [`PinnedObject`] (`pool::handles`),
//! which hand out slices of the arena on the strength of the allocator and the pins, and in
//! tests that write raw memory. The system calls behind the arena are umbp-unix's.

#![deny(unsafe_code)]

pub mod alloc;
mod checksum;
mod error;
pub mod image;
mod index;
mod keep;
mod lease;
mod policy;
mod pool;
pub mod region;
pub mod shared_fd;
mod window;

pub use checksum::{checksum, Summer};
pub use error::PoolError;
pub use keep::{KeepStats, NamespacePins};
pub use pool::clearing::Clearing;
pub use pool::{
    Adopted, CommitOutcome, PinnedObject, Pool, PoolCounters, PoolEvent, PoolStats, RemoveCause,
    Reservation, SpillFn, SpillKind,
};
pub use region::{memory_available, MemoryAvailable, Placement};
pub use shared_fd::{check_shareable_fd, ServerMapping};
pub use umbp_core::caching::{Admit, EvictionPolicy, StoreAdmission, DEFAULT_ADMISSION_WINDOW};
