//! Property test of lookup leases: over random interleavings of lookups, stores, evictions,
//! removals, loads and the clock moving on, every hit a lookup reported loads, unless its
//! lease ran out first, and then the expiry is counted. The model keeps, per key, the leases
//! reported and when the newest runs out; the pool's counters must match it exactly.

use std::collections::HashMap;

use proptest::prelude::*;
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{EvictionPolicy, Pool, PoolError};

/// The lease, and the clock's steps: a case runs for well under a step of real time, so the
/// pool's clock (the test's steps plus real time) and the model's agree on what ran out.
const UNIT: u64 = 20_000;
const LEASE: u64 = 3 * UNIT;
const KEYS: u8 = 32;

fn key(i: u8) -> BlockKey {
    KeyBuilder::new("lease-model", RankTopology::default())
        .unwrap()
        .key(0, &[i, 0x5C])
        .unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, usize),
    /// A prefix lookup of keys `start..start + len` (wrapping).
    Prefix(u8, u8),
    /// An `exists` lookup of the keys whose bit is set.
    Exists(u32),
    /// A store followed by a lease of what it stored (as a promotion from disk does).
    Promote(u8, usize),
    Load(u8),
    Remove(u8),
    EvictToLow,
    Advance(u64),
}

const SIZES: [usize; 4] = [16 << 10, 48 << 10, 100 << 10, 250 << 10];

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0..KEYS, 0..SIZES.len()).prop_map(|(k, s)| Op::Put(k, SIZES[s])),
        3 => (0..KEYS, 1u8..8).prop_map(|(k, n)| Op::Prefix(k, n)),
        2 => any::<u32>().prop_map(Op::Exists),
        2 => (0..KEYS, 0..SIZES.len()).prop_map(|(k, s)| Op::Promote(k, SIZES[s])),
        5 => (0..KEYS).prop_map(Op::Load),
        1 => (0..KEYS).prop_map(Op::Remove),
        1 => Just(Op::EvictToLow),
        2 => (1u64..4).prop_map(Op::Advance),
    ];
    proptest::collection::vec(op, 1..300)
}

/// One key's leases in the model.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    count: u64,
    until: u64,
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    held: HashMap<u8, Held>,
    granted: u64,
    released: u64,
    expired: u64,
    ended: u64,
}

impl Model {
    /// Counts `k`'s leases as expired when they ran out.
    fn expire(&mut self, k: u8) {
        let now = self.now;
        if let Some(h) = self.held.get_mut(&k) {
            if h.count > 0 && h.until <= now {
                self.expired += h.count;
                h.count = 0;
            }
        }
    }

    fn hit(&mut self, k: u8) {
        self.expire(k);
        let h = self.held.entry(k).or_default();
        h.count += 1;
        h.until = self.now + LEASE;
        self.granted += 1;
    }

    /// Whether a load of `k` must find it.
    fn promised(&mut self, k: u8) -> bool {
        self.expire(k);
        self.held.get(&k).is_some_and(|h| h.count > 0)
    }

    fn loaded(&mut self, k: u8) {
        let h = self.held.get_mut(&k).expect("promised");
        h.count -= 1;
        self.released += 1;
    }

    fn removed(&mut self, k: u8) {
        self.expire(k);
        if let Some(h) = self.held.get_mut(&k) {
            self.ended += h.count;
            h.count = 0;
        }
    }
}

fn run(ops: Vec<Op>, policy: EvictionPolicy) -> Result<(), TestCaseError> {
    let pool = Pool::new(PoolConfig {
        capacity_bytes: 1 << 20,
        segment_bytes: 64 << 10,
        // The background evictor would race the checks of what a store may evict: off (it
        // still counts expired leases every 100 ms).
        high_watermark: 1.0,
        low_watermark: 0.5,
        prefault: false,
        eviction_policy: policy,
        lookup_lease_ms: LEASE,
        ..PoolConfig::default()
    })
    .unwrap();
    let mut m = Model::default();
    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            Op::Put(k, len) => match pool.put(key(k), &vec![seq as u8; len]) {
                Ok(_) | Err(PoolError::Full { .. }) => {}
                Err(e) => prop_assert!(false, "put {}: {}", k, e),
            },
            Op::Prefix(start, n) => {
                let ks: Vec<u8> = (0..n).map(|i| (start + i) % KEYS).collect();
                let hits = pool.prefix_hits_leased(ks.len(), |i| key(ks[i]));
                for &k in &ks[..hits] {
                    m.hit(k);
                }
            }
            Op::Exists(bits) => {
                let ks: Vec<u8> = (0..KEYS).filter(|i| bits >> i & 1 == 1).collect();
                let keys: Vec<BlockKey> = ks.iter().map(|k| key(*k)).collect();
                let found = pool.exists_many_leased(&keys);
                for (k, f) in ks.iter().zip(found) {
                    if f {
                        m.hit(*k);
                    }
                }
            }
            Op::Promote(k, len) => {
                if pool.put(key(k), &vec![seq as u8; len]).is_ok()
                    && pool.lease_prefix_with(1, |_| key(k)) == 1
                {
                    m.hit(k);
                }
            }
            Op::Load(k) => {
                let must = m.promised(k);
                let got = pool.get(&key(k));
                if must {
                    prop_assert!(
                        got.is_some(),
                        "key {} was reported and leased, not loadable",
                        k
                    );
                    m.loaded(k);
                }
            }
            Op::Remove(k) => {
                if pool.remove(&key(k)) {
                    m.removed(k);
                }
            }
            Op::EvictToLow => {
                pool.evict_to_low_watermark();
            }
            Op::Advance(units) => {
                pool.advance_lease_clock(units * UNIT);
                m.now += units * UNIT;
            }
        }
        pool.check_invariants();
    }
    // Every lease runs out: what no load used is counted as expired.
    pool.advance_lease_clock(LEASE);
    m.now += LEASE;
    pool.sweep_leases();
    for k in 0..KEYS {
        m.expire(k);
    }
    let s = pool.stats();
    prop_assert_eq!(
        (
            s.leases,
            s.leases_released,
            s.leases_expired,
            s.leases_ended
        ),
        (m.granted, m.released, m.expired, m.ended),
        "granted, released, expired, ended"
    );
    prop_assert_eq!((s.leases_active, s.leased_bytes), (0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_reported_hit_loads_unless_its_lease_ran_out_s3fifo(ops in ops()) {
        run(ops, EvictionPolicy::S3Fifo)?;
    }

    #[test]
    fn every_reported_hit_loads_unless_its_lease_ran_out_lru(ops in ops()) {
        run(ops, EvictionPolicy::Lru)?;
    }
}
