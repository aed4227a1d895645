//! The handles a caller holds: a [`Reservation`] (room being written, freed if dropped
//! uncommitted) and a [`PinnedObject`] (a committed object kept from eviction while it lives).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::inner::Inner;
use crate::alloc::Slot;

/// Room for one object, exclusively owned by its writer until [`Pool::commit`]. Dropping it
/// uncommitted returns the room to the pool.
#[derive(Debug)]
pub struct Reservation {
    pub(super) inner: Arc<Inner>,
    pub(super) slot: Option<Slot>,
    pub(super) len: u64,
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
}

impl Drop for PinnedObject {
    fn drop(&mut self) {
        let freed = self.inner.shards[self.shard as usize]
            .write()
            .unpin(self.idx);
        self.inner.counters.pinned.fetch_sub(1, Ordering::Relaxed);
        if let Some(slot) = freed {
            self.inner.alloc.lock().free(slot);
        }
    }
}
