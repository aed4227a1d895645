//! The tier on real files: write-behind and promotion byte-exact, restart, damage, capacity,
//! and the failures the tier must survive.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::{DiskConfig, DiskError, DiskTier, Queued, Sink};

pub(crate) fn key(n: u32) -> BlockKey {
    let mut b = [0u8; 64];
    b[..4].copy_from_slice(&n.to_le_bytes());
    b[60..].copy_from_slice(&n.wrapping_mul(0x9e37_79b9).to_le_bytes());
    BlockKey::from_bytes(b)
}

pub(crate) fn data(n: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8)
        .collect()
}

/// A fresh directory under the target dir (a real file system, unlike a tmpfs /tmp).
pub(crate) fn tmpdir(tag: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-disk");
    let d = base.join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.canonicalize().unwrap()
}

pub(crate) fn small(dir: &Path) -> DiskConfig {
    let mut c = DiskConfig::new(dir, 64 << 20);
    c.segment_bytes = 1 << 20;
    c.io_threads = 2;
    c
}

/// What a test sink was handed, by key.
pub(crate) type Kept = Arc<Mutex<HashMap<BlockKey, Vec<u8>>>>;

/// A sink that keeps what it is handed.
pub(crate) fn keeper() -> (Sink, Kept) {
    let got = Arc::new(Mutex::new(HashMap::new()));
    let g = Arc::clone(&got);
    let sink: Sink = Arc::new(move |k: &BlockKey, b: &[u8]| {
        g.lock().insert(*k, b.to_vec());
        true
    });
    (sink, got)
}

#[test]
fn written_behind_and_promoted_back_byte_exact() {
    let d = tmpdir("roundtrip");
    let t = DiskTier::open(small(&d)).unwrap();
    for n in 0..20 {
        let obj = Box::new(data(n, 1000 + 4096 * n as usize));
        assert_eq!(t.enqueue(key(n), obj), Queued::Queued);
    }
    assert!(t.flush(Duration::from_secs(10)));
    assert_eq!(t.enqueue(key(3), Box::new(data(3, 10))), Queued::Present);
    let keys: Vec<BlockKey> = (0..25).map(key).collect();
    let (sink, got) = keeper();
    assert_eq!(t.promote_prefix(&keys, t.deadline(), sink), 20);
    let got = got.lock();
    for n in 0..20 {
        assert_eq!(
            got[&key(n)],
            data(n, 1000 + 4096 * n as usize),
            "object {n}"
        );
    }
    let s = t.stats();
    assert_eq!((s.writes, s.hits, s.misses, s.objects), (20, 20, 5, 20));
    assert_eq!(s.direct_io, 1, "ext4 takes O_DIRECT");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_restart_rebuilds_the_index() {
    let d = tmpdir("restart");
    {
        let t = DiskTier::open(small(&d)).unwrap();
        for n in 0..50 {
            assert!(t.write_now(&key(n), &data(n, 3000)).unwrap());
        }
        assert!(t.remove(&key(0)));
    }
    let t = DiskTier::open(small(&d)).unwrap();
    let s = t.stats();
    // A removal is forgotten at restart (its bytes are still valid): the object is back.
    assert_eq!((s.rebuilt_objects, s.objects), (50, 50));
    let (sink, got) = keeper();
    let keys: Vec<BlockKey> = (0..50).map(key).collect();
    assert_eq!(t.promote_present(&keys, t.deadline(), sink), vec![true; 50]);
    assert_eq!(got.lock()[&key(49)], data(49, 3000));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn restarts_go_on_filling_the_newest_segment_and_lose_nothing() {
    let d = tmpdir("resume");
    let mut c = small(&d);
    c.capacity_bytes = 8 << 20; // 8 segments of 1 MiB (the smallest tier)
                                // 20 restarts, 5 objects of 8 KiB (+ header) each: 100 objects, 1.2 MiB. A fresh segment
                                // per start would have made 21 and dropped the oldest 13 with their objects.
    for round in 0..20u32 {
        let t = DiskTier::open(c.clone()).unwrap();
        let s = t.stats();
        assert_eq!(s.rebuilt_objects, u64::from(round) * 5, "round {round}");
        for n in round * 5..round * 5 + 5 {
            assert!(t.write_now(&key(n), &data(n, 8192)).unwrap());
        }
    }
    let t = DiskTier::open(c).unwrap();
    let s = t.stats();
    assert_eq!((s.objects, s.segments_evicted), (100, 0), "{s:?}");
    assert!(s.used_bytes <= 2 << 20, "two segments hold it all: {s:?}");
    let keys: Vec<BlockKey> = (0..100).map(key).collect();
    let (sink, got) = keeper();
    assert_eq!(
        t.promote_present(&keys, t.deadline(), sink),
        vec![true; 100]
    );
    let got = got.lock();
    for n in 0..100 {
        assert_eq!(got[&key(n)], data(n, 8192), "object {n}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A tier in a fresh directory `tag` holding key 1 (100 bytes), closed, then half of an index
/// record of key 2 appended to its index file (a crash mid-append); the directory and the
/// open index file (for more appends).
fn one_object_and_a_torn_record(tag: &str) -> (PathBuf, std::fs::File) {
    use std::io::Write;
    let d = tmpdir(tag);
    {
        let t = DiskTier::open(small(&d)).unwrap();
        t.write_now(&key(1), &data(1, 100)).unwrap();
    }
    let idx = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "idx") && std::fs::metadata(p).unwrap().len() > 64
        })
        .unwrap();
    let rec = crate::format::Record {
        key: key(2),
        offset: 8192,
        len: 100,
    };
    let mut f = std::fs::OpenOptions::new().append(true).open(&idx).unwrap();
    f.write_all(&rec.encode()[..60]).unwrap();
    (d, f)
}

#[test]
fn a_resumed_segment_appends_after_a_torn_record_and_keeps_both_sides() {
    let (d, f) = one_object_and_a_torn_record("resume-torn");
    drop(f);
    {
        // Resumed: the torn tail is cut off, the next object's record lands whole.
        let t = DiskTier::open(small(&d)).unwrap();
        assert_eq!(t.stats().objects, 1);
        t.write_now(&key(3), &data(3, 100)).unwrap();
    }
    let t = DiskTier::open(small(&d)).unwrap();
    let (sink, got) = keeper();
    let hits = t.promote_present(&[key(1), key(2), key(3)], t.deadline(), sink);
    assert_eq!(hits, vec![true, false, true]);
    assert_eq!(got.lock()[&key(3)], data(3, 100));
    assert_eq!(t.stats().corrupt, 0);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_second_process_on_the_directory_is_refused() {
    let d = tmpdir("inuse");
    let _t = DiskTier::open(small(&d)).unwrap();
    let e = DiskTier::open(small(&d)).unwrap_err();
    assert!(matches!(e, DiskError::InUse { .. }), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Flips a byte of every segment file at `offset`.
fn damage(dir: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name().to_str().unwrap().ends_with(".dat") {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(e.path())
                .unwrap();
            let mut b = [0u8];
            f.read_at(&mut b, offset).unwrap();
            b[0] ^= 0x5a;
            f.write_at(&b, offset).unwrap();
        }
    }
}

#[test]
fn a_damaged_object_is_a_miss_and_leaves_the_index() {
    let d = tmpdir("corrupt");
    {
        let t = DiskTier::open(small(&d)).unwrap();
        t.write_now(&key(1), &data(1, 5000)).unwrap();
        t.write_now(&key(2), &data(2, 5000)).unwrap();
    }
    // The first object's bytes (after its 4 KiB header): a checksum mismatch.
    damage(&d, 4096 + 100);
    let t = DiskTier::open(small(&d)).unwrap();
    let (sink, got) = keeper();
    let hits = t.promote_present(&[key(1), key(2)], t.deadline(), sink);
    assert_eq!(hits, vec![false, true]);
    assert!(!got.lock().contains_key(&key(1)));
    let s = t.stats();
    assert_eq!((s.corrupt, s.objects), (1, 1));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_torn_index_record_and_a_torn_object_are_misses() {
    use std::io::Write;
    // A crash while appending a record: half of one at the end of the index file.
    let (d, mut f) = one_object_and_a_torn_record("torn");
    // And a whole record of an object whose bytes never reached the disk.
    let rec3 = crate::format::Record {
        key: key(3),
        offset: 8192,
        len: 100,
    };
    f.write_all(&rec3.encode()).unwrap();
    drop(f);
    let t = DiskTier::open(small(&d)).unwrap();
    let (sink, _) = keeper();
    let hits = t.promote_present(&[key(1), key(2), key(3)], t.deadline(), sink);
    // Key 2's record is torn (skipped); key 3's record lands mid-record after the torn half
    // and fails its checksum too, or points at bytes that fail theirs: either way a miss.
    assert_eq!(hits, vec![true, false, false]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn past_the_capacity_the_oldest_segments_go() {
    let d = tmpdir("fifo");
    let mut c = small(&d);
    c.capacity_bytes = 8 << 20; // 8 segments of 1 MiB
    let t = DiskTier::open(c).unwrap();
    // 200 objects of 64 KiB + header: 15 per segment, 14 segments' worth.
    for n in 0..200 {
        t.write_now(&key(n), &data(n, 64 << 10)).unwrap();
    }
    let s = t.stats();
    assert!(s.used_bytes <= 8 << 20, "{s:?}");
    assert!(s.segments_evicted > 0 && s.objects_evicted > 0, "{s:?}");
    let held = t.contains_many(&(0..200).map(key).collect::<Vec<_>>());
    assert!(!held[0] && held[199], "oldest gone, newest kept");
    // FIFO: what is held is a suffix.
    let first = held.iter().position(|h| *h).unwrap();
    assert!(held[first..].iter().all(|h| *h));
    assert_eq!(s.objects, (200 - first) as u64);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_full_backlog_drops_and_counts() {
    let d = tmpdir("backlog");
    let mut c = small(&d);
    c.write_backlog_bytes = 100 << 10;
    c.write_bytes_per_s = 1 << 20; // slow: 64 KiB take 60 ms each
    let t = DiskTier::open(c).unwrap();
    let mut dropped = 0;
    for n in 0..10 {
        if t.enqueue(key(n), Box::new(data(n, 64 << 10))) == Queued::Dropped {
            dropped += 1;
        }
    }
    assert!(dropped >= 7, "{dropped}");
    assert_eq!(t.stats().writes_dropped, dropped);
    assert!(t.flush(Duration::from_secs(10)));
    assert_eq!(t.stats().backlog_bytes, 0);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn more_than_the_file_system_holds_is_refused_at_start() {
    let d = tmpdir("nospace");
    let mut c = small(&d);
    c.capacity_bytes = 1 << 60;
    c.segment_bytes = 256 << 20;
    let e = DiskTier::open(c).unwrap_err();
    assert!(matches!(e, DiskError::NoSpace { .. }), "{e}");
    assert!(e.to_string().contains("lower disk_capacity_bytes"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_directory_removed_while_running_turns_writes_into_counted_errors() {
    let d = tmpdir("vanish");
    let t = DiskTier::open(small(&d)).unwrap();
    t.write_now(&key(1), &data(1, 1000)).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
    // The open segment still takes writes (its file is unlinked, not gone); a new segment
    // cannot be made: writes fail, counted, and nothing panics.
    let mut errors = 0;
    for n in 2..40 {
        if t.enqueue(key(n), Box::new(data(n, 64 << 10))) != Queued::Queued {
            continue;
        }
        errors += 1;
    }
    assert!(t.flush(Duration::from_secs(10)));
    let s = t.stats();
    assert!(errors > 0 && s.write_errors > 0, "{s:?}");
    // Reads of what is indexed still answer (hit or counted miss), never a crash.
    let (sink, _) = keeper();
    let _ = t.promote_present(&[key(1), key(2)], t.deadline(), sink);
    t.clear();
}

#[test]
fn a_directory_that_cannot_be_written_is_an_error_at_start() {
    let d = tmpdir("readonly");
    let sub = d.join("ro");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join(crate::store::LOCK_FILE), b"").unwrap();
    if !read_only(&sub, true) {
        eprintln!("skipped: cannot make {} read-only here", sub.display());
        return;
    }
    let e = DiskTier::open(small(&sub)).unwrap_err();
    read_only(&sub, false);
    assert!(matches!(e, DiskError::Dir { .. }), "{e}");
    assert!(e.to_string().contains("choose another directory"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Makes `dir` read-only (or writable again): mode 0500, or for root (whom modes do not
/// stop) the immutable attribute. False when that is not possible here.
pub(crate) fn read_only(dir: &Path, on: bool) -> bool {
    use std::os::unix::fs::PermissionsExt;
    if umbp_unix::peer::effective_uid() != 0 {
        let mode = if on { 0o500 } else { 0o700 };
        return std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).is_ok();
    }
    std::process::Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}
