//! Tests of sessions: their own regions, layouts and jobs, what dropping one releases,
//! and the store API as the default session.

use super::*;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use umbp_core::{KeyBuilder, KeyOutcome, PoolConfig, RankTopology};

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
        vec![KeyOutcome::Done]
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
    assert_eq!(st.wait(&job).unwrap(), vec![KeyOutcome::Done]);
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
        vec![KeyOutcome::Cancelled; 4]
    );
    let reg = st.shared.engine.registry();
    assert!(!reg.covers(buf_a.as_ptr() as u64, 1));
    assert!(!reg.contains(ra));
    assert!(matches!(st.layout(la), Err(StoreError::UnknownLayout(_))));
    // B is untouched: its job ran, its memory and layout are there and usable.
    assert_eq!(b.wait(&job_b).unwrap(), vec![KeyOutcome::Done; 2]);
    assert!(reg.contains(rb) && reg.covers(buf_b.as_ptr() as u64, BLOCK * BLOCKS));
    assert_eq!(b.layouts(), vec![lb]);
    let again = b.store(lb, 0, &[6], keys("b2", 1)).unwrap();
    assert_eq!(b.wait(&again).unwrap(), vec![KeyOutcome::Done]);
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
    assert_eq!(a.wait(&job).unwrap(), vec![KeyOutcome::Done]);
    let la = a.register_layout(absolute(&buf_a)).unwrap();
    let job = a.load(la, 0, &[0], k).unwrap();
    assert_eq!(a.wait(&job).unwrap(), vec![KeyOutcome::Done]);
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
        vec![KeyOutcome::Done; 2]
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
