//! The pool: region + allocator + sharded index + eviction + stats + events.
//!
//! The shared state is in `inner`, the caller's handles with it, eviction and the
//! evictor thread in `evict`, and the public value types in `types`; this file is the
//! [`Pool`] API.

mod admit;
pub(crate) mod clearing;
mod evict;
mod handover;
// The one module with `unsafe`: the handles' slices of the arena, valid by the allocator's
// and the pins' invariants, which no wrapper below the pool can own (with the shared state
// and the spill hook, which hands out handles).
#[allow(unsafe_code)]
mod inner;
mod keeps;
mod leases;
mod types;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::{Admit, BlockKey, CoreError, PoolConfig};

use crate::alloc::Allocator;
use crate::index::Shard;
use crate::keep::{KeepBook, Keeps};
use crate::lease::{LeaseBook, Leases};
use crate::policy::PolicyCounters;
use crate::region::{Placement, Region};
use crate::PoolError;
use evict::evictor_loop;
pub use inner::SpillFn;
use inner::{owner_tag, shard_of, Counters, EventHub, Inner, SHARDS};

pub use inner::{PinnedObject, Reservation};
pub use types::{
    Adopted, CommitOutcome, PoolCounters, PoolEvent, PoolStats, RemoveCause, SpillKind,
};

/// The host-DRAM object pool. Cheap to share behind an `Arc`; objects, reservations and pins
/// keep the memory alive on their own.
#[derive(Debug)]
pub struct Pool {
    inner: Arc<Inner>,
    evictor: Mutex<Option<JoinHandle<()>>>,
}

impl Pool {
    /// Maps the pool's memory and starts its background evictor; `cfg` also sets the caching
    /// (`eviction_policy`, `store_admission`, `admission_window`).
    pub fn new(cfg: PoolConfig) -> Result<Pool, PoolError> {
        let region = Region::map(&cfg)?;
        Pool::with_region(cfg, region)
    }

    /// A pool of `cfg` over memory mapped already.
    fn with_region(cfg: PoolConfig, region: Region) -> Result<Pool, PoolError> {
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
        let leases = Arc::new(LeaseBook::new(cfg.lookup_lease_ms, capacity / 2));
        let keeps = Arc::new(KeepBook::new(
            cfg.keep_namespace_bytes(capacity),
            capacity / 2,
            Arc::clone(&leases),
        ));
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            region,
            alloc: Mutex::new(alloc),
            shards: (0..SHARDS)
                .map(|_| {
                    RwLock::new(Shard::new(
                        cfg.eviction_policy,
                        Leases::new(Arc::clone(&leases)),
                        Keeps::new(Arc::clone(&keeps)),
                    ))
                })
                .collect(),
            policy: cfg.eviction_policy,
            admission: admit::windows(&cfg),
            tick: AtomicU64::new(1),
            capacity,
            high_bytes: (capacity as f64 * cfg.high_watermark) as u64,
            low_bytes: (capacity as f64 * cfg.low_watermark) as u64,
            counters: Counters::default(),
            events: EventHub::default(),
            wake: Mutex::new(false),
            wake_cv: Condvar::new(),
            closed: AtomicBool::new(false),
            spill: Default::default(),
            leases,
            keeps,
            integrity: cfg.integrity,
            verify_tick: AtomicU64::new(0),
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

    /// Reserves room for an object of `len` bytes, evicting just enough objects (in the
    /// policy's order) synchronously when the pool is full. Fails with [`PoolError::Full`] only when
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
        let mut policy_freed = 0u64;
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
                    sum: None,
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
            // First evict in the policy's order; if the bytes freed that way do not help
            // (fragmentation), empty whole segments, first to evict first.
            if policy_freed < footprint + inner.alloc.lock().segment_bytes() {
                let freed = inner.evict(footprint, RemoveCause::Evicted, SpillKind::Now);
                policy_freed += freed.max(1);
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
    /// wins; a later one gets [`CommitOutcome::AlreadyPresent`] and its object is discarded,
    /// as is one the store admission refuses ([`CommitOutcome::Skipped`]).
    pub fn commit(&self, res: Reservation, key: BlockKey) -> CommitOutcome {
        self.commit_as(res, key, Admit::Policy)
    }

    /// [`Pool::commit`], meeting the store admission as `how` says: [`Admit::Now`] stores
    /// the key on its first sighting (a request marked to be stored at once) and remembers
    /// it; it is never [`CommitOutcome::Skipped`].
    pub fn commit_as(&self, mut res: Reservation, key: BlockKey, how: Admit) -> CommitOutcome {
        let inner = &self.inner;
        let fp = key.fingerprint();
        if !inner.admit_as(fp, how) {
            drop(res);
            return CommitOutcome::Skipped;
        }
        let sum = match (inner.integrity.sums(), res.sum) {
            (false, _) => None,
            (true, Some(sum)) => Some(sum),
            (true, None) => Some(crate::checksum(res.as_mut_slice())),
        };
        let slot = res.slot.take().expect("live reservation");
        let len = res.len;
        drop(res);
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
        shard.set_sum(idx, sum);
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

    /// Whether the store admission would store a commit of `key` now. Records the sighting:
    /// with `on_reuse` a key not seen before is remembered and refused (counted in
    /// [`PoolStats::admissions_skipped`]), and its next commit is stored. Writers that copy
    /// before committing ask first, so that a refused key costs no reservation and no copy.
    pub fn admit(&self, key: &BlockKey) -> bool {
        self.inner.admit(key.fingerprint())
    }

    /// [`Pool::admit`] for a store asked for as `how`: [`Admit::Now`] is always admitted
    /// (and remembered, counted in [`PoolStats::admissions_forced`] where `on_reuse` would
    /// have refused it).
    pub fn admit_as(&self, key: &BlockKey, how: Admit) -> bool {
        self.inner.admit_as(key.fingerprint(), how)
    }

    /// Reserves, fills and commits in one call (copies `data`). A key the store admission
    /// refuses is neither reserved nor copied.
    pub fn put(&self, key: BlockKey, data: &[u8]) -> Result<CommitOutcome, PoolError> {
        if self.contains(&key) {
            return Ok(CommitOutcome::AlreadyPresent);
        }
        if !self.admit(&key) {
            return Ok(CommitOutcome::Skipped);
        }
        let mut r = self.reserve(data.len() as u64)?;
        if self.inner.integrity.sums() {
            // Summed from the caller's bytes, so a copy that damaged them is found later.
            r.set_checksum(crate::checksum(data));
        }
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

    /// Which of `keys` are committed now, as [`Pool::exists_many`] but counting nothing (no
    /// hit, no miss) and leasing nothing: for bookkeeping that watches the pool (the
    /// connector's `BlockRemoved` events), not for lookups a load follows.
    pub fn holds_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.presence(keys)
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
        if hits < n && self.inner.admission.is_some() {
            // The first missing key is the one the engine computes next: seen.
            self.inner.seen(key(hits).fingerprint());
        }
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

    /// Pins `key`'s object for reading and marks it most recently used; the read uses one of
    /// the key's lookup leases, if it has any ([`Pool::prefix_hits_leased`]).
    pub fn get(&self, key: &BlockKey) -> Option<PinnedObject> {
        let c = &self.inner.counters;
        let Some(obj) = self.pin(key, true) else {
            c.misses.fetch_add(1, Ordering::Relaxed);
            self.inner.seen(key.fingerprint());
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

    /// The integrity setting: whether objects are checksummed and how many loads verify them.
    pub fn integrity(&self) -> umbp_core::Integrity {
        self.inner.integrity
    }

    /// Whether the load asking now should verify its object ([`Pool::verify`]): every load
    /// with `integrity` `all`, one in `integrity_sample_every` with `sample`, none with `off`.
    pub fn verify_due(&self) -> bool {
        match self.inner.integrity.verify_every() {
            0 => false,
            1 => true,
            every => self
                .inner
                .verify_tick
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(u64::from(every)),
        }
    }

    /// Checks `obj`'s bytes against the checksum kept with it ([`PinnedObject::verify`]):
    /// `true` when they match or the object has none; `false` (the object removed and
    /// counted) when the caller must fail the load.
    pub fn verify(&self, obj: &PinnedObject) -> bool {
        obj.verify()
    }

    /// Flips the bits of `mask` in byte `offset` of `key`'s object; whether it was there.
    /// Damage for tests of the integrity checks only ([`PinnedObject::debug_flip`]).
    #[doc(hidden)]
    pub fn debug_corrupt(&self, key: &BlockKey, offset: u64, mask: u8) -> bool {
        match self.pin(key, false) {
            Some(obj) => {
                obj.debug_flip(offset % obj.len().max(1), mask);
                true
            }
            None => false,
        }
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
            shard.release_lease(idx);
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
            spilled: 0,
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
        let freed = shard.remove(idx, false);
        drop(shard);
        inner.finish_removals(
            freed.into_iter().collect(),
            vec![(*key, RemoveCause::Removed)],
        );
        true
    }

    /// Removes every object (pinned ones are freed when unpinned). Returns how many. With a
    /// lower tier, clear it inside [`Pool::begin_clear`] instead.
    pub fn clear(&self) -> u64 {
        self.begin_clear().all()
    }

    /// Removes the objects of one key namespace (`namespace_id`: the first 16 bytes of its
    /// keys, [`BlockKey::namespace_id`]); other namespaces are untouched. Returns how many.
    /// With a lower tier, clear it inside [`Pool::begin_clear`] instead.
    pub fn clear_namespace(&self, namespace_id: &[u8; 16]) -> u64 {
        self.begin_clear().namespace(namespace_id)
    }

    /// The keys of every object in the pool now (a snapshot, shard by shard).
    pub fn keys(&self) -> Vec<BlockKey> {
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            let s = shard.read();
            out.extend(s.live_ids().into_iter().map(|idx| s.entry(idx).key));
        }
        out
    }

    pub(super) fn clear_where(&self, matches: impl Fn(&BlockKey) -> bool) -> u64 {
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
                slots.extend(s.remove(idx, false));
            }
            drop(s);
            removed += keys.len() as u64;
            inner.finish_removals(slots, keys);
        }
        removed
    }

    /// Evicts objects (in the policy's order) until occupancy is at the low watermark, now, on
    /// the caller's thread. Returns the bytes freed.
    pub fn evict_to_low_watermark(&self) -> u64 {
        let used = self.inner.used_for_watermarks();
        if used <= self.inner.low_bytes {
            return 0;
        }
        self.inner.evict(
            used - self.inner.low_bytes,
            RemoveCause::Evicted,
            SpillKind::Behind,
        )
    }

    /// Hands every object eviction takes to `hook`, pinned: the object leaves lookups at once
    /// and its memory is freed when the hook's receiver drops the pin. Objects of the watermark
    /// eviction (the background evictor and
    /// [`evict_to_low_watermark`](Self::evict_to_low_watermark)) come as [`SpillKind::Behind`]:
    /// the pin may be kept until the object is written to a disk tier, say, and until then its
    /// bytes are not counted against the high watermark again, so the evictor does not evict
    /// more for them. Objects of the just-enough eviction of a reservation that found the pool
    /// full (and of its whole-segment fallback) come as [`SpillKind::Now`]: the reservation
    /// needs their memory, so the hook must release the pin before it returns (copying the
    /// bytes out, or dropping the object). The hook must not block.
    pub fn set_spill(&self, hook: Option<SpillFn>) {
        *self.inner.spill.hook.write() = hook;
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
        let mut metadata = 0u64;
        let mut policy = PolicyCounters::default();
        for shard in inner.shards.iter() {
            let s = shard.read();
            metadata += s.metadata_bytes() as u64;
            policy.add(&s.policy_counters());
        }
        let (admission_seen, admission_meta) = inner.admission_window();
        metadata += admission_meta;
        let (used, free_segments, segment_bytes, alloc_meta) = {
            let a = inner.alloc.lock();
            // owner tags (8 bytes per slot) and segment records
            let meta = a.capacity() / 4096 * 2 + u64::from(a.num_segments()) * 96;
            (a.used(), a.free_segments() as u64, a.segment_bytes(), meta)
        };
        metadata += alloc_meta;
        let [leases, leases_released, leases_expired, leases_refused, leases_ended, leases_active, leased_bytes] =
            inner.lease_counts();
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            counters: PoolCounters {
                capacity_bytes: inner.capacity,
                used_bytes: used,
                objects: r(&c.objects),
                puts: r(&c.puts),
                duplicate_puts: r(&c.duplicate_puts),
                gets: r(&c.gets),
                hits: r(&c.hits),
                misses: r(&c.misses),
                evictions: r(&c.evictions),
                evictions_small: policy.evicted[crate::policy::s3fifo::SMALL],
                evictions_main: policy.evicted[crate::policy::s3fifo::MAIN],
                promotions: policy.promotions,
                ghost_hits: policy.ghost_hits,
                admissions_skipped: r(&c.admissions_skipped),
                admissions_forced: r(&c.admissions_forced),
                admission_seen,
                verified: r(&c.verified),
                corrupt_detected: r(&c.corrupt_detected),
                bytes_in: r(&c.bytes_in),
                bytes_out: r(&c.bytes_out),
                reservations: r(&c.reservations),
                pinned: r(&c.pinned),
                events_dropped: inner.events.dropped.load(Ordering::Relaxed),
                segment_bytes,
                free_segments,
                metadata_bytes: metadata,
                leases,
                leases_released,
                leases_expired,
                leases_refused,
                leases_ended,
                leases_active,
                leased_bytes,
            },
            eviction_policy: inner.policy,
            store_admission: if inner.admission.is_some() {
                umbp_core::caching::StoreAdmission::OnReuse
            } else {
                umbp_core::caching::StoreAdmission::All
            },
            integrity: inner.integrity,
            placement: inner.region.placement().clone(),
            lookup_lease_ms: inner.leases.ms,
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

impl PinnedObject {
    /// Checks the bytes against the checksum kept with the object: `true` when they match or
    /// the object has none. On a mismatch the object is removed from the pool (this pin keeps
    /// its memory until dropped; nobody finds it again), counted in
    /// [`PoolStats::corrupt_detected`] and logged, and `false` is answered: the caller must
    /// not hand the bytes on (fail the load, skip the write to another tier). The bytes
    /// cannot change while pinned (committed objects are never written), so what was
    /// verified is what the caller copies next.
    pub fn verify(&self) -> bool {
        let Some(want) = self.checksum() else {
            return true;
        };
        let inner = &self.inner;
        inner.counters.verified.fetch_add(1, Ordering::Relaxed);
        if crate::checksum(self.as_slice()) == want {
            return true;
        }
        inner
            .counters
            .corrupt_detected
            .fetch_add(1, Ordering::Relaxed);
        let mut shard = inner.shards[self.shard as usize].write();
        let e = shard.entry(self.idx);
        let key = e.key;
        // Still the entry this pin holds (not removed meanwhile): removed now.
        let live = e.state == crate::index::EntryState::Live && e.slot.offset == self.offset;
        let freed = if live {
            shard.remove(self.idx, false)
        } else {
            None
        };
        drop(shard);
        log::warn!(
            "umbp: object {key:?} failed its checksum: removed from the pool; its load fails \
             and the engine recomputes it"
        );
        if live {
            inner.finish_removals(
                freed.into_iter().collect(),
                vec![(key, RemoveCause::Corrupt)],
            );
        }
        false
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod integrity_tests;
