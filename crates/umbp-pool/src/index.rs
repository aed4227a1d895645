//! One shard of the pool's index: a hash table of entry ids, the entries in a slab, and the
//! eviction policy's state for them ([`crate::policy`]).

use hashbrown::HashTable;
use umbp_core::{BlockKey, PinOutcome};

use crate::alloc::Slot;
use crate::keep::Keeps;
use crate::lease::{Grant, Leases};
use crate::policy::{new_policy, PolicyCounters, ShardPolicy, QUEUES};
use umbp_core::caching::EvictionPolicy;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryState {
    Vacant,
    /// In the table and the policy's queues.
    Live,
    /// Removed from the table while pinned; its slot is freed by the last unpin.
    Doomed,
}

/// One hash-table slot: an entry id and its key's fingerprint.
#[derive(Debug, Clone, Copy)]
struct TableSlot {
    fp: u64,
    idx: u32,
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub key: BlockKey,
    pub slot: Slot,
    pub len: u64,
    pub pins: u32,
    pub state: EntryState,
    /// Whether the shard's `sums` hold this object's checksum (a flag in the padding after
    /// `state`: a pool without `integrity` pays nothing per entry for checksums).
    has_sum: bool,
}

/// The index shard. Callers hold the shard's lock.
#[derive(Debug)]
pub(crate) struct Shard {
    /// Entry ids with their key's fingerprint: probes compare fingerprints before touching an
    /// entry, and membership tests (`contains_fp`) never touch entries at all.
    table: HashTable<TableSlot>,
    entries: Vec<Entry>,
    /// Checksums by entry id ([`crate::checksum`]), for the entries whose `has_sum` is set;
    /// empty until the first one is recorded (`integrity` on).
    sums: Vec<u64>,
    vacant: Vec<u32>,
    policy: Box<dyn ShardPolicy>,
    /// Lookup leases on this shard's entries ([`crate::lease`]).
    leases: Leases,
    /// Kept entries ([`crate::keep`]).
    keeps: Keeps,
    live: usize,
}

impl Shard {
    pub fn new(policy: EvictionPolicy, leases: Leases, keeps: Keeps) -> Self {
        Shard {
            table: HashTable::new(),
            entries: Vec::new(),
            sums: Vec::new(),
            vacant: Vec::new(),
            policy: new_policy(policy),
            leases,
            keeps,
            live: 0,
        }
    }

    pub fn live(&self) -> usize {
        self.live
    }

    pub fn entry(&self, idx: u32) -> &Entry {
        &self.entries[idx as usize]
    }

    #[inline]
    pub fn find(&self, key: &BlockKey, fp: u64) -> Option<u32> {
        let entries = &self.entries;
        self.table
            .find(fp, |s| s.fp == fp && entries[s.idx as usize].key == *key)
            .map(|s| s.idx)
    }

    /// Whether a live key with fingerprint `fp` is present. Compares the 64-bit fingerprint
    /// only, so no entry is read: two distinct keys share a fingerprint with probability about
    /// 2^-64, and the reads that follow a lookup (`find`) compare whole keys.
    #[inline]
    pub fn contains_fp(&self, fp: u64) -> bool {
        self.table.find(fp, |s| s.fp == fp).is_some()
    }

    /// Inserts a live entry (the policy places it). The key must not be present.
    pub fn insert(&mut self, key: BlockKey, fp: u64, slot: Slot, len: u64, tick: u64) -> u32 {
        self.insert_placed(key, fp, slot, len, tick, None)
    }

    /// Inserts a live entry taken over from another pool, at `place` in the policy when the
    /// image carried one (else as [`insert`](Self::insert) places it).
    pub fn insert_placed(
        &mut self,
        key: BlockKey,
        fp: u64,
        slot: Slot,
        len: u64,
        tick: u64,
        place: Option<crate::image::Place>,
    ) -> u32 {
        let entry = Entry {
            key,
            slot,
            len,
            pins: 0,
            state: EntryState::Live,
            has_sum: false,
        };
        let idx = match self.vacant.pop() {
            Some(i) => {
                self.entries[i as usize] = entry;
                i
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.table
            .insert_unique(fp, TableSlot { fp, idx }, |s| s.fp);
        match place {
            Some(p) => self.policy.insert_at(idx, fp, len, tick, p),
            None => self.policy.insert(idx, fp, len, tick),
        }
        self.live += 1;
        idx
    }

    /// Where live entry `idx` sits in the policy.
    pub fn place(&self, idx: u32) -> crate::image::Place {
        self.policy.place(idx)
    }

    /// Records the checksum of `idx`'s object.
    pub fn set_sum(&mut self, idx: u32, sum: Option<u64>) {
        let i = idx as usize;
        self.entries[i].has_sum = sum.is_some();
        if let Some(v) = sum {
            if self.sums.len() <= i {
                self.sums.resize(self.entries.len().max(i + 1), 0);
            }
            self.sums[i] = v;
        }
    }

    /// The checksum recorded for `idx`'s object, if any.
    pub fn sum(&self, idx: u32) -> Option<u64> {
        let i = idx as usize;
        self.entries[i].has_sum.then(|| self.sums[i])
    }

    /// Tells the policy `idx` was read.
    pub fn touch(&mut self, idx: u32, tick: u64) {
        self.policy.access(idx, tick);
    }

    pub fn pin(&mut self, idx: u32) {
        self.entries[idx as usize].pins += 1;
    }

    /// Drops one pin; returns the slot to free if this was the last pin of a removed entry.
    pub fn unpin(&mut self, idx: u32) -> Option<Slot> {
        let e = &mut self.entries[idx as usize];
        debug_assert!(e.pins > 0);
        e.pins -= 1;
        if e.pins == 0 && e.state == EntryState::Doomed {
            return Some(self.vacate(idx));
        }
        None
    }

    fn vacate(&mut self, idx: u32) -> Slot {
        let e = &mut self.entries[idx as usize];
        e.state = EntryState::Vacant;
        self.vacant.push(idx);
        e.slot
    }

    /// Removes a live entry from the table and the policy (`evicted`: by eviction). Returns
    /// its slot when it can be freed now; a pinned entry is doomed instead and freed by its
    /// last unpin.
    pub fn remove(&mut self, idx: u32, evicted: bool) -> Option<Slot> {
        let fp = self.entries[idx as usize].key.fingerprint();
        debug_assert_eq!(self.entries[idx as usize].state, EntryState::Live);
        if let Ok(found) = self.table.find_entry(fp, |s| s.idx == idx) {
            found.remove();
        }
        let len = self.entries[idx as usize].len;
        self.policy.remove(idx, fp, len, evicted);
        self.leases.end(idx);
        self.keeps.end(idx);
        self.live -= 1;
        if self.entries[idx as usize].pins == 0 {
            Some(self.vacate(idx))
        } else {
            self.entries[idx as usize].state = EntryState::Doomed;
            None
        }
    }

    /// Adds the bytes in each of the policy's queues to `out`.
    pub fn queue_bytes(&self, out: &mut [u64; QUEUES]) {
        self.policy.queue_bytes(out);
    }

    /// Up to `limit` unpinned entries of the policy's `queue`, next to evict first, as
    /// `(rank, idx)` ([`ShardPolicy::candidates`]).
    pub fn candidates(&mut self, queue: usize, limit: usize, now: u64, out: &mut Vec<(u64, u32)>) {
        let (entries, leases, keeps) = (&self.entries, &self.leases, &self.keeps);
        self.policy.candidates(
            queue,
            limit,
            now,
            &|i| entries[i as usize].pins > 0 || leases.holds(i) || keeps.holds(i),
            out,
        );
    }

    /// Whether `(rank, idx)` from [`Shard::candidates`] may still be evicted: live, unpinned,
    /// unleased, and not used or moved since.
    pub fn still_candidate(&self, idx: u32, queue: usize, rank: u64) -> bool {
        let e = &self.entries[idx as usize];
        e.state == EntryState::Live
            && e.pins == 0
            && !self.leases.holds(idx)
            && !self.keeps.holds(idx)
            && self.policy.still_candidate(idx, queue, rank)
    }

    /// Whether a lookup's lease or a keep protects `idx` from eviction now.
    pub fn leased(&self, idx: u32) -> bool {
        self.leases.holds(idx) || self.keeps.holds(idx)
    }

    /// Keeps live entry `idx` for `ttl_ms` ([`crate::keep`]).
    pub fn keep(&mut self, idx: u32, ttl_ms: u64) -> PinOutcome {
        let e = &self.entries[idx as usize];
        self.keeps.keep(idx, e.len, e.key.namespace_id(), ttl_ms)
    }

    /// Adds this shard's live keeps to `out`, by namespace.
    pub fn summarize_keeps(
        &self,
        out: &mut std::collections::HashMap<[u8; 16], crate::keep::NamespacePins>,
    ) {
        self.keeps.summarize(out);
    }

    /// Milliseconds the keep of `idx` has left (0: not kept).
    pub fn keep_left_ms(&self, idx: u32) -> u64 {
        self.keeps.left_ms(idx)
    }

    /// Releases the keep of `idx`; whether it was kept.
    pub fn release_kept(&mut self, idx: u32) -> bool {
        self.keeps.release(idx)
    }

    /// Counts and drops the keeps that ran out.
    pub fn sweep_keeps(&mut self) {
        self.keeps.sweep();
    }

    /// Takes a lookup's lease on live entry `idx`; `None` when the bound refuses it.
    pub fn lease(&mut self, idx: u32) -> Option<Grant> {
        let len = self.entries[idx as usize].len;
        self.leases.grant(idx, len)
    }

    /// Takes back the lease `g` that [`Shard::lease`] gave.
    pub fn take_back_lease(&mut self, idx: u32, g: Grant) {
        self.leases.take_back(idx, g);
    }

    /// A load used one of `idx`'s leases.
    pub fn release_lease(&mut self, idx: u32) {
        self.leases.release(idx);
    }

    /// Counts and drops the leases that ran out.
    pub fn sweep_leases(&mut self) {
        self.leases.sweep();
    }

    /// Every unpinned, unleased live entry in the policy's eviction order, as `(rank, idx)`,
    /// in place of what `out` held.
    pub fn eviction_order(&self, out: &mut Vec<(u64, u32)>) {
        out.clear();
        self.policy.order(out);
        let (entries, leases, keeps) = (&self.entries, &self.leases, &self.keeps);
        out.retain(|&(_, idx)| {
            entries[idx as usize].pins == 0 && !leases.holds(idx) && !keeps.holds(idx)
        });
    }

    /// Ids of every live entry.
    pub fn live_ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.live);
        let mut order = Vec::with_capacity(self.live);
        self.policy.order(&mut order);
        out.extend(order.into_iter().map(|(_, idx)| idx));
        out
    }

    /// What the policy counted.
    pub fn policy_counters(&self) -> PolicyCounters {
        self.policy.counters()
    }

    /// Bytes of metadata this shard holds.
    pub fn metadata_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.sums.capacity() * 8
            + self.vacant.capacity() * 4
            + self.table.capacity() * (std::mem::size_of::<TableSlot>() + 1)
            + self.policy.metadata_bytes()
            + self.leases.metadata_bytes()
            + self.keeps.metadata_bytes()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::keep::KeepBook;
    use crate::lease::LeaseBook;

    /// Every object costs one entry: its size is the pool's metadata per object (with the
    /// table's slot), so growing it is a decision, not an accident. A 64-byte key, the slot
    /// (24), the length, the pins, the state and the checksum's flag fill 104 bytes; a
    /// checksum (with `integrity` on) lives beside, 8 bytes more.
    #[test]
    fn an_entry_stays_at_104_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 104);
    }

    #[test]
    fn checksums_are_kept_only_for_the_entries_that_have_one() {
        let clock = Arc::new(LeaseBook::new(0, 0));
        let mut s = Shard::new(
            EvictionPolicy::Lru,
            Leases::new(Arc::clone(&clock)),
            Keeps::new(Arc::new(KeepBook::new(0, 0, clock))),
        );
        let slot = |i: u64| Slot {
            offset: i * 4096,
            bytes: 4096,
            segment: 0,
            index: i as u32,
        };
        let k = |i: u8| BlockKey::from_bytes([i; 64]);
        let a = s.insert(k(1), 1, slot(0), 4096, 0);
        let b = s.insert(k(2), 2, slot(1), 4096, 0);
        assert_eq!(s.sum(a), None);
        let before = s.sums.capacity();
        assert_eq!(before, 0, "no integrity, no checksum storage");
        s.set_sum(b, Some(7));
        assert_eq!((s.sum(a), s.sum(b)), (None, Some(7)));
        s.set_sum(b, None);
        assert_eq!(s.sum(b), None);
    }
}
