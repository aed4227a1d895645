//! Sessions: what one client of a store owns.
//!
//! A [`Session`] holds its memory registrations, the KV layouts over them and the jobs it
//! submitted. Dropping it (or [`Session::release`]) releases all of it: unfinished jobs are
//! cancelled and waited for (bounded by the store's timeout, logged), then its layouts are
//! dropped and its memory deregistered. Another session's registrations and jobs are not
//! touched.
//!
//! A session's layouts may lie only in its own registrations. Besides absolute addresses, a
//! layout can be given relative to them ([`Session::register_relative_layout`]: each layer's
//! base is a [`RegionOffset`]), which is what a server needs that maps a client's memory
//! itself (at addresses the client does not know): it resolves the offsets against that
//! session's regions only, and refuses a region id of another session by name.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;
use umbp_copy::{Direction, JobHandle, JobSet, MemoryKind, MemoryRegistry, RegionId};
use umbp_core::{BlockKey, CoreError, GroupLayout, KvLayout, LayerSpec};

use crate::error::StoreError;
use crate::ids::{LayoutId, SessionId};
use crate::mapped::check_mapped_writable;
use crate::shared::StoreShared;
use umbp_copy::KeyResult;

/// A place in a registered memory region: `offset` bytes past the start of registration
/// `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionOffset {
    /// The registration (of the session the layout is registered in).
    pub region: RegionId,
    /// Bytes from the start of the registration.
    pub offset: u64,
}

/// One run of a cache group, placed relative to a registration: like
/// [`umbp_core::LayerSpec`], with the address of block 0 given as a [`RegionOffset`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelativeLayer {
    /// Where block 0 of the run starts.
    pub base: RegionOffset,
    /// Number of blocks the cache holds.
    pub num_blocks: u64,
    /// Distance in bytes between consecutive blocks.
    pub block_stride: u64,
    /// Bytes of one block of this run.
    pub block_bytes: u64,
}

/// What releasing a session did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionRelease {
    /// Unfinished jobs that were asked to stop.
    pub jobs_cancelled: usize,
    /// Jobs still copying when the store's timeout ran out.
    pub jobs_unfinished: usize,
    /// Layouts dropped.
    pub layouts_dropped: usize,
    /// Registrations removed.
    pub regions_deregistered: usize,
    /// Registrations still used by transfers when the timeout ran out: they stay registered
    /// (their memory may still be written), and the failure is logged.
    pub regions_kept: Vec<RegionId>,
}

/// A registration of this session, as it was registered.
#[derive(Debug, Clone, Copy)]
struct OwnedRegion {
    addr: u64,
    len: u64,
    kind: MemoryKind,
}

impl OwnedRegion {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A layout of this session.
#[derive(Debug)]
struct SessionLayout {
    layout: Arc<KvLayout>,
    /// The CUDA device whose memory it lies in (None: host memory).
    cuda: Option<i32>,
    /// The registrations it lies in: deregistering one drops the layout.
    regions: Vec<RegionId>,
}

#[derive(Debug, Default)]
struct Owned {
    regions: BTreeMap<RegionId, OwnedRegion>,
    layouts: HashMap<LayoutId, SessionLayout>,
}

impl Owned {
    /// The registration of this session that covers `[addr, addr + len)`.
    fn covering(&self, addr: u64, len: u64) -> Option<(RegionId, OwnedRegion)> {
        self.regions
            .iter()
            .find(|(_, r)| r.covers(addr, len))
            .map(|(id, r)| (*id, *r))
    }
}

/// One client of a store: its memory registrations, its layouts and its in-flight jobs.
/// Dropping it releases them (see the module documentation); the store's pool and other
/// sessions are not affected.
#[derive(Debug)]
pub struct Session {
    id: SessionId,
    shared: Arc<StoreShared>,
    owned: RwLock<Owned>,
    jobs: JobSet,
    released: AtomicBool,
}

impl Session {
    pub(crate) fn new(shared: Arc<StoreShared>) -> Self {
        Session {
            id: shared.new_session_id(),
            shared,
            owned: RwLock::new(Owned::default()),
            jobs: JobSet::new(),
            released: AtomicBool::new(false),
        }
    }

    /// This session's id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    fn registry(&self) -> &MemoryRegistry {
        self.shared.engine.registry()
    }

    /// Registers host memory this session's layouts may lie in.
    ///
    /// # Safety
    /// As [`MemoryRegistry::register`]: the memory stays valid until deregistered (by
    /// [`Session::deregister_memory`] or by releasing the session).
    pub unsafe fn register_memory(&self, addr: u64, len: u64) -> Result<RegionId, StoreError> {
        self.check_live()?;
        if len > 0 {
            check_mapped_writable(addr, len)?;
        }
        // SAFETY: forwarded contract.
        unsafe { self.own(addr, len, MemoryKind::Host) }
    }

    /// Registers CUDA memory of `device`, like [`crate::EmbeddedStore::register_cuda_memory`].
    ///
    /// # Safety
    /// As [`Session::register_memory`]: the memory stays allocated until deregistered.
    pub unsafe fn register_cuda_memory(
        &self,
        addr: u64,
        len: u64,
        device: i32,
    ) -> Result<RegionId, StoreError> {
        self.check_live()?;
        let mover = self.shared.cuda_mover_for(device)?;
        mover.check_device_range(addr, len)?;
        // SAFETY: forwarded contract; the range was checked to be memory of `device`.
        unsafe { self.own(addr, len, MemoryKind::Cuda { device }) }
    }

    /// Registers `[addr, addr + len)` in the store's registry as this session's.
    ///
    /// # Safety
    /// As [`MemoryRegistry::register`].
    unsafe fn own(&self, addr: u64, len: u64, kind: MemoryKind) -> Result<RegionId, StoreError> {
        // SAFETY: forwarded contract.
        let id = unsafe { self.registry().register(addr, len, kind) }?;
        let mut owned = self.owned.write();
        if self.is_released() {
            // Released while registering: the release did not see this region.
            drop(owned);
            let _ = self.registry().deregister(id, self.shared.timeout);
            return Err(StoreError::SessionReleased(self.id));
        }
        owned.regions.insert(id, OwnedRegion { addr, len, kind });
        Ok(id)
    }

    /// Removes registration `id` of this session, waiting up to the store's timeout for
    /// transfers that use it; the session's layouts that lie in it are dropped with it. Another
    /// session's registration is refused ([`StoreError::ForeignRegion`]).
    ///
    /// The region and its layouts leave the session first (under the write lock that every
    /// submission holds while it plans and checks its job), and only then the registry, which
    /// waits for the jobs that hold the region. So a job either was checked against this
    /// region and holds it until it ends, or finds its layout gone: it can never be checked
    /// against a registration another session makes later at the same addresses.
    pub fn deregister_memory(&self, id: RegionId) -> Result<(), StoreError> {
        let (region, layouts) = {
            let mut owned = self.owned.write();
            let Some(region) = owned.regions.remove(&id) else {
                drop(owned);
                return Err(self.not_own(id));
            };
            let (gone, kept): (HashMap<_, _>, HashMap<_, _>) = std::mem::take(&mut owned.layouts)
                .into_iter()
                .partition(|(_, l)| l.regions.contains(&id));
            owned.layouts = kept;
            (region, gone)
        };
        if let Err(e) = self.registry().deregister(id, self.shared.timeout) {
            // Still registered (jobs in flight past the timeout): the session keeps it.
            let mut owned = self.owned.write();
            owned.regions.insert(id, region);
            owned.layouts.extend(layouts);
            return Err(e.into());
        }
        if !layouts.is_empty() {
            log::debug!(
                "umbp: session {}: deregistering memory region {id} dropped {} layout(s) in it",
                self.id,
                layouts.len()
            );
        }
        Ok(())
    }

    /// The error for a region id this session does not own.
    fn not_own(&self, id: RegionId) -> StoreError {
        if self.registry().contains(id) {
            StoreError::ForeignRegion(id)
        } else {
            umbp_copy::CopyError::UnknownRegion(id).into()
        }
    }

    /// Registers a layout given in absolute addresses, after checking every layer lies inside
    /// one of this session's registrations, all of one kind (host or CUDA).
    pub fn register_layout(&self, layout: KvLayout) -> Result<LayoutId, StoreError> {
        self.check_live()?;
        let mut owned = self.owned.write();
        self.insert_layout(&mut owned, layout)
    }

    /// Registers a layout whose runs are placed relative to this session's registrations:
    /// `groups[g]` lists group `g`'s runs. Each run is resolved against the registration it
    /// names (another session's is refused by name) and must lie inside it.
    pub fn register_relative_layout(
        &self,
        groups: Vec<Vec<RelativeLayer>>,
    ) -> Result<LayoutId, StoreError> {
        self.check_live()?;
        let mut owned = self.owned.write();
        let mut resolved = Vec::with_capacity(groups.len());
        for (g, layers) in groups.iter().enumerate() {
            let mut specs = Vec::with_capacity(layers.len());
            for (i, l) in layers.iter().enumerate() {
                specs.push(self.resolve(&owned, g, i, l)?);
            }
            resolved.push(GroupLayout::new(specs).map_err(|e| in_group(g, e))?);
        }
        let layout = KvLayout::new(resolved)?;
        self.insert_layout(&mut owned, layout)
    }

    /// Layer `i` of group `g`, at the address its region offset names.
    fn resolve(
        &self,
        owned: &Owned,
        g: usize,
        i: usize,
        l: &RelativeLayer,
    ) -> Result<LayerSpec, StoreError> {
        let RegionOffset { region, offset } = l.base;
        let bad = |why: String| {
            StoreError::Core(CoreError::InvalidLayout(format!(
                "group {g} layer {i}: {why}"
            )))
        };
        let Some(r) = owned.regions.get(&region) else {
            return Err(bad(if self.registry().contains(region) {
                format!("memory region {region} was registered by another session; a layout may refer only to its own session's registrations")
            } else {
                format!("memory region {region} is not registered in this session (never registered, or deregistered)")
            }));
        };
        if l.num_blocks == 0 || l.block_bytes == 0 {
            return Err(bad(format!(
                "num_blocks and block_bytes must be > 0 (got {} and {})",
                l.num_blocks, l.block_bytes
            )));
        }
        // The run's span: blocks 0 .. num_blocks - 1, the last one block_bytes long.
        let span = (l.num_blocks - 1)
            .checked_mul(l.block_stride)
            .and_then(|s| s.checked_add(l.block_bytes));
        let fits = span
            .and_then(|s| s.checked_add(offset))
            .is_some_and(|end| end <= r.len);
        if !fits {
            return Err(bad(format!(
                "{} blocks of {} bytes at stride {} from offset {offset} do not fit inside memory region {region} ({} bytes)",
                l.num_blocks, l.block_bytes, l.block_stride, r.len
            )));
        }
        Ok(LayerSpec {
            base_addr: r.addr + offset,
            num_blocks: l.num_blocks,
            block_stride: l.block_stride,
            block_bytes: l.block_bytes,
        })
    }

    /// Checks `layout` against this session's registrations and keeps it under a new id.
    fn insert_layout(&self, owned: &mut Owned, layout: KvLayout) -> Result<LayoutId, StoreError> {
        if self.is_released() {
            return Err(StoreError::SessionReleased(self.id));
        }
        // Per layer, the registration it lies in (or, when none of ours does, another
        // session's that does: the error then names it).
        let found = RefCell::new(Vec::new());
        let foreign = RefCell::new(None);
        let checked = layout.validate_within(|addr, len| match owned.covering(addr, len) {
            Some(r) => {
                found.borrow_mut().push(r);
                true
            }
            None => {
                if let Some(r) = self.registry().find(addr, len) {
                    foreign.borrow_mut().get_or_insert(r.id);
                }
                false
            }
        });
        if let Err(e) = checked {
            return Err(match (e, foreign.into_inner()) {
                (CoreError::InvalidLayout(m), Some(id)) => CoreError::InvalidLayout(format!(
                    "{m} (the bytes lie in memory region {id}, which another session registered; a session's layouts may use only its own registrations)"
                ))
                .into(),
                (e, _) => e.into(),
            });
        }
        let found = found.into_inner();
        let kind = found.first().map(|(_, r)| r.kind);
        if let Some((_, other)) = found.iter().find(|(_, r)| Some(r.kind) != kind) {
            let why = match (kind, other.kind) {
                (Some(MemoryKind::Cuda { device: a }), MemoryKind::Cuda { device: b }) => format!(
                    "the layout spans CUDA devices {a} and {b}; register one layout per device"
                ),
                _ => "the layout mixes host and CUDA memory; register one layout per kind".into(),
            };
            return Err(CoreError::InvalidLayout(why).into());
        }
        let mut regions: Vec<RegionId> = found.into_iter().map(|(id, _)| id).collect();
        regions.sort_unstable();
        regions.dedup();
        if let Some(r) = &self.shared.remote {
            // Fetched values are read as far as the largest object a layout makes.
            for g in layout.groups() {
                r.allow_object_bytes(g.object_bytes());
            }
        }
        let id = self.shared.new_layout_id();
        owned.layouts.insert(
            id,
            SessionLayout {
                layout: Arc::new(layout),
                cuda: match kind {
                    Some(MemoryKind::Cuda { device }) => Some(device),
                    _ => None,
                },
                regions,
            },
        );
        Ok(id)
    }

    /// A layout of this session (another session's layout ids are unknown here).
    pub fn layout(&self, id: LayoutId) -> Result<Arc<KvLayout>, StoreError> {
        self.owned
            .read()
            .layouts
            .get(&id)
            .map(|l| Arc::clone(&l.layout))
            .ok_or(StoreError::UnknownLayout(id))
    }

    /// This session's registrations.
    pub fn regions(&self) -> Vec<RegionId> {
        self.owned.read().regions.keys().copied().collect()
    }

    /// This session's layouts.
    pub fn layouts(&self) -> Vec<LayoutId> {
        let mut v: Vec<LayoutId> = self.owned.read().layouts.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// How many of the jobs this session submitted have not finished.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// # Safety
    /// As [`crate::EmbeddedStore::store_on`] for `stream`.
    unsafe fn submit(
        &self,
        dir: Direction,
        layout_id: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        self.check_live()?;
        // Held until the job is checked against the registry and holds its regions (see
        // `deregister_memory`): no deregistration of this session runs in between.
        let owned = self.owned.read();
        let l = owned
            .layouts
            .get(&layout_id)
            .ok_or(StoreError::UnknownLayout(layout_id))?;
        #[cfg(test)]
        tests::parked_after_planning(self);
        // SAFETY: forwarded contract.
        let job = unsafe {
            self.shared.submit(
                dir, layout_id, &l.layout, l.cuda, group, block_ids, keys, stream,
            )
        }?;
        self.jobs.insert(&job);
        drop(owned);
        Ok(job)
    }

    /// Starts storing `block_ids` of group `group` of layout `layout` under `keys`, like
    /// [`crate::EmbeddedStore::store_on`]. The job is this session's.
    ///
    /// # Safety
    /// As [`crate::EmbeddedStore::store_on`] for `stream`.
    pub unsafe fn store_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.submit(Direction::Store, layout, group, block_ids, keys, stream) }
    }

    /// Starts loading `keys` into `block_ids`, like [`crate::EmbeddedStore::load_on`]. The
    /// job is this session's.
    ///
    /// # Safety
    /// As [`crate::EmbeddedStore::store_on`] for `stream`.
    pub unsafe fn load_on(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.submit(Direction::Load, layout, group, block_ids, keys, stream) }
    }

    /// [`Session::store_on`] without a stream.
    pub fn store(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: no stream.
        unsafe { self.store_on(layout, group, block_ids, keys, None) }
    }

    /// [`Session::load_on`] without a stream.
    pub fn load(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: no stream.
        unsafe { self.load_on(layout, group, block_ids, keys, None) }
    }

    /// Waits for a job with the store's default timeout.
    pub fn wait(&self, job: &JobHandle) -> Result<Vec<KeyResult>, StoreError> {
        Ok(job.wait(self.shared.timeout)?)
    }

    /// Releases everything the session owns and says what that did (dropping the session does
    /// the same, and logs it).
    pub fn release(self) -> SessionRelease {
        self.release_owned()
    }

    /// [`Session::release`] through a shared reference (a server whose requests may still
    /// hold the session): from now on the session refuses new registrations, layouts and
    /// jobs ([`StoreError::SessionReleased`]); a second call does nothing.
    pub fn release_now(&self) -> SessionRelease {
        self.release_owned()
    }

    /// Whether the session has been released.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    fn check_live(&self) -> Result<(), StoreError> {
        self.shared.check_open()?;
        if self.is_released() {
            Err(StoreError::SessionReleased(self.id))
        } else {
            Ok(())
        }
    }

    fn release_owned(&self) -> SessionRelease {
        if self.released.swap(true, Ordering::AcqRel) {
            return SessionRelease::default();
        }
        let timeout = self.shared.timeout;
        let deadline = Instant::now() + timeout;
        let jobs_cancelled = self.jobs.cancel_all();
        let jobs_unfinished = self.jobs.wait_all(timeout);
        if jobs_unfinished > 0 {
            log::warn!(
                "umbp: session {}: {jobs_unfinished} job(s) still copying {timeout:?} after it was released",
                self.id
            );
        }
        let owned = std::mem::take(&mut *self.owned.write());
        let mut report = SessionRelease {
            jobs_cancelled,
            jobs_unfinished,
            layouts_dropped: owned.layouts.len(),
            ..SessionRelease::default()
        };
        drop(owned.layouts);
        for id in owned.regions.into_keys() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.registry().deregister(id, left) {
                Ok(()) => report.regions_deregistered += 1,
                Err(e) => {
                    log::error!(
                        "umbp: session {}: memory region {id} stays registered: {e}",
                        self.id
                    );
                    report.regions_kept.push(id);
                }
            }
        }
        if report != SessionRelease::default() {
            log::debug!("umbp: session {} released: {report:?}", self.id);
        }
        report
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.release_owned();
    }
}

/// Names the group in a layout error about one of its layers.
fn in_group(g: usize, e: CoreError) -> StoreError {
    match e {
        CoreError::InvalidLayout(m) => CoreError::InvalidLayout(format!("group {g}: {m}")).into(),
        e => e.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::time::Duration;

    use parking_lot::{Condvar, Mutex};
    use umbp_core::{KeyBuilder, PoolConfig, RankTopology};

    use crate::{EmbeddedStore, StoreConfig};

    const BLOCK: u64 = 1024;
    const BLOCKS: u64 = 32;

    fn store(workers: usize) -> EmbeddedStore {
        EmbeddedStore::new(StoreConfig {
            pool: PoolConfig {
                prefault: false,
                ..PoolConfig::with_capacity(4 << 20)
            },
            num_workers: workers,
            timeout: Duration::from_secs(5),
            ..StoreConfig::default()
        })
        .unwrap()
    }

    /// A cache of `BLOCKS` 1 KiB blocks, one layer, filled with `fill`.
    fn cache(fill: u8) -> Vec<u8> {
        vec![fill; (BLOCK * BLOCKS) as usize]
    }

    fn absolute(buf: &[u8]) -> KvLayout {
        KvLayout::new(vec![GroupLayout::new(vec![LayerSpec {
            base_addr: buf.as_ptr() as u64,
            num_blocks: BLOCKS,
            block_stride: BLOCK,
            block_bytes: BLOCK,
        }])
        .unwrap()])
        .unwrap()
    }

    fn relative(region: RegionId, offset: u64, num_blocks: u64) -> Vec<Vec<RelativeLayer>> {
        vec![vec![RelativeLayer {
            base: RegionOffset { region, offset },
            num_blocks,
            block_stride: BLOCK,
            block_bytes: BLOCK,
        }]]
    }

    fn keys(tag: &str, n: u64) -> Vec<BlockKey> {
        let kb = KeyBuilder::new("session-test", RankTopology::default()).unwrap();
        (0..n)
            .map(|i| kb.key(0, format!("{tag}{i}").as_bytes()).unwrap())
            .collect()
    }

    /// Where a test parks a submission between reading its layout and checking its job: the
    /// next submission of the session named (by address: ids repeat across the stores of
    /// tests running at once) signals and waits for the go.
    #[allow(clippy::type_complexity)]
    static PARK: Mutex<Option<(usize, mpsc::Sender<()>, mpsc::Receiver<()>)>> = Mutex::new(None);

    pub(super) fn parked_after_planning(session: &Session) {
        let at = session as *const Session as usize;
        let mut park = PARK.lock();
        if park.as_ref().is_none_or(|(s, _, _)| *s != at) {
            return;
        }
        let (_, parked, go) = park.take().expect("checked");
        drop(park);
        parked.send(()).unwrap();
        let _ = go.recv_timeout(Duration::from_secs(20));
    }

    /// Issue 29, item 1: session A deregistered a region while its own load into it was
    /// between planning and the registry check; session B then registered memory at the same
    /// address, and A's load passed the check against B's registration and wrote into B's
    /// memory. Now the deregistration waits for the submission (which then holds the region
    /// until its copy ends), so B cannot register there until A's job is over.
    #[test]
    fn a_job_is_never_checked_against_another_sessions_later_registration() {
        let st = store(2);
        let buf = cache(7);
        let (a, b) = (st.open_session().unwrap(), st.open_session().unwrap());
        let ra = register(&a, &buf);
        let la = a.register_relative_layout(relative(ra, 0, BLOCKS)).unwrap();
        let k = keys("race", 1);
        assert_eq!(
            st.wait(&a.store(la, 0, &[0], k.clone()).unwrap()).unwrap(),
            vec![KeyResult::Done]
        );
        let (parked_tx, parked_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel();
        let a = Arc::new(a);
        *PARK.lock() = Some((Arc::as_ptr(&a) as usize, parked_tx, go_rx));
        let loader = {
            let a = Arc::clone(&a);
            let k = k.clone();
            std::thread::spawn(move || a.load(la, 0, &[1], k))
        };
        parked_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let (dereg_tx, dereg_rx) = mpsc::channel();
        let deregistering = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || dereg_tx.send(a.deregister_memory(ra)).unwrap())
        };
        // The deregistration must wait for the parked submission (the old code finished it
        // here at once).
        let early = dereg_rx.recv_timeout(Duration::from_secs(1));
        assert!(
            early.is_err(),
            "the region was deregistered under a job being submitted: {early:?}"
        );
        // So B cannot register the same addresses yet.
        // SAFETY: the buffer outlives the store.
        let rb = unsafe { b.register_memory(buf.as_ptr() as u64, buf.len() as u64) };
        assert!(
            rb.is_err(),
            "B registered memory A's job is about to copy into"
        );
        go_tx.send(()).unwrap();
        let job = loader.join().unwrap().unwrap();
        assert_eq!(st.wait(&job).unwrap(), vec![KeyResult::Done]);
        dereg_rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        deregistering.join().unwrap();
        // Now B may; A's layout went with the region.
        // SAFETY: as above.
        unsafe { b.register_memory(buf.as_ptr() as u64, buf.len() as u64) }.unwrap();
        assert!(matches!(
            a.load(la, 0, &[1], k),
            Err(StoreError::UnknownLayout(_))
        ));
    }

    /// Registers `buf` in `s`.
    fn register(s: &Session, buf: &[u8]) -> RegionId {
        // SAFETY: every test drops its store (and so its sessions) before its buffers.
        unsafe { s.register_memory(buf.as_ptr() as u64, buf.len() as u64) }.unwrap()
    }

    /// Holds the store's only copy worker until [`Hold::free`]: a callback of a finished job
    /// runs on the worker and waits there.
    struct Hold {
        open: Mutex<bool>,
        cv: Condvar,
        holding: AtomicBool,
    }

    impl Hold {
        fn take(s: &Session, layout: LayoutId) -> Arc<Hold> {
            let hold = Arc::new(Hold {
                open: Mutex::new(false),
                cv: Condvar::new(),
                holding: AtomicBool::new(false),
            });
            for attempt in 0..1000u64 {
                let job = s
                    .store(
                        layout,
                        0,
                        &[attempt % BLOCKS],
                        keys(&format!("hold{attempt}-"), 1),
                    )
                    .unwrap();
                let h = Arc::clone(&hold);
                let ran = Arc::new(AtomicBool::new(false));
                let r = Arc::clone(&ran);
                let me = std::thread::current().id();
                job.on_done(move |_| {
                    let on_worker = std::thread::current().id() != me;
                    if on_worker {
                        h.holding.store(true, Ordering::Release);
                    }
                    r.store(true, Ordering::Release);
                    if on_worker {
                        // Bounded, so a failed assertion cannot leave the worker held.
                        let until = Instant::now() + Duration::from_secs(10);
                        let mut open = h.open.lock();
                        while !*open && !h.cv.wait_until(&mut open, until).timed_out() {}
                    }
                });
                let deadline = Instant::now() + Duration::from_secs(5);
                while !ran.load(Ordering::Acquire) {
                    assert!(Instant::now() < deadline, "the callback never ran");
                    std::thread::sleep(Duration::from_millis(1));
                }
                if hold.holding.load(Ordering::Acquire) {
                    return hold;
                }
                // The job had finished before the callback was attached: try again.
            }
            panic!("never held the worker");
        }

        fn free(&self) {
            *self.open.lock() = true;
            self.cv.notify_all();
        }
    }

    #[test]
    fn dropping_a_session_releases_its_memory_layouts_and_jobs_only() {
        let st = store(1);
        let (buf_a, buf_b) = (cache(1), cache(2));
        let a = st.open_session().unwrap();
        let b = st.open_session().unwrap();
        assert_ne!(a.id(), b.id());
        let ra = register(&a, &buf_a);
        let rb = register(&b, &buf_b);
        let la = a.register_layout(absolute(&buf_a)).unwrap();
        let lb = b.register_layout(absolute(&buf_b)).unwrap();
        assert!(matches!(b.layout(la), Err(StoreError::UnknownLayout(_))));
        // B's job finishes, holding the only worker; A's job and B's next job wait behind it.
        let hold = Hold::take(&b, lb);
        let job_a = a.store(la, 0, &[0, 1, 2, 3], keys("a", 4)).unwrap();
        let job_b = b.store(lb, 0, &[4, 5], keys("b", 2)).unwrap();
        assert_eq!(a.jobs_in_flight(), 1);
        let releasing = std::thread::spawn(move || a.release());
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !releasing.is_finished(),
            "the release waits for the session's job"
        );
        assert!(
            st.shared.engine.registry().covers(buf_a.as_ptr() as u64, 1),
            "memory stays registered while its job is not done"
        );
        hold.free();
        let report = releasing.join().unwrap();
        assert_eq!(
            report,
            SessionRelease {
                jobs_cancelled: 1,
                jobs_unfinished: 0,
                layouts_dropped: 1,
                regions_deregistered: 1,
                regions_kept: vec![],
            }
        );
        assert_eq!(
            job_a.poll().expect("finished by the release"),
            vec![KeyResult::Cancelled; 4]
        );
        let reg = st.shared.engine.registry();
        assert!(!reg.covers(buf_a.as_ptr() as u64, 1));
        assert!(!reg.contains(ra));
        assert!(matches!(st.layout(la), Err(StoreError::UnknownLayout(_))));
        // B is untouched: its job ran, its memory and layout are there and usable.
        assert_eq!(b.wait(&job_b).unwrap(), vec![KeyResult::Done; 2]);
        assert!(reg.contains(rb) && reg.covers(buf_b.as_ptr() as u64, BLOCK * BLOCKS));
        assert_eq!(b.layouts(), vec![lb]);
        let again = b.store(lb, 0, &[6], keys("b2", 1)).unwrap();
        assert_eq!(b.wait(&again).unwrap(), vec![KeyResult::Done]);
        // Plain drop releases as well.
        drop(b);
        assert!(!reg.contains(rb) && reg.is_empty());
    }

    #[test]
    fn a_relative_layout_resolves_against_its_own_sessions_regions_only() {
        let st = store(2);
        let (mut buf_a, buf_b) = (cache(0), cache(9));
        for (i, x) in buf_a.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let a = st.open_session().unwrap();
        let b = st.open_session().unwrap();
        let ra = register(&a, &buf_a);
        let rb = register(&b, &buf_b);

        // Resolved inside A's region: blocks start 4 blocks in.
        let lr = a
            .register_relative_layout(relative(ra, 4 * BLOCK, 8))
            .unwrap();
        let l = a.layout(lr).unwrap();
        assert_eq!(
            l.groups()[0].layers()[0].base_addr,
            buf_a.as_ptr() as u64 + 4 * BLOCK
        );
        // It copies those bytes: block 1 of the layout is block 5 of the buffer.
        let k = keys("rel", 1);
        let job = a.store(lr, 0, &[1], k.clone()).unwrap();
        assert_eq!(a.wait(&job).unwrap(), vec![KeyResult::Done]);
        let la = a.register_layout(absolute(&buf_a)).unwrap();
        let job = a.load(la, 0, &[0], k).unwrap();
        assert_eq!(a.wait(&job).unwrap(), vec![KeyResult::Done]);
        let b5 = (5 * BLOCK) as usize;
        assert_eq!(buf_a[..BLOCK as usize], buf_a[b5..b5 + BLOCK as usize]);

        // Another session's region is refused by name, an unknown one as unknown, a run that
        // leaves the region as not fitting.
        let e = a
            .register_relative_layout(relative(rb, 0, 4))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "memory region {rb} was registered by another session"
            )),
            "{e}"
        );
        let e = a
            .register_relative_layout(relative(rb + ra + 100, 0, 4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not registered in this session"), "{e}");
        let e = a
            .register_relative_layout(relative(ra, (BLOCKS - 1) * BLOCK, 2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("do not fit inside memory region {ra}")),
            "{e}"
        );
        assert!(a.register_relative_layout(relative(ra, 0, BLOCKS)).is_ok());
        let e = a
            .register_relative_layout(relative(ra, u64::MAX - 10, 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not fit"), "{e}");

        // Absolute addresses in another session's memory are refused too, naming the region.
        let e = a.register_layout(absolute(&buf_b)).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "memory region {rb}, which another session registered"
            )),
            "{e}"
        );
        // Nor can A deregister B's memory.
        assert!(matches!(
            a.deregister_memory(rb),
            Err(StoreError::ForeignRegion(id)) if id == rb
        ));
        assert!(st.shared.engine.registry().contains(rb));
        assert!(matches!(
            a.deregister_memory(rb + ra + 100),
            Err(StoreError::Copy(umbp_copy::CopyError::UnknownRegion(_)))
        ));

        // Deregistering A's region drops the layouts that lie in it.
        assert_eq!(a.layouts().len(), 3);
        a.deregister_memory(ra).unwrap();
        assert!(a.layouts().is_empty());
        assert!(matches!(a.layout(lr), Err(StoreError::UnknownLayout(_))));
        let e = a
            .register_relative_layout(relative(ra, 0, 4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not registered in this session"), "{e}");
        drop((a, b, st));
    }

    #[test]
    fn the_store_api_is_its_default_session() {
        let st = store(1);
        let buf = cache(3);
        // SAFETY: `buf` outlives the store.
        let r = unsafe { st.register_memory(buf.as_ptr() as u64, buf.len() as u64) }.unwrap();
        let l = st.register_layout(absolute(&buf)).unwrap();
        assert_eq!(st.session().regions(), vec![r]);
        assert_eq!(st.session().layouts(), vec![l]);
        let other = st.open_session().unwrap();
        assert!(matches!(other.layout(l), Err(StoreError::UnknownLayout(_))));
        assert!(matches!(
            other.deregister_memory(r),
            Err(StoreError::ForeignRegion(_))
        ));
        // A job of the default session is tracked by it and can be awaited by callback.
        let (tx, rx) = mpsc::channel();
        let job = st.store(l, 0, &[0, 1], keys("d", 2)).unwrap();
        job.on_done(move |r| tx.send(r).unwrap());
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            vec![KeyResult::Done; 2]
        );
        // Callbacks run before the job reads as finished: wait for that before counting.
        job.wait(Duration::from_secs(5)).unwrap();
        assert_eq!(st.session().jobs_in_flight(), 0);
        // Store-wide operations stay on the store.
        assert_eq!(st.clear().unwrap(), 2);
        st.close();
        assert!(matches!(st.open_session(), Err(StoreError::Closed)));
        // After close every session refuses work, before looking at its arguments.
        assert!(matches!(
            other.store(l, 0, &[0], keys("x", 1)),
            Err(StoreError::Closed)
        ));
        assert!(matches!(
            st.store(l, 0, &[0], keys("x", 1)),
            Err(StoreError::Closed)
        ));
        // A session outliving its store still releases its memory.
        let regs = Arc::clone(st.shared.engine.registry());
        drop(st);
        assert!(
            regs.is_empty(),
            "the default session deregistered its memory"
        );
        drop(other);
    }
}
