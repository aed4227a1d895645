//! Hits a lookup reports stay loadable until their load (issue 45 §3): after a restart, a
//! store whose disk tier holds the objects answers lookups by promoting them into the pool,
//! while other writers churn the pool with new objects (read once each, as reused prefixes
//! are, so S3-FIFO's main queue holds them and new, unread promotions fill its small queue);
//! every hit must load. Run with `--nocapture` for the figures, with leases and without
//! (`lookup_lease_ms` 0: then S3-FIFO evicts many promotions before their load).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{EvictionPolicy, KeyBuilder, PoolConfig, RankTopology};
use umbp_store::{DiskConfig, EmbeddedStore, StoreConfig};

const MIB: u64 = 1 << 20;
const OBJ: usize = 256 << 10;
/// Objects on disk before the restart: 256 MiB, four times the pool.
const STORED: u32 = 1024;
/// Keys of one request's lookup.
const PREFIX: u32 = 16;

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../target/test-disk/leases-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.canonicalize().unwrap()
}

fn store(dir: &std::path::Path, policy: EvictionPolicy, lease_ms: u64) -> EmbeddedStore {
    // Room for what the churn's evictions write too, so the objects stored before the
    // restart stay on disk (the oldest segment is dropped past the capacity).
    let mut disk = DiskConfig::new(dir, 4096 * MIB);
    disk.io_threads = 2;
    EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: false,
            // Room for promotions (they take free room only, never evict).
            high_watermark: 0.8,
            low_watermark: 0.5,
            eviction_policy: policy,
            lookup_lease_ms: lease_ms,
            ..PoolConfig::with_capacity(64 * MIB)
        },
        disk: Some(disk),
        ..StoreConfig::default()
    })
    .unwrap()
}

/// Hits reported, hits that did not load, and the pool's stats, for one run of `lookups`
/// requests after a restart.
fn restart_and_look_up(
    policy: EvictionPolicy,
    lease_ms: u64,
    lookups: u32,
) -> (u64, u64, umbp_pool::PoolStats) {
    let tag = format!("{policy:?}-{lease_ms}");
    let d = tmpdir(&tag);
    let kb = KeyBuilder::new("leases", RankTopology::default()).unwrap();
    let key = |i: u32| kb.key(0, &i.to_le_bytes()).unwrap();
    {
        let s = store(&d, policy, lease_ms);
        for i in 0..STORED {
            s.pool().put(key(i), &vec![i as u8; OBJ]).unwrap();
        }
        // Closing writes what the pool holds: the disk has every object.
        s.close();
    }
    let s = Arc::new(store(&d, policy, lease_ms));
    assert_eq!(
        s.disk_stats().unwrap().rebuilt_objects,
        u64::from(STORED),
        "{tag}"
    );
    // Writers churn the pool with new objects while lookups promote and loads follow.
    let stop = Arc::new(AtomicBool::new(false));
    let churned = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let (s, stop, churned, kb) = (
                Arc::clone(&s),
                Arc::clone(&stop),
                Arc::clone(&churned),
                kb.clone(),
            );
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let k = kb.key(0, &(1_000_000 * (w + 1) + i).to_le_bytes()).unwrap();
                    let _ = s.pool().put(k, &vec![7u8; OBJ]);
                    // Read once (a prefix used again): S3-FIFO keeps it in its main queue,
                    // so that new, unread objects (promotions) fill its small one.
                    drop(s.pool().get(&k));
                    churned.fetch_add(1, Ordering::Relaxed);
                    // At most 125 MB/s of new objects per writer.
                    std::thread::sleep(Duration::from_millis(2));
                    i += 1;
                }
            })
        })
        .collect();
    let (mut hits, mut lost) = (0u64, 0u64);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..lookups {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let first = (rng % u64::from(STORED - PREFIX)) as u32;
        let keys: Vec<_> = (first..first + PREFIX).map(key).collect();
        let h = s.prefix_hits(&keys).unwrap();
        // The engine schedules the request, then loads what the lookup found.
        std::thread::sleep(Duration::from_millis(20));
        for (j, k) in keys[..h].iter().enumerate() {
            hits += 1;
            match s.pool().get(k) {
                Some(obj) => assert_eq!(obj.as_slice()[0], (first + j as u32) as u8, "{tag}"),
                None => lost += 1,
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    assert!(churned.load(Ordering::Relaxed) > 0);
    let st = s.stats().unwrap();
    let ds = s.disk_stats().unwrap();
    println!(
        "{tag}: disk {} keys asked, {} promoted, {} misses, {} timeouts",
        ds.lookup_keys, ds.hits, ds.misses, ds.timeouts
    );
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
    (hits, lost, st)
}

#[test]
fn every_hit_after_a_restart_loads_while_stores_churn() {
    for policy in [EvictionPolicy::S3Fifo, EvictionPolicy::Lru] {
        for lease_ms in [0, 5000] {
            // LEASE_LOOKUPS=N: more requests, for the figure in docs/disk.md.
            let lookups = std::env::var("LEASE_LOOKUPS").map_or(200, |n| n.parse().unwrap());
            let (hits, lost, st) = restart_and_look_up(policy, lease_ms, lookups);
            println!(
                "{policy:?} lookup_lease_ms {lease_ms}: {hits} hits, {lost} not loadable \
                 ({:.3} % loadable); evictions {} (small {}), leases {} released {} expired {} \
                 refused {}",
                100.0 * (hits - lost) as f64 / hits.max(1) as f64,
                st.evictions,
                st.evictions_small,
                st.leases,
                st.leases_released,
                st.leases_expired,
                st.leases_refused
            );
            assert!(hits > 0, "{policy:?} {lease_ms}: no hits");
            if lease_ms > 0 {
                // Loads follow within the lease: none may miss.
                assert_eq!(lost, 0, "{policy:?}: {st:?}");
                assert_eq!(st.leases_expired, 0, "{policy:?}: {st:?}");
            }
        }
    }
}
