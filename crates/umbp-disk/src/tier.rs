//! The running tier ([`DiskTier`]): the store, its writer threads (write-behind) and its
//! reader threads (promotion), and the calls its owner makes.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::behind::{Behind, ObjectBytes, Queued, Source};
use crate::buf::AlignedBuf;
use crate::config::DiskConfig;
use crate::error::DiskError;
use crate::promote::{Readers, Sink};
use crate::stats::{add, DiskStats};
use crate::store::Store;

/// A running disk tier. Dropping it (or [`DiskTier::close`]) stops its threads.
#[derive(Debug)]
pub struct DiskTier {
    store: Arc<Store>,
    behind: Arc<Behind>,
    readers: Arc<Readers>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl DiskTier {
    /// Opens the tier on `cfg.dir`: checks the settings, the directory (created when
    /// missing; writable; not used by another process) and the space, rebuilds the index from
    /// the files found (the time it takes is logged and in [`DiskStats::rebuild_us`]) and
    /// starts `io_threads` writers and as many readers.
    pub fn open(cfg: DiskConfig) -> Result<DiskTier, DiskError> {
        let threads = cfg.io_threads;
        let store = Arc::new(Store::open(cfg)?);
        let tier = DiskTier {
            store,
            behind: Arc::new(Behind::new()),
            readers: Arc::new(Readers::new()),
            threads: Mutex::new(Vec::new()),
        };
        for i in 0..threads {
            let (s, b) = (Arc::clone(&tier.store), Arc::clone(&tier.behind));
            tier.spawn(format!("umbp-disk-w{i}"), "writer", move || b.writer(&s))?;
            let (s, r) = (Arc::clone(&tier.store), Arc::clone(&tier.readers));
            tier.spawn(format!("umbp-disk-r{i}"), "reader", move || r.reader(&s))?;
        }
        Ok(tier)
    }

    fn spawn(
        &self,
        name: String,
        what: &'static str,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<(), DiskError> {
        let h = std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(|source| DiskError::Thread { what, source })?;
        self.threads.lock().push(h);
        Ok(())
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &DiskConfig {
        &self.store.cfg
    }

    /// Queues `key`'s object (an evicted one) for writing behind the caller; never waits.
    /// Objects past the backlog are dropped (counted); one the disk holds or has queued
    /// already is released at once (counted in [`DiskStats::already_present`]). Each call is
    /// one eviction handed over: counted in [`DiskStats::evicted_queued`],
    /// [`DiskStats::evicted_dropped`] or [`DiskStats::already_present`].
    pub fn enqueue(&self, key: BlockKey, obj: Box<dyn ObjectBytes>) -> Queued {
        let q = self.behind.enqueue(&self.store, key, obj);
        self.count_eviction(q);
        q
    }

    /// [`DiskTier::enqueue`] for an object whose memory its owner needs back now (the pool
    /// evicting for a store that found it full): when the backlog has room, its bytes are
    /// copied (the caller may free `data` when this returns) and queued; otherwise it is
    /// dropped. Never waits for the disk. Counted as [`DiskTier::enqueue`] counts, and in
    /// [`DiskStats::evicted_copied`] when queued.
    pub fn enqueue_copy(&self, key: BlockKey, data: &[u8]) -> Queued {
        let q = if self.store.contains(&key) {
            Queued::Present
        } else if self.behind.has_room(&self.store, data.len() as u64) {
            self.behind
                .enqueue(&self.store, key, Box::new(data.to_vec()))
        } else {
            // Room is checked before copying, so a full backlog costs no copy.
            self.behind.drop_one(&self.store)
        };
        if q == Queued::Queued {
            add(&self.store.c.evicted_copied, 1);
        }
        self.count_eviction(q);
        q
    }

    fn count_eviction(&self, q: Queued) {
        let c = &self.store.c;
        add(
            match q {
                Queued::Queued => &c.evicted_queued,
                Queued::Present => &c.already_present,
                Queued::Dropped => &c.evicted_dropped,
            },
            1,
        );
    }

    /// Queues `key`'s object of `len` bytes by key only (an eager write on commit); the writer
    /// takes its bytes from the [`Source`] when it gets to it. Never waits; past the backlog
    /// it is dropped (counted).
    pub fn enqueue_key(&self, key: BlockKey, len: u64) -> Queued {
        let q = self.behind.enqueue_key(&self.store, key, len);
        if q == Queued::Queued {
            add(&self.store.c.eager_queued, 1);
        }
        q
    }

    /// Sets where key-only entries ([`DiskTier::enqueue_key`]) get their bytes.
    pub fn set_source(&self, source: Option<Source>) {
        self.behind.set_source(source);
    }

    /// Whether the tier was closed.
    pub fn is_closed(&self) -> bool {
        self.store.is_closed()
    }

    /// Writes `key`'s object now on the calling thread; `Ok(false)` when the disk has it.
    pub fn write_now(&self, key: &BlockKey, data: &[u8]) -> Result<bool, DiskError> {
        self.store.write(key, data, &mut AlignedBuf::new())
    }

    /// Whether the disk holds `key` (index only; reads nothing).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.store.contains(key)
    }

    /// Which of `keys` the disk holds (index only).
    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.store.contains_many(keys)
    }

    /// When a lookup that starts now must be answered.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.store.cfg.read_timeout
    }

    /// Reads the leading `keys` the disk holds, in parallel, handing each checked object to
    /// `sink`; waits until `deadline` at most. Returns how many keys from the first were
    /// promoted.
    pub fn promote_prefix(&self, keys: &[BlockKey], deadline: Instant, sink: Sink) -> usize {
        let got = self
            .readers
            .promote(&self.store, keys, true, deadline, sink);
        got.iter().take_while(|p| **p).count()
    }

    /// Reads every one of `keys` the disk holds, handing each checked object to `sink`; waits
    /// until `deadline` at most. Returns, per key, whether it was promoted.
    pub fn promote_present(&self, keys: &[BlockKey], deadline: Instant, sink: Sink) -> Vec<bool> {
        self.readers
            .promote(&self.store, keys, false, deadline, sink)
    }

    /// Forgets `key` (a queued write of it is cancelled); whether the disk held it. As
    /// [`DiskTier::remove_many`].
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.remove_many(std::slice::from_ref(key)) == 1
    }

    /// Forgets `keys` (queued writes of them are cancelled); how many the disk held. Only
    /// the index forgets them: their bytes stay in their segments until those are dropped,
    /// and a restart's index rebuild finds them again (see docs/disk.md).
    pub fn remove_many(&self, keys: &[BlockKey]) -> u64 {
        if keys.is_empty() {
            return 0;
        }
        let set: HashSet<BlockKey> = keys.iter().copied().collect();
        self.behind.cancel(&self.store, |k| set.contains(k));
        let n = set.iter().filter(|k| self.store.remove(k)).count() as u64;
        add(&self.store.c.removed, n);
        n
    }

    /// Forgets the objects of the key namespace with id `namespace_id` (queued writes of them
    /// are cancelled); how many. Only the index forgets them: their bytes stay in their
    /// segments until those are dropped, and a restart's index rebuild finds them again (see
    /// docs/disk.md).
    pub fn clear_namespace(&self, namespace_id: &[u8; 16]) -> u64 {
        let ns = |k: &BlockKey| k.namespace_id() == *namespace_id;
        self.behind.cancel(&self.store, ns);
        let n = self.store.remove_where(ns);
        add(&self.store.c.removed, n);
        n
    }

    /// Forgets every object (queued writes are cancelled, the segments deleted); how many
    /// there were.
    pub fn clear(&self) -> u64 {
        self.behind.cancel(&self.store, |_| true);
        let n = self.store.clear();
        add(&self.store.c.removed, n);
        n
    }

    /// Flips the bits of `mask` in byte `offset` (modulo its length) of `key`'s object in
    /// its segment file; whether the disk held the key. Damage for tests of the integrity
    /// checks only: the next read of the key fails its checksum.
    #[doc(hidden)]
    pub fn debug_corrupt(&self, key: &BlockKey, offset: u64, mask: u8) -> Result<bool, DiskError> {
        self.store.debug_corrupt(key, offset, mask)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DiskStats {
        self.store.stats()
    }

    /// Waits until every queued object is written (or dropped), at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.behind.flush(timeout)
    }

    /// Stops the threads; queued objects not yet written are dropped (counted).
    pub fn close(&self) {
        self.behind.stop(&self.store);
        self.readers.stop();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
        self.behind.set_source(None);
        self.store.close();
        self.store.release_lock();
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        self.close();
    }
}
