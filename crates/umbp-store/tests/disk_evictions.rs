//! Every object the pool evicts with a disk tier under it is accounted for: queued for the
//! disk, dropped (counted), or already on disk, whichever path evicted it (the background
//! watermark evictor, or a store that found the pool full and evicted synchronously, in the
//! policy's order or by emptying whole segments).

use std::sync::Arc;
use std::time::Duration;

use umbp_core::{EvictionPolicy, KeyBuilder, PoolConfig, RankTopology};
use umbp_store::{DiskConfig, EmbeddedStore, StoreConfig};

const MIB: u64 = 1 << 20;

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../target/test-disk/evictions-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.canonicalize().unwrap()
}

fn store(dir: &std::path::Path, policy: EvictionPolicy, backlog: u64, rate: u64) -> EmbeddedStore {
    let mut disk = DiskConfig::new(dir, 512 * MIB);
    disk.segment_bytes = 32 * MIB;
    disk.io_threads = 1;
    disk.write_backlog_bytes = backlog;
    disk.write_bytes_per_s = rate;
    EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: false,
            eviction_policy: policy,
            ..PoolConfig::with_capacity(32 * MIB)
        },
        disk: Some(disk),
        ..StoreConfig::default()
    })
    .unwrap()
}

/// Four writers burst 16 MiB and 1 MiB objects into a 32 MiB pool, each key twice (so that a
/// second eviction of it finds it on disk); then the pool's evictions must equal the disk
/// tier's queued + dropped + already present, exactly.
fn burst(policy: EvictionPolicy, backlog: u64, rate: u64) {
    let tag = format!("{policy:?}-{backlog}-{rate}");
    let d = tmpdir(&tag);
    let s = Arc::new(store(&d, policy, backlog, rate));
    let kb = KeyBuilder::new("evictions", RankTopology::default()).unwrap();
    let writers: Vec<_> = (0..4u32)
        .map(|w| {
            let s = Arc::clone(&s);
            let kb = kb.clone();
            std::thread::spawn(move || {
                for round in 0..2u32 {
                    for i in 0..16u32 {
                        let k = kb.key(0, &(w * 1000 + i).to_le_bytes()).unwrap();
                        let len = if i % 3 == 2 { MIB } else { 16 * MIB };
                        let byte = (w * 31 + i + round) as u8;
                        // A pool whose room is all being written or waiting for the disk
                        // answers Full (not an eviction): tried again a while.
                        let data = vec![byte; len as usize];
                        for _ in 0..1000 {
                            match s.pool().put(k, &data) {
                                Err(umbp_pool::PoolError::Full { .. }) => {
                                    std::thread::sleep(Duration::from_millis(1))
                                }
                                _ => break,
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert!(s.flush_disk(Duration::from_secs(60)), "{tag}: flush");
    let p = s.pool().stats();
    let ds = s.disk_stats().unwrap();
    println!(
        "{tag}: {} evictions = {} queued ({} copied) + {} dropped + {} on disk already",
        p.evictions, ds.evicted_queued, ds.evicted_copied, ds.evicted_dropped, ds.already_present
    );
    assert!(p.evictions > 64, "{tag}: {p:?}");
    assert_eq!(
        p.evictions,
        ds.evicted_queued + ds.evicted_dropped + ds.already_present,
        "{tag}: every eviction is queued, dropped or on disk already: {ds:?}"
    );
    assert!(ds.evicted_copied <= ds.evicted_queued, "{tag}: {ds:?}");
    assert!(ds.evicted_dropped <= ds.writes_dropped, "{tag}: {ds:?}");
    // Every queued object was written (or failed to be, counted).
    assert_eq!(ds.backlog_bytes, 0, "{tag}: {ds:?}");
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_burst_of_large_stores_into_a_small_pool_loses_no_eviction_s3fifo() {
    // A backlog that holds everything, and one that holds one object behind a slow disk.
    burst(EvictionPolicy::S3Fifo, 256 * MIB, 0);
    burst(EvictionPolicy::S3Fifo, 16 * MIB, 200_000_000);
}

#[test]
fn a_burst_of_large_stores_into_a_small_pool_loses_no_eviction_lru() {
    burst(EvictionPolicy::Lru, 256 * MIB, 0);
    burst(EvictionPolicy::Lru, 16 * MIB, 200_000_000);
}
