//! Eviction: freeing removed objects and publishing their events, exact-LRU eviction down to
//! a target, emptying a whole segment for a large reservation, and the background evictor
//! thread that keeps usage under the high watermark.

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use umbp_core::BlockKey;

use super::inner::{Inner, EVICT_BATCH};
use super::types::{PoolEvent, RemoveCause};
use crate::alloc::Slot;
use crate::index::EntryState;

impl Inner {
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

    /// Evicts unpinned objects in exact least-recently-used order until at least `target` bytes
    /// were freed or nothing is left to evict. Returns the bytes freed.
    pub(super) fn evict_lru(&self, target: u64, cause: RemoveCause) -> u64 {
        let mut freed = 0u64;
        let mut cands: Vec<(u64, u32)> = Vec::new();
        let mut merged: Vec<(u64, usize, u32)> = Vec::new();
        while freed < target {
            merged.clear();
            // The newest tick that is still safe to evict in order: a shard that returned a
            // full batch may hold older entries than its next one beyond the batch.
            let mut horizon = u64::MAX;
            for (si, shard) in self.shards.iter().enumerate() {
                cands.clear();
                shard.read().oldest_unpinned(EVICT_BATCH, &mut cands);
                if cands.len() == EVICT_BATCH {
                    horizon = horizon.min(cands.last().expect("full batch").0);
                }
                merged.extend(cands.iter().map(|&(t, i)| (t, si, i)));
            }
            if merged.is_empty() {
                break;
            }
            merged.sort_unstable();
            let mut progressed = false;
            for &(tick, si, idx) in merged.iter() {
                if tick > horizon || freed >= target {
                    break;
                }
                let mut shard = self.shards[si].write();
                let e = shard.entry(idx);
                if e.state != EntryState::Live || e.tick != tick || e.pins != 0 {
                    continue;
                }
                let key = e.key;
                let slot = shard.remove(idx).expect("unpinned entries free at once");
                drop(shard);
                freed += slot.bytes;
                progressed = true;
                self.finish_removals(vec![slot], vec![(key, cause)]);
            }
            if !progressed {
                break;
            }
        }
        freed
    }

    /// Empties the segment of the least recently used unpinned object that is not in `tried`
    /// (evicting every unpinned object in it). Returns false when no such segment is left.
    pub(super) fn evict_oldest_segment(&self, tried: &mut Vec<u32>) -> bool {
        let mut cands: Vec<(u64, u32)> = Vec::new();
        let mut best: Option<(u64, usize, u32)> = None;
        for (si, shard) in self.shards.iter().enumerate() {
            cands.clear();
            let s = shard.read();
            s.oldest_unpinned(usize::MAX, &mut cands);
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
        let owners = self.alloc.lock().owners_in(segment);
        for tag in owners {
            let (si, idx) = ((tag >> 32) as usize, tag as u32);
            let mut shard = self.shards[si].write();
            let e = shard.entry(idx);
            if e.state != EntryState::Live || e.pins != 0 {
                continue;
            }
            if self.alloc.lock().segment_of(e.slot.offset) != segment {
                continue;
            }
            let key = e.key;
            let slot = shard.remove(idx).expect("unpinned entries free at once");
            drop(shard);
            self.finish_removals(vec![slot], vec![(key, RemoveCause::Evicted)]);
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
        let used = inner.alloc.lock().used();
        if used > inner.high_bytes {
            let freed = inner.evict_lru(used - inner.low_bytes, RemoveCause::Evicted);
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
