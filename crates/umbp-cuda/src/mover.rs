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
//! `auto` (the default) uses DMA only for batches whose pieces average at least 64 KiB and whose
//! blocks average at least 2 MiB, and stages the rest: DMA pays a fixed cost per copy (one 2-D
//! copy per block) and per row, so smaller pieces or blocks fall below 0.9 of the link, where
//! the staged path stays at 0.93-0.98 (the piece-size sweep of `umbp bench gpu --sweep`, in
//! docs/benchmarks.md). While compute kernels fill every SM the staging kernels wait for SMs;
//! `auto` watches their GPU time per GB and sends small pieces by DMA while they are slower than
//! DMA would be (see [`StagedHealth`]). Per direction there is one DMA stream and one kernel stream, created once and reused.
//! A submitter's ordering token is an event recorded on its stream ([`CudaMover::record_after`]);
//! every copy of the job that reads (store) or writes (load) engine memory waits for it on the
//! device, so the host never blocks on it. A batch returns once its completion event has been
//! observed, so a finished job's bytes are visible to any work launched afterwards.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_copy::{BlockCopy, MoveError, MoveResult, Mover, OrderToken, TokenOwner};

use crate::device::{Device, DeviceBuffer, Event, HostBuffer, Stream};
use crate::driver::BatchFn;
use crate::ffi::*;
use crate::pin::{PinProgress, PinStatus, PoolPinner, SPLIT_BYTES};
use crate::plan::{self, Run, Slice};
use crate::CudaError;

const PTX: &str = concat!(include_str!("umbp_copy.ptx"), "\0");

/// How batches move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// DMA for batches whose pieces average at least [`CudaOptions::auto_dma_min_piece`] and
    /// whose blocks average at least [`CudaOptions::auto_dma_min_block`]; staged otherwise.
    Auto,
    /// DMA only: no GPU compute units.
    Dma,
    /// Always staged (falls back to DMA for a block larger than a staging slot).
    Staged,
}

impl FromStr for CopyMethod {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self, CudaError> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(CopyMethod::Auto),
            "dma" => Ok(CopyMethod::Dma),
            "staged" => Ok(CopyMethod::Staged),
            _ => Err(CudaError::Option {
                name: "cuda_copy_method",
                reason: format!("{s:?} is not one of \"auto\", \"dma\", \"staged\""),
            }),
        }
    }
}

impl std::fmt::Display for CopyMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Dma => "dma",
            CopyMethod::Staged => "staged",
        })
    }
}

/// Options of the CUDA backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// How batches move.
    pub method: CopyMethod,
    /// Device staging memory per direction (0 disables staging).
    pub staging_bytes: u64,
    /// Staging slots per direction (the staging memory is split evenly).
    pub staging_slots: usize,
    /// Thread blocks (of 256 threads) a gather/scatter kernel may use.
    pub max_ctas: u32,
    /// Pool registration chunk (a multiple of 64 MiB; copies wait for at most one).
    pub pin_chunk_bytes: u64,
    /// Blocks per mover call.
    pub batch_blocks: usize,
    /// `auto` stages batches whose pieces average fewer bytes than this.
    pub auto_dma_min_piece: u64,
    /// `auto` stages batches whose blocks average fewer bytes than this.
    pub auto_dma_min_block: u64,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            method: CopyMethod::Auto,
            staging_bytes: 64 << 20,
            staging_slots: 4,
            max_ctas: 132,
            pin_chunk_bytes: SPLIT_BYTES,
            batch_blocks: 64,
            auto_dma_min_piece: 64 << 10,
            auto_dma_min_block: 2 << 20,
        }
    }
}

impl CudaOptions {
    /// Checks every option (no CUDA needed).
    pub fn validate(&self) -> Result<(), CudaError> {
        let bad = |name, reason: String| Err(CudaError::Option { name, reason });
        if self.staging_bytes != 0 && self.staging_bytes < (1 << 20) {
            return bad(
                "cuda_staging_bytes",
                format!(
                    "{} is below 1 MiB (use 0 to disable staging)",
                    self.staging_bytes
                ),
            );
        }
        let within = |name, v: u64, hi: u64| {
            if (1..=hi).contains(&v) {
                Ok(())
            } else {
                bad(name, format!("{v} is outside 1..={hi}"))
            }
        };
        within("cuda_staging_slots", self.staging_slots as u64, 64)?;
        within("cuda_max_ctas", u64::from(self.max_ctas), 1024)?;
        within("cuda_batch_blocks", self.batch_blocks as u64, 4096)?;
        if self.pin_chunk_bytes == 0 || !self.pin_chunk_bytes.is_multiple_of(SPLIT_BYTES) {
            return bad(
                "cuda_pin_chunk_bytes",
                format!(
                    "{} is not a positive multiple of 64 MiB",
                    self.pin_chunk_bytes
                ),
            );
        }
        if self.method == CopyMethod::Staged && self.staging_bytes == 0 {
            return bad(
                "cuda_copy_method",
                "\"staged\" needs cuda_staging_bytes > 0".into(),
            );
        }
        Ok(())
    }
}

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

/// One step of a traced copy (see [`CudaMover::start_trace`]). Device steps are timed with
/// CUDA events, host steps with the host clock; both count microseconds from the start of the
/// trace (the two clocks agree to within a few microseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpan {
    /// `"store"` or `"load"`.
    pub direction: &'static str,
    /// `"kernel"` (gather/scatter), `"dma"` (copy-engine copies of one slice or one DMA
    /// batch), `"call"` (host: one mover call, submission to completion), `"slot_wait"` (host:
    /// waiting for a staging slot to come free, where events order the stages) or
    /// `"desc_wait"` (host: waiting for a kernel to finish reading a descriptor buffer).
    pub step: &'static str,
    /// Bytes the step moved (0 for waits).
    pub bytes: u64,
    /// Start, microseconds since the trace started.
    pub start_us: f64,
    /// End, microseconds since the trace started.
    pub end_us: f64,
}

#[derive(Debug)]
struct Tracer {
    base: Event,
    t0: std::time::Instant,
    spans: Vec<TraceSpan>,
}

/// A device step timed by two events.
struct Timed {
    step: &'static str,
    bytes: u64,
    t0: Event,
    t1: Event,
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
struct Kernels {
    module: CUmodule,
    gather: CUfunction,
    scatter: CUfunction,
}

// SAFETY: module and function handles may be used from any thread of the process.
unsafe impl Send for Kernels {}
// SAFETY: as above; they are never mutated.
unsafe impl Sync for Kernels {}

/// Most descriptors one staging slot carries.
const MAX_DESCS: usize = 16384;

/// Descriptor buffers per staging slot where device flags order the stages: the host writes
/// a slice's descriptors while up to this many earlier kernels of the slot are still queued.
const DESC_BUFFERS: usize = 4;

#[derive(Debug)]
struct Slot {
    stage: DeviceBuffer,
    /// Descriptor buffers (`devs | offs | lens`, `u64` each), written by the host and read by
    /// the kernel through the mapping; used in turn.
    descs: Vec<HostBuffer>,
    /// Per descriptor buffer: recorded after the kernel that read it.
    descs_read: Vec<Event>,
    descs_used: Vec<bool>,
    next_desc: usize,
    /// Events mode: recorded after the slot's last stage; the host waits for it before
    /// reusing the slot.
    free: Event,
    /// Events mode: recorded after the slot's first stage; the second stage's stream waits
    /// for it.
    ready: Event,
    /// Flags mode (both non-zero): device addresses of two 32-bit words. Use `seq` of the slot
    /// writes `seq` to `ready_flag` after its first stage (the second stage waits for it) and
    /// to `free_flag` after its last stage (the next use's first stage waits for it). Each
    /// flag is written by one stream, in increasing order, and waits are cyclic `>=`, so a
    /// value written twice or skipped on an error path never strands a wait. The GPU polls
    /// device memory, so no host thread waits between stages.
    ready_flag: u64,
    free_flag: u64,
    /// The slot's use count.
    seq: u32,
    used: bool,
}

impl Slot {
    fn flags(&self) -> bool {
        self.ready_flag != 0
    }
}

#[derive(Debug)]
struct Ring {
    slots: Vec<Slot>,
    next: usize,
}

#[derive(Debug)]
struct Lane {
    dma: Stream,
    kern: Stream,
    ring: Option<Mutex<Ring>>,
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
}

/// How long the staging kernels of one direction take per GB (GPU time from the moment their
/// stream reaches them, so the wait for free SMs is included) and whether `auto` therefore
/// sends small pieces by DMA for now. When compute kernels fill every SM, staging kernels
/// start only as SMs free up: they then move less than DMA does (measured on the H200 beside
/// a full-GPU bf16 matmul: 20-31 GB/s staged, 34-40 GB/s by DMA for 8 and 32 KiB pieces).
#[derive(Debug, Default)]
struct StagedHealth {
    /// Recent kernel milliseconds per GB (an exponential average, as f64 bits; 0: none yet).
    ms_per_gb: AtomicU64,
    /// Small pieces go by DMA (set above [`STAGED_SLOW_MS_PER_GB`], cleared below
    /// [`STAGED_FAST_MS_PER_GB`]).
    by_dma: std::sync::atomic::AtomicBool,
    /// Calls decided while `by_dma`: every [`STAGED_PROBE_EVERY`]-th is staged anyway, to notice
    /// when SMs are free again.
    calls: AtomicU64,
    /// Times `auto` switched between the two.
    switches: AtomicU64,
}

/// Above this many kernel milliseconds per GB the staging kernels alone move less than 40 GB/s,
/// about what DMA moves for small pieces while compute fills the GPU: `auto` switches small
/// pieces to DMA.
const STAGED_SLOW_MS_PER_GB: f64 = 25.0;
/// Below this (the kernels no longer limit the copy: idle they take 2-8 ms per GB) `auto`
/// stages small pieces again.
const STAGED_FAST_MS_PER_GB: f64 = 15.0;
/// While small pieces go by DMA, one call in this many is staged to measure the kernels again.
const STAGED_PROBE_EVERY: u64 = 8;

/// Whether `auto` should send small pieces by DMA, given whether it does now and the staging
/// kernels' recent milliseconds per GB (with hysteresis between the two thresholds).
fn small_pieces_by_dma(now: bool, ms_per_gb: f64) -> bool {
    if now {
        ms_per_gb >= STAGED_FAST_MS_PER_GB
    } else {
        ms_per_gb > STAGED_SLOW_MS_PER_GB
    }
}

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
        let kernels = if want_staging {
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
        let slot_bytes = (opts.staging_bytes / opts.staging_slots as u64) / 256 * 256;
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
                        stage: dev.alloc(slot_bytes)?,
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

    /// Starts recording a timeline of every copy step (kernels, DMAs, mover calls and waits
    /// for staging slots) until [`CudaMover::take_trace`]. Costs two timing events per step;
    /// for diagnosing throughput, not for production.
    pub fn start_trace(&self) -> Result<(), CudaError> {
        let base = self.dev.event(true)?;
        let s = self.dev.stream()?;
        base.record(&s)?;
        base.synchronize()?;
        *self.tracer.lock() = Some(Tracer {
            base,
            t0: std::time::Instant::now(),
            spans: Vec::new(),
        });
        self.tracing.store(true, Ordering::Release);
        Ok(())
    }

    /// Stops tracing and returns the spans recorded since [`CudaMover::start_trace`] (empty
    /// when no trace was started), in the order their mover calls finished.
    pub fn take_trace(&self) -> Vec<TraceSpan> {
        self.tracing.store(false, Ordering::Release);
        self.tracer.lock().take().map_or_else(Vec::new, |t| t.spans)
    }

    fn trace_host(&self, dir: Dir, step: &'static str, bytes: u64, from: std::time::Instant) {
        if let Some(t) = self.tracer.lock().as_mut() {
            let us = |i: std::time::Instant| i.saturating_duration_since(t.t0).as_secs_f64() * 1e6;
            t.spans.push(TraceSpan {
                direction: dir.name(),
                step,
                bytes,
                start_us: us(from),
                end_us: us(std::time::Instant::now()),
            });
        }
    }

    /// When tracing, a timing event recorded on `stream` before a DMA step (tracing never
    /// fails a copy: an event that cannot be had leaves the step out of the trace).
    fn dma_begin(&self, stream: &Stream) -> Option<Event> {
        if !self.tracing.load(Ordering::Relaxed) {
            return None;
        }
        let t0 = self.take_event(true).ok()?;
        match t0.record(stream) {
            Ok(()) => Some(t0),
            Err(_) => {
                self.give_event(t0, true);
                None
            }
        }
    }

    /// Ends the DMA step that [`CudaMover::dma_begin`] started.
    fn dma_end(&self, stream: &Stream, t0: Option<Event>, bytes: u64, timings: &mut Vec<Timed>) {
        let Some(t0) = t0 else {
            return;
        };
        match self.take_event(true) {
            Ok(t1) if t1.record(stream).is_ok() => timings.push(Timed {
                step: "dma",
                bytes,
                t0,
                t1,
            }),
            Ok(t1) => {
                // t0 may still be pending on the stream: drop it rather than reuse it.
                self.give_event(t1, true);
            }
            Err(_) => {}
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
    pub fn record_after(&self, stream: u64) -> Result<OrderToken, CudaError> {
        let _g = self.dev.scoped()?;
        let d = self.dev.driver();
        let s = stream as CUstream;
        let mut status: std::ffi::c_int = 0;
        // SAFETY: valid out-pointer; `s` is the caller's stream handle.
        d.check("cuStreamIsCapturing", unsafe {
            (d.stream_is_capturing)(s, &mut status)
        })?;
        if status != CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(CudaError::Invalid(
                "the stream is being captured into a CUDA graph; submit stores and loads outside graph capture".into(),
            ));
        }
        let ev = self.take_event(false)?;
        if let Err(e) = ev.record_raw(s) {
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
                let small_pieces = n > 0 && bytes / n < self.opts.auto_dma_min_piece;
                let small_blocks = !blocks.is_empty()
                    && bytes / (blocks.len() as u64) < self.opts.auto_dma_min_block;
                if !(small_pieces || small_blocks) {
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
        let d = self.dev.driver();
        let mut pinned = true;
        for b in blocks {
            let extent = b.extent();
            if extent > 0 && !pin.ensure(d, b.object as u64, extent) {
                pinned = false;
            }
        }
        if !pinned {
            // The pageable path is partly synchronous; do not rely on device-side ordering
            // through it: wait on the host for the submitter's work.
            if let Some(ev) = after {
                // SAFETY: a live event of this context (the job holds its token).
                let rc = unsafe { (d.event_synchronize)(ev) };
                if let Err(e) = d.check("cuEventSynchronize", rc) {
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
        let slices = match self.choose(dir, blocks) {
            CopyMethod::Dma => None,
            _ => plan::staged(blocks, self.slot_bytes, MAX_DESCS, base, g),
        };
        let enqueued = match &slices {
            Some(slices) => self.run_staged(dir, slices, after, &done, &mut results, &mut timings),
            None => self.run_dma(dir, blocks, after, &done, &mut results, &mut timings),
        };
        if let Err(e) = enqueued.and_then(|_| done.synchronize()) {
            log::error!("umbp: CUDA copy failed: {e}");
            // Whatever was queued must finish before the blocks are failed: a failed store's
            // pool reservations are handed out again, and its events go back to the pools.
            let lane = self.lane(dir);
            let _ = lane.dma.synchronize();
            let _ = lane.kern.synchronize();
            fail_all(&mut results, &e);
        }
        self.account(dir, timings, call_start);
        self.give_event(done, false);
        results
    }

    /// Adds the kernels' GPU time to the counters and, when tracing, the steps to the trace;
    /// every event of `timings` has completed.
    fn account(&self, dir: Dir, timings: Vec<Timed>, call_start: std::time::Instant) {
        let mut ns = 0u64;
        let mut total = 0u64;
        let mut kernel_bytes = 0u64;
        // The tracer is locked only while a trace runs (this is on every call's path).
        let mut tracer = self
            .tracing
            .load(Ordering::Relaxed)
            .then(|| self.tracer.lock());
        for t in timings {
            if t.step == "kernel" {
                if let Ok(ms) = t.t1.elapsed_ms_since(&t.t0) {
                    ns += (f64::from(ms) * 1e6) as u64;
                    kernel_bytes += t.bytes;
                }
            } else {
                total += t.bytes;
            }
            if let Some(tr) = tracer.as_mut().and_then(|g| g.as_mut()) {
                if let (Ok(a), Ok(b)) = (
                    t.t0.elapsed_ms_since(&tr.base),
                    t.t1.elapsed_ms_since(&tr.base),
                ) {
                    tr.spans.push(TraceSpan {
                        direction: dir.name(),
                        step: t.step,
                        bytes: t.bytes,
                        start_us: f64::from(a) * 1e3,
                        end_us: f64::from(b) * 1e3,
                    });
                }
            }
            self.give_event(t.t0, true);
            self.give_event(t.t1, true);
        }
        let traced = tracer.is_some();
        drop(tracer);
        self.counters.kernel_ns.fetch_add(ns, Ordering::Relaxed);
        if kernel_bytes > 0 {
            self.note_kernels(dir, ns as f64 / 1e6 / (kernel_bytes as f64 / 1e9));
        }
        if traced {
            self.trace_host(dir, "call", total, call_start);
        }
    }

    /// Folds one staged call's kernel time per GB into `auto`'s view and switches small pieces
    /// between staged and DMA when the kernels have become slow or fast again.
    fn note_kernels(&self, dir: Dir, ms_per_gb: f64) {
        let h = &self.staged_health[dir.index()];
        let old = f64::from_bits(h.ms_per_gb.load(Ordering::Relaxed));
        let avg = if old > 0.0 {
            0.5 * old + 0.5 * ms_per_gb
        } else {
            ms_per_gb
        };
        h.ms_per_gb.store(avg.to_bits(), Ordering::Relaxed);
        if self.opts.method != CopyMethod::Auto {
            return;
        }
        let by_dma = h.by_dma.load(Ordering::Relaxed);
        let want = small_pieces_by_dma(by_dma, avg);
        if want != by_dma {
            h.by_dma.store(want, Ordering::Relaxed);
            h.switches.fetch_add(1, Ordering::Relaxed);
            log::debug!(
                "umbp: {} staging kernels take {avg:.1} ms per GB (SMs are {}): small pieces go {}",
                dir.name(),
                if want { "busy" } else { "free again" },
                if want { "by DMA" } else { "staged" }
            );
        }
    }

    fn run_dma(
        &self,
        dir: Dir,
        blocks: &[BlockCopy<'_>],
        after: Option<CUevent>,
        done: &Event,
        results: &mut [MoveResult],
        timings: &mut Vec<Timed>,
    ) -> Result<(), CudaError> {
        let lane = self.lane(dir);
        if let Some(ev) = after {
            lane.dma.wait(ev)?;
        }
        let (base, g) = (self.pinner.progress().base, self.pinner.progress().chunk);
        let ps = plan::split(&plan::pieces(blocks), base, g);
        let runs = plan::runs(&ps, base, g);
        let t0 = self.dma_begin(&lane.dma);
        let mut singles: Vec<Run> = Vec::new();
        let mut bytes = 0u64;
        for r in runs {
            bytes += r.bytes();
            if r.count == 1 {
                singles.push(r);
                continue;
            }
            if let Err(e) = self.strided(dir, &lane.dma, &r) {
                log::debug!("umbp: strided copy failed ({e}); copying its rows one by one");
                for i in 0..r.count {
                    singles.push(Run {
                        dev: r.dev + i * r.dev_stride,
                        host: r.host + i * r.host_stride,
                        count: 1,
                        ..r
                    });
                }
            }
        }
        self.singles(dir, &lane.dma, &singles, results);
        self.dma_end(&lane.dma, t0, bytes, timings);
        self.counters.dma_bytes.fetch_add(bytes, Ordering::Relaxed);
        done.record(&lane.dma)
    }

    fn lane(&self, dir: Dir) -> &Lane {
        match dir {
            Dir::Store => &self.store,
            Dir::Load => &self.load,
        }
    }

    /// One strided run as a 2-D copy, or a 3-D copy when a stride is above the maximum pitch.
    fn strided(&self, dir: Dir, stream: &Stream, r: &Run) -> Result<(), CudaError> {
        let d = self.dev.driver();
        let maxp = self.dev.max_pitch;
        if r.dev_stride <= maxp && r.host_stride <= maxp {
            let mut c = CUDA_MEMCPY2D::zeroed();
            c.WidthInBytes = r.len as usize;
            c.Height = r.count as usize;
            match dir {
                Dir::Store => {
                    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
                    c.srcDevice = r.dev;
                    c.srcPitch = r.dev_stride as usize;
                    c.dstMemoryType = CU_MEMORYTYPE_HOST;
                    c.dstHost = r.host as *mut c_void;
                    c.dstPitch = r.host_stride as usize;
                }
                Dir::Load => {
                    c.srcMemoryType = CU_MEMORYTYPE_HOST;
                    c.srcHost = r.host as *const c_void;
                    c.srcPitch = r.host_stride as usize;
                    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                    c.dstDevice = r.dev;
                    c.dstPitch = r.dev_stride as usize;
                }
            }
            // SAFETY: both sides were checked by the engine (device side against a CUDA
            // registration, host side is a pool object of this batch); the struct is fully
            // initialised.
            d.check("cuMemcpy2DAsync", unsafe {
                (d.memcpy_2d_async)(&c, stream.raw())
            })?;
            self.counters.copies_2d.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let no_fit = || CudaError::Invalid(format!("no pitch <= {maxp} divides stride"));
        let (dp, dh) = plan::pitch_for(r.dev_stride, r.len, maxp).ok_or_else(no_fit)?;
        let (hp, hh) = plan::pitch_for(r.host_stride, r.len, maxp).ok_or_else(no_fit)?;
        let mut c = CUDA_MEMCPY3D::zeroed();
        c.WidthInBytes = r.len as usize;
        c.Height = 1;
        c.Depth = r.count as usize;
        match dir {
            Dir::Store => {
                c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
                c.srcDevice = r.dev;
                c.srcPitch = dp as usize;
                c.srcHeight = dh as usize;
                c.dstMemoryType = CU_MEMORYTYPE_HOST;
                c.dstHost = r.host as *mut c_void;
                c.dstPitch = hp as usize;
                c.dstHeight = hh as usize;
            }
            Dir::Load => {
                c.srcMemoryType = CU_MEMORYTYPE_HOST;
                c.srcHost = r.host as *const c_void;
                c.srcPitch = hp as usize;
                c.srcHeight = hh as usize;
                c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                c.dstDevice = r.dev;
                c.dstPitch = dp as usize;
                c.dstHeight = dh as usize;
            }
        }
        // SAFETY: as for the 2-D copy; slice z starts at pitch * height * z = stride * z.
        d.check("cuMemcpy3DAsync", unsafe {
            (d.memcpy_3d_async)(&c, stream.raw())
        })?;
        self.counters.copies_3d.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Plain copies: batched where the driver can and every host side is registered, else one
    /// call each. A failure fails the blocks the copy touches.
    fn singles(&self, dir: Dir, stream: &Stream, runs: &[Run], results: &mut [MoveResult]) {
        if runs.is_empty() {
            return;
        }
        let d = self.dev.driver();
        let pin = self.pinner.progress();
        let batchable = runs.len() >= 2 && runs.iter().all(|r| pin.is_registered(r.host, r.len));
        if let (true, Some(batch)) = (batchable, d.memcpy_batch_async) {
            let mut ok = true;
            for chunk in runs.chunks(4096) {
                let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) = chunk
                    .iter()
                    .map(|r| match dir {
                        Dir::Store => (r.host, r.dev),
                        Dir::Load => (r.dev, r.host),
                    })
                    .unzip();
                let mut sizes: Vec<usize> = chunk.iter().map(|r| r.len as usize).collect();
                let mut attrs = [CUmemcpyAttributes {
                    srcAccessOrder: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    flags: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
                    ..Default::default()
                }];
                let mut idx = [0usize];
                let n = chunk.len();
                let rc = match batch {
                    // SAFETY: the arrays hold `n` entries each; one attribute applies to all
                    // copies; every address was checked (device side) or is a registered pool
                    // object (host side); the stream is ours (never the legacy NULL stream).
                    BatchFn::V2(f) => unsafe {
                        f(
                            dsts.as_mut_ptr(),
                            srcs.as_mut_ptr(),
                            sizes.as_mut_ptr(),
                            n,
                            attrs.as_mut_ptr(),
                            idx.as_mut_ptr(),
                            1,
                            stream.raw(),
                        )
                    },
                    BatchFn::V1(f) => {
                        let mut fail = 0usize;
                        // SAFETY: as above, with the 12.8 ABI's failIdx out-pointer.
                        unsafe {
                            f(
                                dsts.as_mut_ptr(),
                                srcs.as_mut_ptr(),
                                sizes.as_mut_ptr(),
                                n,
                                attrs.as_mut_ptr(),
                                idx.as_mut_ptr(),
                                1,
                                &mut fail,
                                stream.raw(),
                            )
                        }
                    }
                };
                if let Err(e) = d.check("cuMemcpyBatchAsync", rc) {
                    log::debug!("umbp: batched copy failed ({e}); copying one by one");
                    ok = false;
                    break;
                }
                self.counters.batch_calls.fetch_add(1, Ordering::Relaxed);
            }
            if ok {
                return;
            }
        }
        for r in runs {
            let rc = match dir {
                // SAFETY: as for the batched copies; `r.host` is a pool object, `r.dev` checked.
                Dir::Store => unsafe {
                    (d.memcpy_dtoh_async)(
                        r.host as *mut c_void,
                        r.dev,
                        r.len as usize,
                        stream.raw(),
                    )
                },
                // SAFETY: as above.
                Dir::Load => unsafe {
                    (d.memcpy_htod_async)(
                        r.dev,
                        r.host as *const c_void,
                        r.len as usize,
                        stream.raw(),
                    )
                },
            };
            match d.check("cuMemcpyAsync", rc) {
                Ok(()) => {
                    self.counters.copies_1d.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    for b in r.first_block..=r.last_block {
                        results[b as usize] = Err(self.move_error(&e));
                    }
                }
            }
        }
    }

    /// The DMAs between a staging slot and the pool objects of slice `s`; a failure fails
    /// the slice's blocks.
    fn slot_dmas(
        &self,
        dir: Dir,
        stream: &Stream,
        s: &Slice,
        stage: u64,
        results: &mut [MoveResult],
    ) {
        let runs: Vec<Run> = s
            .dmas
            .iter()
            .map(|m| Run {
                dev: stage + m.off,
                host: m.host,
                len: m.len,
                dev_stride: 0,
                host_stride: 0,
                count: 1,
                first_block: 0,
                last_block: 0,
            })
            .collect();
        let mut outcome = [Ok(())];
        self.singles(dir, stream, &runs, &mut outcome);
        if let [Err(e)] = outcome {
            for &b in &s.blocks {
                results[b] = Err(e.clone());
            }
        }
    }

    fn run_staged(
        &self,
        dir: Dir,
        slices: &[Slice],
        after: Option<CUevent>,
        done: &Event,
        results: &mut [MoveResult],
        timings: &mut Vec<Timed>,
    ) -> Result<(), CudaError> {
        let lane = self.lane(dir);
        let kernels = self
            .kernels
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("staging kernels are not loaded".into()))?;
        let ring = lane
            .ring
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no staging memory".into()))?;
        let d = self.dev.driver();
        // Held only while this call's slices are queued (in flags mode no host thread waits
        // for the GPU here, except, rarely, for a descriptor buffer).
        let mut ring = ring.lock();
        if dir == Dir::Store {
            if let Some(ev) = after {
                lane.kern.wait(ev)?;
            }
        }
        // Store: gather on `kern`, then DMA on `dma`. Load: DMA on `dma`, then scatter.
        let (first, second) = match dir {
            Dir::Store => (&lane.kern, &lane.dma),
            Dir::Load => (&lane.dma, &lane.kern),
        };
        let mut bytes = 0u64;
        for (k, s) in slices.iter().enumerate() {
            let i = ring.next;
            ring.next = (i + 1) % ring.slots.len();
            let slot = &mut ring.slots[i];
            if !slot.flags() && slot.used {
                self.host_wait(dir, "slot_wait", &slot.free)?;
            }
            let j = slot.next_desc;
            slot.next_desc = (j + 1) % slot.descs.len();
            if slot.flags() && slot.descs_used[j] {
                self.host_wait(dir, "desc_wait", &slot.descs_read[j])?;
            }
            let n = s.descs.len();
            // Descriptors: devs | offs | lens.
            // SAFETY: the buffer holds 3 * MAX_DESCS u64 and n <= MAX_DESCS (plan::staged);
            // the kernel that last read it has finished (waited for above).
            let desc =
                unsafe { std::slice::from_raw_parts_mut(slot.descs[j].ptr() as *mut u64, 3 * n) };
            for (m, x) in s.descs.iter().enumerate() {
                desc[m] = x.dev;
                desc[n + m] = x.off;
                desc[2 * n + m] = x.len;
            }
            slot.descs_used[j] = true;
            slot.used = true;
            let prev = slot.seq;
            slot.seq = prev.wrapping_add(1);
            let slot = &*slot;
            let stage = slot.stage.ptr();
            // The kernel reads the descriptors through the mapping (24 bytes per piece over
            // PCIe): measured faster than uploading them, whose copy queues behind the bulk
            // host-to-device DMAs of loads.
            let dp = slot.descs[j].device_ptr();
            let slice_bytes = s.descs.iter().map(|x| x.len).sum::<u64>();
            let launch = |f: CUfunction| -> Result<Timed, CudaError> {
                let stream = &lane.kern;
                let t0 = self.take_event(true)?;
                let t1 = self.take_event(true)?;
                t0.record(stream)?;
                let mut a0: u64 = dp;
                let mut a1: u64 = dp + 8 * n as u64;
                let mut a2: u64 = dp + 16 * n as u64;
                let mut a3: u64 = stage;
                let mut a4: u32 = n as u32;
                let mut params: [*mut c_void; 5] = [
                    &mut a0 as *mut u64 as *mut c_void,
                    &mut a1 as *mut u64 as *mut c_void,
                    &mut a2 as *mut u64 as *mut c_void,
                    &mut a3 as *mut u64 as *mut c_void,
                    &mut a4 as *mut u32 as *mut c_void,
                ];
                let grid = (n.div_ceil(8) as u32).clamp(1, self.opts.max_ctas);
                // SAFETY: the kernel takes (u64, u64, u64, u64, u32), matching `params`;
                // every descriptor names a checked device range and a range inside this slot.
                d.check("cuLaunchKernel", unsafe {
                    (d.launch_kernel)(
                        f,
                        grid as c_uint,
                        1,
                        1,
                        256,
                        1,
                        1,
                        0,
                        stream.raw(),
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                })?;
                t1.record(stream)?;
                slot.descs_read[j].record(stream)?;
                self.counters
                    .kernel_launches
                    .fetch_add(1, Ordering::Relaxed);
                Ok(Timed {
                    step: "kernel",
                    bytes: slice_bytes,
                    t0,
                    t1,
                })
            };
            let dmas = |results: &mut [MoveResult], timings: &mut Vec<Timed>| {
                let t0 = self.dma_begin(&lane.dma);
                self.slot_dmas(dir, &lane.dma, s, stage, results);
                self.dma_end(&lane.dma, t0, slice_bytes, timings);
            };
            let step = |results: &mut [MoveResult],
                        timings: &mut Vec<Timed>|
             -> Result<Timed, CudaError> {
                if slot.flags() {
                    // The previous use of the slot has finished with its staging memory.
                    first.wait_flag(slot.free_flag, prev)?;
                }
                let t = match dir {
                    Dir::Store => {
                        let t = launch(kernels.gather)?;
                        handoff(slot, first, second)?;
                        dmas(results, timings);
                        t
                    }
                    Dir::Load => {
                        dmas(results, timings);
                        handoff(slot, first, second)?;
                        if k == 0 {
                            if let Some(ev) = after {
                                lane.kern.wait(ev)?;
                            }
                        }
                        launch(kernels.scatter)?
                    }
                };
                if slot.flags() {
                    second.write_flag(slot.free_flag, slot.seq)?;
                } else {
                    slot.free.record(second)?;
                }
                Ok(t)
            };
            match step(results, timings) {
                Ok(t) => {
                    timings.push(t);
                    bytes += slice_bytes;
                }
                Err(e) => {
                    for &b in &s.blocks {
                        results[b] = Err(self.move_error(&e));
                    }
                    // Keep the protocol whatever was queued, so that no later wait hangs and
                    // `done` (on the second stream) still follows everything of this use:
                    // first waits for the previous use (a repeated wait is harmless), hands
                    // over to second, and second marks the slot free.
                    if slot.flags() {
                        let _ = first.wait_flag(slot.free_flag, prev);
                    }
                    let _ = handoff(slot, first, second);
                    if slot.flags() {
                        let _ = second.write_flag(slot.free_flag, slot.seq);
                    } else {
                        let _ = slot.free.record(second);
                    }
                    let _ = slot.descs_read[j].record(&lane.kern);
                }
            }
        }
        self.counters
            .staged_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        done.record(second)
    }

    /// Waits on the host for `ev` (a step the caller cannot go on without), traced as `what`.
    fn host_wait(&self, dir: Dir, what: &'static str, ev: &Event) -> Result<(), CudaError> {
        if ev.query()? {
            return Ok(());
        }
        let w = std::time::Instant::now();
        ev.synchronize()?;
        if self.tracing.load(Ordering::Relaxed) {
            self.trace_host(dir, what, 0, w);
        }
        Ok(())
    }
}

/// Makes `to`'s later work wait for `from`'s work so far on `slot`: through the slot's device
/// flag where there is one, else through its `ready` event.
fn handoff(slot: &Slot, from: &Stream, to: &Stream) -> Result<(), CudaError> {
    if slot.flags() {
        from.write_flag(slot.ready_flag, slot.seq)?;
        to.wait_flag(slot.ready_flag, slot.seq)
    } else {
        slot.ready.record(from)?;
        to.wait(slot.ready.raw())
    }
}

/// `n` zeroed 32-bit flag words in device memory, once a write and a wait through them were
/// seen to work on this device.
fn device_flags(dev: &Arc<Device>, n: usize) -> Result<DeviceBuffer, CudaError> {
    let buf = dev.alloc((4 * n as u64).max(256))?;
    let s = dev.stream()?;
    let k = dev.stream()?;
    // SAFETY: our own fresh allocation, used by nothing else yet.
    unsafe { dev.memset(buf.ptr(), 0, buf.len(), &s) }?;
    s.write_flag(buf.ptr(), 1)?;
    k.wait_flag(buf.ptr(), 1)?;
    k.write_flag(buf.ptr(), 0)?;
    k.synchronize()?;
    s.synchronize()?;
    Ok(buf)
}

fn load_kernels(dev: &Device) -> Result<Kernels, CudaError> {
    let _g = dev.scoped()?;
    let d = dev.driver();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut log = vec![0u8; 8192];
    let mut opts = [CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut vals: [*mut c_void; 2] = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    // SAFETY: PTX is NUL-terminated; the two JIT options point at a live buffer of that size.
    let rc = unsafe {
        (d.module_load_data_ex)(
            &mut module,
            PTX.as_ptr() as *const c_void,
            2,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    };
    if let Err(e) = d.check("cuModuleLoadDataEx", rc) {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        return Err(CudaError::Invalid(format!(
            "{e}; JIT log: {}",
            String::from_utf8_lossy(&log[..end])
        )));
    }
    let func = |name: &std::ffi::CStr| -> Result<CUfunction, CudaError> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        d.check("cuModuleGetFunction", unsafe {
            (d.module_get_function)(&mut f, module, name.as_ptr())
        })?;
        Ok(f)
    };
    Ok(Kernels {
        module,
        gather: func(c"umbp_gather")?,
        scatter: func(c"umbp_scatter")?,
    })
}

impl Drop for CudaMover {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(k) = &self.kernels {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: every launch finished (streams synchronised in shutdown).
                unsafe { (self.dev.driver().module_unload)(k.module) };
            }
        }
    }
}

impl Mover for CudaMover {
    fn batch_size(&self) -> usize {
        self.opts.batch_blocks
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
    fn auto_switches_small_pieces_with_hysteresis() {
        // Idle kernels (2-8 ms per GB, measured) stay staged; kernels waiting for SMs beside
        // a full-GPU matmul (40-160 ms per GB) switch to DMA; back only once clearly fast.
        assert!(!small_pieces_by_dma(false, 2.0));
        assert!(!small_pieces_by_dma(false, 8.0));
        assert!(!small_pieces_by_dma(false, 24.0));
        assert!(small_pieces_by_dma(false, 40.0));
        assert!(small_pieces_by_dma(true, 20.0));
        assert!(!small_pieces_by_dma(true, 10.0));
    }

    #[test]
    fn options_are_validated_without_cuda() {
        CudaOptions::default().validate().unwrap();
        let e = CudaOptions {
            pin_chunk_bytes: 100,
            ..CudaOptions::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("cuda_pin_chunk_bytes"), "{e}");
        let e = CudaOptions {
            method: CopyMethod::Staged,
            staging_bytes: 0,
            ..CudaOptions::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("cuda_copy_method"), "{e}");
        assert_eq!("DMA".parse::<CopyMethod>().unwrap(), CopyMethod::Dma);
        assert!("fast".parse::<CopyMethod>().is_err());
    }

    #[test]
    fn the_kernels_are_embedded_nul_terminated() {
        assert!(PTX.ends_with('\0'));
        assert!(PTX.contains(".entry umbp_gather") && PTX.contains(".entry umbp_scatter"));
    }
}
