//! A store hands its pool over to another store (as the standalone server does when a newer
//! one takes over): the taker serves every object byte-exact from the same memory, with the
//! disk tier's directory released to it and nothing written out on the way.

use std::sync::Arc;

use umbp_core::{BlockKey, KeyBuilder, MemoryBacking, PoolConfig, RankTopology};
use umbp_store::{DiskConfig, EmbeddedStore, StoreConfig, StoreError};

const OBJ: usize = 96 << 10;

fn object(i: u32) -> Vec<u8> {
    (0..OBJ)
        .map(|b| (b as u32 ^ i.wrapping_mul(2_654_435_761) ^ (b as u32 >> 9)) as u8)
        .collect()
}

fn cfg(disk: Option<&std::path::Path>, backing: MemoryBacking) -> StoreConfig {
    StoreConfig {
        pool: PoolConfig {
            segment_bytes: 1 << 20,
            prefault: false,
            backing,
            ..PoolConfig::with_capacity(32 << 20)
        },
        disk: disk.map(|d| DiskConfig::new(d, 64 << 20)),
        num_workers: 2,
        ..StoreConfig::default()
    }
}

fn keys(n: u32) -> Vec<BlockKey> {
    let kb = KeyBuilder::new("store-handover", RankTopology::default()).unwrap();
    (0..n)
        .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
        .collect()
}

#[test]
fn a_store_takes_over_another_stores_pool_and_its_disk_directory() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../target/test-disk/handover-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir = dir.canonicalize().unwrap();
    let giver = EmbeddedStore::new(cfg(Some(&dir), MemoryBacking::Memfd)).unwrap();
    let ks = keys(200);
    for (i, k) in ks.iter().enumerate() {
        giver.pool().put(*k, &object(i as u32)).unwrap();
    }
    let live: Vec<usize> = (0..ks.len())
        .filter(|&i| giver.pool().contains(&ks[i]))
        .collect();
    assert!(live.len() > 150, "{}", live.len());
    let writes_before = giver.disk_stats().unwrap().writes;
    let (fd, image) = giver.hand_over(0).unwrap();
    // The giver is closed; it wrote nothing out on the way (the objects stay in memory).
    assert!(matches!(giver.stats(), Err(StoreError::Closed)) || giver.check_open().is_err());
    assert_eq!(giver.disk_stats().map(|d| d.writes), Some(writes_before));
    let bytes = image.encode();
    // The disk directory is free for the taker (its lock released by the hand-over).
    let (taker, got) =
        EmbeddedStore::adopt(cfg(Some(&dir), MemoryBacking::Memfd), fd, &bytes).unwrap();
    drop(giver);
    assert_eq!(got.objects, live.len() as u64);
    for &i in &live {
        assert_eq!(
            taker
                .pool()
                .get(&ks[i])
                .expect("an object was lost")
                .as_slice(),
            &object(i as u32)[..],
            "object {i}"
        );
    }
    // Lookups and stores go on through the taker's tiers.
    assert_eq!(taker.exists(&[ks[live[0]]]).unwrap(), vec![true]);
    let more = Arc::new(keys(400));
    for (i, k) in more.iter().enumerate().skip(200) {
        taker.pool().put(*k, &object(i as u32)).unwrap();
    }
    assert!(taker.stats().unwrap().evictions > 0);
    taker.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_anonymous_pool_is_not_handed_over_and_its_store_goes_on() {
    let s = EmbeddedStore::new(cfg(None, MemoryBacking::Anonymous)).unwrap();
    let k = keys(1);
    s.pool().put(k[0], &object(0)).unwrap();
    match s.hand_over(0) {
        Err(e) => assert!(e.to_string().contains("memfd"), "{e}"),
        Ok(_) => panic!("handed over"),
    }
    assert_eq!(s.exists(&k).unwrap(), vec![true]);
}
