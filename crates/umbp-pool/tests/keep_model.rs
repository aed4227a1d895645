//! Property test of kept objects (`Pool::keep`, the pins of agents' KV): over random
//! interleavings of stores that overfill the pool, keeps and renewals, releases, removals,
//! clears of one namespace, evictions and the clock moving on, no object is ever evicted while
//! its keep lives, and the counters add up: every keep granted is released, ended with its
//! object, or runs out. The model holds, per key, when its keep runs out; the pool's answers
//! to `keep` and `release_kept` must be what the model predicts.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use umbp_core::{BlockKey, KeyBuilder, PinOutcome, PoolConfig, RankTopology};
use umbp_pool::{EvictionPolicy, Pool, PoolError};

/// The clock's steps: a case runs for well under one of real time, so the pool's clock (the
/// test's steps plus real time) and the model's agree on what ran out.
const UNIT: u64 = 20_000;
/// Keys 0..16 are namespace A's, 16..32 namespace B's.
const KEYS: u8 = 32;

fn key(i: u8) -> BlockKey {
    let ns = if i < KEYS / 2 {
        "keep-model-a"
    } else {
        "keep-model-b"
    };
    KeyBuilder::new(ns, RankTopology::default())
        .unwrap()
        .key(0, &[i, 0x4B])
        .unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, usize),
    /// Keeps the key for this many clock steps.
    Keep(u8, u64),
    Release(u8),
    Remove(u8),
    ClearA,
    EvictToLow,
    /// Stores this many new keys (outside the 32), overfilling the pool.
    Flood(u8),
    Advance(u64),
}

const SIZES: [usize; 4] = [16 << 10, 48 << 10, 100 << 10, 250 << 10];

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0..KEYS, 0..SIZES.len()).prop_map(|(k, s)| Op::Put(k, SIZES[s])),
        5 => (0..KEYS, 1u64..5).prop_map(|(k, t)| Op::Keep(k, t)),
        2 => (0..KEYS).prop_map(Op::Release),
        1 => (0..KEYS).prop_map(Op::Remove),
        1 => Just(Op::ClearA),
        1 => Just(Op::EvictToLow),
        2 => (1u8..12).prop_map(Op::Flood),
        2 => (1u64..3).prop_map(Op::Advance),
    ];
    proptest::collection::vec(op, 1..250)
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    /// When each key's keep runs out (records not yet released or ended; some ran out).
    until: HashMap<u8, u64>,
    granted: u64,
    renewed: u64,
    released: u64,
    ended: u64,
    refused: u64,
}

impl Model {
    fn live(&self, k: u8) -> bool {
        self.until.get(&k).is_some_and(|&u| u > self.now)
    }

    /// `k`'s object left the pool by a removal or a clear: a live keep ends with it.
    fn removed(&mut self, k: u8) {
        if self.live(k) {
            self.ended += 1;
        }
        self.until.remove(&k);
    }
}

fn run(ops: Vec<Op>, policy: EvictionPolicy) -> Result<(), TestCaseError> {
    let pool = Pool::new(PoolConfig {
        capacity_bytes: 1 << 20,
        segment_bytes: 64 << 10,
        // The background evictor would race the checks: off (it still sweeps every 100 ms).
        high_watermark: 1.0,
        low_watermark: 0.5,
        prefault: false,
        eviction_policy: policy,
        lookup_lease_ms: 0,
        ..PoolConfig::default()
    })
    .unwrap();
    let mut m = Model::default();
    let mut flood = 0u32;
    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            Op::Put(k, len) => match pool.put(key(k), &vec![seq as u8; len]) {
                Ok(_) | Err(PoolError::Full { .. }) => {}
                Err(e) => prop_assert!(false, "put {}: {}", k, e),
            },
            Op::Keep(k, units) => {
                let present = pool.contains(&key(k));
                let live = m.live(k);
                let got = pool.keep(&[key(k)], Duration::from_millis(units * UNIT))[0];
                match got {
                    PinOutcome::Renewed => {
                        prop_assert!(live, "key {} renewed, but its keep had run out", k);
                        m.renewed += 1;
                    }
                    PinOutcome::Pinned => {
                        prop_assert!(present && !live, "key {}: kept anew while {}", k, live);
                        m.granted += 1;
                    }
                    PinOutcome::Missing => prop_assert!(!present, "key {} is there", k),
                    PinOutcome::Refused => {
                        prop_assert!(present && !live, "key {}: refused while live", k);
                        m.refused += 1;
                    }
                }
                if matches!(got, PinOutcome::Pinned | PinOutcome::Renewed) {
                    m.until.insert(k, m.now + units * UNIT);
                }
            }
            Op::Release(k) => {
                let live = m.live(k);
                let n = pool.release_kept(&[key(k)]);
                prop_assert_eq!(n, u64::from(live), "release of key {}", k);
                if live {
                    m.released += 1;
                }
                m.until.remove(&k);
            }
            Op::Remove(k) => {
                if pool.remove(&key(k)) {
                    m.removed(k);
                }
            }
            Op::ClearA => {
                pool.clear_namespace(&key(0).namespace_id());
                for k in 0..KEYS / 2 {
                    m.removed(k);
                }
            }
            Op::EvictToLow => {
                pool.evict_to_low_watermark();
            }
            Op::Flood(n) => {
                for _ in 0..n {
                    flood += 1;
                    let k = KeyBuilder::new("keep-model-flood", RankTopology::default())
                        .unwrap()
                        .key(0, &flood.to_le_bytes())
                        .unwrap();
                    match pool.put(k, &vec![1; 64 << 10]) {
                        Ok(_) | Err(PoolError::Full { .. }) => {}
                        Err(e) => prop_assert!(false, "flood put: {}", e),
                    }
                }
            }
            Op::Advance(units) => {
                pool.advance_lease_clock(units * UNIT);
                m.now += units * UNIT;
            }
        }
        pool.check_invariants();
        // The property: nothing whose keep lives has left the pool, whatever filled it.
        for k in 0..KEYS {
            if m.live(k) {
                prop_assert!(pool.contains(&key(k)), "key {} evicted while kept", k);
            }
        }
        let a = pool.kept_bytes_of(&key(0).namespace_id());
        let b = pool.kept_bytes_of(&key(KEYS - 1).namespace_id());
        prop_assert!(
            a <= (1 << 20) / 4 && b <= (1 << 20) / 4,
            "kept {} and {}",
            a,
            b
        );
    }
    // Every keep runs out: what no holder released and no removal ended is counted expired.
    pool.advance_lease_clock(5 * UNIT);
    pool.sweep_keeps();
    let s = pool.keep_stats();
    prop_assert_eq!((s.pinned, s.pinned_bytes), (0, 0));
    prop_assert_eq!(
        (s.granted, s.renewed, s.released, s.ended, s.refused),
        (m.granted, m.renewed, m.released, m.ended, m.refused),
        "granted, renewed, released, ended, refused"
    );
    prop_assert_eq!(s.expired, m.granted - m.released - m.ended, "expired");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn no_kept_object_is_evicted_and_every_keep_is_accounted_s3fifo(ops in ops()) {
        run(ops, EvictionPolicy::S3Fifo)?;
    }

    #[test]
    fn no_kept_object_is_evicted_and_every_keep_is_accounted_lru(ops in ops()) {
        run(ops, EvictionPolicy::Lru)?;
    }
}
