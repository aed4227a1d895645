//! The embedded store: one worker's pool, memory, layouts and copy engine.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_copy::{CopyEngine, HostMover, JobHandle, MemoryRegistry, RegionId};
use umbp_core::{Admit, BlockKey, KvLayout};
use umbp_cuda::CudaMover;
use umbp_cuda::{CudaStats, PinStatus};
use umbp_pool::{Pool, PoolEvent, PoolStats};
use umbp_remote::RemoteStats;

use umbp_core::KeyOutcome;

use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::ids::LayoutId;
use crate::session::Session;
use crate::shared::StoreShared;
use crate::tier::{Tier, TierChain};

/// One worker's pool with its memory, layouts and copy engine.
///
/// Memory registrations, layouts and jobs belong to a [`Session`]; the store's own
/// registration, layout and copy calls go to the default session it owns (embedded mode is one
/// client), and [`EmbeddedStore::open_session`] opens more. Pool-wide operations (lookups,
/// `clear`, statistics, `close`) stay on the store.
#[derive(Debug)]
pub struct EmbeddedStore {
    pub(crate) shared: Arc<StoreShared>,
    default: Session,
}

impl EmbeddedStore {
    /// Maps the pool and starts the copy workers, and the disk and remote tiers when
    /// configured.
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> {
        Self::with_tiers(cfg, Vec::new())
    }

    /// [`EmbeddedStore::new`] with more tiers under the pool: `extra`, in order, after the
    /// configured disk and remote tiers. A tier is wired only through the chain
    /// ([`Tier`]): it is offered what the pool evicts, asked for what lookups miss, and
    /// cleared, flushed and closed with the store.
    pub fn with_tiers(cfg: StoreConfig, extra: Vec<Arc<dyn Tier>>) -> Result<Self, StoreError> {
        cfg.validate()?;
        let pool = Arc::new(Pool::new(cfg.pool.clone())?);
        Self::around(cfg, pool, extra)
    }

    /// A store of `cfg` around the pool memory another store handed over
    /// ([`EmbeddedStore::hand_over`]): its memfd and image. Every object of the image is
    /// served from where it lies ([`Pool::adopt`]); `cfg.pool` must have the giver's
    /// geometry (capacity, segment size, huge pages), else the error says what differs and
    /// the caller starts an empty store instead.
    pub fn adopt(
        cfg: StoreConfig,
        memfd: std::os::fd::OwnedFd,
        image: &[u8],
    ) -> Result<(Self, umbp_pool::Adopted), StoreError> {
        cfg.validate()?;
        let (pool, got) = Pool::adopt(cfg.pool.clone(), memfd, image)?;
        log::info!(
            "umbp: took over a pool of {} objects ({} bytes, {} pinned), hand-over {}",
            got.objects,
            got.bytes,
            got.pinned,
            got.generation
        );
        Ok((Self::around(cfg, Arc::new(pool), Vec::new())?, got))
    }

    /// Hands the pool over to another process: closes this store (every later call fails
    /// with [`StoreError::Closed`]) after stopping every writer of the pool (copy workers,
    /// the tiers' fills and write-backs: nothing is written out, the objects stay in the
    /// pool's memory), and returns the pool's memfd with its image (encode it with
    /// [`umbp_pool::image::Image::encode`]) for [`EmbeddedStore::adopt`] there.
    /// `generation` counts the hand-overs (the adopter's [`umbp_pool::Adopted::generation`]).
    /// Refused, with the store left serving, when the pool is not memfd-backed.
    pub fn hand_over(
        &self,
        generation: u64,
    ) -> Result<(std::os::fd::OwnedFd, umbp_pool::image::Image), StoreError> {
        self.shared.hand_over(generation)
    }

    fn around(
        cfg: StoreConfig,
        pool: Arc<Pool>,
        extra: Vec<Arc<dyn Tier>>,
    ) -> Result<Self, StoreError> {
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
        let remote = match cfg.remote {
            Some(rc) => Some(Arc::new(crate::remote::start_remote_tier(rc, &pool)?)),
            None => None,
        };
        let disk = match cfg.disk {
            Some(dc) => Some(crate::disk::open(dc, &pool)?),
            None => None,
        };
        // Pool, disk, remote, then the caller's.
        let mut chain: Vec<Arc<dyn Tier>> = Vec::new();
        if let Some(d) = &disk {
            chain.push(Arc::clone(d) as Arc<dyn Tier>);
        }
        if let Some(r) = &remote {
            chain.push(Arc::clone(r) as Arc<dyn Tier>);
        }
        chain.extend(extra);
        let tiers = TierChain::new(chain);
        tiers.install_spill(&pool);
        let shared = Arc::new(StoreShared {
            pool,
            remote,
            disk,
            tiers,
            engine,
            next_layout: AtomicU32::new(1),
            next_session: AtomicU64::new(1),
            timeout: cfg.timeout,
            closed: AtomicBool::new(false),
            cuda_opts: cfg.cuda,
            cuda: Mutex::new(BTreeMap::new()),
            pinner: Mutex::new(None),
        });
        let default = Session::new(Arc::clone(&shared));
        Ok(EmbeddedStore { shared, default })
    }

    /// [`StoreError::Closed`] once [`close`](Self::close) has been called.
    pub fn check_open(&self) -> Result<(), StoreError> {
        self.shared.check_open()
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    /// The store's default session: the one its registration, layout and copy calls use.
    pub fn session(&self) -> &Session {
        &self.default
    }

    /// Opens another session (a client of this store): its memory, layouts and jobs are its
    /// own, and dropping it releases them. [`StoreError::Closed`] after `close`.
    pub fn open_session(&self) -> Result<Session, StoreError> {
        self.check_open()?;
        Ok(Session::new(Arc::clone(&self.shared)))
    }

    /// Registers host memory the store may copy to and from (in the default session).
    ///
    /// # Safety
    /// As [`MemoryRegistry::register`]: the memory stays valid until deregistered.
    pub unsafe fn register_memory(&self, addr: u64, len: u64) -> Result<RegionId, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.default.register_memory(addr, len) }
    }

    /// Removes one registration of the default session, waiting up to the store's timeout for
    /// transfers using it; layouts that lie in it are dropped with it.
    pub fn deregister_memory(&self, id: RegionId) -> Result<(), StoreError> {
        self.default.deregister_memory(id)
    }

    /// Registers a layout (in the default session) after checking every layer lies inside
    /// registered memory, all of one kind (host or CUDA).
    pub fn register_layout(&self, layout: KvLayout) -> Result<LayoutId, StoreError> {
        self.default.register_layout(layout)
    }

    /// A registered layout of the default session.
    pub fn layout(&self, id: LayoutId) -> Result<Arc<KvLayout>, StoreError> {
        self.default.layout(id)
    }

    /// Which keys are in the pool (pins nothing). With a disk or remote tier, keys the pool
    /// misses are read from them into the pool first (waiting at most their timeouts). Every
    /// key reported present is leased: it stays in the pool until a load of it, or for the
    /// pool's `lookup_lease_ms`. [`StoreError::Closed`] after `close`.
    pub fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>, StoreError> {
        self.check_open()?;
        Ok(self.shared.tiers.exists(&self.shared.pool, keys))
    }

    /// Which keys are in the DRAM pool now: no lease is taken, no lower tier is read, no hit
    /// or miss is counted. For watching the pool (which stored objects were evicted since),
    /// never for a lookup a load follows: use [`exists`](Self::exists) there.
    /// [`StoreError::Closed`] after `close`.
    pub fn holds(&self, keys: &[BlockKey]) -> Result<Vec<bool>, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.holds_many(keys))
    }

    /// Pins `keys` in the pool for `ttl` from now (the pool's keeps, `Pool::keep`): a pinned
    /// object is never evicted while its pin lives; pinning a pinned one sets its expiry anew.
    /// Pins are bounded in bytes per key namespace (`keep_namespace_bytes`, a quarter of the
    /// pool by default) and for the pool (half of it): a pin past a bound is refused, and
    /// counted. Keys not in the pool are `Missing` (nothing is read from the lower tiers
    /// here). An explicit [`evict`](Self::evict) or a clear still removes a pinned object.
    /// [`StoreError::Closed`] after `close`.
    pub fn pin(
        &self,
        keys: &[BlockKey],
        ttl: std::time::Duration,
    ) -> Result<Vec<umbp_core::PinOutcome>, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.keep(keys, ttl))
    }

    /// Releases the pins of `keys`; how many were pinned. [`StoreError::Closed`] after
    /// `close`.
    pub fn unpin(&self, keys: &[BlockKey]) -> Result<u64, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.release_kept(keys))
    }

    /// The live pins by key namespace, most pinned bytes first (`umbp pins`).
    pub fn pins_by_namespace(&self) -> Vec<umbp_pool::NamespacePins> {
        self.shared.pool.pins_by_namespace()
    }

    /// Counters of pins (the pool's keeps).
    pub fn pin_stats(&self) -> umbp_pool::KeepStats {
        self.shared.pool.keep_stats()
    }

    /// How many keys, from the first, are in the pool (with a disk or remote tier, as
    /// [`exists`](Self::exists), the missing rest is read from them first); each is leased as
    /// [`exists`](Self::exists) says. [`StoreError::Closed`] after `close`.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, StoreError> {
        self.prefix_hits_with(keys.len(), |i| keys[i])
    }

    /// [`prefix_hits`](Self::prefix_hits) over `n` keys made on demand by `key(i)` (none is
    /// made past the first miss, but for the remote tier's fetch).
    pub fn prefix_hits_with(
        &self,
        n: usize,
        key: impl Fn(usize) -> BlockKey,
    ) -> Result<usize, StoreError> {
        self.prefix_hits_until(n, key, None)
    }

    /// When a lookup that starts now must have its remote tier's answers (`None` without a
    /// remote tier): one deadline for the several calls of one request (every rank of a
    /// topology, say), so that together they wait the tier's timeout at most.
    pub fn remote_deadline(&self) -> Option<std::time::Instant> {
        self.shared.remote.as_ref().map(|r| r.deadline())
    }

    /// [`prefix_hits_with`](Self::prefix_hits_with) whose remote fetch ends at `deadline`
    /// (from [`remote_deadline`](Self::remote_deadline); `None`: the tier's timeout from now).
    pub fn prefix_hits_until(
        &self,
        n: usize,
        key: impl Fn(usize) -> BlockKey,
        deadline: Option<std::time::Instant>,
    ) -> Result<usize, StoreError> {
        self.check_open()?;
        Ok(self
            .shared
            .tiers
            .prefix_hits(&self.shared.pool, n, key, deadline))
    }

    /// Whether lookups may wait for a remote tier (then callers holding a lock other threads
    /// need, such as Python's GIL, should release it first).
    pub fn has_remote(&self) -> bool {
        self.shared.remote.is_some()
    }

    /// The remote tier's counters (`None` without one).
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        self.shared.remote.as_ref().map(|r| r.stats())
    }

    /// Waits until the remote tier has written every object committed so far (or dropped it),
    /// at most `timeout`; whether it did (true without a remote tier).
    pub fn flush_remote(&self, timeout: Duration) -> bool {
        self.shared.remote.as_ref().is_none_or(|r| r.flush(timeout))
    }

    /// Flips the bits of `mask` in byte `offset` of `key`'s object, in the pool (`disk`
    /// false) or in its disk tier's segment file (`disk` true); whether the object was
    /// there. Damage for tests of the integrity checks only (the Python binding's
    /// `_debug_corrupt`).
    #[doc(hidden)]
    pub fn debug_corrupt(
        &self,
        key: &BlockKey,
        offset: u64,
        mask: u8,
        disk: bool,
    ) -> Result<bool, StoreError> {
        if !disk {
            return Ok(self.shared.pool.debug_corrupt(key, offset, mask));
        }
        match &self.shared.disk {
            None => Ok(false),
            Some(d) => Ok(d.debug_corrupt(key, offset, mask)?),
        }
    }

    /// The disk tier's counters (`None` without one).
    pub fn disk_stats(&self) -> Option<umbp_disk::DiskStats> {
        self.shared.disk.as_ref().map(|d| d.stats())
    }

    /// Waits until the disk tier has written every object handed to it so far (or dropped
    /// it), at most `timeout`; whether it did (true without a disk tier).
    pub fn flush_disk(&self, timeout: Duration) -> bool {
        self.shared.disk.as_ref().is_none_or(|d| d.flush(timeout))
    }

    /// Registers CUDA device memory of device `device` (e.g. a KV cache tensor's `data_ptr()`
    /// and byte size), in the default session. The first call loads the CUDA driver and starts
    /// registering the pool for DMA in the background; each device's first call creates that
    /// device's mover (all devices share the pool's one registration). The range must be device
    /// memory of that device, inside one allocation.
    ///
    /// # Safety
    /// As [`MemoryRegistry::register`]: the memory stays allocated until deregistered.
    pub unsafe fn register_cuda_memory(
        &self,
        addr: u64,
        len: u64,
        device: i32,
    ) -> Result<RegionId, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.default.register_cuda_memory(addr, len, device) }
    }

    /// Starts storing like [`EmbeddedStore::store`]; with `stream` (a raw CUDA stream handle,
    /// 0 for the legacy default stream) the copies wait on the device for the work queued on
    /// that stream so far, so a store submitted right after the kernels that wrote its blocks
    /// copies their output. CUDA layouts only.
    ///
    /// # Safety
    /// `stream`, when given, must be 0 (the legacy default stream) or a live CUDA stream of the
    /// primary context of the device the layout's memory is on (e.g. PyTorch's current stream
    /// there): the driver dereferences the handle.
    pub unsafe fn store_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: forwarded contract.
        unsafe {
            self.default
                .store_on(layout, group, block_ids, keys, stream)
        }
    }

    /// [`EmbeddedStore::store_on`], meeting the pool's store admission as `admit` says
    /// ([`Admit::Now`]: kept on each key's first sighting even under `on_reuse`).
    ///
    /// # Safety
    /// As [`EmbeddedStore::store_on`].
    pub unsafe fn store_as_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
        admit: Admit,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: forwarded contract.
        unsafe {
            self.default
                .store_as_on(layout, group, block_ids, keys, stream, admit)
        }
    }

    /// Starts loading like [`EmbeddedStore::load`]; with `stream`, the copies into the blocks
    /// wait on the device for the work queued on that stream so far (which may still read the
    /// blocks). The job finishes once the bytes are in place: work launched after that sees
    /// them.
    ///
    /// # Safety
    /// As [`EmbeddedStore::store_on`].
    pub unsafe fn load_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.default.load_on(layout, group, block_ids, keys, stream) }
    }

    /// The CUDA mover of the lowest-numbered device whose memory is registered (for its trace
    /// and statistics; one device per engine process is the common case).
    pub fn cuda(&self) -> Option<Arc<CudaMover>> {
        self.shared.cuda.lock().values().next().cloned()
    }

    /// The CUDA mover of `device`, once memory of that device is registered.
    pub fn cuda_on(&self, device: i32) -> Option<Arc<CudaMover>> {
        self.shared.cuda.lock().get(&device).cloned()
    }

    /// The devices whose memory is registered, in order.
    pub fn cuda_devices(&self) -> Vec<i32> {
        self.shared.cuda.lock().keys().copied().collect()
    }

    /// The counters of [`EmbeddedStore::cuda`]'s mover and the pool's DMA registration, once
    /// CUDA memory is registered.
    pub fn cuda_status(&self) -> Option<(CudaStats, PinStatus)> {
        self.cuda().map(|m| (m.stats(), m.pin_status()))
    }

    /// Waits up to `timeout` for the pool's DMA registration; false when it has not finished
    /// (or no CUDA memory is registered).
    pub fn wait_pool_registered(&self, timeout: Duration) -> bool {
        let p = self.shared.pinner.lock().clone();
        p.is_some_and(|p| p.progress().wait(timeout))
    }

    /// Starts storing `block_ids` of cache group `group` under `keys` (one key per block).
    pub fn store(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.default.store(layout, group, block_ids, keys)
    }

    /// Starts loading `keys` into `block_ids` of cache group `group`.
    pub fn load(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.default.load(layout, group, block_ids, keys)
    }

    /// Waits for a job with the store's default timeout.
    pub fn wait(&self, job: &JobHandle) -> Result<Vec<KeyOutcome>, StoreError> {
        Ok(job.wait(self.shared.timeout)?)
    }

    /// Default transfer timeout.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Removes every object (the disk tier's too); returns how many left the pool.
    /// [`StoreError::Closed`] after `close`.
    pub fn clear(&self) -> Result<u64, StoreError> {
        self.check_open()?;
        // One clear of the pool and the tiers under it: no evicted object reaches a tier
        // meanwhile, and no fill that read a tier before commits after (`Pool::begin_clear`).
        Ok(self.shared.tiers.clear(&self.shared.pool))
    }

    /// Drops `keys` from this store: from the pool and from the disk tier (its index, and
    /// writes of them still queued), so lookups here miss them. A remote tier keeps its copies
    /// (other nodes share it; a later lookup may fetch them back). Returns how many were in
    /// the pool. A pinned object leaves lookups at once and its space is freed when the
    /// transfer using it ends. [`StoreError::Closed`] after `close`.
    pub fn evict(&self, keys: &[BlockKey]) -> Result<u64, StoreError> {
        self.check_open()?;
        Ok(self.shared.tiers.evict(&self.shared.pool, keys))
    }

    /// Removes the objects of one key namespace (the string keys were built from) from the
    /// pool, from the disk tier's index and from the remote tier when there are ones; returns
    /// how many left the pool. Other namespaces are untouched. The disk keeps their bytes
    /// until their segments are dropped: a restart finds them again.
    pub fn clear_namespace(&self, namespace: &str) -> Result<u64, StoreError> {
        self.check_open()?;
        let id = umbp_core::KeyBuilder::new(namespace, Default::default())?.namespace_id();
        Ok(self.shared.tiers.clear_namespace(&self.shared.pool, &id))
    }

    /// Removes the remote tier's objects of the namespace with id `namespace_id` (every rank,
    /// whichever node wrote them); how many (`None` without a remote tier or when it failed).
    /// [`clear`](Self::clear) leaves the remote tier alone: other nodes and models share it.
    pub fn clear_remote_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        self.shared.tiers.clear_shared_namespace(namespace_id)
    }

    /// Pool counters. [`StoreError::Closed`] after `close`.
    pub fn stats(&self) -> Result<PoolStats, StoreError> {
        self.check_open()?;
        let mut s = self.shared.pool.stats();
        // Damage found on the way to the engine in any tier: the pool's own, and objects the
        // disk and remote tiers refused to hand over.
        s.corrupt_detected += self.shared.tiers.corrupt();
        Ok(s)
    }

    /// Stored / removed notifications.
    pub fn subscribe(&self, capacity: usize) -> std::sync::mpsc::Receiver<PoolEvent> {
        self.shared.pool.subscribe(capacity)
    }

    /// Stops the copy workers (after queued jobs) and the evictor; later calls fail with
    /// [`StoreError::Closed`], in every session. Idempotent.
    pub fn close(&self) {
        self.shared.close();
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::{GroupLayout, KeyBuilder, LayerSpec, PoolConfig, RankTopology};
    use umbp_cuda::{CudaError, CudaOptions};

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
        assert_eq!(r, vec![KeyOutcome::Done]);
        assert_eq!(s.prefix_hits(&keys).unwrap(), 1);
        // Evicting one key of three: only it is gone, and only once.
        let more = vec![keys[0], kb.key(0, b"x").unwrap(), kb.key(1, b"h").unwrap()];
        let r = s.wait(&s.store(lid, 0, &[1, 2], more[1..].to_vec()).unwrap());
        assert_eq!(r.unwrap(), vec![KeyOutcome::Done; 2]);
        assert_eq!(s.evict(&more[1..2]).unwrap(), 1);
        assert_eq!(s.evict(&more[1..2]).unwrap(), 0);
        assert_eq!(s.exists(&more).unwrap(), vec![true, false, true]);
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
    fn memory_that_is_not_mapped_writable_is_refused_at_registration() {
        let s = store();
        // SAFETY: mapping a fresh anonymous region for this test, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                3 * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let a = p as u64;
        // SAFETY: unmapping / protecting pages of our own mapping.
        unsafe {
            libc::munmap(p.cast::<u8>().add(2 * 4096).cast(), 4096);
            libc::mprotect(p.cast::<u8>().add(4096).cast(), 4096, libc::PROT_READ);
        }
        // SAFETY: every registration below is refused or never copied; the store is dropped
        // before the mapping.
        unsafe {
            let e = s
                .register_memory(a + 2 * 4096, 4096)
                .unwrap_err()
                .to_string();
            assert!(e.contains("is not mapped") && e.contains("data_ptr"), "{e}");
            let e = s.register_memory(a, 2 * 4096).unwrap_err().to_string();
            assert!(e.contains("not readable and writable"), "{e}");
            let e = s.register_memory(a, 3 * 4096).unwrap_err().to_string();
            assert!(e.contains("cannot register host memory"), "{e}");
            s.register_memory(a, 4096).unwrap();
        }
        s.close();
        drop(s);
        // SAFETY: our own mapping, no longer registered anywhere.
        unsafe { libc::munmap(p, 2 * 4096) };
    }

    #[test]
    fn a_closed_store_answers_nothing() {
        let s = store();
        let kb = KeyBuilder::new("s", RankTopology::default()).unwrap();
        let keys = vec![kb.key(0, b"h").unwrap()];
        assert_eq!(s.exists(&keys).unwrap(), vec![false]);
        s.close();
        assert!(matches!(s.exists(&keys), Err(StoreError::Closed)));
        assert!(matches!(s.prefix_hits(&keys), Err(StoreError::Closed)));
        assert!(matches!(s.clear(), Err(StoreError::Closed)));
        assert!(matches!(s.evict(&keys), Err(StoreError::Closed)));
        assert!(matches!(s.stats(), Err(StoreError::Closed)));
    }

    #[test]
    fn cuda_without_a_driver_is_an_error_that_names_cuda() {
        let s = store();
        let buf = vec![0u8; 4096];
        // SAFETY: the range is never copied (registration fails before the registry is used).
        let e = unsafe { s.register_cuda_memory(buf.as_ptr() as u64, 4096, 0) };
        match e {
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("CUDA"), "{m}");
                if matches!(e, StoreError::Cuda(CudaError::NoDriver { .. })) {
                    assert!(
                        s.cuda_status().is_none(),
                        "nothing CUDA exists without a driver"
                    );
                }
            }
            // Only where a driver and a device exist: host memory is then rejected.
            Ok(_) => panic!("host memory was accepted as CUDA memory"),
        }
        let layer = LayerSpec {
            base_addr: buf.as_ptr() as u64,
            num_blocks: 4,
            block_stride: 1024,
            block_bytes: 1024,
        };
        // SAFETY: `buf` outlives the store's use of it.
        unsafe { s.register_memory(buf.as_ptr() as u64, 4096) }.unwrap();
        let lid = s
            .register_layout(KvLayout::new(vec![GroupLayout::new(vec![layer]).unwrap()]).unwrap())
            .unwrap();
        let kb = KeyBuilder::new("s", RankTopology::default()).unwrap();
        // SAFETY: stream 0 is the legacy default stream (and a host layout is refused first).
        let e = unsafe { s.store_on(lid, 0, &[1], vec![kb.key(0, b"h").unwrap()], Some(0)) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("stream"), "{e}");
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
        let e = EmbeddedStore::new(StoreConfig {
            cuda: CudaOptions {
                max_ctas: 0,
                ..CudaOptions::default()
            },
            ..StoreConfig::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("cuda_max_ctas"), "{e}");
    }
}
