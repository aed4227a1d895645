//! The pool: region + allocator + sharded index + eviction + stats + events.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::{BlockKey, CoreError, PoolConfig};

use crate::alloc::{Allocator, Slot};
use crate::index::{EntryState, Shard};
use crate::region::{Placement, Region};
use crate::PoolError;

const SHARD_BITS: u32 = 6;
const SHARDS: usize = 1 << SHARD_BITS;
/// Candidates taken from each shard per eviction round.
const EVICT_BATCH: usize = 32;

#[inline]
fn shard_of(fp: u64) -> usize {
    (fp >> (64 - SHARD_BITS)) as usize
}

fn owner_tag(shard: usize, idx: u32) -> u64 {
    ((shard as u64) << 32) | u64::from(idx)
}

/// Why an object left the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveCause {
    /// Evicted to make room.
    Evicted,
    /// Removed by key.
    Removed,
    /// Removed by a clear.
    Cleared,
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
}

#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    duplicate_puts: AtomicU64,
    gets: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    reservations: AtomicU64,
    pinned: AtomicU64,
    objects: AtomicU64,
}

#[derive(Debug, Default)]
struct EventHub {
    active: AtomicBool,
    subscribers: Mutex<Vec<SyncSender<PoolEvent>>>,
    dropped: AtomicU64,
}

impl EventHub {
    fn publish(&self, events: Vec<PoolEvent>) {
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
    fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct Inner {
    region: Region,
    alloc: Mutex<Allocator>,
    shards: Box<[RwLock<Shard>]>,
    tick: AtomicU64,
    capacity: u64,
    high_bytes: u64,
    low_bytes: u64,
    counters: Counters,
    events: EventHub,
    wake: Mutex<bool>,
    wake_cv: Condvar,
    closed: AtomicBool,
}

/// The host-DRAM object pool. Cheap to share behind an `Arc`; objects, reservations and pins
/// keep the memory alive on their own.
#[derive(Debug)]
pub struct Pool {
    inner: Arc<Inner>,
    evictor: Mutex<Option<JoinHandle<()>>>,
}

/// Room for one object, exclusively owned by its writer until [`Pool::commit`]. Dropping it
/// uncommitted returns the room to the pool.
#[derive(Debug)]
pub struct Reservation {
    inner: Arc<Inner>,
    slot: Option<Slot>,
    len: u64,
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
    inner: Arc<Inner>,
    shard: u32,
    idx: u32,
    offset: u64,
    len: u64,
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

impl Pool {
    /// Maps the pool's memory and starts its background evictor.
    pub fn new(cfg: PoolConfig) -> Result<Pool, PoolError> {
        let region = Region::map(&cfg)?;
        let segment_bytes = cfg.effective_segment_bytes();
        let num_segments = (region.len() as u64 / segment_bytes) as u32;
        if num_segments == 0 {
            return Err(CoreError::option(
                "segment_bytes",
                format!(
                    "{segment_bytes} is larger than capacity_bytes {}; lower it or leave it 0",
                    cfg.capacity_bytes
                ),
            )
            .into());
        }
        let alloc = Allocator::new(segment_bytes, num_segments);
        let capacity = alloc.capacity();
        let inner = Arc::new(Inner {
            region,
            alloc: Mutex::new(alloc),
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::new())).collect(),
            tick: AtomicU64::new(1),
            capacity,
            high_bytes: (capacity as f64 * cfg.high_watermark) as u64,
            low_bytes: (capacity as f64 * cfg.low_watermark) as u64,
            counters: Counters::default(),
            events: EventHub::default(),
            wake: Mutex::new(false),
            wake_cv: Condvar::new(),
            closed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        let evictor = std::thread::Builder::new()
            .name("umbp-evictor".into())
            .spawn(move || evictor_loop(weak))
            .map_err(|source| PoolError::Spawn {
                thread: "umbp-evictor",
                source,
            })?;
        Ok(Pool {
            inner,
            evictor: Mutex::new(Some(evictor)),
        })
    }

    /// Usable bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// How the memory was placed.
    pub fn placement(&self) -> &Placement {
        self.inner.region.placement()
    }

    /// Base address and length of the pool's memory (for registering it with a DMA engine).
    pub fn memory(&self) -> (u64, u64) {
        (
            self.inner.region.base() as u64,
            self.inner.region.len() as u64,
        )
    }

    /// The memfd behind the pool, when it is memfd-backed.
    pub fn memfd(&self) -> Option<&std::os::fd::OwnedFd> {
        self.inner.region.fd()
    }

    /// Reserves room for an object of `len` bytes, evicting just enough least-recently-used
    /// objects synchronously when the pool is full. Fails with [`PoolError::Full`] only when
    /// what is left is pinned or being written.
    pub fn reserve(&self, len: u64) -> Result<Reservation, PoolError> {
        self.reserve_inner(len, true)
    }

    /// Like [`Pool::reserve`] but never evicts on the caller's path: a pool that has no room at
    /// once answers [`PoolError::Full`] (retry later).
    pub fn try_reserve(&self, len: u64) -> Result<Reservation, PoolError> {
        self.reserve_inner(len, false)
    }

    fn reserve_inner(&self, len: u64, evict: bool) -> Result<Reservation, PoolError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(PoolError::Closed);
        }
        let footprint = inner.alloc.lock().footprint(len);
        if footprint > inner.capacity || len == 0 {
            return Err(PoolError::TooLarge {
                requested: len,
                max: inner.capacity,
            });
        }
        let mut lru_freed = 0u64;
        let mut tried_segments = Vec::new();
        loop {
            let got = {
                let mut a = inner.alloc.lock();
                let slot = a.alloc(len);
                (slot, a.used())
            };
            if let (Some(slot), used) = got {
                inner.counters.reservations.fetch_add(1, Ordering::Relaxed);
                if used > inner.high_bytes {
                    inner.wake_evictor();
                }
                return Ok(Reservation {
                    inner: Arc::clone(inner),
                    slot: Some(slot),
                    len,
                });
            }
            let full = || PoolError::Full {
                requested: len,
                capacity: inner.capacity,
                pinned_or_writing: inner.alloc.lock().used(),
            };
            if !evict {
                return Err(full());
            }
            // First evict least-recently-used objects; if the bytes freed that way do not help
            // (fragmentation), empty whole segments, oldest first.
            if lru_freed < footprint + inner.alloc.lock().segment_bytes() {
                let freed = inner.evict_lru(footprint, RemoveCause::Evicted);
                lru_freed += freed.max(1);
                if freed > 0 {
                    continue;
                }
            }
            if !inner.evict_oldest_segment(&mut tried_segments) {
                return Err(full());
            }
        }
    }

    /// Makes a reservation's object visible under `key`. The first committed writer of a key
    /// wins; a later one gets [`CommitOutcome::AlreadyPresent`] and its object is discarded.
    pub fn commit(&self, mut res: Reservation, key: BlockKey) -> CommitOutcome {
        let inner = &self.inner;
        let slot = res.slot.take().expect("live reservation");
        let len = res.len;
        drop(res);
        let fp = key.fingerprint();
        let si = shard_of(fp);
        let mut shard = inner.shards[si].write();
        if shard.find(&key, fp).is_some() {
            drop(shard);
            inner.alloc.lock().free(slot);
            inner
                .counters
                .duplicate_puts
                .fetch_add(1, Ordering::Relaxed);
            return CommitOutcome::AlreadyPresent;
        }
        let tick = inner.tick.fetch_add(1, Ordering::Relaxed);
        let idx = shard.insert(key, fp, slot, len, tick);
        inner.alloc.lock().set_owner(slot, owner_tag(si, idx));
        drop(shard);
        let c = &inner.counters;
        c.puts.fetch_add(1, Ordering::Relaxed);
        c.objects.fetch_add(1, Ordering::Relaxed);
        c.bytes_in.fetch_add(len, Ordering::Relaxed);
        if inner.events.active() {
            inner
                .events
                .publish(vec![PoolEvent::Stored { key, bytes: len }]);
        }
        CommitOutcome::Stored
    }

    /// Reserves, fills and commits in one call (copies `data`).
    pub fn put(&self, key: BlockKey, data: &[u8]) -> Result<CommitOutcome, PoolError> {
        if self.contains(&key) {
            return Ok(CommitOutcome::AlreadyPresent);
        }
        let mut r = self.reserve(data.len() as u64)?;
        r.as_mut_slice().copy_from_slice(data);
        Ok(self.commit(r, key))
    }

    /// Whether `key` is committed. Does not pin and does not refresh recency.
    pub fn contains(&self, key: &BlockKey) -> bool {
        let fp = key.fingerprint();
        let hit = self.inner.shards[shard_of(fp)]
            .read()
            .find(key, fp)
            .is_some();
        let c = if hit {
            &self.inner.counters.hits
        } else {
            &self.inner.counters.misses
        };
        c.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Which of `keys` are committed. Pins nothing and does not refresh recency.
    ///
    /// Batches compare 64-bit key fingerprints, not whole keys (see `Shard::contains_fp`): a
    /// false hit is about 2^-64 likely and would only make the following load miss.
    /// Keys are grouped by shard so each shard's lock is taken once per batch, not once per
    /// key: with many lookup threads on few cores, the lock words would otherwise bounce
    /// between cores on every key.
    pub fn exists_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let out = self.presence(keys);
        let hits = out.iter().filter(|h| **h).count() as u64;
        self.count_lookups(hits, keys.len() as u64 - hits);
        out
    }

    fn presence(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.presence_with(keys.len(), |i| keys[i])
    }

    /// Which of the keys `key(0)..key(n)` are committed; keys are made on the fly (twice), so
    /// a long batch needs no key buffer.
    fn presence_with(&self, n: usize, key: impl Fn(usize) -> BlockKey) -> Vec<bool> {
        let mut out = vec![false; n];
        if n < 16 {
            for (i, o) in out.iter_mut().enumerate() {
                let k = key(i);
                let fp = k.fingerprint();
                *o = self.inner.shards[shard_of(fp)]
                    .read()
                    .find(&k, fp)
                    .is_some();
            }
            return out;
        }
        // Counting sort of key indices by shard, then one read lock per shard.
        let fps: Vec<u64> = (0..n).map(|i| key(i).fingerprint()).collect();
        let mut starts = [0usize; SHARDS + 1];
        for fp in &fps {
            starts[shard_of(*fp) + 1] += 1;
        }
        for i in 0..SHARDS {
            starts[i + 1] += starts[i];
        }
        let mut next = starts;
        let mut order = vec![0u32; n];
        for (i, fp) in fps.iter().enumerate() {
            let s = shard_of(*fp);
            order[next[s]] = i as u32;
            next[s] += 1;
        }
        for s in 0..SHARDS {
            let idx = &order[starts[s]..starts[s + 1]];
            if idx.is_empty() {
                continue;
            }
            let shard = self.inner.shards[s].read();
            for &i in idx {
                let i = i as usize;
                out[i] = shard.contains_fp(fps[i]);
            }
        }
        out
    }

    /// How many keys `key(0)`, `key(1)`, ... of `n` are committed before the first miss.
    pub fn prefix_hits_with(&self, n: usize, key: impl Fn(usize) -> BlockKey) -> usize {
        let hits = if n > 0 && {
            let k = key(0);
            let fp = k.fingerprint();
            self.inner.shards[shard_of(fp)]
                .read()
                .find(&k, fp)
                .is_some()
        } {
            let present = self.presence_with(n - 1, |i| key(i + 1));
            1 + present.iter().take_while(|p| **p).count()
        } else {
            0
        };
        self.count_lookups(hits as u64, u64::from(hits < n));
        hits
    }

    /// How many of `keys`, from the first, are committed (the prefix up to the first miss).
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> usize {
        self.prefix_hits_with(keys.len(), |i| keys[i])
    }

    fn count_lookups(&self, hits: u64, misses: u64) {
        let c = &self.inner.counters;
        c.hits.fetch_add(hits, Ordering::Relaxed);
        c.misses.fetch_add(misses, Ordering::Relaxed);
    }

    /// Pins `key`'s object for reading and marks it most recently used.
    pub fn get(&self, key: &BlockKey) -> Option<PinnedObject> {
        let c = &self.inner.counters;
        let Some(obj) = self.pin(key, true) else {
            c.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        c.hits.fetch_add(1, Ordering::Relaxed);
        c.gets.fetch_add(1, Ordering::Relaxed);
        c.bytes_out.fetch_add(obj.len, Ordering::Relaxed);
        Some(obj)
    }

    /// Pins `key`'s object for reading without refreshing its recency or counting a hit or a
    /// get: for readers that are not the engine (the remote tier's writer).
    pub fn peek(&self, key: &BlockKey) -> Option<PinnedObject> {
        self.pin(key, false)
    }

    /// Pins `key`'s object (marking it most recently used when `touch`); counts the pin only.
    fn pin(&self, key: &BlockKey, touch: bool) -> Option<PinnedObject> {
        let inner = &self.inner;
        let fp = key.fingerprint();
        let si = shard_of(fp);
        let mut shard = inner.shards[si].write();
        let idx = shard.find(key, fp)?;
        shard.pin(idx);
        if touch {
            shard.touch(idx, inner.tick.fetch_add(1, Ordering::Relaxed));
        }
        let e = shard.entry(idx);
        let (offset, len) = (e.slot.offset, e.len);
        drop(shard);
        inner.counters.pinned.fetch_add(1, Ordering::Relaxed);
        Some(PinnedObject {
            inner: Arc::clone(inner),
            shard: si as u32,
            idx,
            offset,
            len,
        })
    }

    /// Removes `key`. A pinned object disappears from lookups at once and is freed when its
    /// last pin is dropped. Returns whether the key was present.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let inner = &self.inner;
        let fp = key.fingerprint();
        let mut shard = inner.shards[shard_of(fp)].write();
        let Some(idx) = shard.find(key, fp) else {
            return false;
        };
        let freed = shard.remove(idx);
        drop(shard);
        inner.finish_removals(
            freed.into_iter().collect(),
            vec![(*key, RemoveCause::Removed)],
        );
        true
    }

    /// Removes every object (pinned ones are freed when unpinned). Returns how many.
    pub fn clear(&self) -> u64 {
        self.clear_where(|_| true)
    }

    /// Removes the objects of one key namespace (`namespace_id`: the first 16 bytes of its
    /// keys, [`BlockKey::namespace_id`]); other namespaces are untouched. Returns how many.
    pub fn clear_namespace(&self, namespace_id: &[u8; 16]) -> u64 {
        self.clear_where(|k| k.namespace_id() == *namespace_id)
    }

    fn clear_where(&self, matches: impl Fn(&BlockKey) -> bool) -> u64 {
        let inner = &self.inner;
        let mut removed = 0;
        for shard in inner.shards.iter() {
            let mut s = shard.write();
            let mut slots = Vec::new();
            let mut keys = Vec::new();
            for idx in s.live_ids() {
                let key = s.entry(idx).key;
                if !matches(&key) {
                    continue;
                }
                keys.push((key, RemoveCause::Cleared));
                slots.extend(s.remove(idx));
            }
            drop(s);
            removed += keys.len() as u64;
            inner.finish_removals(slots, keys);
        }
        removed
    }

    /// Evicts least-recently-used objects until occupancy is at the low watermark, now, on the
    /// caller's thread. Returns the bytes freed.
    pub fn evict_to_low_watermark(&self) -> u64 {
        let used = self.inner.alloc.lock().used();
        if used <= self.inner.low_bytes {
            return 0;
        }
        self.inner
            .evict_lru(used - self.inner.low_bytes, RemoveCause::Evicted)
    }

    /// A stream of stored / removed events. At most `capacity` events wait unread; past that,
    /// events are dropped (counted in [`PoolStats::events_dropped`]) so the pool never blocks.
    pub fn subscribe(&self, capacity: usize) -> Receiver<PoolEvent> {
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity.max(1));
        let hub = &self.inner.events;
        hub.subscribers.lock().push(tx);
        hub.active.store(true, Ordering::Relaxed);
        rx
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let inner = &self.inner;
        let c = &inner.counters;
        let mut metadata = inner
            .shards
            .iter()
            .map(|s| s.read().metadata_bytes())
            .sum::<usize>() as u64;
        let (used, free_segments, segment_bytes, alloc_meta) = {
            let a = inner.alloc.lock();
            // owner tags (8 bytes per slot) and segment records
            let meta = a.capacity() / 4096 * 2 + u64::from(a.num_segments()) * 96;
            (a.used(), a.free_segments() as u64, a.segment_bytes(), meta)
        };
        metadata += alloc_meta;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            capacity_bytes: inner.capacity,
            used_bytes: used,
            objects: r(&c.objects),
            puts: r(&c.puts),
            duplicate_puts: r(&c.duplicate_puts),
            gets: r(&c.gets),
            hits: r(&c.hits),
            misses: r(&c.misses),
            evictions: r(&c.evictions),
            bytes_in: r(&c.bytes_in),
            bytes_out: r(&c.bytes_out),
            reservations: r(&c.reservations),
            pinned: r(&c.pinned),
            events_dropped: inner.events.dropped.load(Ordering::Relaxed),
            segment_bytes,
            free_segments,
            metadata_bytes: metadata,
            placement: inner.region.placement().clone(),
        }
    }

    /// Stops the evictor and refuses new reservations. Objects already handed out stay valid.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.wake_evictor();
        if let Some(h) = self.evictor.lock().take() {
            let _ = h.join();
        }
    }

    /// Checks the allocator's and index's invariants (tests only).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let live: usize = self.inner.shards.iter().map(|s| s.read().live()).sum();
        assert_eq!(
            live as u64,
            self.inner.counters.objects.load(Ordering::Relaxed)
        );
        self.inner.alloc.lock().check_invariants();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

impl Inner {
    fn wake_evictor(&self) {
        *self.wake.lock() = true;
        self.wake_cv.notify_one();
    }

    /// Frees `slots`, counts and publishes `removed`.
    fn finish_removals(&self, slots: Vec<Slot>, removed: Vec<(BlockKey, RemoveCause)>) {
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
    fn evict_lru(&self, target: u64, cause: RemoveCause) -> u64 {
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
    fn evict_oldest_segment(&self, tried: &mut Vec<u32>) -> bool {
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

fn evictor_loop(weak: Weak<Inner>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::{KeyBuilder, RankTopology};

    fn pool(capacity: u64, segment: u64) -> Pool {
        Pool::new(PoolConfig {
            segment_bytes: segment,
            prefault: false,
            ..PoolConfig::with_capacity(capacity)
        })
        .unwrap()
    }

    fn key(i: u64) -> BlockKey {
        KeyBuilder::new("t", RankTopology::default())
            .unwrap()
            .key(0, &i.to_le_bytes())
            .unwrap()
    }

    #[test]
    fn peek_pins_without_counting_a_lookup() {
        let p = Pool::new(PoolConfig::with_capacity(64 << 20)).unwrap();
        let (a, b) = (key(1), key(2));
        p.put(a, &[1u8; 4096]).unwrap();
        p.put(b, &[2u8; 4096]).unwrap();
        let before = p.stats();
        let o = p.peek(&a).unwrap();
        assert_eq!(o.as_slice(), &[1u8; 4096][..]);
        assert_eq!(p.stats().pinned, before.pinned + 1);
        drop(o);
        let after = p.stats();
        assert_eq!(
            (after.hits, after.gets, after.pinned),
            (before.hits, before.gets, before.pinned)
        );
        assert!(p.peek(&key(3)).is_none());
        assert_eq!(
            p.stats().misses,
            before.misses,
            "a peek miss is no lookup miss"
        );
    }

    #[test]
    fn clear_namespace_removes_only_that_namespace() {
        let p = pool(1 << 20, 64 << 10);
        let other = KeyBuilder::new("other", RankTopology::default()).unwrap();
        for i in 0..20u64 {
            p.put(key(i), &[1; 100]).unwrap();
            p.put(other.key(0, &i.to_le_bytes()).unwrap(), &[2; 100])
                .unwrap();
        }
        assert_eq!(p.clear_namespace(&key(0).namespace_id()), 20);
        assert!((0..20).all(|i| !p.contains(&key(i))));
        assert!((0..20u64).all(|i| p.contains(&other.key(0, &i.to_le_bytes()).unwrap())));
        assert_eq!(p.stats().objects, 20);
        assert_eq!(p.clear_namespace(&key(0).namespace_id()), 0);
        assert_eq!(p.clear(), 20);
    }

    #[test]
    fn readers_see_only_committed_objects() {
        let p = pool(1 << 20, 64 << 10);
        let mut r = p.reserve(1000).unwrap();
        r.as_mut_slice().fill(9);
        assert!(!p.contains(&key(1)));
        assert!(p.get(&key(1)).is_none());
        assert_eq!(p.commit(r, key(1)), CommitOutcome::Stored);
        let g = p.get(&key(1)).unwrap();
        assert_eq!(g.as_slice(), &[9u8; 1000][..]);
    }

    #[test]
    fn first_committed_writer_wins() {
        let p = pool(1 << 20, 64 << 10);
        let mut a = p.reserve(10).unwrap();
        let mut b = p.reserve(10).unwrap();
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        assert_eq!(p.commit(b, key(5)), CommitOutcome::Stored);
        assert_eq!(p.commit(a, key(5)), CommitOutcome::AlreadyPresent);
        assert_eq!(p.get(&key(5)).unwrap().as_slice(), &[2u8; 10]);
        let s = p.stats();
        assert_eq!((s.puts, s.duplicate_puts, s.objects), (1, 1, 1));
        p.check_invariants();
    }

    #[test]
    fn abandoned_reservations_are_reclaimed() {
        let p = pool(1 << 20, 64 << 10);
        let r = p.reserve(300 << 10).unwrap();
        assert!(p.stats().used_bytes >= 300 << 10);
        assert_eq!(p.stats().reservations, 1);
        drop(r);
        let s = p.stats();
        assert_eq!((s.used_bytes, s.reservations), (0, 0));
    }

    #[test]
    fn pinned_objects_survive_remove_and_clear() {
        let p = pool(1 << 20, 64 << 10);
        p.put(key(1), &[7; 4096]).unwrap();
        let pin = p.get(&key(1)).unwrap();
        assert!(p.remove(&key(1)));
        assert!(!p.contains(&key(1)));
        // Fill the pool: the pinned slot must not be reused.
        for i in 10..400 {
            let _ = p.put(key(i), &[0xEE; 4096]);
        }
        assert_eq!(pin.as_slice(), &[7u8; 4096][..]);
        p.clear();
        assert_eq!(pin.as_slice(), &[7u8; 4096][..]);
        let used_with_pin = p.stats().used_bytes;
        drop(pin);
        assert_eq!(p.stats().used_bytes, used_with_pin - 4096);
        p.check_invariants();
    }

    #[test]
    fn full_pool_evicts_synchronously_or_reports_full() {
        let p = pool(1 << 20, 64 << 10);
        for i in 0..1000 {
            p.put(key(i), &[1; 16 << 10]).unwrap();
        }
        assert!(p.stats().evictions > 900);
        // Pin everything that is left: a new object cannot fit and nothing is evictable.
        let pins: Vec<_> = (0..1000).filter_map(|i| p.get(&key(i))).collect();
        assert!(!pins.is_empty());
        let mut held = Vec::new();
        loop {
            match p.reserve(16 << 10) {
                Ok(r) => held.push(r),
                Err(PoolError::Full { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        let e = p.try_reserve(16 << 10).unwrap_err().to_string();
        assert!(e.contains("pool full") && e.contains("retry"), "{e}");
    }

    #[test]
    fn too_large_is_distinct() {
        let p = pool(1 << 20, 64 << 10);
        assert!(matches!(
            p.reserve(2 << 20),
            Err(PoolError::TooLarge { .. })
        ));
        assert!(matches!(p.reserve(0), Err(PoolError::TooLarge { .. })));
    }

    #[test]
    fn background_eviction_brings_usage_to_low_watermark() {
        let p = Pool::new(PoolConfig {
            segment_bytes: 64 << 10,
            prefault: false,
            high_watermark: 0.5,
            low_watermark: 0.25,
            ..PoolConfig::with_capacity(4 << 20)
        })
        .unwrap();
        for i in 0..200 {
            p.put(key(i), &[3; 16 << 10]).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.stats().used_bytes > p.capacity() / 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = p.stats();
        assert!(s.used_bytes <= p.capacity() / 2, "{s:?}");
        assert!(s.evictions > 0);
        // The survivors are the most recently stored keys.
        assert!(p.contains(&key(199)));
        assert!(!p.contains(&key(0)));
    }

    #[test]
    fn lookups_do_not_pin_or_refresh() {
        // A high watermark of 1.0 keeps the background evictor out: only the synchronous
        // eviction of a full pool runs, so which keys go is decided by LRU order alone (with the
        // defaults the evictor could drop key 0 while the pool fills, before the lookups below).
        let p = Pool::new(PoolConfig {
            segment_bytes: 64 << 10,
            prefault: false,
            high_watermark: 1.0,
            low_watermark: 0.5,
            ..PoolConfig::with_capacity(1 << 20)
        })
        .unwrap();
        for i in 0..64 {
            p.put(key(i), &[1; 16 << 10]).unwrap();
        }
        // Looking key 0 up must not save it from eviction.
        assert!(p.exists_many(&[key(0)])[0]);
        assert_eq!(p.prefix_hits(&[key(0), key(1), key(999)]), 2);
        p.put(key(100), &[1; 16 << 10]).unwrap();
        assert!(!p.contains(&key(0)));
        assert_eq!(p.stats().pinned, 0);
        // A pinned read does refresh: key 1 survives the next eviction, key 2 does not.
        drop(p.get(&key(1)).unwrap());
        p.put(key(101), &[1; 16 << 10]).unwrap();
        assert!(p.contains(&key(1)));
        assert!(!p.contains(&key(2)));
    }

    #[test]
    fn events_report_stores_and_removals() {
        let p = pool(1 << 20, 64 << 10);
        let rx = p.subscribe(1024);
        p.put(key(1), &[1; 100]).unwrap();
        p.remove(&key(1));
        p.put(key(2), &[1; 100]).unwrap();
        p.clear();
        let evs: Vec<_> = rx.try_iter().collect();
        assert_eq!(
            evs,
            vec![
                PoolEvent::Stored {
                    key: key(1),
                    bytes: 100
                },
                PoolEvent::Removed {
                    key: key(1),
                    cause: RemoveCause::Removed
                },
                PoolEvent::Stored {
                    key: key(2),
                    bytes: 100
                },
                PoolEvent::Removed {
                    key: key(2),
                    cause: RemoveCause::Cleared
                },
            ]
        );
    }

    #[test]
    fn closed_pool_refuses_reservations() {
        let p = pool(1 << 20, 64 << 10);
        p.close();
        assert!(matches!(p.reserve(10), Err(PoolError::Closed)));
    }
}
