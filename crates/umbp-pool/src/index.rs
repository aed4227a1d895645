//! One shard of the pool's index: a hash table of entry ids, the entries in a slab, and an
//! intrusive LRU list (oldest at the head).

use hashbrown::HashTable;
use umbp_core::BlockKey;

use crate::alloc::Slot;

pub(crate) const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryState {
    Vacant,
    /// In the table and the LRU list.
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
    pub tick: u64,
    pub pins: u32,
    pub state: EntryState,
    prev: u32,
    next: u32,
}

/// The index shard. Callers hold the shard's lock.
#[derive(Debug)]
pub(crate) struct Shard {
    /// Entry ids with their key's fingerprint: probes compare fingerprints before touching an
    /// entry, and membership tests (`contains_fp`) never touch entries at all.
    table: HashTable<TableSlot>,
    entries: Vec<Entry>,
    vacant: Vec<u32>,
    head: u32,
    tail: u32,
    live: usize,
}

impl Shard {
    pub fn new() -> Self {
        Shard {
            table: HashTable::new(),
            entries: Vec::new(),
            vacant: Vec::new(),
            head: NIL,
            tail: NIL,
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

    /// Inserts a live entry at the LRU tail. The key must not be present.
    pub fn insert(&mut self, key: BlockKey, fp: u64, slot: Slot, len: u64, tick: u64) -> u32 {
        let entry = Entry {
            key,
            slot,
            len,
            tick,
            pins: 0,
            state: EntryState::Live,
            prev: NIL,
            next: NIL,
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
        self.push_tail(idx);
        self.live += 1;
        idx
    }

    fn push_tail(&mut self, idx: u32) {
        let e = &mut self.entries[idx as usize];
        e.prev = self.tail;
        e.next = NIL;
        if self.tail == NIL {
            self.head = idx;
        } else {
            self.entries[self.tail as usize].next = idx;
        }
        self.tail = idx;
    }

    fn unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let e = &self.entries[idx as usize];
            (e.prev, e.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
    }

    /// Marks `idx` most recently used.
    pub fn touch(&mut self, idx: u32, tick: u64) {
        self.unlink(idx);
        self.entries[idx as usize].tick = tick;
        self.push_tail(idx);
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

    /// Removes a live entry from the table and the LRU list. Returns its slot when it can be
    /// freed now; a pinned entry is doomed instead and freed by its last unpin.
    pub fn remove(&mut self, idx: u32) -> Option<Slot> {
        let fp = self.entries[idx as usize].key.fingerprint();
        debug_assert_eq!(self.entries[idx as usize].state, EntryState::Live);
        if let Ok(found) = self.table.find_entry(fp, |s| s.idx == idx) {
            found.remove();
        }
        self.unlink(idx);
        self.live -= 1;
        if self.entries[idx as usize].pins == 0 {
            Some(self.vacate(idx))
        } else {
            self.entries[idx as usize].state = EntryState::Doomed;
            None
        }
    }

    /// Up to `limit` of the least recently used unpinned entries, oldest first, as
    /// `(tick, idx)`.
    pub fn oldest_unpinned(&self, limit: usize, out: &mut Vec<(u64, u32)>) {
        let mut i = self.head;
        let mut n = 0;
        while i != NIL && n < limit {
            let e = &self.entries[i as usize];
            if e.pins == 0 {
                out.push((e.tick, i));
                n += 1;
            }
            i = e.next;
        }
    }

    /// Ids of every live entry.
    pub fn live_ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.live);
        let mut i = self.head;
        while i != NIL {
            out.push(i);
            i = self.entries[i as usize].next;
        }
        out
    }

    /// Bytes of metadata this shard holds.
    pub fn metadata_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.vacant.capacity() * 4
            + self.table.capacity() * (std::mem::size_of::<TableSlot>() + 1)
    }
}
