//! End-to-end integrity across the disk tier: an object damaged in its segment file fails
//! the disk's checksum at promotion (a miss, counted in the store's `corrupt_detected`), an
//! object damaged in DRAM is never written to disk, and every object that comes back is
//! byte-exact and carries its checksum into the pool.

use std::path::{Path, PathBuf};
use std::time::Duration;

use umbp_core::{BlockKey, Integrity, KeyBuilder, PoolConfig, RankTopology};
use umbp_store::{DiskConfig, DiskWrite, EmbeddedStore, StoreConfig};

const LEN: usize = 32 << 10;

fn tmpdir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../target/test-disk/integrity-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.canonicalize().unwrap()
}

fn store(dir: &Path, write: DiskWrite) -> EmbeddedStore {
    let mut disk = DiskConfig::new(dir, 64 << 20);
    disk.segment_bytes = 1 << 20;
    disk.io_threads = 2;
    disk.write = write;
    EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            segment_bytes: 64 << 10,
            prefault: false,
            high_watermark: 0.5,
            low_watermark: 0.25,
            integrity: Integrity::All,
            ..PoolConfig::with_capacity(4 << 20)
        },
        disk: Some(disk),
        ..StoreConfig::default()
    })
    .unwrap()
}

fn keys(n: usize) -> Vec<BlockKey> {
    let kb = KeyBuilder::new("disk-integrity", RankTopology::default()).unwrap();
    (0..n)
        .map(|i| kb.key(0, &(i as u64).to_le_bytes()).unwrap())
        .collect()
}

fn obj(i: usize) -> Vec<u8> {
    (0..LEN).map(|j| ((i * 31 + j * 3) % 253) as u8).collect()
}

#[test]
fn a_damaged_segment_file_makes_a_miss_and_every_promoted_byte_is_right() {
    let d = tmpdir("segment");
    let s = store(&d, DiskWrite::Eager);
    let ks = keys(16);
    for (i, k) in ks.iter().enumerate() {
        s.pool().put(*k, &obj(i)).unwrap();
    }
    let t = std::time::Instant::now();
    while s.disk_stats().unwrap().objects < 16 {
        assert!(t.elapsed() < Duration::from_secs(20), "eager writes");
        assert!(s.flush_disk(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(10));
    }
    // The pool forgets them (the disk keeps them); object 5 is damaged on disk.
    s.pool().clear();
    assert!(s.debug_corrupt(&ks[5], 777, 0x20, true).unwrap());
    assert!(
        !s.debug_corrupt(&keys(17)[16], 0, 1, true).unwrap(),
        "no such key"
    );
    assert_eq!(s.prefix_hits(&ks).unwrap(), 5);
    let present = s.exists(&ks).unwrap();
    assert_eq!(present, (0..16).map(|i| i != 5).collect::<Vec<_>>());
    let st = s.stats().unwrap();
    assert_eq!(
        (st.corrupt_detected, s.disk_stats().unwrap().corrupt),
        (1, 1)
    );
    for (i, k) in ks.iter().enumerate().filter(|(i, _)| *i != 5) {
        let o = s.pool().get(k).unwrap();
        assert_eq!(o.as_slice(), &obj(i)[..], "object {i}");
        assert_eq!(o.checksum(), Some(umbp_pool::checksum(&obj(i))));
        assert!(o.verify());
    }
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_object_damaged_in_dram_is_never_written_to_disk() {
    let d = tmpdir("dram");
    let s = store(&d, DiskWrite::OnEvict);
    let ks = keys(100);
    // The first object stored is damaged in the pool at once, before any eviction: S3-FIFO
    // evicts it among the first (nobody reads it), and the spill verifies it.
    s.pool().put(ks[0], &obj(0)).unwrap();
    assert!(s.debug_corrupt(&ks[0], 100, 0x01, false).unwrap());
    for (i, k) in ks.iter().enumerate().skip(1) {
        s.pool().put(*k, &obj(i)).unwrap();
    }
    s.pool().evict_to_low_watermark();
    assert!(s.flush_disk(Duration::from_secs(20)));
    assert!(!s.pool().contains(&ks[0]), "evicted");
    let ds = s.disk_stats().unwrap();
    assert!(ds.writes > 10, "{ds:?}");
    assert_eq!(s.stats().unwrap().corrupt_detected, 1);
    // Not on disk: a lookup misses it (vLLM recomputes); the others come back exact (in
    // batches that leave the pool below its high watermark, so nothing promoted is evicted
    // again before it is read).
    s.pool().clear();
    assert_eq!(s.exists(&ks[..1]).unwrap(), vec![false]);
    let mut back = 0;
    for chunk in (1..ks.len()).collect::<Vec<_>>().chunks(20) {
        s.pool().clear();
        for &i in chunk {
            if s.exists(&ks[i..=i]).unwrap()[0] {
                let o = s.pool().get(&ks[i]).unwrap();
                assert_eq!(o.as_slice(), &obj(i)[..], "object {i}");
                back += 1;
            }
        }
    }
    assert!(back > 10, "{back} objects came back from disk");
    s.close();
    std::fs::remove_dir_all(&d).unwrap();
}
