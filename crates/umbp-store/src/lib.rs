//! The embedded store: what one engine worker owns in embedded mode.
//!
//! [`EmbeddedStore`] ties a [`Pool`], the [`MemoryRegistry`] of the worker's KV cache, its
//! registered [`KvLayout`]s and a [`CopyEngine`] together. Callers pass block ids and keys in
//! bulk; range planning and copies happen here.
//!
//! Registrations, layouts and jobs belong to a [`Session`] (one client); dropping it releases
//! them. Embedded mode is one session, which the store owns and its calls go to.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use thiserror::Error;
use umbp_copy::{CopyEngine, CopyError, Direction, HostMover, JobHandle, MemoryRegistry, RegionId};
use umbp_core::{BlockKey, CoreError, KeyBuilder, KvLayout, PoolConfig};
use umbp_cuda::CudaMover;
pub use umbp_cuda::{CopyMethod, CudaError, CudaOptions, CudaStats, PinStatus};
use umbp_pool::{Pool, PoolError, PoolEvent, PoolStats};

pub use umbp_copy::{JobFinished, JobSet, KeyResult};

mod session;
pub use session::{RegionOffset, RelativeLayer, Session, SessionId, SessionRelease};

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
    /// A memory registration of another session was named.
    #[error("memory region {0} was registered by another session; a session uses and deregisters only its own registrations")]
    ForeignRegion(RegionId),
    /// The store was closed.
    #[error("the store is closed")]
    Closed,
    /// The CUDA backend failed (or there is no CUDA).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Host memory to register is not mapped readable and writable in this process.
    #[error("cannot register host memory {addr:#x}+{len}: {reason}; pass the address and byte size of a live, writable allocation (e.g. a tensor's data_ptr() and its storage's nbytes())")]
    Unmapped {
        /// Start of the range.
        addr: u64,
        /// Bytes.
        len: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// Checks through `/proc/self/maps` that `[addr, addr + len)` is mapped readable and writable
/// in this process: a range that is not would crash the process on the first copy.
pub(crate) fn check_mapped_writable(addr: u64, len: u64) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::Unmapped { addr, len, reason };
    let end = addr
        .checked_add(len)
        .ok_or_else(|| err("the range wraps around the address space".into()))?;
    let maps = match std::fs::read_to_string("/proc/self/maps") {
        Ok(m) => m,
        Err(e) => {
            log::warn!("umbp: /proc/self/maps unreadable ({e}); registered memory is not checked");
            return Ok(());
        }
    };
    let mut spans: Vec<(u64, u64, bool)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (lo, hi) = f.next()?.split_once('-')?;
            let perms = f.next()?.as_bytes();
            let rw = perms.len() >= 2 && perms[0] == b'r' && perms[1] == b'w';
            Some((
                u64::from_str_radix(lo, 16).ok()?,
                u64::from_str_radix(hi, 16).ok()?,
                rw,
            ))
        })
        .collect();
    spans.sort_unstable();
    let mut at = addr;
    for (lo, hi, rw) in spans {
        if hi <= at {
            continue;
        }
        if lo > at || at >= end {
            break;
        }
        if !rw {
            return Err(err(format!(
                "{at:#x} lies in a mapping that is not readable and writable"
            )));
        }
        at = hi;
    }
    if at < end {
        return Err(err(format!("{at:#x} is not mapped in this process")));
    }
    Ok(())
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
    /// The CUDA backend, used once CUDA memory is registered.
    pub cuda: CudaOptions,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            pool: PoolConfig::default(),
            num_workers: 4,
            timeout: Duration::from_millis(30_000),
            cuda: CudaOptions::default(),
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
        self.cuda.validate().map_err(|e| match e {
            CudaError::Option { name, reason } => CoreError::option(name, reason),
            other => CoreError::option("cuda", other.to_string()),
        })
    }
}

/// What every session of a store shares: the pool, the copy engine with its registry of all
/// sessions' memory, the CUDA mover, and the counters that keep layout and session ids unique
/// across sessions.
#[derive(Debug)]
pub(crate) struct StoreShared {
    pub(crate) pool: Arc<Pool>,
    pub(crate) engine: CopyEngine,
    next_layout: AtomicU32,
    next_session: AtomicU64,
    pub(crate) timeout: Duration,
    closed: AtomicBool,
    cuda_opts: CudaOptions,
    /// The CUDA mover, created by the first CUDA registration (never before: no CUDA at start).
    cuda: Mutex<Option<Arc<CudaMover>>>,
}

impl StoreShared {
    pub(crate) fn check_open(&self) -> Result<(), StoreError> {
        if self.closed.load(Ordering::Acquire) {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }

    /// A layout id no session has used.
    pub(crate) fn new_layout_id(&self) -> LayoutId {
        self.next_layout.fetch_add(1, Ordering::Relaxed)
    }

    /// A session id no session has used.
    pub(crate) fn new_session_id(&self) -> SessionId {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Plans blocks `block_ids` of group `group` of layout `layout_id` (`layout`, whose memory
    /// is CUDA memory when `cuda`) and submits the copy.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn submit(
        &self,
        dir: Direction,
        layout_id: LayoutId,
        layout: &KvLayout,
        cuda: bool,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        self.check_open()?;
        let plan = layout.group(group)?.plan(block_ids)?;
        let mut token = 0;
        if let Some(stream) = stream {
            if !cuda {
                return Err(CoreError::option(
                    "stream",
                    format!("layout {layout_id} is host memory; a CUDA stream orders only copies of CUDA memory"),
                )
                .into());
            }
            if !block_ids.is_empty() && keys.len() == block_ids.len() {
                let m = self.cuda_mover()?;
                token = m.record_after(stream)?;
            }
        }
        match self.engine.submit_after(dir, keys, plan, token) {
            Ok(h) => Ok(h),
            Err(e) => {
                if token != 0 {
                    if let Ok(m) = self.cuda_mover() {
                        umbp_copy::Mover::release_token(m.as_ref(), token);
                    }
                }
                Err(e.into())
            }
        }
    }

    fn cuda_mover(&self) -> Result<Arc<CudaMover>, StoreError> {
        self.cuda.lock().clone().ok_or_else(|| {
            CoreError::option("stream", "no CUDA memory is registered with this store").into()
        })
    }

    /// The CUDA mover of `device`, created (and installed in the engine) by the first call;
    /// later calls must name the same device.
    pub(crate) fn cuda_mover_for(&self, device: i32) -> Result<Arc<CudaMover>, StoreError> {
        let mut slot = self.cuda.lock();
        match slot.as_ref() {
            Some(m) if m.device().ordinal() != device => Err(CudaError::Device {
                device,
                reason: format!(
                    "this store already copies for CUDA device {}; use one store per device",
                    m.device().ordinal()
                ),
            }
            .into()),
            Some(m) => Ok(Arc::clone(m)),
            None => {
                let m = Arc::new(CudaMover::new(
                    device,
                    Arc::clone(&self.pool),
                    self.cuda_opts.clone(),
                )?);
                self.engine.set_device_mover(m.clone())?;
                *slot = Some(Arc::clone(&m));
                Ok(m)
            }
        }
    }

    fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.engine.close();
            if let Some(m) = self.cuda.lock().as_ref() {
                // Every copy has finished: unregister the pool before it can be unmapped.
                m.shutdown();
            }
            self.pool.close();
        }
    }
}

/// One worker's pool with its memory, layouts and copy engine.
///
/// Memory registrations, layouts and jobs belong to a [`Session`]; the store's own
/// registration, layout and copy calls go to the default session it owns (embedded mode is one
/// client), and [`EmbeddedStore::open_session`] opens more. Pool-wide operations (lookups,
/// `clear`, statistics, `close`) stay on the store.
#[derive(Debug)]
pub struct EmbeddedStore {
    shared: Arc<StoreShared>,
    default: Session,
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
        let shared = Arc::new(StoreShared {
            pool,
            engine,
            next_layout: AtomicU32::new(1),
            next_session: AtomicU64::new(1),
            timeout: cfg.timeout,
            closed: AtomicBool::new(false),
            cuda_opts: cfg.cuda,
            cuda: Mutex::new(None),
        });
        let default = Session::new(Arc::clone(&shared));
        Ok(EmbeddedStore { shared, default })
    }

    fn check_open(&self) -> Result<(), StoreError> {
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

    /// Which keys are in the pool (pins nothing). [`StoreError::Closed`] after `close`.
    pub fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.exists_many(keys))
    }

    /// How many keys, from the first, are in the pool. [`StoreError::Closed`] after `close`.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.prefix_hits(keys))
    }

    /// Registers CUDA device memory of device `device` (e.g. a KV cache tensor's `data_ptr()`
    /// and byte size), in the default session. The first call loads the CUDA driver, creates
    /// the CUDA mover and starts registering the pool for DMA in the background; later calls
    /// must name the same device. The range must be device memory of that device, inside one
    /// allocation.
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
    pub fn store_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        self.default
            .store_on(layout, group, block_ids, keys, stream)
    }

    /// Starts loading like [`EmbeddedStore::load`]; with `stream`, the copies into the blocks
    /// wait on the device for the work queued on that stream so far (which may still read the
    /// blocks). The job finishes once the bytes are in place: work launched after that sees
    /// them.
    pub fn load_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        self.default.load_on(layout, group, block_ids, keys, stream)
    }

    /// The CUDA mover, once CUDA memory is registered (for its trace and statistics).
    pub fn cuda(&self) -> Option<Arc<CudaMover>> {
        self.shared.cuda.lock().clone()
    }

    /// The CUDA mover's counters and the pool's DMA registration, once CUDA memory is
    /// registered.
    pub fn cuda_status(&self) -> Option<(CudaStats, PinStatus)> {
        self.shared
            .cuda
            .lock()
            .as_ref()
            .map(|m| (m.stats(), m.pin_status()))
    }

    /// Waits up to `timeout` for the pool's DMA registration; false when it has not finished
    /// (or no CUDA memory is registered).
    pub fn wait_pool_registered(&self, timeout: Duration) -> bool {
        let m = self.cuda();
        m.is_some_and(|m| m.pin_progress().wait(timeout))
    }

    /// Starts storing `block_ids` of cache group `group` under `keys` (one key per block).
    pub fn store(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.store_on(layout, group, block_ids, keys, None)
    }

    /// Starts loading `keys` into `block_ids` of cache group `group`.
    pub fn load(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        self.load_on(layout, group, block_ids, keys, None)
    }

    /// Waits for a job with the store's default timeout.
    pub fn wait(&self, job: &JobHandle) -> Result<Vec<KeyResult>, StoreError> {
        Ok(job.wait(self.shared.timeout)?)
    }

    /// Default transfer timeout.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Removes every object; returns how many. [`StoreError::Closed`] after `close`.
    pub fn clear(&self) -> Result<u64, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.clear())
    }

    /// Pool counters. [`StoreError::Closed`] after `close`.
    pub fn stats(&self) -> Result<PoolStats, StoreError> {
        self.check_open()?;
        Ok(self.shared.pool.stats())
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
        // A closed store holds nothing: its lookups fail (the scheduler counts a miss).
        self.store.check_open().map_err(|e| e.to_string())?;
        if hash_len == 0 || hash_len > 32 || !packed.len().is_multiple_of(hash_len) {
            return Err(format!(
                "{} bytes are not whole {hash_len}-byte hashes",
                packed.len()
            ));
        }
        let hashes: Vec<&[u8]> = packed.chunks_exact(hash_len).collect();
        let n = self.store.pool().prefix_hits_with(hashes.len(), |i| {
            self.keys
                .key(group, hashes[i])
                .expect("hash length checked above")
        });
        Ok(n as u32)
    }

    fn exists(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<Vec<bool>, String> {
        self.store.check_open().map_err(|e| e.to_string())?;
        let keys = self
            .keys
            .keys_packed(group, packed, hash_len)
            .map_err(|e| e.to_string())?;
        self.store.exists(&keys).map_err(|e| e.to_string())
    }

    fn clear(&self) -> u64 {
        self.store.clear().unwrap_or(0)
    }

    fn describe(&self) -> String {
        let Ok(s) = self.store.stats() else {
            return format!("{} (store closed)", self.describe);
        };
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
        assert_eq!(s.prefix_hits(&keys).unwrap(), 1);
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
        let e = s
            .store_on(lid, 0, &[1], vec![kb.key(0, b"h").unwrap()], Some(0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("stream"), "{e}");
    }

    #[test]
    fn a_lookup_service_over_a_closed_store_answers_misses() {
        let s = Arc::new(store());
        let buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives the store's use of it (the store is closed first).
        unsafe { s.register_memory(buf.as_ptr() as u64, 4096) }.unwrap();
        let layer = LayerSpec {
            base_addr: buf.as_ptr() as u64,
            num_blocks: 4,
            block_stride: 1024,
            block_bytes: 1024,
        };
        let lid = s
            .register_layout(KvLayout::new(vec![GroupLayout::new(vec![layer]).unwrap()]).unwrap())
            .unwrap();
        let kb = KeyBuilder::new("s", RankTopology::default()).unwrap();
        let keys = vec![kb.key(0, b"h").unwrap()];
        s.wait(&s.store(lid, 0, &[1], keys).unwrap()).unwrap();
        let dir = std::env::temp_dir().join(format!("umbp-store-closed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.sock");
        let target = Arc::new(StoreLookup::new(Arc::clone(&s), kb, String::new()));
        let server = umbp_lookup::LookupServer::bind(&path, target).unwrap();
        let client = umbp_lookup::LookupClient::new(vec![path], Duration::from_secs(2));
        assert_eq!(client.prefix_hits(0, b"h", 1), 1);
        assert_eq!(client.exists_all(0, b"h", 1), [true]);
        s.close();
        assert_eq!(
            client.prefix_hits(0, b"h", 1),
            0,
            "a closed store answered a hit"
        );
        assert_eq!(client.exists_all(0, b"h", 1), [false]);
        server.shutdown();
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
