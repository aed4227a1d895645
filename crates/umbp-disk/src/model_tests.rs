//! Property tests: the tier against a simple model (a map of what was written), through
//! writes, removals, clears and restarts; and, at a capacity that forces segments out, that
//! whatever is found is exactly what was written.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;
use umbp_core::BlockKey;

use crate::tests::{data, key, small, tmpdir};
use crate::{DiskTier, Sink};

#[derive(Debug, Clone)]
enum Op {
    Write(u32, usize),
    Remove(u32),
    Reopen,
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..16, 0usize..20_000).prop_map(|(k, l)| Op::Write(k, l)),
        2 => (0u32..16).prop_map(Op::Remove),
        1 => Just(Op::Reopen),
        1 => Just(Op::Clear),
    ]
}

/// Promotes every one of `keys`; what came back, by key.
fn read_all(t: &DiskTier, keys: &[BlockKey]) -> HashMap<BlockKey, Vec<u8>> {
    let got = Arc::new(Mutex::new(HashMap::new()));
    let g = Arc::clone(&got);
    let sink: Sink = Arc::new(move |k: &BlockKey, b: &[u8]| {
        g.lock().insert(*k, b.to_vec());
        true
    });
    t.promote_present(keys, t.deadline(), sink);
    let out = std::mem::take(&mut *got.lock());
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn the_tier_holds_what_the_model_says(ops in proptest::collection::vec(op(), 1..40)) {
        let d = tmpdir("model");
        let mut t = Some(DiskTier::open(small(&d)).unwrap());
        // Written since the last clear (a restart brings removed ones back), and indexed now.
        let mut on_disk: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut indexed: HashSet<u32> = HashSet::new();
        for o in ops {
            let tier = t.as_ref().unwrap();
            match o {
                Op::Write(k, len) => {
                    let fresh = tier.write_now(&key(k), &data(k, len)).unwrap();
                    prop_assert_eq!(fresh, !indexed.contains(&k));
                    if fresh {
                        on_disk.insert(k, data(k, len));
                        indexed.insert(k);
                    }
                }
                Op::Remove(k) => prop_assert_eq!(tier.remove(&key(k)), indexed.remove(&k)),
                Op::Reopen => {
                    drop(t.take());
                    t = Some(DiskTier::open(small(&d)).unwrap());
                    indexed = on_disk.keys().copied().collect();
                }
                Op::Clear => {
                    prop_assert_eq!(tier.clear(), indexed.len() as u64);
                    on_disk.clear();
                    indexed.clear();
                }
            }
            let tier = t.as_ref().unwrap();
            let keys: Vec<BlockKey> = (0..16).map(key).collect();
            let got = read_all(tier, &keys);
            prop_assert_eq!(got.len(), indexed.len());
            for k in &indexed {
                prop_assert_eq!(&got[&key(*k)], &on_disk[k]);
            }
        }
        drop(t);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn under_eviction_every_hit_is_exact(lens in proptest::collection::vec(0usize..200_000, 20..120)) {
        let d = tmpdir("evict");
        let mut c = small(&d);
        c.capacity_bytes = 8 << 20;
        let t = DiskTier::open(c).unwrap();
        for (n, len) in lens.iter().enumerate() {
            t.write_now(&key(n as u32), &data(n as u32, *len)).unwrap();
        }
        let keys: Vec<BlockKey> = (0..lens.len() as u32).map(key).collect();
        let got = read_all(&t, &keys);
        // The newest object is always held; what is held is a suffix (FIFO), byte-exact.
        prop_assert!(got.contains_key(keys.last().unwrap()));
        let first = (0..lens.len()).find(|&n| got.contains_key(&keys[n])).unwrap();
        for n in first..lens.len() {
            prop_assert_eq!(&got[&keys[n]], &data(n as u32, lens[n]));
        }
        prop_assert!(t.stats().used_bytes <= 8 << 20);
        drop(t);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
