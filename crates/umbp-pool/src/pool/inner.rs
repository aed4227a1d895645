//! The state every handle shares: the region, allocator and index shards, the counters
//! behind [`PoolStats`](super::PoolStats), the event hub subscribers hang off and the spill
//! hook; and the handles a caller holds: a [`Reservation`] (room being written, freed if
//! dropped uncommitted) and a [`PinnedObject`] (a committed object kept from eviction while
//! it lives). One file, since the spill hook hands out handles.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};

use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::BlockKey;

use super::types::PoolEvent;
use crate::alloc::{Allocator, Slot};
use crate::index::Shard;
use crate::lease::LeaseBook;
use crate::region::Region;
use crate::window::FpWindow;
use umbp_core::caching::EvictionPolicy;

pub(super) const SHARD_BITS: u32 = 6;
pub(super) const SHARDS: usize = 1 << SHARD_BITS;
/// Candidates taken from each shard per eviction round.
pub(super) const EVICT_BATCH: usize = 32;

#[inline]
pub(super) fn shard_of(fp: u64) -> usize {
    (fp >> (64 - SHARD_BITS)) as usize
}

pub(super) fn owner_tag(shard: usize, idx: u32) -> u64 {
    ((shard as u64) << 32) | u64::from(idx)
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) puts: AtomicU64,
    pub(super) duplicate_puts: AtomicU64,
    pub(super) gets: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) bytes_in: AtomicU64,
    pub(super) bytes_out: AtomicU64,
    pub(super) reservations: AtomicU64,
    pub(super) pinned: AtomicU64,
    pub(super) objects: AtomicU64,
    pub(super) admissions_skipped: AtomicU64,
    pub(super) admissions_forced: AtomicU64,
    pub(super) verified: AtomicU64,
    pub(super) corrupt_detected: AtomicU64,
}

#[derive(Debug, Default)]
pub(super) struct EventHub {
    pub(super) active: AtomicBool,
    pub(super) subscribers: Mutex<Vec<SyncSender<PoolEvent>>>,
    pub(super) dropped: AtomicU64,
}

impl EventHub {
    pub(super) fn publish(&self, events: Vec<PoolEvent>) {
        if events.is_empty() {
            return;
        }
        let mut subs = self.subscribers.lock();
        for ev in events {
            subs.retain(|tx| match tx.try_send(ev.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(TrySendError::Disconnected(_)) => false,
            });
        }
        if subs.is_empty() {
            self.active.store(false, Ordering::Relaxed);
        }
    }

    #[inline]
    pub(super) fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
}

/// Where the pool hands every object it evicts (a disk tier's write-behind queue), pinned, with
/// how soon the pool needs its memory back ([`SpillKind`](super::SpillKind)).
pub type SpillFn = Arc<dyn Fn(BlockKey, PinnedObject, super::SpillKind) + Send + Sync>;

/// The spill hook, when set, the bytes of spilled objects not yet released, and what keeps
/// clears and spills apart ([`super::clearing`]).
#[derive(Default)]
pub(super) struct Spill {
    pub(super) hook: RwLock<Option<SpillFn>>,
    pub(super) pending: AtomicU64,
    /// Held for reading by every eviction from before it takes an object until the hook has
    /// it; for writing by a clear ([`super::Pool::begin_clear`]).
    pub(super) gate: RwLock<()>,
    /// Clears ended ([`super::Pool::clear_epoch`]).
    pub(super) clears: AtomicU64,
}

impl std::fmt::Debug for Spill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spill")
            .field("hooked", &self.hook.read().is_some())
            .field("pending", &self.pending.load(Ordering::Relaxed))
            .finish()
    }
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) region: Region,
    pub(super) alloc: Mutex<Allocator>,
    pub(super) shards: Box<[RwLock<Shard>]>,
    pub(super) policy: EvictionPolicy,
    /// The `on_reuse` admission's windows; `None` stores every commit.
    pub(super) admission: Option<Box<[Mutex<FpWindow>]>>,
    pub(super) tick: AtomicU64,
    pub(super) capacity: u64,
    pub(super) high_bytes: u64,
    pub(super) low_bytes: u64,
    pub(super) counters: Counters,
    pub(super) events: EventHub,
    pub(super) wake: Mutex<bool>,
    pub(super) wake_cv: Condvar,
    pub(super) closed: AtomicBool,
    pub(super) spill: Spill,
    /// Lookup leases: their clock, bound and counters ([`crate::lease`]).
    pub(super) leases: Arc<LeaseBook>,
    /// Kept objects: their bounds and counters ([`crate::keep`]).
    pub(super) keeps: Arc<crate::keep::KeepBook>,
    /// Whether objects are checksummed, and how many loads verify them.
    pub(super) integrity: umbp_core::Integrity,
    /// Loads asked whether to verify (the sampling's count).
    pub(super) verify_tick: AtomicU64,
    /// This pool itself, for handles made inside it (spilled objects).
    pub(super) me: std::sync::Weak<Inner>,
}

/// Room for one object, exclusively owned by its writer until [`Pool::commit`]. Dropping it
/// uncommitted returns the room to the pool.
#[derive(Debug)]
pub struct Reservation {
    pub(super) inner: Arc<Inner>,
    pub(super) slot: Option<Slot>,
    pub(super) len: u64,
    /// The checksum its writer computed ([`Reservation::set_checksum`]).
    pub(super) sum: Option<u64>,
}

// SAFETY: a reservation refers to memory no one else can reach until it is committed.
unsafe impl Send for Reservation {}

impl Reservation {
    /// Object size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the object's first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        let slot = self.slot.expect("live reservation");
        // SAFETY: the slot lies inside the region (the allocator hands out offsets below its
        // capacity, which is at most the region's length).
        unsafe { self.inner.region.base().add(slot.offset as usize) }
    }

    /// Gives the checksum ([`crate::checksum`]) of the bytes written, computed where they
    /// passed the writer's CPU; a pool that keeps checksums sums the object at commit when
    /// its writer did not. The sum must be of the bytes as committed: the pool trusts it.
    pub fn set_checksum(&mut self, sum: u64) {
        self.sum = Some(sum);
    }

    /// The object's bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len as usize;
        let ptr = self.as_mut_ptr();
        // SAFETY: `len <= slot.bytes`, the slot is inside the region, and the reservation is
        // its only user until commit; `&mut self` prevents aliasing through this handle.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.inner.alloc.lock().free(slot);
        }
        self.inner
            .counters
            .reservations
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// A committed object that cannot be evicted or freed while this handle lives.
#[derive(Debug)]
pub struct PinnedObject {
    pub(super) inner: Arc<Inner>,
    pub(super) shard: u32,
    pub(super) idx: u32,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Bytes of an evicted object handed to the spill hook (0 for other pins): released from
    /// the evictor's count of spills in flight when this pin goes.
    pub(super) spilled: u64,
}

// SAFETY: the pinned bytes are immutable while pinned; the handle only reads them.
unsafe impl Send for PinnedObject {}
// SAFETY: as above.
unsafe impl Sync for PinnedObject {}

impl PinnedObject {
    /// Object size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: the object's slot lies inside the region.
        unsafe { self.inner.region.base().add(self.offset as usize) }
    }

    /// The object's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: committed objects are never written again, and the pin keeps the slot from
        // being freed or reused while `self` lives.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len as usize) }
    }

    /// The checksum kept with the object ([`crate::checksum`]); `None` where the pool keeps
    /// none (`integrity` off when it was committed).
    pub fn checksum(&self) -> Option<u64> {
        // The entry stays in its slab while pinned (doomed, not vacant), so `idx` is ours.
        self.inner.shards[self.shard as usize].read().sum(self.idx)
    }

    /// Flips the bits of `mask` in byte `offset` of the committed object: damage for tests
    /// of the integrity checks (nothing else may call it; readers of the object race with it).
    #[doc(hidden)]
    pub fn debug_flip(&self, offset: u64, mask: u8) {
        assert!(
            offset < self.len,
            "offset {offset} is past the object's {} bytes",
            self.len
        );
        // SAFETY: the byte lies inside the pinned object, which stays allocated while `self`
        // lives; writing it breaks the objects' immutability on purpose, for tests only.
        unsafe {
            let p = self.as_ptr().add(offset as usize) as *mut u8;
            p.write_volatile(p.read_volatile() ^ mask);
        }
    }
}

impl Drop for PinnedObject {
    fn drop(&mut self) {
        let freed = self.inner.shards[self.shard as usize]
            .write()
            .unpin(self.idx);
        self.inner.counters.pinned.fetch_sub(1, Ordering::Relaxed);
        if self.spilled > 0 {
            self.inner
                .spill
                .pending
                .fetch_sub(self.spilled, Ordering::Relaxed);
        }
        if let Some(slot) = freed {
            self.inner.alloc.lock().free(slot);
        }
    }
}
