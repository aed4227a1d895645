//! The disk tier under the pool: objects the pool's watermark eviction takes are written
//! behind to disk (pinned until written), objects a store's synchronous eviction takes are
//! copied into the write-behind backlog when it has room (dropped, counted, when not), and
//! keys a lookup misses in the pool are read back from disk into the pool before the lookup
//! answers. With `DiskWrite::Eager` every object committed is queued too (by key: pinned
//! only while written), so the evictor finds most on disk already and frees them at once.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use umbp_core::BlockKey;
use umbp_disk::{DiskConfig, DiskError, DiskTier, DiskWrite, ObjectBytes, Sink};
use umbp_pool::{PinnedObject, Pool, PoolEvent, SpillKind};

use crate::tier::{PoolFill, Tier};

/// Commits the eager forwarder may lag behind before the pool drops (and counts, in
/// `events_dropped`) the next: those objects are written on eviction instead.
const EAGER_EVENTS: usize = 65_536;
/// How often the eager forwarder looks whether the tier closed.
const EAGER_POLL: Duration = Duration::from_millis(100);

/// A pool object on its way to disk (evicted, or committed and pinned while written): its
/// pin ends, and an evicted one's memory is freed, when this is dropped.
struct Spilled(PinnedObject);

impl ObjectBytes for Spilled {
    fn bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// With integrity on, every object is verified before it goes to disk (on the writer's
    /// thread, off the engine's path): the disk's own checksum then covers the pool's bytes,
    /// so damage they took in DRAM never reaches the disk.
    fn intact(&self) -> bool {
        self.0.verify()
    }
}

/// Opens the tier; with eager writes it is handed every object committed too. Evicted
/// objects reach it through the chain ([`Tier::spill`]).
pub(crate) fn open(cfg: DiskConfig, pool: &Arc<Pool>) -> Result<Arc<DiskTier>, DiskError> {
    let eager = cfg.write == DiskWrite::Eager;
    let disk = Arc::new(DiskTier::open(cfg)?);
    if eager {
        let p = Arc::downgrade(pool);
        disk.set_source(Some(Arc::new(move |key: &BlockKey| {
            let obj = p.upgrade()?.peek(key)?;
            Some(Box::new(Spilled(obj)) as Box<dyn ObjectBytes>)
        })));
        let events = pool.subscribe(EAGER_EVENTS);
        let d = Arc::downgrade(&disk);
        std::thread::Builder::new()
            .name("umbp-disk-eager".into())
            .spawn(move || forward_commits(&events, &d))
            .map_err(|source| DiskError::Thread {
                what: "eager writer",
                source,
            })?;
    }
    Ok(disk)
}

/// The eager forwarder: queues each object the pool stores, by key, until the tier closes or
/// the pool goes.
fn forward_commits(events: &Receiver<PoolEvent>, disk: &Weak<DiskTier>) {
    loop {
        let ev = match events.recv_timeout(EAGER_POLL) {
            Ok(ev) => Some(ev),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let Some(d) = disk.upgrade() else { return };
        if d.is_closed() {
            return;
        }
        if let Some(PoolEvent::Stored { key, bytes }) = ev {
            // Promotions from disk are present already: not queued.
            d.enqueue_key(key, bytes);
        }
    }
}

/// Writes the pool's objects the disk does not hold yet, on the calling thread, until the
/// tier's `close_write` budget is spent (after the write-behind queue has drained); how many.
/// Run at close, so a clean restart finds what the pool held.
pub(crate) fn write_pool(disk: &DiskTier, pool: &Pool) -> u64 {
    let budget = disk.config().close_write;
    if budget.is_zero() {
        return 0;
    }
    let t = Instant::now();
    let deadline = t + budget;
    disk.flush(budget);
    let mut written = 0u64;
    for key in pool.keys() {
        if Instant::now() >= deadline {
            log::warn!(
                "umbp: disk tier: closing wrote {written} of the pool's objects before its \
                 {budget:?} budget ran out; the rest are not on disk"
            );
            break;
        }
        if disk.contains(&key) {
            continue;
        }
        let Some(obj) = pool.peek(&key) else { continue };
        if !obj.verify() {
            continue;
        }
        match disk.write_now(&key, obj.as_slice()) {
            Ok(true) => written += 1,
            Ok(false) => {}
            Err(e) => {
                log::warn!("umbp: disk tier: closing stopped writing the pool: {e}");
                break;
            }
        }
    }
    log::info!(
        "umbp: disk tier: closing wrote {written} objects of the pool in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    written
}

impl Tier for DiskTier {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn deadline(&self) -> Instant {
        DiskTier::deadline(self)
    }

    /// Takes every object (never waits): a full backlog drops it (counted), which frees it
    /// now; one the disk holds already is freed now too.
    fn spill(&self, key: BlockKey, obj: PinnedObject, kind: SpillKind) -> Option<PinnedObject> {
        match kind {
            // The watermark eviction: queued pinned, freed once written.
            SpillKind::Behind => {
                self.enqueue(key, Box::new(Spilled(obj)));
            }
            // A store found the pool full and needs the memory now: the bytes are copied
            // into the backlog when it has room, and the pin goes here. With integrity on
            // they are verified first, as the writer verifies a `Behind` object: damaged
            // bytes are never written (the object is counted in `corrupt_detected`).
            SpillKind::Now => {
                if obj.verify() {
                    self.enqueue_copy(key, obj.as_slice());
                }
            }
        }
        None
    }

    fn fill_prefix(&self, fill: &PoolFill, keys: &[BlockKey], deadline: Instant) -> usize {
        self.promote_prefix(keys, deadline, sink(fill))
    }

    fn fill_present(&self, fill: &PoolFill, keys: &[BlockKey], deadline: Instant) -> Vec<bool> {
        self.promote_present(keys, deadline, sink(fill))
    }

    fn forget(&self, keys: &[BlockKey]) {
        self.remove_many(keys);
    }

    fn clear(&self) {
        DiskTier::clear(self);
    }

    fn clear_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        Some(DiskTier::clear_namespace(self, namespace_id))
    }

    fn corrupt(&self) -> u64 {
        self.stats().corrupt
    }

    /// The pool's objects go to disk (within the budget) for the next start.
    fn write_out(&self, pool: &Pool) {
        write_pool(self, pool);
    }

    fn close(&self) {
        DiskTier::close(self);
    }
}

/// The disk's readers hand each checked object to the lookup's fill.
fn sink(fill: &PoolFill) -> Sink {
    let fill = fill.clone();
    Arc::new(move |key: &BlockKey, bytes: &[u8]| fill.put(key, bytes))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use umbp_core::{KeyBuilder, PoolConfig, RankTopology};

    use crate::{DiskConfig, DiskWrite, EmbeddedStore, StoreConfig};

    fn store(dir: &std::path::Path) -> EmbeddedStore {
        store_with(dir, |_| {})
    }

    fn store_with(dir: &std::path::Path, f: impl FnOnce(&mut DiskConfig)) -> EmbeddedStore {
        let mut disk = DiskConfig::new(dir, 64 << 20);
        disk.segment_bytes = 1 << 20;
        disk.io_threads = 2;
        f(&mut disk);
        EmbeddedStore::new(StoreConfig {
            pool: PoolConfig {
                segment_bytes: 64 << 10,
                prefault: false,
                high_watermark: 0.5,
                low_watermark: 0.25,
                ..PoolConfig::with_capacity(4 << 20)
            },
            disk: Some(disk),
            ..StoreConfig::default()
        })
        .unwrap()
    }

    fn tmpdir(tag: &str) -> std::path::PathBuf {
        let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
            "../../target/test-disk/store-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d.canonicalize().unwrap()
    }

    #[test]
    fn evicted_objects_come_back_from_disk_byte_exact_and_survive_a_restart() {
        let d = tmpdir("evict");
        let kb = KeyBuilder::new("disk-test", RankTopology::default()).unwrap();
        let keys: Vec<_> = (0..120u32)
            .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
            .collect();
        let obj = |i: usize| vec![(i * 7 % 251) as u8; 32 << 10];
        let in_pool_only;
        {
            let s = store(&d);
            for (i, k) in keys.iter().enumerate() {
                s.pool().put(*k, &obj(i)).unwrap();
            }
            s.pool().evict_to_low_watermark();
            assert!(s.flush_disk(Duration::from_secs(10)));
            let ds = s.disk_stats().unwrap();
            assert!(ds.writes > 0, "{ds:?}");
            assert!(!s.pool().contains(&keys[0]), "key 0 was evicted");
            // A lookup promotes the evicted prefix back into the pool before it answers.
            let hits = s.prefix_hits(&keys[..10]).unwrap();
            assert_eq!(hits, 10);
            for (i, k) in keys[..10].iter().enumerate() {
                assert_eq!(s.pool().get(k).unwrap().as_slice(), &obj(i)[..]);
            }
            // Objects put since are in the pool only (the background evictor, racing the
            // explicit eviction above, may have emptied the pool of the others).
            let fresh: Vec<_> = (1000..1004u32)
                .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
                .collect();
            for (j, k) in fresh.iter().enumerate() {
                s.pool().put(*k, &obj(1000 + j)).unwrap();
            }
            let disk = s.shared.disk.as_ref().unwrap();
            in_pool_only = keys
                .iter()
                .chain(&fresh)
                .copied()
                .filter(|k| s.pool().contains(k) && !disk.contains(k))
                .collect::<Vec<_>>();
            assert!(!in_pool_only.is_empty());
            // Closing writes what the pool holds.
            s.close();
        }
        // A new store on the same directory (a restart) finds them on disk, the pool's last
        // objects too.
        let s = store(&d);
        assert!(s.disk_stats().unwrap().rebuilt_objects > 0);
        assert_eq!(s.exists(&keys[..3]).unwrap(), vec![true; 3]);
        assert_eq!(
            s.exists(&in_pool_only).unwrap(),
            vec![true; in_pool_only.len()]
        );
        assert_eq!(s.pool().get(&keys[2]).unwrap().as_slice(), &obj(2)[..]);
        // Clearing another namespace leaves these; clearing theirs forgets them on disk too.
        s.clear_namespace("disk-test-other").unwrap();
        assert_eq!(s.exists(&keys[3..4]).unwrap(), vec![true]);
        s.clear_namespace("disk-test").unwrap();
        assert_eq!(s.exists(&keys[3..6]).unwrap(), vec![false; 3]);
        assert_eq!(s.disk_stats().unwrap().objects, 0);
        // Clearing the store clears the disk: nothing comes back.
        s.clear().unwrap();
        assert_eq!(s.prefix_hits(&keys[..3]).unwrap(), 0);
        s.close();
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < end, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn eager_writes_reach_disk_before_eviction_which_then_writes_nothing_again() {
        let d = tmpdir("eager");
        let kb = KeyBuilder::new("disk-eager", RankTopology::default()).unwrap();
        let keys: Vec<_> = (0..40u32)
            .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
            .collect();
        let obj = |i: usize| vec![(i * 13 % 251) as u8; 32 << 10];
        let s = store_with(&d, |c| c.write = DiskWrite::Eager);
        // 1.25 MiB: below the high watermark (2 MiB), nothing is evicted.
        for (i, k) in keys.iter().enumerate() {
            s.pool().put(*k, &obj(i)).unwrap();
        }
        wait_until("eager queueing", || {
            s.disk_stats().unwrap().eager_queued == 40
        });
        assert!(s.flush_disk(Duration::from_secs(10)));
        let ds = s.disk_stats().unwrap();
        assert_eq!((ds.writes, ds.objects, ds.writes_dropped), (40, 40, 0));
        assert_eq!(s.pool().stats().evictions, 0);
        assert!(keys.iter().all(|k| s.pool().contains(k)));
        // Eviction finds them on disk: freed at once, not written again.
        s.pool().evict_to_low_watermark();
        assert!(s.flush_disk(Duration::from_secs(10)));
        let ds = s.disk_stats().unwrap();
        assert!(ds.already_present >= 8, "{ds:?}");
        assert_eq!(ds.writes, 40);
        assert!(!s.pool().contains(&keys[0]));
        assert_eq!(s.prefix_hits(&keys[..4]).unwrap(), 4);
        assert_eq!(s.pool().get(&keys[1]).unwrap().as_slice(), &obj(1)[..]);
        // `evict` forgets the pool's and the disk's copies: lookups miss.
        assert_eq!(s.evict(&keys[..4]).unwrap(), 4);
        assert_eq!(s.exists(&keys[..4]).unwrap(), vec![false; 4]);
        assert_eq!(s.prefix_hits(&keys[..4]).unwrap(), 0);
        assert_eq!(s.disk_stats().unwrap().removed, 4);
        assert_eq!(s.exists(&keys[4..6]).unwrap(), vec![true; 2]);
        s.close();
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A clear racing every tier's traffic: a writer keeps storing (its stores evict, and the
    /// evictor spills to disk behind it), a reader keeps looking up what went to disk
    /// (promotions), and the namespace is cleared in the middle. Every key stored before the
    /// clear began must be gone, from the pool and the disk, once it returns and what was in
    /// flight has landed. Before clears held evictions and promotions back, a spill or a
    /// promotion in flight brought some back.
    #[test]
    fn a_clear_amid_evictions_spills_and_promotions_leaves_nothing_to_come_back() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let d = tmpdir("clear-race");
        let s = Arc::new(store(&d));
        let kb = KeyBuilder::new("clear-race", RankTopology::default()).unwrap();
        let mut came_back = Vec::new();
        for round in 0..12u32 {
            let kb = kb.clone();
            let key = move |i: usize| {
                let mut h = [0u8; 8];
                h[..4].copy_from_slice(&round.to_le_bytes());
                h[4..].copy_from_slice(&(i as u32).to_le_bytes());
                kb.key(0, &h).unwrap()
            };
            let done = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let writer = {
                let (s, done, stop, key) = (
                    Arc::clone(&s),
                    Arc::clone(&done),
                    Arc::clone(&stop),
                    key.clone(),
                );
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) && i < 4000 {
                        let _ = s.pool().put(key(i), &[(i % 251) as u8; 32 << 10]);
                        i += 1;
                        done.store(i, Ordering::Release);
                    }
                })
            };
            let reader = {
                let (s, done, stop, key) = (
                    Arc::clone(&s),
                    Arc::clone(&done),
                    Arc::clone(&stop),
                    key.clone(),
                );
                std::thread::spawn(move || {
                    let mut j = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let n = done.load(Ordering::Acquire).max(1);
                        // The oldest keys: the ones the evictor sent to disk.
                        let ks: Vec<_> = (0..8).map(|x| key((j * 8 + x) % n.min(96))).collect();
                        let _ = s.exists(&ks);
                        j += 1;
                    }
                })
            };
            // Into the churn: the pool (4 MiB) holds about 128 objects; 200 put evicts.
            wait_until("the writer's first 200 stores", || {
                done.load(Ordering::Acquire) >= 200
            });
            let before = done.load(Ordering::Acquire);
            s.clear_namespace("clear-race").unwrap();
            // What was in flight lands (or not) now.
            std::thread::sleep(Duration::from_millis(30));
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            reader.join().unwrap();
            assert!(s.flush_disk(Duration::from_secs(10)));
            let disk = s.shared.disk.as_ref().unwrap();
            for i in 0..before {
                let k = key(i);
                if s.pool().contains(&k) || disk.contains(&k) {
                    came_back.push((round, i, s.pool().contains(&k), before));
                }
            }
            s.clear().unwrap();
        }
        assert!(
            came_back.is_empty(),
            "{} keys stored before a clear were back after it (round, key, in the pool, stores before the clear): {:?}",
            came_back.len(),
            &came_back[..came_back.len().min(10)]
        );
        s.close();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_zero_close_budget_writes_nothing_on_close() {
        let d = tmpdir("close0");
        let kb = KeyBuilder::new("disk-close", RankTopology::default()).unwrap();
        let keys: Vec<_> = (0..10u32)
            .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
            .collect();
        for budget in [Duration::ZERO, Duration::from_secs(30)] {
            let s = store_with(&d, |c| c.close_write = budget);
            s.clear().unwrap();
            for k in &keys {
                s.pool().put(*k, &[7u8; 32 << 10]).unwrap();
            }
            s.close();
            let s = store(&d);
            let found = s.disk_stats().unwrap().rebuilt_objects;
            assert_eq!(found, if budget.is_zero() { 0 } else { 10 }, "{budget:?}");
            s.close();
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
