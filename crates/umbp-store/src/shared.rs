//! What every session of a store shares, and the ids it hands out.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_copy::{CopyEngine, Direction, JobHandle, MemoryKind};
use umbp_core::{Admit, BlockKey, CoreError, KvLayout};
use umbp_cuda::CudaOptions;
use umbp_cuda::{CudaMover, Device, PoolPinner};
use umbp_pool::Pool;
use umbp_remote::RemoteTier;

use crate::error::StoreError;
use crate::ids::{LayoutId, SessionId};
use crate::tier::TierChain;

/// What every session of a store shares: the pool, the copy engine with its registry of all
/// sessions' memory, the CUDA mover, and the counters that keep layout and session ids unique
/// across sessions.
#[derive(Debug)]
pub(crate) struct StoreShared {
    pub(crate) pool: Arc<Pool>,
    pub(crate) engine: CopyEngine,
    pub(crate) next_layout: AtomicU32,
    pub(crate) next_session: AtomicU64,
    pub(crate) timeout: Duration,
    pub(crate) closed: AtomicBool,
    pub(crate) cuda_opts: CudaOptions,
    /// One CUDA mover per device, each created by the first registration of that device's
    /// memory (never before: no CUDA at start).
    pub(crate) cuda: Mutex<BTreeMap<i32, Arc<CudaMover>>>,
    /// The pool's registration for DMA, shared by every device's mover (pinned once, whatever
    /// the number of devices; released after the last mover, when the store closes).
    pub(crate) pinner: Mutex<Option<Arc<PoolPinner>>>,
    /// The remote tier, when configured (also in `tiers`; here for its own counters).
    pub(crate) remote: Option<Arc<RemoteTier>>,
    /// The disk tier, when configured (also in `tiers`; here for its own counters).
    pub(crate) disk: Option<Arc<umbp_disk::DiskTier>>,
    /// Every tier under the pool, in order: what lookups, clears and close go through.
    pub(crate) tiers: TierChain,
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
    /// is CUDA memory of device `cuda` when set) and submits the copy.
    ///
    /// # Safety
    /// As [`EmbeddedStore::store_on`] for `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn submit(
        &self,
        dir: Direction,
        layout_id: LayoutId,
        layout: &KvLayout,
        cuda: Option<i32>,
        group: u32,
        block_ids: &[u64],
        keys: Vec<BlockKey>,
        stream: Option<u64>,
        admit: Admit,
    ) -> Result<JobHandle, StoreError> {
        self.check_open()?;
        let plan = layout.group(group)?.plan(block_ids)?;
        let mut token = None;
        if let Some(stream) = stream {
            let Some(device) = cuda else {
                return Err(CoreError::option(
                    "stream",
                    format!("layout {layout_id} is host memory; a CUDA stream orders only copies of CUDA memory"),
                )
                .into());
            };
            if !block_ids.is_empty() && keys.len() == block_ids.len() {
                let m = self.cuda.lock().get(&device).cloned().ok_or_else(|| {
                    CoreError::option(
                        "stream",
                        format!("no CUDA memory of device {device} is registered with this store"),
                    )
                })?;
                // SAFETY: forwarded contract: a live stream of this device (or 0).
                token = Some(unsafe { m.record_after(stream) }?);
            }
        }
        // A job that is refused drops its token, which goes back to its mover.
        Ok(self.engine.submit_as(dir, keys, plan, token, admit)?)
    }

    /// The CUDA mover of `device`, created (and installed in the engine) by the first call for
    /// that device; every device's mover copies through the pool's one DMA registration.
    pub(crate) fn cuda_mover_for(&self, device: i32) -> Result<Arc<CudaMover>, StoreError> {
        let mut movers = self.cuda.lock();
        if let Some(m) = movers.get(&device) {
            return Ok(Arc::clone(m));
        }
        let first = self.pinner.lock().is_none();
        let pinner = self.pinner_for(device)?;
        let m = match CudaMover::new(device, pinner, self.cuda_opts.clone()) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                // No mover: do not leave the pool page-locked for nothing.
                if first {
                    if let Some(p) = self.pinner.lock().take() {
                        p.shutdown();
                    }
                }
                return Err(e.into());
            }
        };
        self.engine
            .set_device_mover(MemoryKind::Cuda { device }, m.clone())?;
        movers.insert(device, Arc::clone(&m));
        Ok(m)
    }

    /// The pool's DMA registration, started (with `device`'s context) by the first call.
    pub(crate) fn pinner_for(&self, device: i32) -> Result<Arc<PoolPinner>, StoreError> {
        let mut p = self.pinner.lock();
        if let Some(p) = p.as_ref() {
            return Ok(Arc::clone(p));
        }
        let pinner = Arc::new(PoolPinner::start(
            Device::open(device)?,
            Arc::clone(&self.pool),
            self.cuda_opts.pin_chunk_bytes,
        )?);
        *p = Some(Arc::clone(&pinner));
        Ok(pinner)
    }

    /// Stops the copy workers (after the jobs queued) and every device's mover, then
    /// unregisters the pool from the devices: nothing copies into or out of it afterwards.
    fn stop_copies(&self) {
        self.engine.close();
        for m in self.cuda.lock().values() {
            m.shutdown();
        }
        if let Some(p) = self.pinner.lock().as_ref() {
            // Every copy of every device has finished: unregister the pool before it can be
            // unmapped.
            p.shutdown();
        }
    }

    /// Closes the store for a hand-over of its pool (see `EmbeddedStore::hand_over`).
    pub(crate) fn hand_over(
        &self,
        generation: u64,
    ) -> Result<(std::os::fd::OwnedFd, umbp_pool::image::Image), StoreError> {
        if self.pool.memfd().is_none() {
            // Refused before anything stops: the store goes on serving.
            return Err(umbp_pool::PoolError::Image {
                reason: "the pool's memory is anonymous; only a memfd-backed pool \
                         (dram_backing memfd) can be handed over"
                    .into(),
            }
            .into());
        }
        if self.closed.swap(true, Ordering::AcqRel) {
            return Err(StoreError::Closed);
        }
        // Every writer of the pool stops first: the tiers' fills (promotions, fetches), the
        // copy workers (after the jobs queued), the device movers.
        self.tiers.close_for_hand_over(&self.pool);
        self.stop_copies();
        Ok(self.pool.hand_over(generation)?)
    }

    pub(crate) fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            // The disk tier writes the pool's objects out (within its budget) for the next
            // start; then objects still queued are dropped (their pins released) before the
            // pool goes.
            self.tiers.close(&self.pool);
            self.stop_copies();
            self.pool.close();
        }
    }
}
