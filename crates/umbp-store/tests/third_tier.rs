//! A tier is one file: this one keeps evicted objects in a map, and is wired into the store
//! only through the chain (`EmbeddedStore::with_tiers`). Objects the pool evicts reach it,
//! lookups fill the pool back from it byte-exact, and the store's `evict`, namespace clear,
//! full clear and close reach it, with no other code that names it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{PinnedObject, SpillKind};
use umbp_store::{EmbeddedStore, PoolFill, StoreConfig, Tier};

/// The whole tier: a map of evicted objects' bytes.
#[derive(Debug, Default)]
struct MapTier {
    objects: Mutex<HashMap<BlockKey, Vec<u8>>>,
    closed: AtomicBool,
}

impl Tier for MapTier {
    fn name(&self) -> &'static str {
        "map"
    }

    fn spill(&self, key: BlockKey, obj: PinnedObject, _kind: SpillKind) -> Option<PinnedObject> {
        // Copied, and the pin dropped here: the pool gets the memory back at once.
        self.objects.lock().insert(key, obj.as_slice().to_vec());
        None
    }

    fn fill_prefix(&self, fill: &PoolFill, keys: &[BlockKey], _deadline: Instant) -> usize {
        let objects = self.objects.lock();
        keys.iter()
            .take_while(|k| objects.get(k).is_some_and(|b| fill.put(k, b)))
            .count()
    }

    fn fill_present(&self, fill: &PoolFill, keys: &[BlockKey], _deadline: Instant) -> Vec<bool> {
        let objects = self.objects.lock();
        keys.iter()
            .map(|k| objects.get(k).is_some_and(|b| fill.put(k, b)))
            .collect()
    }

    fn forget(&self, keys: &[BlockKey]) {
        let mut objects = self.objects.lock();
        for k in keys {
            objects.remove(k);
        }
    }

    fn clear(&self) {
        self.objects.lock().clear();
    }

    fn clear_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        let mut objects = self.objects.lock();
        let before = objects.len();
        objects.retain(|k, _| k.namespace_id() != *namespace_id);
        Some((before - objects.len()) as u64)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

const OBJ: usize = 64 << 10;

fn object(i: u32) -> Vec<u8> {
    (0..OBJ)
        .map(|b| (b as u32 ^ i.wrapping_mul(2_654_435_761)) as u8)
        .collect()
}

#[test]
fn a_third_tier_wired_only_through_the_chain_keeps_and_returns_evicted_objects() {
    let tier = Arc::new(MapTier::default());
    let store = EmbeddedStore::with_tiers(
        StoreConfig {
            pool: PoolConfig {
                segment_bytes: 256 << 10,
                prefault: false,
                high_watermark: 0.5,
                low_watermark: 0.25,
                ..PoolConfig::with_capacity(4 << 20)
            },
            ..StoreConfig::default()
        },
        vec![Arc::clone(&tier) as Arc<dyn Tier>],
    )
    .unwrap();
    let kb = KeyBuilder::new("third-tier", RankTopology::default()).unwrap();
    let keys: Vec<BlockKey> = (0..192u32)
        .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
        .collect();
    // 12 MiB through a 4 MiB pool: most objects are evicted, into the tier.
    for (i, k) in keys.iter().enumerate() {
        store.pool().put(*k, &object(i as u32)).unwrap();
    }
    store.pool().evict_to_low_watermark();
    assert!(!store.pool().contains(&keys[0]), "the oldest was evicted");
    let held = tier.objects.lock().len();
    assert!(held >= 100, "the tier took the evictions: {held}");

    // A lookup fills the pool back from the tier; the bytes are the ones stored.
    assert_eq!(store.prefix_hits(&keys[..8]).unwrap(), 8);
    for (i, k) in keys[..8].iter().enumerate() {
        assert_eq!(
            store.pool().get(k).unwrap().as_slice(),
            &object(i as u32)[..]
        );
    }
    assert_eq!(store.exists(&keys[8..12]).unwrap(), vec![true; 4]);

    // The store's evict reaches it: neither the pool nor the tier answers for those keys.
    store.evict(&keys[..4]).unwrap();
    assert!(keys[..4]
        .iter()
        .all(|k| !tier.objects.lock().contains_key(k)));
    assert_eq!(store.exists(&keys[..4]).unwrap(), vec![false; 4]);

    // So does a namespace clear, and nothing comes back afterwards.
    store.clear_namespace("third-tier").unwrap();
    assert!(tier.objects.lock().is_empty());
    assert_eq!(store.prefix_hits(&keys).unwrap(), 0);

    // And the full clear, and close.
    store.pool().put(keys[0], &object(0)).unwrap();
    tier.objects.lock().insert(keys[1], object(1));
    store.clear().unwrap();
    assert!(tier.objects.lock().is_empty());
    assert_eq!(store.exists(&keys[..2]).unwrap(), vec![false; 2]);
    store.close();
    assert!(tier.closed.load(Ordering::Acquire));
}
