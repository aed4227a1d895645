//! [`CudaMover`]: the copy engine's mover between CUDA memory and pool objects.
//!
//! Two methods, chosen per batch:
//!
//! * **DMA** (`dma`): copy engines only, no GPU compute units. Pieces adjacent on both sides are
//!   merged, equal pieces at constant strides become one 2-D copy (3-D when a stride is above
//!   the device's maximum pitch), and what is left is sent in batched copy calls where the driver
//!   has them.
//! * **Staged** (`staged`): a brief device-side gather (store) or scatter (load) between the KV
//!   cache and a small device staging slot, and one DMA per run of neighbouring pool objects.
//!   The kernel runs at HBM speed on at most `max_ctas` thread blocks; its GPU time is measured
//!   (see [`CudaStats`]).
//!
//! `auto` (the default) uses DMA only for batches whose pieces average at least 1 MiB and whose
//! blocks average at least 2 MiB, and stages the rest: DMA pays a fixed cost per copy (one 2-D
//! copy per block) and per row, so it reaches 0.61-0.93 of the link where the staged path
//! reaches 0.91-0.99 for every piece from 4 to 256 KiB (the piece-size sweep of
//! `umbp bench gpu --sweep`, in docs/benchmarks.md). While compute kernels fill every SM the
//! staging kernels wait for SMs, and each launch moves one staging slot: with the default
//! 128 MiB slots the staged path still moved 46-53 GB/s beside a full-GPU bf16 matmul, against
//! 33-50 GB/s by DMA, where 16 MiB slots moved 12-34. `auto` also watches the kernels' GPU time
//! per GB and sends small pieces by DMA while they are slower than DMA would be (see
//! [`StagedHealth`]). Per direction there is one DMA stream and one kernel stream, created once
//! and reused.
//! A submitter's ordering token is an event recorded on its stream ([`CudaMover::record_after`]);
//! every copy of the job that reads (store) or writes (load) engine memory waits for it on the
//! device, so the host never blocks on it. A batch returns once its completion event has been
//! observed, so a finished job's bytes are visible to any work launched afterwards.

mod dma;
mod kernels;
mod options;
mod spans;
mod staged;
mod staging;
mod trace;
mod wait;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_copy::{BlockCopy, MoveError, MoveResult, Mover, OrderToken, TokenOwner};

use crate::pin::{PinProgress, PinStatus, PoolPinner};
use crate::plan;
use kernels::{load_kernels, Kernels};
pub use options::{CopyMethod, CudaOptions};
pub use spans::TraceSpan;
use spans::Tracer;
use staging::{
    device_flags, Ring, Slot, StagedHealth, DESC_BUFFERS, MAX_DESCS, STAGED_PROBE_EVERY,
};
use umbp_cuda_driver::sys::types::*;
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Device, DeviceBuffer, Event, Stream};

/// Counters of the CUDA mover.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CudaStats {
    /// Bytes moved by the DMA method.
    pub dma_bytes: u64,
    /// Bytes moved by the staged method.
    pub staged_bytes: u64,
    /// GPU time of gather/scatter kernels, in nanoseconds (measured with events).
    pub kernel_ns: u64,
    /// Kernel launches.
    pub kernel_launches: u64,
    /// Strided copies issued as 2-D copies.
    pub copies_2d: u64,
    /// Strided copies issued as 3-D copies (strides above the maximum pitch).
    pub copies_3d: u64,
    /// Plain copies.
    pub copies_1d: u64,
    /// Batched copy calls.
    pub batch_calls: u64,
    /// Device memory held for staging slots, both directions (plus 384 KiB of pinned host
    /// memory per slot for descriptors).
    pub staging_device_bytes: u64,
    /// Thread blocks per kernel launch at most.
    pub max_ctas: u32,
    /// The device's multiprocessors.
    pub sm_count: u32,
    /// Times `auto` switched small pieces between staged and DMA because the staging kernels
    /// waited for SMs (or no longer did).
    pub auto_switches: u64,
    /// Whether `auto` sends small pieces of stores and of loads by DMA right now.
    pub small_pieces_by_dma: [bool; 2],
}

#[derive(Debug, Default)]
struct Counters {
    dma_bytes: AtomicU64,
    staged_bytes: AtomicU64,
    kernel_ns: AtomicU64,
    kernel_launches: AtomicU64,
    copies_2d: AtomicU64,
    copies_3d: AtomicU64,
    copies_1d: AtomicU64,
    batch_calls: AtomicU64,
}

#[derive(Debug)]
struct Lane {
    dma: Stream,
    kern: Stream,
    ring: Option<Mutex<Ring>>,
    /// When the copies queued on this direction's streams should end.
    eta: wait::Eta,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Store,
    Load,
}

impl Dir {
    fn index(self) -> usize {
        match self {
            Dir::Store => 0,
            Dir::Load => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Dir::Store => "store",
            Dir::Load => "load",
        }
    }
}

/// Moves bytes between CUDA memory and pool objects (see the module docs).
#[derive(Debug)]
pub struct CudaMover {
    dev: Arc<Device>,
    opts: CudaOptions,
    /// The pool's DMA registration, shared with the other devices' movers.
    pinner: Arc<PoolPinner>,
    store: Lane,
    load: Lane,
    kernels: Option<Kernels>,
    slot_bytes: u64,
    /// The slots' flag words, both directions (None: events order the stages).
    _flags: Option<DeviceBuffer>,
    timing_events: Mutex<Vec<Event>>,
    /// Ordering tokens handed out and not yet given back, and the idle (non-timing) events.
    tokens: Arc<TokenTable>,
    /// `tokens`, as the owner the tokens it made point back to.
    token_owner: Arc<dyn TokenOwner>,
    counters: Counters,
    tracing: std::sync::atomic::AtomicBool,
    tracer: Mutex<Option<Tracer>>,
    /// `auto`'s view of the staging kernels, per direction (store, load).
    staged_health: [StagedHealth; 2],
    /// Staging plans of finished calls, whose memory the next calls reuse.
    spare_plans: Mutex<Vec<Vec<plan::Slice>>>,
}

/// Spare staging plans kept at most (one per copy worker that stages at once is enough).
const SPARE_PLANS: usize = 16;

impl CudaMover {
    /// A mover for device `device` that copies into and out of the pool `pinner` registers for
    /// DMA (one pinner serves every device's mover: registrations are portable to every
    /// context).
    pub fn new(
        device: i32,
        pinner: Arc<PoolPinner>,
        opts: CudaOptions,
    ) -> Result<CudaMover, CudaError> {
        opts.validate()?;
        let dev = Device::open(device)?;
        let want_staging = opts.method != CopyMethod::Dma && opts.staging_bytes > 0;
        let mut kernels = if want_staging {
            match load_kernels(&dev) {
                Ok(k) => Some(k),
                Err(e) if opts.method == CopyMethod::Auto => {
                    log::warn!("umbp: the staging kernels did not load ({e}); using DMA only");
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let (stages, slot_bytes) = if kernels.is_some() {
            match staging_memory(&dev, &opts) {
                Ok(s) => s,
                Err(e) if opts.method == CopyMethod::Auto && e.is_out_of_memory() => {
                    log::warn!("umbp: no device memory for staging ({e}); using DMA only");
                    kernels = None;
                    (Vec::new(), 0)
                }
                Err(e) => return Err(e),
            }
        } else {
            (Vec::new(), 0)
        };
        let mut stages = stages.into_iter();
        let flags = if kernels.is_some() {
            match device_flags(&dev, 4 * opts.staging_slots) {
                Ok(f) => Some(f),
                Err(e) => {
                    log::info!(
                        "umbp: device flags unavailable ({e}); staging stages wait on events"
                    );
                    None
                }
            }
        } else {
            None
        };
        let mut next_flag = flags.as_ref().map(DeviceBuffer::ptr);
        let mut lane = |with_ring: bool| -> Result<Lane, CudaError> {
            let ring = if with_ring {
                let mut slots = Vec::with_capacity(opts.staging_slots);
                for _ in 0..opts.staging_slots {
                    let mut flag = || match next_flag.as_mut() {
                        Some(f) => {
                            *f += 4;
                            *f - 4
                        }
                        None => 0,
                    };
                    let (ready_flag, free_flag) = (flag(), flag());
                    let nd = if ready_flag != 0 { DESC_BUFFERS } else { 1 };
                    slots.push(Slot {
                        stage: stages.next().expect("one staging buffer per slot"),
                        descs: (0..nd)
                            .map(|_| dev.alloc_host(3 * 8 * MAX_DESCS as u64))
                            .collect::<Result<_, _>>()?,
                        descs_read: (0..nd)
                            .map(|_| dev.event(false))
                            .collect::<Result<_, _>>()?,
                        descs_used: vec![false; nd],
                        next_desc: 0,
                        free: dev.event(false)?,
                        ready: dev.event(false)?,
                        ready_flag,
                        free_flag,
                        seq: 0,
                        used: false,
                    });
                }
                Some(Mutex::new(Ring { slots, next: 0 }))
            } else {
                None
            };
            Ok(Lane {
                dma: dev.stream()?,
                kern: dev.priority_stream()?,
                ring,
                eta: wait::Eta::default(),
            })
        };
        let store = lane(kernels.is_some())?;
        let load = lane(kernels.is_some())?;
        log::info!(
            "umbp: CUDA mover on device {} ({}): method {}, staging {} x {} bytes per direction{}",
            dev.ordinal(),
            dev.name,
            opts.method,
            if kernels.is_some() {
                opts.staging_slots
            } else {
                0
            },
            slot_bytes,
            if flags.is_some() {
                ", stages ordered by device flags"
            } else {
                ""
            }
        );
        let tokens = Arc::new(TokenTable::default());
        Ok(CudaMover {
            dev,
            opts,
            pinner,
            store,
            load,
            kernels,
            slot_bytes,
            _flags: flags,
            timing_events: Mutex::new(Vec::new()),
            token_owner: Arc::clone(&tokens) as Arc<dyn TokenOwner>,
            tokens,
            counters: Counters::default(),
            tracing: std::sync::atomic::AtomicBool::new(false),
            tracer: Mutex::new(None),
            staged_health: Default::default(),
            spare_plans: Mutex::new(Vec::new()),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The options in force.
    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// Pool registration progress.
    pub fn pin_progress(&self) -> &Arc<PinProgress> {
        self.pinner.progress()
    }

    /// A snapshot of pool registration.
    pub fn pin_status(&self) -> PinStatus {
        self.pinner.progress().status()
    }

    /// Waits for everything queued on this mover's streams (call after the last copy). The
    /// pool's registration is the pinner's: its owner unregisters it after every mover.
    pub fn shutdown(&self) {
        for lane in [&self.store, &self.load] {
            let _ = lane.dma.synchronize();
            let _ = lane.kern.synchronize();
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> CudaStats {
        let c = &self.counters;
        CudaStats {
            dma_bytes: c.dma_bytes.load(Ordering::Relaxed),
            staged_bytes: c.staged_bytes.load(Ordering::Relaxed),
            kernel_ns: c.kernel_ns.load(Ordering::Relaxed),
            kernel_launches: c.kernel_launches.load(Ordering::Relaxed),
            copies_2d: c.copies_2d.load(Ordering::Relaxed),
            copies_3d: c.copies_3d.load(Ordering::Relaxed),
            copies_1d: c.copies_1d.load(Ordering::Relaxed),
            batch_calls: c.batch_calls.load(Ordering::Relaxed),
            staging_device_bytes: if self.kernels.is_some() {
                2 * self.slot_bytes * self.opts.staging_slots as u64
            } else {
                0
            },
            max_ctas: self.opts.max_ctas,
            sm_count: self.dev.sm_count,
            auto_switches: self
                .staged_health
                .iter()
                .map(|h| h.switches.load(Ordering::Relaxed))
                .sum(),
            small_pieces_by_dma: [
                self.staged_health[0].by_dma.load(Ordering::Relaxed),
                self.staged_health[1].by_dma.load(Ordering::Relaxed),
            ],
        }
    }

    /// Checks that `[addr, addr + len)` is memory of this mover's device.
    pub fn check_device_range(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        self.dev.check_device_range(addr, len)
    }

    /// Records an event on the caller's stream `stream` (a raw `cudaStream_t`; 0 is the legacy
    /// default stream) and returns it as an ordering token for [`umbp_copy::CopyEngine`]. The
    /// copies of the job wait for it on the device. Fails while the stream is being captured
    /// into a CUDA graph.
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream of this device's primary context: the driver
    /// dereferences the handle.
    pub unsafe fn record_after(&self, stream: u64) -> Result<OrderToken, CudaError> {
        let _g = self.dev.scoped()?;
        let s = stream as CUstream;
        // SAFETY: forwarded contract.
        if unsafe { self.dev.is_capturing(s) }? {
            return Err(CudaError::Invalid(
                "the stream is being captured into a CUDA graph; submit stores and loads outside graph capture".into(),
            ));
        }
        let ev = self.take_event(false)?;
        // SAFETY: forwarded contract; `ev` is an event of this device's context.
        if let Err(e) = unsafe { ev.record_raw(s) } {
            self.give_event(ev, false);
            return Err(e);
        }
        let raw = ev.raw() as u64;
        self.tokens.live.lock().insert(raw, ev);
        Ok(OrderToken::new(raw, Arc::clone(&self.token_owner)))
    }

    fn take_event(&self, timing: bool) -> Result<Event, CudaError> {
        let pool = if timing {
            &self.timing_events
        } else {
            &self.tokens.free
        };
        match pool.lock().pop() {
            Some(e) => Ok(e),
            None => self.dev.event(timing),
        }
    }

    fn give_event(&self, e: Event, timing: bool) {
        if timing {
            self.timing_events.lock().push(e)
        } else {
            self.tokens.free.lock().push(e)
        }
    }

    /// The event behind `after`, which must be a token this mover made.
    fn after_event(&self, after: Option<&OrderToken>) -> Result<Option<CUevent>, MoveError> {
        let Some(t) = after else {
            return Ok(None);
        };
        let not_ours = || {
            MoveError::Unsupported(format!(
                "the job's ordering token was not made by the mover of CUDA device {}; submit with the stream of the device whose memory the job moves",
                self.dev.ordinal()
            ))
        };
        if !t.is_from(&self.token_owner) {
            return Err(not_ours());
        }
        self.tokens
            .live
            .lock()
            .get(&t.raw())
            .map(|e| Some(e.raw()))
            .ok_or_else(not_ours)
    }

    fn choose(&self, dir: Dir, blocks: &[BlockCopy<'_>]) -> CopyMethod {
        if self.kernels.is_none() {
            return CopyMethod::Dma;
        }
        match self.opts.method {
            CopyMethod::Dma => CopyMethod::Dma,
            CopyMethod::Staged => CopyMethod::Staged,
            CopyMethod::Auto => {
                let (mut bytes, mut n) = (0u64, 0u64);
                for b in blocks {
                    for r in b.ranges {
                        bytes += r.len;
                        n += 1;
                    }
                }
                let piece = bytes.checked_div(n);
                let block = bytes.checked_div(blocks.len() as u64);
                if !self.auto_stages(piece, block) {
                    return CopyMethod::Dma;
                }
                let h = &self.staged_health[dir.index()];
                if h.by_dma.load(Ordering::Relaxed)
                    && !h
                        .calls
                        .fetch_add(1, Ordering::Relaxed)
                        .is_multiple_of(STAGED_PROBE_EVERY)
                {
                    CopyMethod::Dma
                } else {
                    CopyMethod::Staged
                }
            }
        }
    }

    /// Whether calls of blocks of `object_bytes` in `pieces_per_block` pieces are staged (by
    /// the method and `auto`'s rule; `auto` may still send some by DMA while the kernels wait
    /// for SMs).
    fn stages(&self, object_bytes: u64, pieces_per_block: usize) -> bool {
        self.kernels.is_some()
            && match self.opts.method {
                CopyMethod::Dma => false,
                CopyMethod::Staged => true,
                CopyMethod::Auto => self.auto_stages(
                    object_bytes.checked_div(pieces_per_block as u64),
                    Some(object_bytes),
                ),
            }
    }

    /// `auto`'s rule: stage a call whose pieces average `piece` bytes and whose blocks average
    /// `block` (None: no pieces or blocks) unless both are large enough for DMA.
    fn auto_stages(&self, piece: Option<u64>, block: Option<u64>) -> bool {
        piece.is_some_and(|p| p < self.opts.auto_dma_min_piece)
            || block.is_some_and(|b| b < self.opts.auto_dma_min_block)
    }

    /// A device error as a mover's error: a sticky error (the context is unusable from now on)
    /// reads as a lost device, any other as one failed call.
    fn move_error(&self, e: &CudaError) -> MoveError {
        if e.is_sticky() {
            MoveError::DeviceLost {
                device: format!("CUDA device {}", self.dev.ordinal()),
                message: e.to_string(),
            }
        } else {
            MoveError::Device(e.to_string())
        }
    }

    fn copy(
        &self,
        dir: Dir,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        let call_start = std::time::Instant::now();
        let mut results: Vec<MoveResult> = vec![Ok(()); blocks.len()];
        let fail_all = |results: &mut Vec<MoveResult>, e: &CudaError| {
            for r in results.iter_mut() {
                if r.is_ok() {
                    *r = Err(self.move_error(e));
                }
            }
        };
        if let Err(e) = self.dev.bind_thread() {
            fail_all(&mut results, &e);
            return results;
        }
        let after = match self.after_event(after) {
            Ok(a) => a,
            Err(e) => return vec![Err(e); blocks.len()],
        };
        // DMA only to registered pool memory: register what this batch touches now if the
        // background thread has not reached it yet.
        let pin = self.pinner.progress();
        let _copying = pin.copying();
        let mut pinned = true;
        for b in blocks {
            let extent = b.extent();
            if extent > 0 && !pin.ensure(&self.dev, b.object as u64, extent) {
                pinned = false;
            }
        }
        if !pinned {
            // The pageable path is partly synchronous; do not rely on device-side ordering
            // through it: wait on the host for the submitter's work.
            if let Some(ev) = after {
                // SAFETY: a live event of this context (the job holds its token).
                if let Err(e) = unsafe { self.dev.wait_event(ev) } {
                    fail_all(&mut results, &e);
                    return results;
                }
            }
        }
        let done = match self.take_event(false) {
            Ok(e) => e,
            Err(e) => {
                fail_all(&mut results, &e);
                return results;
            }
        };
        let (base, g) = (pin.base, pin.chunk);
        let mut timings = Vec::new();
        let bytes: u64 = blocks
            .iter()
            .flat_map(|b| b.ranges.iter().map(|r| r.len))
            .sum();
        // A plan of an earlier call, whose memory is already touched (see plan::staged_into).
        let mut slices = self.spare_plans.lock().pop().unwrap_or_default();
        let staged = self.choose(dir, blocks) != CopyMethod::Dma
            && plan::staged_into(blocks, self.slot_bytes, MAX_DESCS, base, g, &mut slices);
        let enqueued = if staged {
            self.run_staged(dir, &slices, after, &done, &mut results, &mut timings)
        } else {
            self.run_dma(dir, blocks, after, &done, &mut results, &mut timings)
        };
        let lane = self.lane(dir);
        // A call whose copies first wait on the device for the submitter's unfinished work
        // does not tell the copies' rate.
        // SAFETY: `ev` is the job's token event, alive until the job finishes.
        let ordered = after.is_some_and(|ev| !unsafe { self.dev.event_done(ev) });
        if let Err(e) =
            enqueued.and_then(|_| lane.eta.wait(&done, &lane.eta.queued(bytes, ordered)))
        {
            log::error!("umbp: CUDA copy failed: {e}");
            // Whatever was queued must finish before the blocks are failed: a failed store's
            // pool reservations are handed out again, and its events go back to the pools.
            let _ = lane.dma.synchronize();
            let _ = lane.kern.synchronize();
            fail_all(&mut results, &e);
        }
        {
            let mut spare = self.spare_plans.lock();
            if spare.len() < SPARE_PLANS {
                spare.push(slices);
            }
        }
        self.account(dir, timings, call_start);
        self.give_event(done, false);
        results
    }

    fn lane(&self, dir: Dir) -> &Lane {
        match dir {
            Dir::Store => &self.store,
            Dir::Load => &self.load,
        }
    }
}

/// The staging slots' device memory, both directions: `2 × staging_slots` buffers of
/// `staging_bytes / staging_slots` bytes, or of half, a quarter, ... of that (down to 4 MiB
/// slots, with a warning) while the device is out of memory, as it may be when the engine has
/// given its KV cache nearly all of it.
fn staging_memory(
    dev: &Arc<Device>,
    opts: &CudaOptions,
) -> Result<(Vec<DeviceBuffer>, u64), CudaError> {
    let wanted = (opts.staging_bytes / opts.staging_slots as u64) / 256 * 256;
    let mut slot_bytes = wanted;
    loop {
        let got: Result<Vec<DeviceBuffer>, CudaError> = (0..2 * opts.staging_slots)
            .map(|_| dev.alloc(slot_bytes))
            .collect();
        match got {
            Ok(b) => {
                if slot_bytes < wanted {
                    log::warn!(
                        "umbp: CUDA device {} had no room for {} MiB staging slots; using {} MiB slots (copies while the GPU computes are slower with smaller slots; lower the engine's GPU memory share or set cuda_staging_bytes)",
                        dev.ordinal(),
                        wanted >> 20,
                        slot_bytes >> 20
                    );
                }
                return Ok((b, slot_bytes));
            }
            Err(e) if e.is_out_of_memory() && slot_bytes / 2 >= MIN_SLOT_BYTES => {
                slot_bytes = (slot_bytes / 2) / 256 * 256;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Blocks of `object_bytes` in at most `pieces` ranges each for one staged call: what one
/// staging slot of `slot_bytes` holds (objects start 256-byte aligned in it) within its
/// descriptor limit, at most `cap` and at least 1. Slots below [`ONE_SLOT_CALLS_FROM`] (set
/// smaller, or shrunk for want of device memory) get calls of that many bytes instead, over
/// several slots, as the 16 MiB slots measured before. `cap` for blocks larger than a slot or
/// with more pieces than its descriptors, which go by DMA.
fn staged_batch_blocks(slot_bytes: u64, object_bytes: u64, pieces: usize, cap: usize) -> usize {
    if object_bytes > slot_bytes || pieces > MAX_DESCS {
        return cap;
    }
    let slot_object = object_bytes.next_multiple_of(256);
    if slot_bytes < ONE_SLOT_CALLS_FROM {
        return ONE_SLOT_CALLS_FROM
            .checked_div(slot_object)
            .map_or(cap, |n| n as usize)
            .clamp(1, cap);
    }
    let by_bytes = slot_bytes
        .checked_div(slot_object)
        .map_or(cap, |n| n as usize);
    let by_descs = MAX_DESCS / pieces.max(1);
    by_bytes.min(by_descs).min(cap).max(1)
}

/// A job's first and last calls carry this share of a call's blocks ([`Mover::edge_batch`]).
const EDGE_SHARE: usize = 8;
/// Jobs of at least this many calls' blocks start and end with short calls.
const EDGE_FROM_CALLS: usize = 4;

/// Staging slots from this size carry one slot per staged call.
const ONE_SLOT_CALLS_FROM: u64 = 64 << 20;

/// The smallest staging slot [`staging_memory`] falls back to.
const MIN_SLOT_BYTES: u64 = 4 << 20;

impl Drop for CudaMover {
    fn drop(&mut self) {
        // Every launch finishes before the kernels' module is unloaded (a field dropped
        // after this).
        self.shutdown();
    }
}

impl Mover for CudaMover {
    /// `batch_blocks`, and for calls `auto` (or `staged`) would stage, no more than one
    /// staging slot holds: one kernel launch and one slot per call. Measured on the H200: idle,
    /// 64 and 128-block calls of 4 and 8 KiB pieces in 0.5-1 MiB blocks moved 0.93-0.97 of
    /// the link where 256-block calls (two slots each) moved 0.90-0.95; beside a full-GPU
    /// matmul, 2 MiB blocks stored at 51 GB/s in 64-block calls (128 MiB) against 48 in
    /// 128-block calls, while 640 KiB blocks needed 128-block calls (80 MiB) to reach 47.
    fn batch_size(&self, object_bytes: u64, pieces_per_block: usize) -> usize {
        let cap = self.opts.batch_blocks;
        if self.stages(object_bytes, pieces_per_block) {
            staged_batch_blocks(self.slot_bytes, object_bytes, pieces_per_block, cap)
        } else {
            cap
        }
    }

    /// In staged jobs of at least [`EDGE_FROM_CALLS`] calls, while the staging kernels find
    /// free SMs, an eighth of a call (16 MiB of a 128 MiB staging slot): a job's first copies
    /// start once a few blocks are planned and gathered, not a whole slot's worth (a
    /// 16,384-piece call spent 150-250 µs planning and 150 µs in its gather kernel on the H200
    /// before its DMA started), and a load ends with a short scatter kernel. Measured on the
    /// H200 (1,000 blocks of 640 KiB, 8 KiB pieces): one-way 0.93-0.94 of the link without
    /// them, 0.97 with them. A job of one or two calls is left whole: split into four calls
    /// a 16 MiB job took 0.82-0.88 ms instead of 0.68. While compute holds the SMs every
    /// launch waits for free ones however little it moves, so jobs keep whole calls; and
    /// calls by DMA have no kernel stage to shorten.
    fn edge_batch(
        &self,
        batch: usize,
        job_blocks: usize,
        object_bytes: u64,
        pieces_per_block: usize,
    ) -> usize {
        if !self.stages(object_bytes, pieces_per_block) || job_blocks < EDGE_FROM_CALLS * batch {
            return batch;
        }
        let sms_free = self.staged_health.iter().all(|h| {
            f64::from_bits(h.ms_per_gb.load(Ordering::Relaxed)) < staging::SMS_FREE_MS_PER_GB
        });
        if sms_free {
            (batch / EDGE_SHARE).max(1)
        } else {
            batch
        }
    }

    /// Two threads keep one direction's stream fed (one issues while the other waits), and
    /// leave the other workers to a job in the other direction.
    fn max_workers_per_job(&self) -> usize {
        2
    }

    unsafe fn gather(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        self.copy(Dir::Store, blocks, after)
    }

    unsafe fn scatter(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        self.copy(Dir::Load, blocks, after)
    }
}

/// The ordering tokens of one mover: the events behind the tokens handed out (by the token's
/// value), and the idle events, to which a dropped token's event goes back.
#[derive(Debug, Default)]
struct TokenTable {
    live: Mutex<HashMap<u64, Event>>,
    free: Mutex<Vec<Event>>,
}

impl TokenOwner for TokenTable {
    fn release(&self, raw: u64) {
        if let Some(ev) = self.live.lock().remove(&raw) {
            self.free.lock().push(ev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staged_call_fills_one_slot() {
        let slot = 128 << 20;
        // Llama-3-8B at TP 1 (32 x 64 KiB): 64 blocks of 2 MiB.
        assert_eq!(staged_batch_blocks(slot, 2 << 20, 32, 256), 64);
        // Llama-3-70B at TP 8 (80 x 8 KiB): 204 blocks of 640 KiB.
        assert_eq!(staged_batch_blocks(slot, 640 << 10, 80, 256), 204);
        // 128 x 4 KiB: the slot's 16384 descriptors allow 128 blocks (64 MiB).
        assert_eq!(staged_batch_blocks(slot, 512 << 10, 128, 256), 128);
        // The cap; a block larger than a slot, or with more pieces than its descriptors, goes
        // by DMA, in calls of the cap.
        assert_eq!(staged_batch_blocks(slot, 64 << 10, 1, 256), 256);
        assert_eq!(staged_batch_blocks(slot, 256 << 20, 8, 256), 256);
        assert_eq!(staged_batch_blocks(slot, 1 << 20, 20000, 256), 256);
        // As many pieces as a slot's descriptors: one block per call.
        assert_eq!(staged_batch_blocks(slot, 1 << 20, MAX_DESCS, 256), 1);
        // Objects start 256-byte aligned in a slot.
        assert_eq!(staged_batch_blocks(slot, (1 << 20) + 1, 8, 256), 127);
        // Small slots (set so, or shrunk): calls of 64 MiB over several slots.
        assert_eq!(staged_batch_blocks(16 << 20, 640 << 10, 80, 256), 102);
        assert_eq!(staged_batch_blocks(4 << 20, 2 << 20, 32, 256), 32);
        assert_eq!(staged_batch_blocks(slot, 0, 0, 256), 256);
    }
}
