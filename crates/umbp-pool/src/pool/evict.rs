//! Eviction: freeing removed objects and publishing their events, eviction in the policy's
//! order down to a target, emptying a whole segment for a large reservation, and the background evictor
//! thread that keeps usage under the high watermark.

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use umbp_core::BlockKey;

use parking_lot::RwLockWriteGuard;

use super::inner::{Inner, PinnedObject, SpillFn, EVICT_BATCH};
use super::types::{PoolEvent, RemoveCause, SpillKind};
use crate::alloc::Slot;
use crate::index::{EntryState, Shard};
use crate::policy::{plan, QUEUES};
use umbp_core::caching::EvictionPolicy;

impl Inner {
    /// Bytes the watermarks count: those allocated, less spilled objects still being written
    /// (on their way out, so not evicted for twice).
    pub(super) fn used_for_watermarks(&self) -> u64 {
        self.alloc
            .lock()
            .used()
            .saturating_sub(self.spill.pending.load(Ordering::Relaxed))
    }

    pub(super) fn wake_evictor(&self) {
        *self.wake.lock() = true;
        self.wake_cv.notify_one();
    }

    /// Frees `slots`, counts and publishes `removed`.
    pub(super) fn finish_removals(&self, slots: Vec<Slot>, removed: Vec<(BlockKey, RemoveCause)>) {
        if !slots.is_empty() {
            let mut a = self.alloc.lock();
            for s in slots {
                a.free(s);
            }
        }
        let c = &self.counters;
        c.objects.fetch_sub(removed.len() as u64, Ordering::Relaxed);
        let evicted = removed
            .iter()
            .filter(|(_, cause)| *cause == RemoveCause::Evicted)
            .count() as u64;
        c.evictions.fetch_add(evicted, Ordering::Relaxed);
        if self.events.active() {
            self.events.publish(
                removed
                    .into_iter()
                    .map(|(key, cause)| PoolEvent::Removed { key, cause })
                    .collect(),
            );
        }
    }

    /// Evicts unpinned objects in the policy's order until at least `target` bytes were
    /// freed or nothing is left to evict. Returns the bytes freed.
    ///
    /// Each round asks the policy which queue to take from ([`plan`]), collects a batch of
    /// candidates of that queue from every shard and evicts them merged by rank, so the order
    /// is the policy's over the whole pool (exact for LRU).
    /// Evicted objects go to the spill hook, when one is set, as `kind`.
    pub(super) fn evict(&self, target: u64, cause: RemoveCause, kind: SpillKind) -> u64 {
        // No clear runs while objects are on their way to the hook ([`super::clearing`]).
        let _gate = self.spill.gate.read_recursive();
        let hook = self.spill.hook.read().clone();
        let hook = hook.as_ref().map(|h| (h, kind));
        let mut freed = 0u64;
        let mut cands: Vec<(u64, u32)> = Vec::new();
        let mut merged: Vec<(u64, usize, u32)> = Vec::new();
        while freed < target {
            let mut bytes = [0u64; QUEUES];
            if self.policy != EvictionPolicy::Lru {
                for shard in self.shards.iter() {
                    shard.read().queue_bytes(&mut bytes);
                }
            }
            let mut progressed = false;
            for (queue, quota) in plan(self.policy, &bytes) {
                if quota == 0 {
                    continue;
                }
                let want = (target - freed).min(quota);
                let got = self.evict_round(queue, want, cause, hook, &mut cands, &mut merged);
                if got > 0 {
                    freed += got;
                    progressed = true;
                    break;
                }
            }
            if !progressed {
                break;
            }
        }
        freed
    }

    /// One round of [`Inner::evict`] from `queue`: up to [`EVICT_BATCH`] candidates per
    /// shard, evicted oldest rank first until `want` bytes were freed. Returns the bytes freed.
    fn evict_round(
        &self,
        queue: usize,
        want: u64,
        cause: RemoveCause,
        hook: Option<(&SpillFn, SpillKind)>,
        cands: &mut Vec<(u64, u32)>,
        merged: &mut Vec<(u64, usize, u32)>,
    ) -> u64 {
        merged.clear();
        let now = self.tick.load(Ordering::Relaxed);
        // The newest rank that is still safe to evict in order: a shard that returned a full
        // batch may hold older entries than its next one beyond the batch.
        let mut horizon = u64::MAX;
        for (si, shard) in self.shards.iter().enumerate() {
            cands.clear();
            shard.write().candidates(queue, EVICT_BATCH, now, cands);
            if cands.len() == EVICT_BATCH {
                horizon = horizon.min(cands.last().expect("full batch").0);
            }
            merged.extend(cands.iter().map(|&(r, i)| (r, si, i)));
        }
        merged.sort_unstable();
        let mut freed = 0;
        for &(rank, si, idx) in merged.iter() {
            if rank > horizon || freed >= want {
                break;
            }
            let shard = self.shards[si].write();
            if !shard.still_candidate(idx, queue, rank) {
                continue;
            }
            freed += self.evict_entry(shard, si, idx, cause, hook);
        }
        freed
    }

    /// Evicts the live, unpinned entry `idx` of shard `si` (whose lock `shard` is): frees it,
    /// or hands it to the spill hook pinned. Returns its bytes (for [`SpillKind::Behind`] not
    /// freed yet, but no longer counted by the watermarks).
    fn evict_entry(
        &self,
        mut shard: RwLockWriteGuard<'_, Shard>,
        si: usize,
        idx: u32,
        cause: RemoveCause,
        hook: Option<(&SpillFn, SpillKind)>,
    ) -> u64 {
        let e = shard.entry(idx);
        let (key, offset, len, bytes) = (e.key, e.slot.offset, e.len, e.slot.bytes);
        let inner = self.me.upgrade();
        let (Some((hook, kind)), Some(inner)) = (hook, inner) else {
            let slot = shard
                .remove(idx, true)
                .expect("unpinned entries free at once");
            drop(shard);
            self.finish_removals(vec![slot], vec![(key, cause)]);
            return bytes;
        };
        // Pinned before removal: the entry is doomed, its slot freed by the last unpin.
        shard.pin(idx);
        let freed_now = shard.remove(idx, true);
        debug_assert!(freed_now.is_none());
        drop(shard);
        self.counters.pinned.fetch_add(1, Ordering::Relaxed);
        // Spills that may wait leave the watermarks' count until their pin goes; those
        // needed now are released before the hook returns.
        let spilled = if kind == SpillKind::Behind { bytes } else { 0 };
        self.spill.pending.fetch_add(spilled, Ordering::Relaxed);
        self.finish_removals(Vec::new(), vec![(key, cause)]);
        hook(
            key,
            PinnedObject {
                inner,
                shard: si as u32,
                idx,
                offset,
                len,
                spilled,
            },
            kind,
        );
        bytes
    }

    /// Empties the segment of the unpinned object first in its shard's eviction order with the
    /// lowest rank that is not in `tried` (evicting every unpinned object in it; to the spill
    /// hook, when one is set, as [`SpillKind::Now`]). Returns false when no such segment is
    /// left.
    pub(super) fn evict_oldest_segment(&self, tried: &mut Vec<u32>) -> bool {
        let _gate = self.spill.gate.read_recursive();
        let mut cands: Vec<(u64, u32)> = Vec::new();
        let mut best: Option<(u64, usize, u32)> = None;
        for (si, shard) in self.shards.iter().enumerate() {
            cands.clear();
            let s = shard.read();
            s.eviction_order(&mut cands);
            let a = self.alloc.lock();
            for &(t, idx) in &cands {
                let seg = a.segment_of(s.entry(idx).slot.offset);
                if !tried.contains(&seg) {
                    if best.is_none_or(|b| t < b.0) {
                        best = Some((t, si, idx));
                    }
                    break;
                }
            }
        }
        let Some((_, si, idx)) = best else {
            return false;
        };
        let segment = {
            let s = self.shards[si].read();
            let offset = s.entry(idx).slot.offset;
            self.alloc.lock().segment_of(offset)
        };
        tried.push(segment);
        let hook = self.spill.hook.read().clone();
        let hook = hook.as_ref().map(|h| (h, SpillKind::Now));
        let owners = self.alloc.lock().owners_in(segment);
        for tag in owners {
            let (si, idx) = ((tag >> 32) as usize, tag as u32);
            let shard = self.shards[si].write();
            let e = shard.entry(idx);
            if e.state != EntryState::Live || e.pins != 0 || shard.leased(idx) {
                continue;
            }
            if self.alloc.lock().segment_of(e.slot.offset) != segment {
                continue;
            }
            self.evict_entry(shard, si, idx, RemoveCause::Evicted, hook);
        }
        true
    }
}

pub(super) fn evictor_loop(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        inner.sweep_leases();
        inner.sweep_keeps();
        let used = inner.used_for_watermarks();
        if used > inner.high_bytes {
            let freed = inner.evict(
                used - inner.low_bytes,
                RemoveCause::Evicted,
                SpillKind::Behind,
            );
            log::debug!("umbp: evicted {freed} bytes to reach the low watermark");
        }
        {
            let mut woken = inner.wake.lock();
            if !*woken {
                inner
                    .wake_cv
                    .wait_for(&mut woken, Duration::from_millis(100));
            }
            *woken = false;
        }
        drop(inner);
    }
}
