//! Copy engine jobs over real host buffers laid out like an engine's KV cache.

use std::sync::Arc;
use std::time::Duration;

use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use umbp_copy::{
    CopyEngine, CopyError, Direction, HostMover, MemoryKind, MemoryRegistry, MoveResult,
    OrderToken, TokenOwner,
};
use umbp_core::{
    BlockKey, GroupLayout, KeyBuilder, KeyOutcome, LayerSpec, PoolConfig, RangePlan, RankTopology,
};
use umbp_pool::Pool;

const LAYERS: u64 = 4;
const BLOCKS: u64 = 64;
const PIECE: u64 = 1024;

/// A layer-first KV cache in one allocation, with its layout and registration.
struct Cache {
    buf: Vec<u8>,
    layout: GroupLayout,
}

impl Cache {
    fn new(fill: impl Fn(usize) -> u8) -> Self {
        let buf: Vec<u8> = (0..(LAYERS * BLOCKS * PIECE) as usize).map(fill).collect();
        let base = buf.as_ptr() as u64;
        let layout = GroupLayout::new(
            (0..LAYERS)
                .map(|l| LayerSpec {
                    base_addr: base + l * BLOCKS * PIECE,
                    num_blocks: BLOCKS,
                    block_stride: PIECE,
                    block_bytes: PIECE,
                })
                .collect(),
        )
        .unwrap();
        Cache { buf, layout }
    }

    fn block_bytes(&self, b: u64) -> Vec<u8> {
        (0..LAYERS)
            .flat_map(|l| {
                let at = ((l * BLOCKS + b) * PIECE) as usize;
                self.buf[at..at + PIECE as usize].to_vec()
            })
            .collect()
    }
}

fn setup(workers: usize) -> (CopyEngine, KeyBuilder) {
    let pool = Arc::new(
        Pool::new(PoolConfig {
            prefault: false,
            ..PoolConfig::with_capacity(8 << 20)
        })
        .unwrap(),
    );
    let engine = CopyEngine::new(
        pool,
        Arc::new(MemoryRegistry::new()),
        Arc::new(HostMover),
        workers,
    )
    .unwrap();
    (
        engine,
        KeyBuilder::new("copy-test", RankTopology::default()).unwrap(),
    )
}

fn register(engine: &CopyEngine, cache: &Cache) -> u64 {
    // SAFETY: the buffer outlives every job of the test and is deregistered before it drops.
    unsafe {
        engine.registry().register(
            cache.buf.as_ptr() as u64,
            cache.buf.len() as u64,
            MemoryKind::Host,
        )
    }
    .unwrap()
}

fn keys(kb: &KeyBuilder, blocks: &[u64]) -> Vec<BlockKey> {
    blocks
        .iter()
        .map(|b| kb.key(0, &b.to_le_bytes()).unwrap())
        .collect()
}

#[test]
fn store_then_load_round_trips_random_blocks() {
    let (engine, kb) = setup(4);
    let src = Cache::new(|i| (i * 31 % 251) as u8);
    let mut dst = Cache::new(|_| 0);
    let (rs, rd) = (register(&engine, &src), register(&engine, &dst));
    let mut blocks: Vec<u64> = (0..BLOCKS).collect();
    blocks.shuffle(&mut StdRng::seed_from_u64(1));
    let chosen = &blocks[..40];
    let ks = keys(&kb, chosen);
    let job = engine
        .submit(
            Direction::Store,
            ks.clone(),
            src.layout.plan(chosen).unwrap(),
        )
        .unwrap();
    let res = job.wait(Duration::from_secs(10)).unwrap();
    assert!(res.iter().all(|r| *r == KeyOutcome::Done), "{res:?}");
    // Load into other block ids of the destination cache.
    let targets: Vec<u64> = chosen.iter().map(|b| BLOCKS - 1 - b).collect();
    let job = engine
        .submit(Direction::Load, ks, dst.layout.plan(&targets).unwrap())
        .unwrap();
    assert!(job
        .wait(Duration::from_secs(10))
        .unwrap()
        .iter()
        .all(KeyOutcome::is_ok));
    for (b, t) in chosen.iter().zip(&targets) {
        assert_eq!(src.block_bytes(*b), dst.block_bytes(*t), "block {b}");
    }
    engine
        .registry()
        .deregister(rs, Duration::from_secs(1))
        .unwrap();
    engine
        .registry()
        .deregister(rd, Duration::from_secs(1))
        .unwrap();
    dst.buf.clear();
}

#[test]
fn a_layout_partly_outside_registered_memory_fails_only_the_blocks_outside() {
    let (engine, kb) = setup(2);
    let src = Cache::new(|i| (i % 251) as u8);
    // Everything but the second half of the last layer: blocks 32.. of layer 3 are outside.
    let len = (3 * BLOCKS + BLOCKS / 2) * PIECE;
    // SAFETY: the buffer outlives every job of the test.
    unsafe {
        engine
            .registry()
            .register(src.buf.as_ptr() as u64, len, MemoryKind::Host)
            .unwrap()
    };
    let ids = [1u64, 40, 2, 63];
    let res = engine
        .submit(
            Direction::Store,
            keys(&kb, &ids),
            src.layout.plan(&ids).unwrap(),
        )
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert_eq!(res[0], KeyOutcome::Done);
    assert_eq!(res[2], KeyOutcome::Done);
    for r in [&res[1], &res[3]] {
        assert!(
            matches!(r, KeyOutcome::Failed(m) if m.to_string().contains("outside registered memory")),
            "{res:?}"
        );
    }
}

#[test]
fn one_bad_key_does_not_fail_its_siblings() {
    let (engine, kb) = setup(2);
    let src = Cache::new(|i| i as u8);
    register(&engine, &src);
    // A second cache that is NOT registered: its block's ranges are out of bounds.
    let stray = Cache::new(|_| 1);
    let (mut ranges, mut starts) = src.layout.plan(&[0, 1, 2]).unwrap().to_ranges();
    let stray_ranges = stray.layout.plan(&[5]).unwrap().block(0);
    let old = ranges
        .splice(starts[1]..starts[2], stray_ranges.clone())
        .count();
    starts[2] = starts[2] - old + stray_ranges.len();
    starts[3] = starts[3] - old + stray_ranges.len();
    let plan = RangePlan::from_ranges(ranges, starts, src.layout.object_bytes()).unwrap();
    let ks = keys(&kb, &[0, 1, 2]);
    let res = engine
        .submit(Direction::Store, ks.clone(), plan)
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert_eq!(res[0], KeyOutcome::Done);
    assert!(
        matches!(&res[1], KeyOutcome::Failed(m) if m.to_string().contains("outside registered memory")),
        "{res:?}"
    );
    assert_eq!(res[2], KeyOutcome::Done);
    // Loading: the missing key reports Missing, the others load; storing again is skipped.
    let res = engine
        .submit(
            Direction::Load,
            ks.clone(),
            src.layout.plan(&[3, 4, 5]).unwrap(),
        )
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        res,
        vec![KeyOutcome::Done, KeyOutcome::Missing, KeyOutcome::Done]
    );
    let res = engine
        .submit(Direction::Store, ks, src.layout.plan(&[0, 1, 2]).unwrap())
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert_eq!(res[0], KeyOutcome::AlreadyPresent);
}

#[test]
fn size_mismatch_and_bad_arguments_are_errors() {
    let (engine, kb) = setup(1);
    let src = Cache::new(|i| i as u8);
    register(&engine, &src);
    let k = keys(&kb, &[0]);
    engine
        .submit(Direction::Store, k.clone(), src.layout.plan(&[0]).unwrap())
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    // A layout of two layers reads the same key: its object size differs.
    let half = GroupLayout::new(src.layout.layers()[..2].to_vec()).unwrap();
    let res = engine
        .submit(Direction::Load, k.clone(), half.plan(&[0]).unwrap())
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert!(
        matches!(&res[0], KeyOutcome::Failed(m) if m.to_string().contains("layout")),
        "{res:?}"
    );
    let e = engine
        .submit(Direction::Load, vec![], src.layout.plan(&[0]).unwrap())
        .unwrap_err();
    assert!(matches!(e, CopyError::InvalidRequest(_)));
}

#[test]
fn cancel_and_timeout() {
    let (engine, kb) = setup(1);
    let src = Cache::new(|i| i as u8);
    register(&engine, &src);
    let blocks: Vec<u64> = (0..BLOCKS).collect();
    // Many jobs queued on one worker: cancel the last before it runs.
    let mut handles = Vec::new();
    for round in 0..20u64 {
        let ks: Vec<BlockKey> = blocks
            .iter()
            .map(|b| kb.key(round as u32, &b.to_le_bytes()).unwrap())
            .collect();
        handles.push(
            engine
                .submit(Direction::Store, ks, src.layout.plan(&blocks).unwrap())
                .unwrap(),
        );
    }
    let last = handles.pop().unwrap();
    last.cancel();
    let res = last.wait(Duration::from_secs(30)).unwrap();
    assert!(
        res.contains(&KeyOutcome::Cancelled),
        "cancelled keys are reported"
    );
    assert!(res.iter().all(|r| *r != KeyOutcome::Pending));
    // A zero timeout on an unfinished job is a Timeout error that says it is still running.
    let ks = keys(&kb, &blocks);
    let h = engine
        .submit(Direction::Load, ks, src.layout.plan(&blocks).unwrap())
        .unwrap();
    if let Err(e) = h.wait(Duration::ZERO) {
        assert!(e.to_string().contains("still running"), "{e}");
    }
    h.wait(Duration::from_secs(30)).unwrap();
    assert!(h.poll().is_some());
}

#[test]
fn deregistration_waits_for_jobs_in_flight() {
    let (engine, kb) = setup(1);
    let src = Cache::new(|i| i as u8);
    let id = register(&engine, &src);
    let blocks: Vec<u64> = (0..BLOCKS).collect();
    let h = engine
        .submit(
            Direction::Store,
            keys(&kb, &blocks),
            src.layout.plan(&blocks).unwrap(),
        )
        .unwrap();
    // Either the job is still running (busy) or already done (deregistered); never both.
    match engine.registry().deregister(id, Duration::ZERO) {
        Ok(()) => assert!(h.is_done()),
        Err(CopyError::RegionBusy { .. }) => {
            h.wait(Duration::from_secs(30)).unwrap();
            engine
                .registry()
                .deregister(id, Duration::from_secs(1))
                .unwrap();
        }
        Err(e) => panic!("{e}"),
    }
}

/// A device mover for tests: host copies that record the tokens it sees.
#[derive(Debug, Default)]
struct RecordingMover {
    seen: parking_lot::Mutex<Vec<u64>>,
}

impl umbp_copy::Mover for RecordingMover {
    fn batch_size(&self, _object_bytes: u64, _pieces_per_block: usize) -> usize {
        3
    }

    unsafe fn gather(
        &self,
        blocks: &[umbp_copy::BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        self.seen.lock().push(after.map_or(0, OrderToken::raw));
        // SAFETY: forwarded contract (the test's "device" memory is host memory).
        unsafe { umbp_copy::Mover::gather(&HostMover, blocks, after) }
    }

    unsafe fn scatter(
        &self,
        blocks: &[umbp_copy::BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        self.seen.lock().push(after.map_or(0, OrderToken::raw));
        // SAFETY: forwarded contract.
        unsafe { umbp_copy::Mover::scatter(&HostMover, blocks, after) }
    }
}

/// Where the test's tokens go back to.
#[derive(Debug, Default)]
struct Released(parking_lot::Mutex<Vec<u64>>);

impl TokenOwner for Released {
    fn release(&self, raw: u64) {
        self.0.lock().push(raw);
    }
}

#[test]
fn device_memory_jobs_use_their_devices_mover_and_drop_their_token() {
    let (engine, kb) = setup(3);
    let src = Cache::new(|i| (i * 7 % 253) as u8);
    let mut dst = Cache::new(|_| 0);
    // "Device" memory of two devices for the engine's bookkeeping; the recording movers copy
    // it on the host.
    let (dev0, dev1) = (
        MemoryKind::Cuda { device: 0 },
        MemoryKind::Cuda { device: 1 },
    );
    // SAFETY: both buffers outlive the engine's jobs (waited below).
    let ids = unsafe {
        [
            engine
                .registry()
                .register(src.buf.as_ptr() as u64, src.buf.len() as u64, dev0),
            engine
                .registry()
                .register(dst.buf.as_ptr() as u64, dst.buf.len() as u64, dev1),
        ]
    };
    let released = Arc::new(Released::default());
    let owner: Arc<dyn TokenOwner> = released.clone();
    let token = |raw| Some(OrderToken::new(raw, Arc::clone(&owner)));
    let blocks: Vec<u64> = (0..10).collect();
    // Without a mover for the device, a device job is refused up front; its token goes back.
    let e = engine
        .submit_after(
            Direction::Store,
            keys(&kb, &blocks),
            src.layout.plan(&blocks).unwrap(),
            token(5),
        )
        .unwrap_err();
    assert!(e.to_string().contains("no mover"), "{e}");
    assert_eq!(*released.0.lock(), vec![5]);
    let m0 = Arc::new(RecordingMover::default());
    let m1 = Arc::new(RecordingMover::default());
    engine.set_device_mover(dev0, m0.clone()).unwrap();
    assert!(
        engine.set_device_mover(dev0, m1.clone()).is_err(),
        "once per device"
    );
    assert!(engine
        .set_device_mover(MemoryKind::Host, m1.clone())
        .is_err());
    engine.set_device_mover(dev1, m1.clone()).unwrap();
    let res = engine
        .submit_after(
            Direction::Store,
            keys(&kb, &blocks),
            src.layout.plan(&blocks).unwrap(),
            token(7),
        )
        .unwrap()
        .wait(Duration::from_secs(10))
        .unwrap();
    assert!(res.iter().all(|r| *r == KeyOutcome::Done), "{res:?}");
    let targets: Vec<u64> = blocks.iter().map(|b| b + 20).collect();
    let job = engine
        .submit_after(
            Direction::Load,
            keys(&kb, &blocks),
            dst.layout.plan(&targets).unwrap(),
            token(9),
        )
        .unwrap();
    let res = job.wait(Duration::from_secs(10)).unwrap();
    assert!(res.iter().all(|r| *r == KeyOutcome::Done), "{res:?}");
    for (b, t) in blocks.iter().zip(&targets) {
        assert_eq!(src.block_bytes(*b), dst.block_bytes(*t));
    }
    // Each device's mover saw only its own jobs' token; every token came back exactly once,
    // when its job finished (the handle is still alive).
    assert!(m0.seen.lock().iter().all(|t| *t == 7) && !m0.seen.lock().is_empty());
    assert!(m1.seen.lock().iter().all(|t| *t == 9) && !m1.seen.lock().is_empty());
    let mut back = released.0.lock().clone();
    back.sort_unstable();
    assert_eq!(back, vec![5, 7, 9]);
    drop(job);
    // A job mixing host and device memory fails the mixed key alone.
    let host = Cache::new(|_| 3);
    register(&engine, &host);
    let (mut ranges, starts) = src.layout.plan(&[0, 1]).unwrap().to_ranges();
    let host_ranges = host.layout.plan(&[5]).unwrap().block(0);
    // Block 1 keeps its first range (device memory) and takes the host cache's others.
    let old = ranges
        .splice(starts[1] + 1..starts[2], host_ranges[1..].to_vec())
        .count();
    assert_eq!(old, host_ranges.len() - 1, "same layer count");
    let plan = RangePlan::from_ranges(ranges, starts, src.layout.object_bytes()).unwrap();
    let res = engine
        .submit(Direction::Store, keys(&kb, &[40, 41]), plan)
        .unwrap()
        .wait(Duration::from_secs(5))
        .unwrap();
    assert_eq!(res[0], KeyOutcome::Done);
    assert!(
        matches!(&res[1], KeyOutcome::Failed(m) if m.to_string().contains("one kind")),
        "{res:?}"
    );
    for id in ids {
        engine
            .registry()
            .deregister(id.unwrap(), Duration::from_secs(1))
            .unwrap();
    }
    dst.buf.clear();
}

#[test]
fn a_store_admitted_now_is_kept_on_first_sighting_under_on_reuse() {
    use umbp_core::{Admit, StoreAdmission};
    let pool = Arc::new(
        Pool::new(PoolConfig {
            prefault: false,
            store_admission: StoreAdmission::OnReuse,
            ..PoolConfig::with_capacity(8 << 20)
        })
        .unwrap(),
    );
    let engine = CopyEngine::new(
        Arc::clone(&pool),
        Arc::new(MemoryRegistry::new()),
        Arc::new(HostMover),
        2,
    )
    .unwrap();
    let kb = KeyBuilder::new("copy-admit", RankTopology::default()).unwrap();
    let src = Cache::new(|i| (i * 7 % 253) as u8);
    let mut dst = Cache::new(|_| 0);
    let (rs, rd) = (register(&engine, &src), register(&engine, &dst));
    let wait = |job: umbp_copy::JobHandle| job.wait(Duration::from_secs(10)).unwrap();
    // As the policy says: a first sighting is skipped, nothing copied.
    let policy = engine
        .submit(
            Direction::Store,
            keys(&kb, &[0, 1]),
            src.layout.plan(&[0, 1]).unwrap(),
        )
        .unwrap();
    assert_eq!(wait(policy), vec![KeyOutcome::Skipped; 2]);
    // Admitted now: stored on first sighting, byte for byte.
    let now = engine
        .submit_as(
            Direction::Store,
            keys(&kb, &[2, 3]),
            src.layout.plan(&[2, 3]).unwrap(),
            None,
            Admit::Now,
        )
        .unwrap();
    assert_eq!(wait(now), vec![KeyOutcome::Done; 2]);
    let load = engine
        .submit(
            Direction::Load,
            keys(&kb, &[2, 3]),
            dst.layout.plan(&[12, 13]).unwrap(),
        )
        .unwrap();
    assert_eq!(wait(load), vec![KeyOutcome::Done; 2]);
    assert_eq!(src.block_bytes(2), dst.block_bytes(12));
    assert_eq!(src.block_bytes(3), dst.block_bytes(13));
    let s = pool.stats();
    assert_eq!(
        (s.objects, s.admissions_forced, s.admissions_skipped),
        (2, 2, 2)
    );
    // A load cannot ask for admission.
    let e = engine
        .submit_as(
            Direction::Load,
            keys(&kb, &[2]),
            dst.layout.plan(&[12]).unwrap(),
            None,
            Admit::Now,
        )
        .unwrap_err();
    assert!(e.to_string().contains("stores only"), "{e}");
    for r in [rs, rd] {
        engine
            .registry()
            .deregister(r, Duration::from_secs(1))
            .unwrap();
    }
    dst.buf.clear();
}
