//! The state every handle shares: the region, allocator and index shards, the counters
//! behind [`PoolStats`](super::PoolStats) and the event hub subscribers hang off.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};

use parking_lot::{Condvar, Mutex, RwLock};

use super::types::PoolEvent;
use crate::alloc::Allocator;
use crate::index::Shard;
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
}
