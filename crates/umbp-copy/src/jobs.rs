//! How a job's end is observed without parking a thread per job, and sets of jobs that are
//! cancelled and waited for together.
//!
//! * [`JobHandle::finished`] returns a [`JobFinished`] future: it resolves to the job's
//!   results and needs no async runtime (it stores the task's [`Waker`](std::task::Waker) in the job and the
//!   worker that finishes the last key wakes it).
//! * [`JobHandle::on_done`] runs a callback once, with the results, on the worker thread that
//!   finished the job (or at once, on the caller's thread, when the job has already finished).
//! * [`JobSet`] tracks jobs weakly (a finished job whose handles are gone is forgotten), so an
//!   owner such as a client session can cancel and wait for everything it submitted.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::engine::{JobHandle, JobState};
use umbp_core::KeyOutcome;

/// A future that resolves to a job's results once every key has finished
/// ([`JobHandle::finished`]). It needs no particular runtime: any executor's waker works.
/// Dropping it forgets its waker and leaves the job running.
#[derive(Debug)]
#[must_use = "a future does nothing unless it is polled or awaited"]
pub struct JobFinished {
    state: Arc<JobState>,
    slot: Option<u64>,
}

impl Future for JobFinished {
    type Output = Vec<KeyOutcome>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.state.completion.register(&mut this.slot, cx.waker()) {
            Poll::Ready(this.state.results.lock().clone())
        } else {
            Poll::Pending
        }
    }
}

impl Drop for JobFinished {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.state.completion.unregister(slot);
        }
    }
}

impl JobHandle {
    /// A future that resolves to the results once the job has finished (at once for a job
    /// that already has, or has no keys). The worker that finishes the last key wakes it, so
    /// an async caller parks no thread per transfer. Several futures of one job may wait at
    /// once.
    pub fn finished(&self) -> JobFinished {
        JobFinished {
            state: Arc::clone(&self.state),
            slot: None,
        }
    }

    /// Runs `f` once with the results when the job finishes: at once, on this thread, when it
    /// already has (or has no keys); otherwise on the copy worker that finished its last key.
    /// `f` then holds that worker, so it must be quick and must not block (hand the results
    /// to a channel or wake a task); a panic in it is caught and logged. Callbacks run before
    /// the job reads as finished: inside one, `is_done()` is still false, `poll()` None, and a
    /// `wait()` on the same job would block until its timeout.
    pub fn on_done(&self, f: impl FnOnce(Vec<KeyOutcome>) + Send + 'static) {
        if let Some(f) = self.state.completion.add_callback(Box::new(f)) {
            f(self.state.results.lock().clone());
        }
    }
}

/// Jobs submitted on behalf of one owner (a client session, say), held weakly: a job is
/// forgotten once it has finished and nobody holds its handle. [`JobSet::cancel_all`] and
/// [`JobSet::wait_all`] reach every job still running.
#[derive(Debug, Default)]
pub struct JobSet {
    inner: Mutex<Tracked>,
}

#[derive(Debug, Default)]
struct Tracked {
    jobs: Vec<Weak<JobState>>,
    /// Length at which finished jobs are next swept out (so tracking costs O(1) amortised).
    sweep_at: usize,
}

impl JobSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tracks `job` (a job that has already finished is not kept).
    pub fn insert(&self, job: &JobHandle) {
        if job.is_done() {
            return;
        }
        let mut t = self.inner.lock();
        if t.jobs.len() >= t.sweep_at {
            t.jobs
                .retain(|w| w.upgrade().is_some_and(|j| !j.completion.is_done()));
            t.sweep_at = (t.jobs.len() * 2).max(64);
        }
        t.jobs.push(Arc::downgrade(&job.state));
    }

    /// Handles of the jobs that have not finished.
    pub fn unfinished(&self) -> Vec<JobHandle> {
        self.inner
            .lock()
            .jobs
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|j| !j.completion.is_done())
            .map(|state| JobHandle { state })
            .collect()
    }

    /// How many jobs have not finished.
    pub fn len(&self) -> usize {
        self.unfinished().len()
    }

    /// Whether every job has finished.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Asks every unfinished job to stop (see [`JobHandle::cancel`]); returns how many.
    pub fn cancel_all(&self) -> usize {
        let jobs = self.unfinished();
        for j in &jobs {
            j.cancel();
        }
        jobs.len()
    }

    /// Waits up to `timeout` in all for the unfinished jobs; returns how many still have not
    /// finished (0: all have).
    pub fn wait_all(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        self.unfinished()
            .iter()
            .filter(|j| !j.state.completion.wait_until(deadline))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::task::{Wake, Waker};
    use std::thread::{self, Thread};

    use parking_lot::Condvar;

    use umbp_core::{BlockKey, GroupLayout, KeyBuilder, LayerSpec, PoolConfig, RankTopology};
    use umbp_pool::Pool;

    use crate::{
        BlockCopy, CopyEngine, Direction, HostMover, MemoryKind, MemoryRegistry, MoveResult, Mover,
        OrderToken,
    };

    /// Copies like [`HostMover`], but only once the test opens the gate; counts the calls that
    /// have started, so a test knows a batch is being copied.
    #[derive(Debug, Default)]
    struct GatedMover {
        open: Mutex<bool>,
        cv: Condvar,
        entered: AtomicUsize,
    }

    impl GatedMover {
        fn pass(&self) {
            self.entered.fetch_add(1, Ordering::AcqRel);
            let mut open = self.open.lock();
            while !*open {
                self.cv.wait(&mut open);
            }
        }

        fn open(&self) {
            *self.open.lock() = true;
            self.cv.notify_all();
        }

        fn wait_entered(&self, n: usize) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.entered.load(Ordering::Acquire) < n {
                assert!(Instant::now() < deadline, "no batch reached the mover");
                thread::sleep(Duration::from_millis(1));
            }
        }
    }

    impl Mover for GatedMover {
        unsafe fn gather(
            &self,
            blocks: &[BlockCopy<'_>],
            after: Option<&OrderToken>,
        ) -> Vec<MoveResult> {
            self.pass();
            // SAFETY: forwarded contract.
            unsafe { HostMover.gather(blocks, after) }
        }

        unsafe fn scatter(
            &self,
            blocks: &[BlockCopy<'_>],
            after: Option<&OrderToken>,
        ) -> Vec<MoveResult> {
            self.pass();
            // SAFETY: forwarded contract.
            unsafe { HostMover.scatter(blocks, after) }
        }
    }

    /// An engine of one worker over a registered 64-block cache of 1 KiB blocks.
    struct Rig {
        engine: CopyEngine,
        gate: Arc<GatedMover>,
        layout: GroupLayout,
        keys: KeyBuilder,
        _cache: Vec<u8>,
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            // A failed assertion must not leave the worker at the gate (closing the engine
            // would wait for it forever).
            self.gate.open();
        }
    }

    impl Rig {
        fn new() -> Self {
            let pool = Arc::new(
                Pool::new(PoolConfig {
                    prefault: false,
                    ..PoolConfig::with_capacity(4 << 20)
                })
                .unwrap(),
            );
            let gate = Arc::new(GatedMover::default());
            let mover: Arc<dyn Mover> = gate.clone();
            let engine = CopyEngine::new(pool, Arc::new(MemoryRegistry::new()), mover, 1).unwrap();
            let cache = vec![7u8; 64 * 1024];
            let base = cache.as_ptr() as u64;
            // SAFETY: the cache outlives the engine (fields drop in order: engine first).
            unsafe {
                engine
                    .registry()
                    .register(base, 64 * 1024, MemoryKind::Host)
            }
            .unwrap();
            let layout = GroupLayout::new(vec![LayerSpec {
                base_addr: base,
                num_blocks: 64,
                block_stride: 1024,
                block_bytes: 1024,
            }])
            .unwrap();
            Rig {
                engine,
                gate,
                layout,
                keys: KeyBuilder::new("jobs-test", RankTopology::default()).unwrap(),
                _cache: cache,
            }
        }

        /// Stores blocks `ids` under keys named `tag` and the block id.
        fn store(&self, tag: &str, ids: &[u64]) -> JobHandle {
            let keys: Vec<BlockKey> = ids
                .iter()
                .map(|i| self.keys.key(0, format!("{tag}{i}").as_bytes()).unwrap())
                .collect();
            self.engine
                .submit(Direction::Store, keys, self.layout.plan(ids).unwrap())
                .unwrap()
        }
    }

    /// Wakes by unparking the thread that polls (and counts the wakes).
    struct Unpark {
        thread: Thread,
        wakes: AtomicUsize,
    }

    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.wakes.fetch_add(1, Ordering::AcqRel);
            self.thread.unpark();
        }
    }

    fn unpark_waker() -> (Arc<Unpark>, Waker) {
        let u = Arc::new(Unpark {
            thread: thread::current(),
            wakes: AtomicUsize::new(0),
        });
        (Arc::clone(&u), Waker::from(u))
    }

    /// Runs a future to completion on this thread, parking between polls (10 s at most).
    fn block_on<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let (_, waker) = unpark_waker();
        let mut cx = Context::from_waker(&waker);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            assert!(Instant::now() < deadline, "the future never resolved");
            thread::park_timeout(Duration::from_millis(100));
        }
    }

    #[test]
    fn an_awaited_job_resolves_when_its_last_key_finishes() {
        let rig = Rig::new();
        let job = rig.store("a", &(0..20).collect::<Vec<_>>());
        rig.gate.wait_entered(1);
        let (wakes, waker) = unpark_waker();
        let mut fut = job.finished();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        // Polling again with the same waker keeps one waker, not two.
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        assert_eq!(job.state.completion.waker_count(), 1);
        assert_eq!(wakes.wakes.load(Ordering::Acquire), 0);
        rig.gate.open();
        // The waker the future was polled with is woken (polling with another one would
        // replace it), and the future is then ready.
        let deadline = Instant::now() + Duration::from_secs(10);
        while wakes.wakes.load(Ordering::Acquire) == 0 {
            assert!(Instant::now() < deadline, "never woken");
            thread::sleep(Duration::from_millis(1));
        }
        let Poll::Ready(results) = Pin::new(&mut fut).poll(&mut cx) else {
            panic!("woken but not ready");
        };
        assert_eq!(results, vec![KeyOutcome::Done; 20]);
        assert!(job.is_done());
        assert!(job.state.completion.waker_count() == 0);
    }

    #[test]
    fn a_dropped_future_forgets_its_waker() {
        let rig = Rig::new();
        let job = rig.store("d", &[1, 2]);
        let (_, waker) = unpark_waker();
        let mut fut = job.finished();
        assert!(Pin::new(&mut fut)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        drop(fut);
        assert!(job.state.completion.waker_count() == 0);
        rig.gate.open();
        assert_eq!(block_on(job.finished()), vec![KeyOutcome::Done; 2]);
    }

    #[test]
    fn a_callback_runs_once_on_the_worker_that_finished_the_job() {
        let rig = Rig::new();
        let job = rig.store("c", &[3, 4, 5]);
        let (tx, rx) = mpsc::channel();
        job.on_done(move |r| {
            tx.send((thread::current().name().map(str::to_owned), r))
                .unwrap();
        });
        assert!(rx.try_recv().is_err(), "ran before the job finished");
        rig.gate.open();
        let (name, results) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(results, vec![KeyOutcome::Done; 3]);
        assert_eq!(name.as_deref(), Some("umbp-copy-0"));
        assert!(matches!(
            rx.recv_timeout(Duration::from_millis(50)),
            Err(mpsc::RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn a_finished_job_resolves_and_calls_back_at_once() {
        let rig = Rig::new();
        rig.gate.open();
        let job = rig.store("f", &[6, 7]);
        let want = job.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(want, vec![KeyOutcome::Done; 2]);
        let (wakes, waker) = unpark_waker();
        let mut fut = job.finished();
        match Pin::new(&mut fut).poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(r) => assert_eq!(r, want),
            Poll::Pending => panic!("a finished job's future is pending"),
        }
        assert_eq!(wakes.wakes.load(Ordering::Acquire), 0);
        let got = Arc::new(Mutex::new(None));
        let g = Arc::clone(&got);
        let me = thread::current().id();
        job.on_done(move |r| *g.lock() = Some((thread::current().id(), r)));
        assert_eq!(
            got.lock().take(),
            Some((me, want)),
            "the callback of a finished job runs at once, on the caller's thread"
        );
    }

    #[test]
    fn an_empty_job_is_finished_from_the_start() {
        let rig = Rig::new(); // the gate stays shut: nothing may reach the mover
        let job = rig.store("e", &[]);
        assert!(job.is_done());
        assert_eq!(block_on(job.finished()), Vec::<KeyOutcome>::new());
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        job.on_done(move |v| {
            assert!(v.is_empty());
            r.fetch_add(1, Ordering::AcqRel);
        });
        assert_eq!(ran.load(Ordering::Acquire), 1);
        assert_eq!(rig.gate.entered.load(Ordering::Acquire), 0);
        rig.gate.open();
    }

    #[test]
    fn a_panicking_callback_leaves_the_worker_running() {
        let rig = Rig::new();
        let job = rig.store("p", &[8]);
        job.on_done(|_| panic!("deliberate panic in a test callback"));
        let (tx, rx) = mpsc::channel();
        job.on_done(move |r| tx.send(r).unwrap());
        rig.gate.open();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            vec![KeyOutcome::Done],
            "a later callback still ran"
        );
        // The engine's only worker survived and runs the next job.
        let next = rig.store("p", &[9]);
        assert_eq!(
            next.wait(Duration::from_secs(10)).unwrap(),
            vec![KeyOutcome::Done]
        );
    }

    #[test]
    fn a_job_set_cancels_and_waits_for_its_own_jobs_only() {
        let rig = Rig::new();
        let mine = JobSet::new();
        let theirs = JobSet::new();
        // 16 keys are two batches of 8: the first is being copied (held at the gate) when
        // the set is cancelled, the second has not started.
        let running = rig.store("r", &(0..16).collect::<Vec<_>>());
        rig.gate.wait_entered(1);
        let queued = rig.store("q", &[20, 21]);
        let other = rig.store("o", &[30, 31]);
        mine.insert(&running);
        mine.insert(&queued);
        theirs.insert(&other);
        assert_eq!(mine.len(), 2);
        assert_eq!(mine.cancel_all(), 2);
        assert_eq!(
            mine.wait_all(Duration::from_millis(20)),
            2,
            "the gate holds the worker: nothing can have finished"
        );
        rig.gate.open();
        assert_eq!(mine.wait_all(Duration::from_secs(10)), 0);
        assert!(mine.is_empty());
        let r = running.poll().unwrap();
        assert_eq!(
            r[..8],
            vec![KeyOutcome::Done; 8][..],
            "the batch in flight finished"
        );
        assert_eq!(r[8..], vec![KeyOutcome::Cancelled; 8][..]);
        assert_eq!(queued.poll().unwrap(), vec![KeyOutcome::Cancelled; 2]);
        assert_eq!(
            other.wait(Duration::from_secs(10)).unwrap(),
            vec![KeyOutcome::Done; 2],
            "another set's job was not cancelled"
        );
        assert!(theirs.is_empty());
    }

    #[test]
    fn a_job_set_forgets_finished_jobs() {
        let rig = Rig::new();
        rig.gate.open();
        let set = JobSet::new();
        for i in 0..200u64 {
            let j = rig.store("s", &[i % 64]);
            set.insert(&j);
            j.wait(Duration::from_secs(10)).unwrap();
        }
        assert!(set.is_empty());
        assert!(
            set.inner.lock().jobs.len() <= 128,
            "finished jobs are swept out: {} kept",
            set.inner.lock().jobs.len()
        );
    }
}
