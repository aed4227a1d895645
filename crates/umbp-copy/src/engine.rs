//! Asynchronous copy jobs between registered engine memory and pool objects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use umbp_core::{Admit, BlockKey, CopyRange, FailureKind, KeyOutcome, RangePlan};
use umbp_pool::{CommitOutcome, Pool, PoolError};

use crate::completion::Completion;
use crate::mover::{BlockCopy, Mover, OrderToken};
use crate::registry::{MemoryKind, MemoryRegistry, Registration};
use crate::CopyError;

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Engine memory → a new pool object.
    Store,
    /// Pool object → engine memory.
    Load,
}

/// Keys per worker when spreading a job.
const CHUNK: usize = 8;

#[derive(Debug)]
pub(crate) struct JobState {
    direction: Direction,
    /// How a store meets the pool's store admission (loads: always `Policy`).
    admit: Admit,
    keys: Vec<BlockKey>,
    plan: RangePlan,
    /// Keys whose ranges failed validation, with the reason; they are never copied.
    invalid: Vec<Option<String>>,
    /// The submitter's ordering token, handed to the mover; dropped (given back to the mover
    /// that made it) when the last key has finished.
    after: RwLock<Option<OrderToken>>,
    /// The device mover that moves the job's engine memory (None: host memory).
    device: Option<Arc<dyn Mover>>,
    /// Registrations the job touches, held until it finishes.
    regions: Mutex<Vec<Arc<Registration>>>,
    next: AtomicUsize,
    remaining: AtomicUsize,
    cancelled: AtomicBool,
    pub(crate) results: Mutex<Vec<KeyOutcome>>,
    /// Whether the job has finished, and who waits for it (threads, futures, callbacks).
    pub(crate) completion: Completion,
    started: Instant,
    /// Nanoseconds from submission to the last key's end, once finished (0 before).
    finished_after_ns: AtomicU64,
}

impl JobState {
    /// Marks `n` keys finished; after the last ones, runs `on_last` and then reports the job
    /// done (running its callbacks, then waking its waiters, on this thread).
    fn finish_keys(&self, n: usize, on_last: impl FnOnce()) {
        let last = self.remaining.fetch_sub(n, Ordering::AcqRel) == n;
        if last {
            on_last();
            self.after.write().take();
            self.regions.lock().clear();
            let took = self.started.elapsed();
            // At least 1 ns: 0 means "not finished".
            let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).max(1);
            self.finished_after_ns.store(ns, Ordering::Release);
            log::debug!(
                "umbp: {:?} job of {} keys finished in {:?}",
                self.direction,
                self.keys.len(),
                took
            );
            self.completion.finish(|| self.results.lock().clone());
        }
    }

    /// Asks the job to stop (see [`JobHandle::cancel`]).
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }
}

/// A submitted job. Dropping the handle does not cancel the job. Besides polling and waiting
/// on a thread, a job can be awaited ([`JobHandle::finished`]) or given a callback
/// ([`JobHandle::on_done`]).
#[derive(Debug, Clone)]
pub struct JobHandle {
    pub(crate) state: Arc<JobState>,
}

impl JobHandle {
    /// The results, if the job has finished.
    pub fn poll(&self) -> Option<Vec<KeyOutcome>> {
        if self.state.completion.is_done() {
            Some(self.state.results.lock().clone())
        } else {
            None
        }
    }

    /// Whether the job has finished.
    pub fn is_done(&self) -> bool {
        self.state.completion.is_done()
    }

    /// Waits up to `timeout` for the job, then returns its results or [`CopyError::Timeout`].
    pub fn wait(&self, timeout: Duration) -> Result<Vec<KeyOutcome>, CopyError> {
        if !self.state.completion.wait_until(Instant::now() + timeout) {
            return Err(CopyError::Timeout {
                ms: timeout.as_millis() as u64,
            });
        }
        Ok(self.state.results.lock().clone())
    }

    /// Asks the job to stop: keys not yet started end as [`KeyOutcome::Cancelled`]; keys being
    /// copied finish. Wait for the job before reusing its memory.
    pub fn cancel(&self) {
        self.state.cancel();
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.state.keys.len()
    }

    /// From submission to the end of its last key, once the job has finished.
    pub fn elapsed(&self) -> Option<Duration> {
        match self.state.finished_after_ns.load(Ordering::Acquire) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// Bytes of one key's object (every key of a job has the same size).
    pub fn object_bytes(&self) -> u64 {
        self.state.plan.object_bytes()
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
    /// One mover per device, by the kind of memory it serves.
    device_movers: RwLock<HashMap<MemoryKind, Arc<dyn Mover>>>,
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
        // The process's bulk host copy, measured once on this CPU (crate::memcpy).
        let cal = crate::memcpy::calibrate(num_workers);
        log::debug!(
            "host copy: {} ({}; GB/s {:?})",
            cal.chosen.name(),
            cal.how,
            cal.gbps
        );
        let (tx, rx) = channel::<Arc<JobState>>();
        let rx = Arc::new(Mutex::new(rx));
        // Held while a worker reserves one batch, so a batch's objects are neighbours in the
        // pool (one DMA can then cover many of them).
        let reserve = Arc::new(Mutex::new(()));
        let mut workers = Vec::with_capacity(num_workers);
        for i in 0..num_workers {
            let rx = Arc::clone(&rx);
            let pool = Arc::clone(&pool);
            let mover = Arc::clone(&mover);
            let reserve = Arc::clone(&reserve);
            let thread = format!("umbp-copy-{i}");
            let h = std::thread::Builder::new()
                .name(thread.clone())
                .spawn(move || worker_loop(&rx, &pool, &mover, &reserve))
                .map_err(|source| CopyError::Spawn { thread, source })?;
            workers.push(h);
        }
        Ok(CopyEngine {
            pool,
            registry,
            mover,
            device_movers: RwLock::new(HashMap::new()),
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
        self.submit_after(direction, keys, plan, None)
    }

    /// Like [`CopyEngine::submit`], with an ordering token for the mover (for a device mover,
    /// an event recorded on the engine's stream that the copies must wait for). The job owns
    /// the token and drops it when its last key has finished.
    pub fn submit_after(
        &self,
        direction: Direction,
        keys: Vec<BlockKey>,
        plan: RangePlan,
        after: Option<OrderToken>,
    ) -> Result<JobHandle, CopyError> {
        self.submit_as(direction, keys, plan, after, Admit::Policy)
    }

    /// Like [`CopyEngine::submit_after`], for a store that meets the pool's store admission
    /// as `admit` says ([`Admit::Now`]: each key is stored on its first sighting, see
    /// [`Pool::admit_as`]). A load asked for as [`Admit::Now`] is refused.
    pub fn submit_as(
        &self,
        direction: Direction,
        keys: Vec<BlockKey>,
        plan: RangePlan,
        after: Option<OrderToken>,
        admit: Admit,
    ) -> Result<JobHandle, CopyError> {
        if direction == Direction::Load && admit == Admit::Now {
            return Err(CopyError::InvalidRequest(
                "a load was asked to be admitted now; admission applies to stores only".into(),
            ));
        }
        if keys.len() != plan.num_blocks() {
            return Err(CopyError::InvalidRequest(format!(
                "{} keys for {} planned blocks; pass one key per block id",
                keys.len(),
                plan.num_blocks()
            )));
        }
        let n = keys.len();
        let (invalid, regions, kind) = self.validate(&plan);
        let device = match kind {
            None | Some(MemoryKind::Host) => None,
            Some(k) => match self.device_movers.read().get(&k) {
                Some(m) => Some(Arc::clone(m)),
                None => {
                    return Err(CopyError::InvalidRequest(format!(
                        "the job moves {k:?} memory but no mover for it is installed; register device memory through the store"
                    )))
                }
            },
        };
        let state = Arc::new(JobState {
            direction,
            admit,
            keys,
            plan,
            invalid,
            after: RwLock::new(after),
            device,
            regions: Mutex::new(regions),
            next: AtomicUsize::new(0),
            remaining: AtomicUsize::new(n),
            cancelled: AtomicBool::new(false),
            results: Mutex::new(vec![KeyOutcome::Pending; n]),
            completion: Completion::new(n == 0),
            started: Instant::now(),
            finished_after_ns: AtomicU64::new(0),
        });
        if n > 0 {
            let queue = self.queue.lock();
            let tx = queue.as_ref().ok_or(CopyError::Closed)?;
            // Spread big jobs over the workers; small ones take one.
            let limit = state
                .device
                .as_ref()
                .unwrap_or(&self.mover)
                .max_workers_per_job();
            let helpers = n
                .div_ceil(CHUNK * 4)
                .clamp(1, self.num_workers.min(limit).max(1));
            for _ in 0..helpers {
                tx.send(Arc::clone(&state)).map_err(|_| CopyError::Closed)?;
            }
        }
        Ok(JobHandle { state })
    }

    /// Checks a plan's ranges against the registry: per key, why it cannot be copied (if so);
    /// the registrations the job touches; the kind of memory it moves. A plan made from a
    /// layout is checked once per layer (each layer's whole span inside one registration) and
    /// only falls back to checking every range when a span is not covered.
    #[allow(clippy::type_complexity)]
    fn validate(
        &self,
        plan: &RangePlan,
    ) -> (
        Vec<Option<String>>,
        Vec<Arc<Registration>>,
        Option<MemoryKind>,
    ) {
        let n = plan.num_blocks();
        let mut regions: Vec<Arc<Registration>> = Vec::new();
        if let Some(spans) = plan.layer_spans().filter(|_| n > 0) {
            let mut kind: Option<MemoryKind> = None;
            let mut all = true;
            // (end of the previous span, index of its registration in `regions`)
            let mut prev: Option<(u64, usize)> = None;
            for (addr, len) in spans {
                let Some(at) = self.region_of(&mut regions, addr, len) else {
                    all = false;
                    break;
                };
                let k = regions[at].kind;
                // Runs of touching layers may merge into one range: it must not cross from
                // one registration into another (the per-range check decides then).
                let crosses = matches!(prev, Some((end, p)) if end == addr && p != at);
                if *kind.get_or_insert(k) != k || crosses {
                    all = false;
                    break;
                }
                prev = Some((addr + len, at));
            }
            if all {
                return (vec![None; n], regions, kind);
            }
            regions.clear();
        }
        let mut invalid = vec![None; n];
        // The kind of memory the job moves: that of its first valid range.
        let mut kind: Option<MemoryKind> = None;
        let mut ranges = Vec::new();
        for (i, slot) in invalid.iter_mut().enumerate() {
            ranges.clear();
            plan.append_block(i, &mut ranges);
            for r in &ranges {
                let found = self
                    .region_of(&mut regions, r.host_addr, r.len)
                    .map(|at| regions[at].kind);
                if found.is_none() || r.object_offset + r.len > plan.object_bytes() {
                    *slot = Some(format!(
                        "range {:#x}+{} is outside registered memory; register the KV cache first",
                        r.host_addr, r.len
                    ));
                    break;
                }
                if *kind.get_or_insert(found.expect("checked")) != found.expect("checked") {
                    *slot = Some(format!(
                        "range {:#x}+{} is {:?} memory but the job moves {:?} memory; one job moves one kind",
                        r.host_addr,
                        r.len,
                        found.expect("checked"),
                        kind.expect("set")
                    ));
                    break;
                }
            }
        }
        (invalid, regions, kind)
    }

    /// The index in `regions` of a registration that covers `[addr, addr + len)`, looked up
    /// in the registry (and added to `regions`) when none of `regions` does.
    fn region_of(
        &self,
        regions: &mut Vec<Arc<Registration>>,
        addr: u64,
        len: u64,
    ) -> Option<usize> {
        if let Some(i) = regions.iter().position(|g| g.covers(addr, len)) {
            return Some(i);
        }
        let g = self.registry.find(addr, len)?;
        regions.push(g);
        Some(regions.len() - 1)
    }

    /// The mover of host-memory jobs.
    pub fn mover(&self) -> &Arc<dyn Mover> {
        &self.mover
    }

    /// Installs the mover of jobs whose engine memory is of `kind` (one device's memory; once
    /// per device).
    pub fn set_device_mover(
        &self,
        kind: MemoryKind,
        mover: Arc<dyn Mover>,
    ) -> Result<(), CopyError> {
        if kind == MemoryKind::Host {
            return Err(CopyError::InvalidRequest(
                "host memory is moved by the engine's own mover; a device mover serves one device's memory".into(),
            ));
        }
        let mut m = self.device_movers.write();
        if m.contains_key(&kind) {
            return Err(CopyError::InvalidRequest(format!(
                "a mover for {kind:?} memory is already installed"
            )));
        }
        m.insert(kind, mover);
        Ok(())
    }

    /// The mover of `kind` memory, if one is installed.
    pub fn device_mover(&self, kind: MemoryKind) -> Option<Arc<dyn Mover>> {
        self.device_movers.read().get(&kind).cloned()
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

fn worker_loop(
    rx: &Mutex<Receiver<Arc<JobState>>>,
    pool: &Pool,
    host: &Arc<dyn Mover>,
    reserve: &Mutex<()>,
) {
    // The worker's batches build their ranges here: memory touched once and reused (a batch
    // of 16,384 ranges built in fresh memory took ~200 µs, most of it page faults, against
    // ~35 µs here; a job's first copy waits for it).
    let mut ranges: Vec<CopyRange> = Vec::new();
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let mover = job.device.as_ref().unwrap_or(host);
        run_job(&job, pool, mover.as_ref(), reserve, &mut ranges);
        if ranges.capacity() > MAX_KEPT_RANGES {
            ranges = Vec::new();
        }
    }
}

/// Blocks of the call that starts at block `first` of a job of `n` blocks, in calls of
/// `batch` blocks, where the mover asked for `edge`-block calls at the ends (see
/// [`Mover::edge_batch`]): the first call is `edge` blocks and each next one twice the one
/// before (`edge`, `2 edge`, `4 edge`, ... up to `batch`), so that a call is planned while the
/// one before it copies; the last call is `edge` to `2 edge - 1` blocks, and none before it
/// is shorter than `edge`.
fn next_batch(first: usize, n: usize, batch: usize, edge: usize) -> usize {
    let left = n - first;
    if edge >= batch || left < 2 * edge {
        return left.min(batch);
    }
    let size = (first + edge).min(batch);
    if left > size + edge {
        size
    } else {
        // This call leaves `edge` blocks for a short last one.
        (left - edge).min(size)
    }
}

/// Ranges a worker keeps room for between jobs (24 MiB).
const MAX_KEPT_RANGES: usize = 1 << 20;

fn run_job(
    job: &JobState,
    pool: &Pool,
    mover: &dyn Mover,
    reserve: &Mutex<()>,
    ranges: &mut Vec<CopyRange>,
) {
    let n = job.keys.len();
    let (object_bytes, pieces) = (job.plan.object_bytes(), job.plan.pieces_per_block());
    let batch = mover.batch_size(object_bytes, pieces).max(1);
    let edge = mover
        .edge_batch(batch, n, object_bytes, pieces)
        .clamp(1, batch);
    loop {
        let mut first = job.next.load(Ordering::Acquire);
        let last = loop {
            if first >= n {
                return;
            }
            let last = first + next_batch(first, n, batch, edge);
            match job
                .next
                .compare_exchange_weak(first, last, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break last,
                Err(now) => first = now,
            }
        };
        let results = if job.cancelled.load(Ordering::Acquire) {
            vec![KeyOutcome::Cancelled; last - first]
        } else {
            match job.direction {
                Direction::Store => store_batch(job, first..last, pool, mover, reserve, ranges),
                Direction::Load => load_batch(job, first..last, pool, mover, ranges),
            }
        };
        {
            let mut all = job.results.lock();
            for (i, r) in (first..last).zip(results) {
                all[i] = r;
            }
        }
        job.finish_keys(last - first, || {});
    }
}

/// The copies of one batch: for each (index of a block in the plan, its pool object), the
/// block's ranges, built into `ranges` (cleared first).
fn batch_copies<'a>(
    plan: &RangePlan,
    items: impl Iterator<Item = (usize, *mut u8)>,
    ranges: &'a mut Vec<CopyRange>,
) -> Vec<BlockCopy<'a>> {
    ranges.clear();
    let mut spans = Vec::new(); // (object, start, end) in `ranges`
    for (i, object) in items {
        let start = ranges.len();
        plan.append_block(i, ranges);
        spans.push((object, start, ranges.len()));
    }
    let ranges: &'a [CopyRange] = ranges;
    spans
        .into_iter()
        .map(|(object, a, b)| BlockCopy {
            object,
            ranges: &ranges[a..b],
        })
        .collect()
}

fn store_batch(
    job: &JobState,
    keys: std::ops::Range<usize>,
    pool: &Pool,
    mover: &dyn Mover,
    reserve: &Mutex<()>,
    ranges: &mut Vec<CopyRange>,
) -> Vec<KeyOutcome> {
    let mut results = Vec::with_capacity(keys.len());
    let mut todo = Vec::new(); // (result index, key index, reservation)
    let guard = reserve.lock();
    for i in keys {
        let r = if let Some(why) = &job.invalid[i] {
            KeyOutcome::failed(FailureKind::InvalidRange, why.clone())
        } else if pool.contains(&job.keys[i]) {
            KeyOutcome::AlreadyPresent
        } else if !pool.admit_as(&job.keys[i], job.admit) {
            // The pool's store admission keeps no copy of this key yet (`on_reuse`): no
            // reservation and no copy; nothing failed. (`Admit::Now` is always admitted.)
            KeyOutcome::Skipped
        } else {
            match pool.reserve(job.plan.object_bytes()) {
                Ok(res) => {
                    todo.push((results.len(), i, res));
                    KeyOutcome::Pending
                }
                Err(PoolError::Full { .. }) => KeyOutcome::PoolFull,
                Err(e) => KeyOutcome::failed(FailureKind::Pool, e.to_string()),
            }
        };
        results.push(r);
    }
    drop(guard);
    if todo.is_empty() {
        return results;
    }
    let copies = batch_copies(
        &job.plan,
        todo.iter_mut().map(|(_, i, res)| (*i, res.as_mut_ptr())),
        ranges,
    );
    let after = job.after.read();
    let mut sums = vec![None; copies.len()];
    // SAFETY: `submit` checked every range against live registrations, which the job holds
    // until it finishes; each reservation is `object_bytes` long and ours alone.
    let outcomes = unsafe {
        if pool.integrity().sums() {
            mover.gather_summed(&copies, after.as_ref(), &mut sums)
        } else {
            mover.gather(&copies, after.as_ref())
        }
    };
    drop(after);
    // A sum of ranges that stop short of the object's end is not the object's.
    for (sum, c) in sums.iter_mut().zip(&copies) {
        if c.extent() != job.plan.object_bytes() {
            *sum = None;
        }
    }
    drop(copies);
    for (((at, i, mut res), outcome), sum) in todo.into_iter().zip(outcomes).zip(sums) {
        // Where the mover could not sum the bytes (a DMA moved them), the pool sums the
        // object at commit, on this worker, before it becomes visible.
        if let Some(sum) = sum {
            res.set_checksum(sum);
        }
        results[at] = match outcome {
            Ok(()) => match pool.commit_as(res, job.keys[i], job.admit) {
                CommitOutcome::Stored => KeyOutcome::Done,
                CommitOutcome::AlreadyPresent => KeyOutcome::AlreadyPresent,
                // The pool's store admission kept no copy (first sighting under `on_reuse`).
                CommitOutcome::Skipped => KeyOutcome::Skipped,
            },
            Err(e) => KeyOutcome::Failed(e.into()),
        };
    }
    results
}

fn load_batch(
    job: &JobState,
    keys: std::ops::Range<usize>,
    pool: &Pool,
    mover: &dyn Mover,
    ranges: &mut Vec<CopyRange>,
) -> Vec<KeyOutcome> {
    let mut results = Vec::with_capacity(keys.len());
    let mut todo = Vec::new(); // (result index, key index, pinned object)
    for i in keys {
        let r = if let Some(why) = &job.invalid[i] {
            KeyOutcome::failed(FailureKind::InvalidRange, why.clone())
        } else {
            match pool.get(&job.keys[i]) {
                None => KeyOutcome::Missing,
                Some(obj) if obj.len() != job.plan.object_bytes() => {
                    KeyOutcome::failed(
                        FailureKind::SizeMismatch,
                        format!(
                            "stored object has {} bytes but the layout expects {}; a different layout wrote this key",
                            obj.len(),
                            job.plan.object_bytes()
                        ),
                    )
                }
                // Verified before any byte is copied out; the pin keeps the bytes as
                // verified until the copy is done (committed objects are never written).
                Some(obj) if pool.verify_due() && !pool.verify(&obj) => KeyOutcome::failed(
                    FailureKind::Corrupt,
                    "the stored object failed its checksum (integrity) and was removed; \
                     nothing was copied",
                ),
                Some(obj) => {
                    todo.push((results.len(), i, obj));
                    KeyOutcome::Pending
                }
            }
        };
        results.push(r);
    }
    if todo.is_empty() {
        return results;
    }
    let copies = batch_copies(
        &job.plan,
        todo.iter().map(|(_, i, obj)| (*i, obj.as_ptr() as *mut u8)),
        ranges,
    );
    let after = job.after.read();
    // SAFETY: ranges were checked against live registrations held by the job; each pinned
    // object is `object_bytes` long and stays allocated (and unwritten) while pinned; the
    // mover only reads from it.
    let outcomes = unsafe { mover.scatter(&copies, after.as_ref()) };
    drop(after);
    for ((at, _, _obj), outcome) in todo.into_iter().zip(outcomes) {
        results[at] = match outcome {
            Ok(()) => KeyOutcome::Done,
            Err(e) => KeyOutcome::Failed(e.into()),
        };
    }
    results
}

#[cfg(test)]
mod tests {
    #[test]
    fn calls_are_short_at_both_ends_of_a_job_only_where_the_mover_asks() {
        let calls = |n: usize, batch: usize, edge: usize| {
            let (mut first, mut out) = (0, Vec::new());
            while first < n {
                let k = super::next_batch(first, n, batch, edge);
                assert!(k >= 1 && k <= batch);
                out.push(k);
                first += k;
            }
            out
        };
        // No edge asked for: calls of `batch`.
        assert_eq!(calls(1000, 204, 204), [204, 204, 204, 204, 184]);
        // 1,000 blocks of 640 KiB in one-slot calls of 204, edges of 25.
        assert_eq!(calls(1000, 204, 25), [25, 50, 100, 200, 204, 204, 192, 25]);
        assert_eq!(calls(254, 204, 25), [25, 50, 100, 54, 25]);
        assert_eq!(calls(100, 204, 25), [25, 50, 25]);
        assert_eq!(calls(40, 204, 25), [40]);
        // No call but the last is shorter than an edge.
        assert_eq!(calls(817, 204, 25), [25, 50, 100, 200, 204, 204, 34]);
        for n in 1..3000 {
            let c = calls(n, 204, 25);
            assert_eq!(c.iter().sum::<usize>(), n);
            if n >= 50 {
                assert!(c[..c.len() - 1].iter().all(|&k| k >= 25), "{n}: {c:?}");
                assert!((25..50).contains(c.last().unwrap()), "{n}: {c:?}");
            }
        }
        assert_eq!(calls(20, 204, 25), [20]);
        assert_eq!(calls(1, 1, 1), [1]);
    }
}
