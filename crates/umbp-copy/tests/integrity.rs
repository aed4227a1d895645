//! End-to-end integrity through the copy engine: a store sums each object while the host
//! mover copies it, a load verifies before copying out, and a damaged object fails its load
//! (nothing copied), is removed and counted, while every byte that is loaded is right.

use std::sync::Arc;
use std::time::Duration;

use umbp_copy::{CopyEngine, Direction, HostMover, MemoryKind, MemoryRegistry};
use umbp_core::{
    BlockKey, FailureKind, GroupLayout, Integrity, KeyBuilder, KeyOutcome, LayerSpec, PoolConfig,
    RankTopology,
};
use umbp_pool::Pool;

const LAYERS: u64 = 3;
const BLOCKS: u64 = 32;
const PIECE: u64 = 4096 + 512;

/// A layer-first cache: each block is one piece per layer, so an object is three ranges.
struct Cache {
    buf: Vec<u8>,
    layout: GroupLayout,
}

impl Cache {
    fn new(fill: impl Fn(usize) -> u8) -> Cache {
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

    fn block(&self, b: u64) -> Vec<u8> {
        (0..LAYERS)
            .flat_map(|l| {
                let at = ((l * BLOCKS + b) * PIECE) as usize;
                self.buf[at..at + PIECE as usize].to_vec()
            })
            .collect()
    }
}

fn engine(integrity: Integrity) -> CopyEngine {
    let pool = Pool::new(PoolConfig {
        prefault: false,
        integrity,
        ..PoolConfig::with_capacity(16 << 20)
    })
    .unwrap();
    CopyEngine::new(
        Arc::new(pool),
        Arc::new(MemoryRegistry::new()),
        Arc::new(HostMover),
        2,
    )
    .unwrap()
}

fn register(engine: &CopyEngine, cache: &Cache) {
    // SAFETY: the buffer outlives the engine's jobs (each test waits for its jobs).
    unsafe {
        engine.registry().register(
            cache.buf.as_ptr() as u64,
            cache.buf.len() as u64,
            MemoryKind::Host,
        )
    }
    .unwrap();
}

fn keys(n: u64) -> Vec<BlockKey> {
    let kb = KeyBuilder::new("integrity", RankTopology::default()).unwrap();
    (0..n)
        .map(|b| kb.key(0, &b.to_le_bytes()).unwrap())
        .collect()
}

fn run(engine: &CopyEngine, dir: Direction, cache: &Cache, blocks: &[u64]) -> Vec<KeyOutcome> {
    let ks: Vec<BlockKey> = blocks.iter().map(|&b| keys(BLOCKS)[b as usize]).collect();
    engine
        .submit(dir, ks, cache.layout.plan(blocks).unwrap())
        .unwrap()
        .wait(Duration::from_secs(20))
        .unwrap()
}

#[test]
fn stores_keep_the_sum_of_the_bytes_the_host_mover_copied() {
    let e = engine(Integrity::All);
    let src = Cache::new(|i| (i * 13 % 251) as u8);
    register(&e, &src);
    let all: Vec<u64> = (0..BLOCKS).collect();
    assert!(run(&e, Direction::Store, &src, &all)
        .iter()
        .all(|r| *r == KeyOutcome::Done));
    for (b, k) in keys(BLOCKS).iter().enumerate() {
        let o = e.pool().peek(k).unwrap();
        assert_eq!(o.as_slice(), &src.block(b as u64)[..]);
        assert_eq!(
            o.checksum(),
            Some(umbp_pool::checksum(&src.block(b as u64)))
        );
    }
}

#[test]
fn a_damaged_object_fails_its_load_and_every_loaded_byte_is_right() {
    let e = engine(Integrity::All);
    let src = Cache::new(|i| (i * 7 % 253) as u8);
    let dst = Cache::new(|_| 0xEE);
    register(&e, &src);
    register(&e, &dst);
    let all: Vec<u64> = (0..BLOCKS).collect();
    run(&e, Direction::Store, &src, &all);
    let damaged = [3u64, 17, 31];
    for (n, &b) in damaged.iter().enumerate() {
        // One bit, in each of the three layers' pieces in turn.
        let at = n as u64 * PIECE + 1000;
        assert!(e.pool().debug_corrupt(&keys(BLOCKS)[b as usize], at, 0x10));
    }
    let out = run(&e, Direction::Load, &dst, &all);
    for (b, r) in out.iter().enumerate() {
        let b = b as u64;
        if damaged.contains(&b) {
            assert!(
                matches!(r, KeyOutcome::Failed(f) if f.kind == FailureKind::Corrupt),
                "block {b}: {r:?}"
            );
            // Nothing was copied out of it.
            assert!(dst.block(b).iter().all(|&x| x == 0xEE), "block {b}");
        } else {
            assert_eq!(*r, KeyOutcome::Done, "block {b}");
            assert_eq!(dst.block(b), src.block(b), "block {b}");
        }
    }
    let s = e.pool().stats();
    assert_eq!((s.verified, s.corrupt_detected), (BLOCKS, 3));
    assert_eq!(s.objects, BLOCKS - 3, "the damaged objects are removed");
    // A second load misses them (vLLM would have recomputed and stored them again).
    let again = run(&e, Direction::Load, &dst, &damaged);
    assert!(again.iter().all(|r| *r == KeyOutcome::Missing), "{again:?}");
    // Stored again, they load.
    run(&e, Direction::Store, &src, &damaged);
    let back = run(&e, Direction::Load, &dst, &damaged);
    assert!(back.iter().all(|r| *r == KeyOutcome::Done));
    for b in damaged {
        assert_eq!(dst.block(b), src.block(b));
    }
}

#[test]
fn sampling_verifies_one_load_in_n_and_off_verifies_none() {
    let sample = engine(Integrity::Sample { every: 4 });
    let off = engine(Integrity::Off);
    for e in [&sample, &off] {
        let src = Cache::new(|i| (i * 3 % 249) as u8);
        let dst = Cache::new(|_| 0);
        register(e, &src);
        register(e, &dst);
        let all: Vec<u64> = (0..BLOCKS).collect();
        run(e, Direction::Store, &src, &all);
        let out = run(e, Direction::Load, &dst, &all);
        assert!(out.iter().all(|r| *r == KeyOutcome::Done));
    }
    assert_eq!(sample.pool().stats().verified, BLOCKS / 4);
    assert_eq!(off.pool().stats().verified, 0);
    assert_eq!(off.pool().peek(&keys(1)[0]).unwrap().checksum(), None);
}
