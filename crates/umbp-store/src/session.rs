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
use umbp_core::{Admit, BlockKey, CoreError, GroupLayout, KvLayout, LayerSpec};

use crate::error::StoreError;
use crate::ids::{LayoutId, SessionId};
use crate::mapped::check_mapped_writable;
use crate::shared::StoreShared;
use umbp_core::KeyOutcome;

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
        // A tier that fetches values reads them only as far as the largest object a layout
        // makes.
        for g in layout.groups() {
            self.shared.tiers.allow_object_bytes(g.object_bytes());
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
    #[allow(clippy::too_many_arguments)]
    unsafe fn submit(
        &self,
        dir: Direction,
        layout_id: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
        admit: Admit,
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
                dir, layout_id, &l.layout, l.cuda, group, block_ids, keys, stream, admit,
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
        unsafe { self.store_as_on(layout, group, block_ids, keys, stream, Admit::Policy) }
    }

    /// [`Session::store_on`], meeting the pool's store admission as `admit` says
    /// ([`Admit::Now`]: kept on each key's first sighting even under `on_reuse`).
    ///
    /// # Safety
    /// As [`crate::EmbeddedStore::store_on`] for `stream`.
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
            self.submit(
                Direction::Store,
                layout,
                group,
                block_ids,
                keys,
                stream,
                admit,
            )
        }
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
        unsafe {
            self.submit(
                Direction::Load,
                layout,
                group,
                block_ids,
                keys,
                stream,
                Admit::Policy,
            )
        }
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

    /// [`Session::store_as_on`] without a stream.
    pub fn store_as(
        &self,
        layout: LayoutId,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        admit: Admit,
    ) -> Result<JobHandle, StoreError> {
        // SAFETY: no stream.
        unsafe { self.store_as_on(layout, group, block_ids, keys, None, admit) }
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
    pub fn wait(&self, job: &JobHandle) -> Result<Vec<KeyOutcome>, StoreError> {
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
mod tests;
