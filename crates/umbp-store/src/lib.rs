//! The embedded store: what one engine worker owns in embedded mode.
//!
//! [`EmbeddedStore`] ties a [`Pool`], the [`MemoryRegistry`] of the worker's KV cache, its
//! registered [`KvLayout`]s and a [`CopyEngine`] together. Callers pass block ids and keys in
//! bulk; range planning and copies happen here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use thiserror::Error;
use umbp_copy::{
    CopyEngine, CopyError, Direction, HostMover, JobHandle, MemoryKind, MemoryRegistry, RegionId,
};
use umbp_core::{BlockKey, CoreError, KeyBuilder, KvLayout, PoolConfig};
use umbp_pool::{Pool, PoolError, PoolEvent, PoolStats};

pub use umbp_copy::KeyResult;

/// Identifies a registered layout.
pub type LayoutId = u32;

/// Errors of the store.
#[derive(Debug, Error)]
pub enum StoreError {
    /// Invalid configuration or input.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A copy failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// No layout with this id.
    #[error("no KV layout with id {0}; register the layout first")]
    UnknownLayout(LayoutId),
    /// The store was closed.
    #[error("the store is closed")]
    Closed,
}

/// Everything that shapes an embedded store.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// The pool.
    pub pool: PoolConfig,
    /// Copy threads.
    pub num_workers: usize,
    /// Default deadline of a synchronous wait.
    pub timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            pool: PoolConfig::default(),
            num_workers: 4,
            timeout: Duration::from_millis(30_000),
        }
    }
}

impl StoreConfig {
    /// Checks every option.
    pub fn validate(&self) -> Result<(), CoreError> {
        self.pool.validate()?;
        if !(1..=256).contains(&self.num_workers) {
            return Err(CoreError::option(
                "num_workers",
                format!("{} is outside 1..=256", self.num_workers),
            ));
        }
        if self.timeout.is_zero() {
            return Err(CoreError::option("timeout_ms", "must be greater than 0"));
        }
        Ok(())
    }
}

/// One worker's pool with its memory, layouts and copy engine.
#[derive(Debug)]
pub struct EmbeddedStore {
    pool: Arc<Pool>,
    engine: CopyEngine,
    layouts: RwLock<HashMap<LayoutId, Arc<KvLayout>>>,
    next_layout: AtomicU32,
    timeout: Duration,
    closed: AtomicBool,
}

impl EmbeddedStore {
    /// Maps the pool and starts the copy workers.
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> {
        cfg.validate()?;
        let pool = Arc::new(Pool::new(cfg.pool.clone())?);
        let engine = CopyEngine::new(
            Arc::clone(&pool),
            Arc::new(MemoryRegistry::new()),
            Arc::new(HostMover),
            cfg.num_workers,
        )?;
        let p = pool.placement();
        log::info!(
            "umbp: embedded store ready: {} bytes, hugepages {:?} (asked {:?}), numa {:?}, prefault {:.2}s, {} copy workers",
            pool.capacity(),
            p.hugepages_used,
            p.hugepages_requested,
            p.numa_node,
            p.prefault_seconds,
            cfg.num_workers
        );
        Ok(EmbeddedStore {
            pool,
            engine,
            layouts: RwLock::new(HashMap::new()),
            next_layout: AtomicU32::new(1),
            timeout: cfg.timeout,
            closed: AtomicBool::new(false),
        })
    }

    fn check_open(&self) -> Result<(), StoreError> {
        if self.closed.load(Ordering::Acquire) {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Registers host memory the store may copy to and from.
    ///
    /// # Safety
    /// As [`MemoryRegistry::register`]: the memory stays valid until deregistered.
    pub unsafe fn register_memory(&self, addr: u64, len: u64) -> Result<RegionId, StoreError> {
        self.check_open()?;
        // SAFETY: forwarded contract.
        Ok(unsafe { self.engine.registry().register(addr, len, MemoryKind::Host) }?)
    }

    /// Removes one registration, waiting up to the store's timeout for transfers using it.
    pub fn deregister_memory(&self, id: RegionId) -> Result<(), StoreError> {
        Ok(self.engine.registry().deregister(id, self.timeout)?)
    }

    /// Registers a layout after checking every layer lies inside registered memory.
    pub fn register_layout(&self, layout: KvLayout) -> Result<LayoutId, StoreError> {
        self.check_open()?;
        let reg = self.engine.registry();
        layout.validate_within(|a, n| reg.covers(a, n))?;
        let id = self.next_layout.fetch_add(1, Ordering::Relaxed);
        self.layouts.write().insert(id, Arc::new(layout));
        Ok(id)
    }

    /// A registered layout.
    pub fn layout(&self, id: LayoutId) -> Result<Arc<KvLayout>, StoreError> {
        self.layouts
            .read()
            .get(&id)
            .cloned()
            .ok_or(StoreError::UnknownLayout(id))
    }

    /// Which keys are in the pool (pins nothing).
    pub fn exists(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.pool.exists_many(keys)
    }

    /// How many keys, from the first, are in the pool.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> usize {
        self.pool.prefix_hits(keys)
    }

    fn submit(
        &self,
        dir: Direction,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.check_open()?;
        let layout = self.layout(layout)?;
        let plan = layout.group(group)?.plan(block_ids)?;
        Ok(self.engine.submit(dir, keys, plan)?)
    }

    /// Starts storing `block_ids` of cache group `group` under `keys` (one key per block).
    pub fn store(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.submit(Direction::Store, layout, group, block_ids, keys)
    }

    /// Starts loading `keys` into `block_ids` of cache group `group`.
    pub fn load(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.submit(Direction::Load, layout, group, block_ids, keys)
    }

    /// Waits for a job with the store's default timeout.
    pub fn wait(&self, job: &JobHandle) -> Result<Vec<KeyResult>, StoreError> {
        Ok(job.wait(self.timeout)?)
    }

    /// Default transfer timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Removes every object.
    pub fn clear(&self) -> u64 {
        self.pool.clear()
    }

    /// Pool counters.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Stored / removed notifications.
    pub fn subscribe(&self, capacity: usize) -> std::sync::mpsc::Receiver<PoolEvent> {
        self.pool.subscribe(capacity)
    }

    /// Stops the copy workers (after queued jobs) and the evictor; later calls fail with
    /// [`StoreError::Closed`]. Idempotent.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.engine.close();
            self.pool.close();
        }
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        self.close();
    }
}

/// Answers the scheduler's lookups from one worker's store: keys are built here, with this
/// worker's ranks, from the block hashes the scheduler sends.
#[derive(Debug)]
pub struct StoreLookup {
    store: Arc<EmbeddedStore>,
    keys: KeyBuilder,
    describe: String,
}

impl StoreLookup {
    /// Serves `store`'s lookups for keys of `keys`' namespace and ranks.
    pub fn new(store: Arc<EmbeddedStore>, keys: KeyBuilder, describe: String) -> Self {
        StoreLookup {
            store,
            keys,
            describe,
        }
    }
}

impl umbp_lookup::LookupTarget for StoreLookup {
    fn prefix_hits(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<u32, String> {
        if hash_len == 0 || hash_len > 32 || !packed.len().is_multiple_of(hash_len) {
            return Err(format!(
                "{} bytes are not whole {hash_len}-byte hashes",
                packed.len()
            ));
        }
        let hashes: Vec<&[u8]> = packed.chunks_exact(hash_len).collect();
        let n = self.store.pool.prefix_hits_with(hashes.len(), |i| {
            self.keys
                .key(group, hashes[i])
                .expect("hash length checked above")
        });
        Ok(n as u32)
    }

    fn exists(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<Vec<bool>, String> {
        let keys = self
            .keys
            .keys_packed(group, packed, hash_len)
            .map_err(|e| e.to_string())?;
        Ok(self.store.exists(&keys))
    }

    fn clear(&self) -> u64 {
        self.store.clear()
    }

    fn describe(&self) -> String {
        let s = self.store.stats();
        format!(
            "{} objects={} used_bytes={} evictions={}",
            self.describe, s.objects, s.used_bytes, s.evictions
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::{GroupLayout, KeyBuilder, LayerSpec, RankTopology};

    fn store() -> EmbeddedStore {
        EmbeddedStore::new(StoreConfig {
            pool: PoolConfig {
                prefault: false,
                ..PoolConfig::with_capacity(4 << 20)
            },
            num_workers: 2,
            ..StoreConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn layouts_must_lie_in_registered_memory() {
        let s = store();
        let buf = vec![0u8; 4096];
        let layer = LayerSpec {
            base_addr: buf.as_ptr() as u64,
            num_blocks: 4,
            block_stride: 1024,
            block_bytes: 1024,
        };
        let layout = KvLayout::new(vec![GroupLayout::new(vec![layer]).unwrap()]).unwrap();
        let e = s.register_layout(layout.clone()).unwrap_err().to_string();
        assert!(e.contains("register the KV cache"), "{e}");
        // SAFETY: `buf` outlives the store's use of it (the store is dropped first).
        let id = unsafe { s.register_memory(buf.as_ptr() as u64, 4096) }.unwrap();
        let lid = s.register_layout(layout).unwrap();
        assert!(matches!(
            s.layout(lid + 1),
            Err(StoreError::UnknownLayout(_))
        ));
        let kb = KeyBuilder::new("s", RankTopology::default()).unwrap();
        let keys = vec![kb.key(0, b"h").unwrap()];
        let r = s
            .wait(&s.store(lid, 0, &[3], keys.clone()).unwrap())
            .unwrap();
        assert_eq!(r, vec![KeyResult::Done]);
        assert_eq!(s.prefix_hits(&keys), 1);
        assert!(
            s.load(lid, 1, &[3], keys.clone()).is_err(),
            "group 1 does not exist"
        );
        assert!(
            s.load(lid, 0, &[4], keys).is_err(),
            "block 4 does not exist"
        );
        s.deregister_memory(id).unwrap();
        s.close();
        assert!(matches!(
            s.register_layout(KvLayout::new(vec![GroupLayout::new(vec![layer]).unwrap()]).unwrap()),
            Err(StoreError::Closed)
        ));
    }

    #[test]
    fn bad_config_names_the_option() {
        let e = EmbeddedStore::new(StoreConfig {
            num_workers: 0,
            ..StoreConfig::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("num_workers"), "{e}");
    }
}
