//! Property tests: the pool (allocator + index + eviction) against a simple reference model.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{
    CommitOutcome, EvictionPolicy, PinnedObject, Pool, PoolError, PoolEvent, StoreAdmission,
};

fn key(i: u8) -> BlockKey {
    KeyBuilder::new("model", RankTopology::default())
        .unwrap()
        .key(0, &[i, 0xA5])
        .unwrap()
}

/// Content written by the `seq`-th put of key `k`.
fn content(k: u8, seq: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (k as u32 ^ seq.wrapping_mul(31) ^ (i as u32 * 7)) as u8)
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, usize),
    Get(u8),
    Unpin(usize),
    Remove(u8),
    Clear,
    EvictToLow,
}

fn ops(sizes: &'static [usize]) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0u8..48, 0..sizes.len()).prop_map(move |(k, s)| Op::Put(k, sizes[s])),
        3 => (0u8..48).prop_map(Op::Get),
        2 => (0usize..8).prop_map(Op::Unpin),
        1 => (0u8..48).prop_map(Op::Remove),
        1 => Just(Op::Clear),
        1 => Just(Op::EvictToLow),
    ];
    proptest::collection::vec(op, 1..300)
}

/// The model's pool with `eviction_policy` and `store_admission` (the default admission
/// window, which the model never fills).
fn config(eviction_policy: EvictionPolicy, store_admission: StoreAdmission) -> PoolConfig {
    // High watermark 1.0: the background evictor never runs, so every eviction is one the
    // model can predict (synchronous, or EvictToLow).
    PoolConfig {
        capacity_bytes: 1 << 20,
        segment_bytes: 64 << 10,
        high_watermark: 1.0,
        low_watermark: 0.5,
        prefault: false,
        eviction_policy,
        store_admission,
        ..PoolConfig::default()
    }
}

/// The reference model.
#[derive(Default)]
struct Model {
    /// Present keys with their content, and LRU order (oldest first).
    data: HashMap<u8, Vec<u8>>,
    lru: Vec<u8>,
    /// Pins held: key, expected content, handle.
    pins: Vec<(u8, Vec<u8>, PinnedObject)>,
    /// With `on_reuse`: keys seen (put or missed) at least once; the window never fills here.
    seen: HashSet<u8>,
}

impl Model {
    fn touch(&mut self, k: u8) {
        self.lru.retain(|&x| x != k);
        self.lru.push(k);
    }
    fn drop_key(&mut self, k: u8) {
        self.data.remove(&k);
        self.lru.retain(|&x| x != k);
    }
    /// Keys whose current object is pinned (a pin on an object since removed does not count:
    /// contents are unique per put, so they identify the object).
    fn pinned(&self) -> HashSet<u8> {
        self.pins
            .iter()
            .filter(|p| self.data.get(&p.0) == Some(&p.1))
            .map(|p| p.0)
            .collect()
    }
}

/// Runs `ops` against a pool of `cfg` and the model; `exact_lru`: every eviction must be
/// the least recently used unpinned key (LRU with one object size). Every policy: no pinned
/// or absent key is evicted, and the pool is never full while an unpinned object is left.
fn run(ops: Vec<Op>, cfg: PoolConfig, exact_lru: bool) -> Result<(), TestCaseError> {
    let on_reuse = cfg.store_admission == StoreAdmission::OnReuse;
    let pool = Pool::new(cfg).unwrap();
    let events = pool.subscribe(1 << 16);
    let mut m = Model::default();
    let mut skipped = 0;
    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            Op::Put(k, len) => {
                let data = content(k, seq as u32, len);
                let admitted = !on_reuse || m.data.contains_key(&k) || !m.seen.insert(k);
                match pool.put(key(k), &data) {
                    Ok(CommitOutcome::Skipped) => {
                        prop_assert!(!admitted, "key {} skipped though seen before", k);
                        skipped += 1;
                    }
                    Ok(CommitOutcome::Stored) => {
                        prop_assert!(admitted, "key {} stored on first sight", k);
                        prop_assert!(!m.data.contains_key(&k));
                        m.data.insert(k, data);
                        m.touch(k);
                    }
                    Ok(CommitOutcome::AlreadyPresent) => prop_assert!(m.data.contains_key(&k)),
                    Err(PoolError::Full { .. }) => {
                        // Allowed only when everything still stored is pinned.
                        let pinned = m.pinned();
                        prop_assert!(
                            m.data.keys().all(|k| pinned.contains(k)),
                            "pool full while unpinned objects could be evicted"
                        );
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Get(k) => match pool.get(&key(k)) {
                Some(pin) => {
                    let expect = m.data.get(&k).cloned();
                    prop_assert_eq!(Some(pin.as_slice().to_vec()), expect.clone());
                    m.touch(k);
                    if m.pins.len() < 8 {
                        m.pins.push((k, expect.unwrap(), pin));
                    }
                }
                None => {
                    prop_assert!(!m.data.contains_key(&k));
                    m.seen.insert(k);
                }
            },
            Op::Unpin(i) => {
                if i < m.pins.len() {
                    let (_, expect, pin) = m.pins.swap_remove(i);
                    prop_assert_eq!(pin.as_slice(), &expect[..], "pinned bytes changed");
                }
            }
            Op::Remove(k) => {
                prop_assert_eq!(pool.remove(&key(k)), m.data.contains_key(&k));
                m.drop_key(k);
            }
            Op::Clear => {
                pool.clear();
                m.data.clear();
                m.lru.clear();
            }
            Op::EvictToLow => {
                pool.evict_to_low_watermark();
            }
        }
        // Apply the evictions the pool reported, checking each against the model.
        let pinned = m.pinned();
        for ev in events.try_iter() {
            if let PoolEvent::Removed {
                key: kk,
                cause: umbp_pool::RemoveCause::Evicted,
            } = ev
            {
                let k = (0..48u8).find(|&i| key(i) == kk).expect("known key");
                prop_assert!(!pinned.contains(&k), "evicted pinned key {}", k);
                prop_assert!(m.data.contains_key(&k), "evicted absent key {}", k);
                if exact_lru {
                    let oldest = m.lru.iter().copied().find(|x| !pinned.contains(x));
                    prop_assert_eq!(Some(k), oldest, "eviction is not in LRU order");
                }
                m.drop_key(k);
            }
        }
        // The pool holds exactly the model's keys, with the model's bytes.
        let keys: Vec<BlockKey> = (0..48).map(key).collect();
        let present = pool.exists_many(&keys);
        for i in 0..48u8 {
            prop_assert_eq!(present[i as usize], m.data.contains_key(&i), "key {}", i);
        }
        let s = pool.stats();
        prop_assert_eq!(s.objects as usize, m.data.len());
        prop_assert_eq!(s.admissions_skipped, skipped);
        prop_assert_eq!(s.evictions, s.evictions_small + s.evictions_main);
        prop_assert!(s.used_bytes <= s.capacity_bytes);
        pool.check_invariants();
    }
    for (k, expect, pin) in m.pins.drain(..) {
        prop_assert_eq!(pin.as_slice(), &expect[..], "pinned bytes of {} changed", k);
    }
    prop_assert_eq!(pool.stats().pinned, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// One object size: eviction must be exact LRU over unpinned objects.
    #[test]
    fn uniform_sizes_match_the_model_with_exact_lru(ops in ops(&[30_000])) {
        run(ops, config(EvictionPolicy::Lru, StoreAdmission::All), true)?;
    }

    /// Mixed sizes, spans included: contents, presence, pins and accounting match the model.
    #[test]
    fn mixed_sizes_match_the_model(ops in ops(&[100, 5_000, 30_000, 64 << 10, 150_000])) {
        run(ops, config(EvictionPolicy::Lru, StoreAdmission::All), false)?;
    }

    /// S3-FIFO keeps the pool's invariants: pinned objects stay, contents and accounting match.
    /// (Its order is checked against a reference S3-FIFO in the policy's own tests.)
    #[test]
    fn s3fifo_uniform_sizes_match_the_model(ops in ops(&[30_000])) {
        run(ops, config(EvictionPolicy::S3Fifo, StoreAdmission::All), false)?;
    }

    #[test]
    fn s3fifo_mixed_sizes_match_the_model(
        ops in ops(&[100, 5_000, 30_000, 64 << 10, 150_000]),
    ) {
        run(ops, config(EvictionPolicy::S3Fifo, StoreAdmission::All), false)?;
    }

    /// `on_reuse` stores exactly the keys seen before, and LRU stays exact under it.
    #[test]
    fn on_reuse_admission_matches_the_model_with_exact_lru(ops in ops(&[30_000])) {
        run(ops, config(EvictionPolicy::Lru, StoreAdmission::OnReuse), true)?;
    }

    #[test]
    fn s3fifo_with_on_reuse_matches_the_model(
        ops in ops(&[100, 5_000, 30_000, 64 << 10, 150_000]),
    ) {
        run(ops, config(EvictionPolicy::S3Fifo, StoreAdmission::OnReuse), false)?;
    }
}

/// Long churn of mixed sizes through the pool (with its eviction): no allocation ever fails
/// while nothing is pinned, and the memory stays usable (high occupancy by live objects).
#[test]
fn mixed_size_churn_through_the_pool_never_strands_memory() {
    let pool = Pool::new(PoolConfig {
        capacity_bytes: 16 << 20,
        segment_bytes: 256 << 10,
        prefault: false,
        ..PoolConfig::default()
    })
    .unwrap();
    let kb = KeyBuilder::new("churn", RankTopology::default()).unwrap();
    let sizes = [
        2u64 << 10,
        12 << 10,
        64 << 10,
        96 << 10,
        200 << 10,
        700 << 10,
    ];
    let mut min_occupancy = 1.0f64;
    for i in 0u64..60_000 {
        let phase = (i / 6_000) as usize % sizes.len();
        let size = if i % 3 == 0 {
            sizes[(i as usize / 3) % sizes.len()]
        } else {
            sizes[phase]
        };
        let k = kb.key(0, &i.to_le_bytes()).unwrap();
        let mut r = pool
            .reserve(size)
            .unwrap_or_else(|e| panic!("allocation {i} of {size} bytes failed: {e}"));
        r.as_mut_slice()[0] = 1;
        pool.commit(r, k);
        if i > 10_000 && i % 1000 == 0 {
            let s = pool.stats();
            min_occupancy = min_occupancy.min(s.used_bytes as f64 / s.capacity_bytes as f64);
        }
    }
    pool.check_invariants();
    println!("minimum occupancy under churn: {min_occupancy:.2}");
    assert!(
        min_occupancy > 0.5,
        "memory stranded: occupancy fell to {min_occupancy:.2}"
    );
}
