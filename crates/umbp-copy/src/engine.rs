//! Asynchronous copy jobs between registered engine memory and pool objects.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use umbp_core::{BlockKey, CopyRange, RangePlan};
use umbp_pool::{CommitOutcome, Pool, PoolError};

use crate::memcpy;
use crate::registry::{MemoryRegistry, Registration};
use crate::CopyError;

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Engine memory → a new pool object.
    Store,
    /// Pool object → engine memory.
    Load,
}

/// What happened to one key of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyResult {
    /// Not finished yet.
    Pending,
    /// Stored, or loaded.
    Done,
    /// Store skipped: the key was already in the pool (or another writer committed it first).
    AlreadyPresent,
    /// Load failed: the key is not in the pool (never stored, or evicted).
    Missing,
    /// Store failed: the pool had no room even after eviction.
    PoolFull,
    /// Cancelled before it ran.
    Cancelled,
    /// Failed for another reason (a range outside registered memory, a size mismatch, ...).
    Failed(String),
}

impl KeyResult {
    /// Whether the key's transfer succeeded (a store of a present key counts).
    pub fn is_ok(&self) -> bool {
        matches!(self, KeyResult::Done | KeyResult::AlreadyPresent)
    }
}

/// Moves bytes between engine memory and pool memory. The host implementation uses `memcpy`;
/// device implementations plug in here.
pub trait Mover: Send + Sync + std::fmt::Debug {
    /// Copies each range from engine memory into the object at `object`.
    ///
    /// # Safety
    /// Every range must lie inside a live registration of the kind this mover serves, and
    /// `object` must point to at least `max(object_offset + len)` writable bytes that nothing
    /// else accesses during the call.
    unsafe fn gather(&self, object: *mut u8, ranges: &[CopyRange]) -> Result<(), String>;

    /// Copies each range from the object at `object` into engine memory.
    ///
    /// # Safety
    /// As for [`Mover::gather`], with `object` readable and the engine ranges writable.
    unsafe fn scatter(&self, object: *const u8, ranges: &[CopyRange]) -> Result<(), String>;
}

/// Copies between host memories (streaming stores for large pieces, see [`crate::memcpy`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMover;

impl Mover for HostMover {
    unsafe fn gather(&self, object: *mut u8, ranges: &[CopyRange]) -> Result<(), String> {
        for r in ranges {
            // SAFETY: the caller guarantees both sides are valid for `r.len` bytes and do not
            // overlap (one is pool memory, the other registered engine memory).
            unsafe {
                memcpy::copy(
                    object.add(r.object_offset as usize),
                    r.host_addr as *const u8,
                    r.len as usize,
                )
            };
        }
        memcpy::fence();
        Ok(())
    }

    unsafe fn scatter(&self, object: *const u8, ranges: &[CopyRange]) -> Result<(), String> {
        for r in ranges {
            // SAFETY: as in `gather`, in the other direction.
            unsafe {
                memcpy::copy(
                    r.host_addr as *mut u8,
                    object.add(r.object_offset as usize),
                    r.len as usize,
                )
            };
        }
        memcpy::fence();
        Ok(())
    }
}

/// Keys a worker claims at a time.
const CHUNK: usize = 8;

#[derive(Debug)]
struct JobState {
    direction: Direction,
    keys: Vec<BlockKey>,
    plan: RangePlan,
    /// Keys whose ranges failed validation, with the reason; they are never copied.
    invalid: Vec<Option<String>>,
    /// Registrations the job touches, held until it finishes.
    regions: Mutex<Vec<Arc<Registration>>>,
    next: AtomicUsize,
    remaining: AtomicUsize,
    cancelled: AtomicBool,
    results: Mutex<Vec<KeyResult>>,
    done: Mutex<bool>,
    done_cv: Condvar,
    started: Instant,
}

impl JobState {
    fn finish_keys(&self, n: usize) {
        if self.remaining.fetch_sub(n, Ordering::AcqRel) == n {
            self.regions.lock().clear();
            *self.done.lock() = true;
            self.done_cv.notify_all();
            log::debug!(
                "umbp: {:?} job of {} keys finished in {:?}",
                self.direction,
                self.keys.len(),
                self.started.elapsed()
            );
        }
    }
}

/// A submitted job. Dropping the handle does not cancel the job.
#[derive(Debug, Clone)]
pub struct JobHandle {
    state: Arc<JobState>,
}

impl JobHandle {
    /// The results, if the job has finished.
    pub fn poll(&self) -> Option<Vec<KeyResult>> {
        if *self.state.done.lock() {
            Some(self.state.results.lock().clone())
        } else {
            None
        }
    }

    /// Whether the job has finished.
    pub fn is_done(&self) -> bool {
        *self.state.done.lock()
    }

    /// Waits up to `timeout` for the job, then returns its results or [`CopyError::Timeout`].
    pub fn wait(&self, timeout: Duration) -> Result<Vec<KeyResult>, CopyError> {
        let deadline = Instant::now() + timeout;
        let mut done = self.state.done.lock();
        while !*done {
            if self
                .state
                .done_cv
                .wait_until(&mut done, deadline)
                .timed_out()
                && !*done
            {
                return Err(CopyError::Timeout {
                    ms: timeout.as_millis() as u64,
                });
            }
        }
        drop(done);
        Ok(self.state.results.lock().clone())
    }

    /// Asks the job to stop: keys not yet started end as [`KeyResult::Cancelled`]; keys being
    /// copied finish. Wait for the job before reusing its memory.
    pub fn cancel(&self) {
        self.state.cancelled.store(true, Ordering::Release);
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.state.keys.len()
    }

    /// Whether the job has no keys.
    pub fn is_empty(&self) -> bool {
        self.state.keys.is_empty()
    }
}

/// Runs copy jobs on `num_workers` threads.
#[derive(Debug)]
pub struct CopyEngine {
    pool: Arc<Pool>,
    registry: Arc<MemoryRegistry>,
    mover: Arc<dyn Mover>,
    queue: Mutex<Option<Sender<Arc<JobState>>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    num_workers: usize,
}

impl CopyEngine {
    /// An engine over `pool` and `registry` with `num_workers` threads moving bytes with
    /// `mover`.
    pub fn new(
        pool: Arc<Pool>,
        registry: Arc<MemoryRegistry>,
        mover: Arc<dyn Mover>,
        num_workers: usize,
    ) -> Result<Self, CopyError> {
        if num_workers == 0 || num_workers > 256 {
            return Err(CopyError::Core(umbp_core::CoreError::option(
                "num_workers",
                format!("{num_workers} is outside 1..=256"),
            )));
        }
        let (tx, rx) = channel::<Arc<JobState>>();
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::with_capacity(num_workers);
        for i in 0..num_workers {
            let rx = Arc::clone(&rx);
            let pool = Arc::clone(&pool);
            let mover = Arc::clone(&mover);
            let h = std::thread::Builder::new()
                .name(format!("umbp-copy-{i}"))
                .spawn(move || worker_loop(&rx, &pool, mover.as_ref()))
                .map_err(|e| CopyError::InvalidRequest(format!("cannot start a worker: {e}")))?;
            workers.push(h);
        }
        Ok(CopyEngine {
            pool,
            registry,
            mover,
            queue: Mutex::new(Some(tx)),
            workers: Mutex::new(workers),
            num_workers,
        })
    }

    /// The registry jobs are checked against.
    pub fn registry(&self) -> &Arc<MemoryRegistry> {
        &self.registry
    }

    /// The pool jobs store into and load from.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Submits a job: block `i` of `plan` is stored under / loaded from `keys[i]`. Every range
    /// is checked against the registry first; a key with a range outside registered memory
    /// fails alone.
    pub fn submit(
        &self,
        direction: Direction,
        keys: Vec<BlockKey>,
        plan: RangePlan,
    ) -> Result<JobHandle, CopyError> {
        if keys.len() != plan.num_blocks() {
            return Err(CopyError::InvalidRequest(format!(
                "{} keys for {} planned blocks; pass one key per block id",
                keys.len(),
                plan.num_blocks()
            )));
        }
        let n = keys.len();
        let mut invalid = vec![None; n];
        let mut regions: Vec<Arc<Registration>> = Vec::new();
        for (i, slot) in invalid.iter_mut().enumerate() {
            for r in plan.block(i) {
                let ok = regions.iter().any(|g| g.covers(r.host_addr, r.len))
                    || match self.registry.find(r.host_addr, r.len) {
                        Some(g) => {
                            regions.push(g);
                            true
                        }
                        None => false,
                    };
                if !ok || r.object_offset + r.len > plan.object_bytes {
                    *slot = Some(format!(
                        "range {:#x}+{} is outside registered memory; register the KV cache first",
                        r.host_addr, r.len
                    ));
                    break;
                }
            }
        }
        let state = Arc::new(JobState {
            direction,
            keys,
            plan,
            invalid,
            regions: Mutex::new(regions),
            next: AtomicUsize::new(0),
            remaining: AtomicUsize::new(n),
            cancelled: AtomicBool::new(false),
            results: Mutex::new(vec![KeyResult::Pending; n]),
            done: Mutex::new(n == 0),
            done_cv: Condvar::new(),
            started: Instant::now(),
        });
        if n > 0 {
            let queue = self.queue.lock();
            let tx = queue.as_ref().ok_or(CopyError::Closed)?;
            // Spread big jobs over the workers; small ones take one.
            let helpers = n.div_ceil(CHUNK * 4).clamp(1, self.num_workers);
            for _ in 0..helpers {
                tx.send(Arc::clone(&state)).map_err(|_| CopyError::Closed)?;
            }
        }
        Ok(JobHandle { state })
    }

    /// The mover in use.
    pub fn mover(&self) -> &Arc<dyn Mover> {
        &self.mover
    }

    /// Stops the workers after the jobs already queued.
    pub fn close(&self) {
        self.queue.lock().take();
        for h in self.workers.lock().drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.close();
    }
}

fn worker_loop(rx: &Mutex<Receiver<Arc<JobState>>>, pool: &Pool, mover: &dyn Mover) {
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        run_job(&job, pool, mover);
    }
}

fn run_job(job: &JobState, pool: &Pool, mover: &dyn Mover) {
    let n = job.keys.len();
    let mut local: Vec<(usize, KeyResult)> = Vec::with_capacity(CHUNK);
    loop {
        let first = job.next.fetch_add(CHUNK, Ordering::AcqRel);
        if first >= n {
            return;
        }
        let last = (first + CHUNK).min(n);
        local.clear();
        for i in first..last {
            let r = if job.cancelled.load(Ordering::Acquire) {
                KeyResult::Cancelled
            } else if let Some(why) = &job.invalid[i] {
                KeyResult::Failed(why.clone())
            } else {
                match job.direction {
                    Direction::Store => store_one(job, i, pool, mover),
                    Direction::Load => load_one(job, i, pool, mover),
                }
            };
            local.push((i, r));
        }
        {
            let mut results = job.results.lock();
            for (i, r) in local.drain(..) {
                results[i] = r;
            }
        }
        job.finish_keys(last - first);
    }
}

fn store_one(job: &JobState, i: usize, pool: &Pool, mover: &dyn Mover) -> KeyResult {
    let key = &job.keys[i];
    if pool.contains(key) {
        return KeyResult::AlreadyPresent;
    }
    let mut res = match pool.reserve(job.plan.object_bytes) {
        Ok(r) => r,
        Err(PoolError::Full { .. }) => return KeyResult::PoolFull,
        Err(e) => return KeyResult::Failed(e.to_string()),
    };
    // SAFETY: `submit` checked every range of this block against live registrations, which
    // the job holds until it finishes; the reservation is `object_bytes` long and ours alone.
    if let Err(e) = unsafe { mover.gather(res.as_mut_ptr(), job.plan.block(i)) } {
        return KeyResult::Failed(e);
    }
    match pool.commit(res, *key) {
        CommitOutcome::Stored => KeyResult::Done,
        CommitOutcome::AlreadyPresent => KeyResult::AlreadyPresent,
    }
}

fn load_one(job: &JobState, i: usize, pool: &Pool, mover: &dyn Mover) -> KeyResult {
    let Some(obj) = pool.get(&job.keys[i]) else {
        return KeyResult::Missing;
    };
    if obj.len() != job.plan.object_bytes {
        return KeyResult::Failed(format!(
            "stored object has {} bytes but the layout expects {}; a different layout wrote this key",
            obj.len(),
            job.plan.object_bytes
        ));
    }
    // SAFETY: ranges were checked against live registrations held by the job; the pinned
    // object is `object_bytes` long and immutable while pinned.
    match unsafe { mover.scatter(obj.as_ptr(), job.plan.block(i)) } {
        Ok(()) => KeyResult::Done,
        Err(e) => KeyResult::Failed(e),
    }
}
