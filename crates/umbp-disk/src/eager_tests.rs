//! Eager (key-only) entries and removals of queued keys, on real files.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::tests::{data, keeper, key, small, tmpdir};
use crate::{DiskTier, ObjectBytes, Queued, Source};

/// A source serving what `objects` holds now.
fn source(objects: &Arc<Mutex<HashMap<BlockKey, Vec<u8>>>>) -> Source {
    let o = Arc::clone(objects);
    Arc::new(move |k: &BlockKey| {
        o.lock()
            .get(k)
            .map(|b| Box::new(b.clone()) as Box<dyn ObjectBytes>)
    })
}

/// A tier writing one object at a time at 1 MB/s, after two 512 KiB objects that keep its
/// writer busy for about a second: what is queued next stays queued that long.
fn slow_tier(tag: &str) -> (DiskTier, std::path::PathBuf) {
    let d = tmpdir(tag);
    let mut c = small(&d);
    c.io_threads = 1;
    c.write_bytes_per_s = 1_000_000;
    let t = DiskTier::open(c).unwrap();
    for n in [900, 901] {
        assert_eq!(
            t.enqueue(key(n), Box::new(data(n, 512 << 10))),
            Queued::Queued
        );
    }
    (t, d)
}

#[test]
fn eager_entries_take_their_bytes_when_written_and_evictions_of_them_are_not_written_again() {
    let d = tmpdir("eager");
    let t = DiskTier::open(small(&d)).unwrap();
    let objects = Arc::new(Mutex::new(HashMap::new()));
    t.set_source(Some(source(&objects)));
    for n in 0..10 {
        objects.lock().insert(key(n), data(n, 5000 + n as usize));
        assert_eq!(t.enqueue_key(key(n), 5000 + n as u64), Queued::Queued);
    }
    // Key 10 left the pool before its write (removed): nothing to write.
    assert_eq!(t.enqueue_key(key(10), 7000), Queued::Queued);
    assert!(t.flush(Duration::from_secs(10)));
    let s = t.stats();
    assert_eq!(
        (s.writes, s.eager_queued, s.eager_gone),
        (10, 11, 1),
        "{s:?}"
    );
    // The evictor hands over objects the disk holds: released at once, not written again.
    for n in 0..10 {
        let q = t.enqueue(key(n), Box::new(data(n, 5000 + n as usize)));
        assert_eq!(q, Queued::Present);
    }
    assert_eq!(t.enqueue_key(key(3), 5003), Queued::Present);
    assert!(t.flush(Duration::from_secs(10)));
    let s = t.stats();
    assert_eq!((s.writes, s.already_present, s.eager_queued), (10, 10, 11));
    let keys: Vec<BlockKey> = (0..11).map(key).collect();
    let (sink, got) = keeper();
    let hit = t.promote_present(&keys, t.deadline(), sink);
    assert_eq!(hit, [vec![true; 10], vec![false]].concat());
    for n in 0..10 {
        assert_eq!(got.lock()[&key(n)], data(n, 5000 + n as usize));
    }
    t.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_eviction_of_a_queued_eager_key_hands_its_bytes_to_the_entry() {
    let (t, d) = slow_tier("eager-evicted");
    // The source no longer has it (evicted): the eviction's bytes are what gets written.
    t.set_source(Some(Arc::new(|_: &BlockKey| None)));
    assert_eq!(t.enqueue_key(key(1), 3000), Queued::Queued);
    assert_eq!(t.enqueue(key(1), Box::new(data(1, 3000))), Queued::Queued);
    assert!(t.flush(Duration::from_secs(10)));
    let s = t.stats();
    assert_eq!(
        (s.writes, s.eager_gone, s.already_present),
        (3, 0, 0),
        "{s:?}"
    );
    let (sink, got) = keeper();
    assert_eq!(t.promote_prefix(&[key(1)], t.deadline(), sink), 1);
    assert_eq!(got.lock()[&key(1)], data(1, 3000));
    t.close();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn removing_keys_cancels_their_queued_writes() {
    let (t, d) = slow_tier("cancel");
    for n in 0..6 {
        assert_eq!(t.enqueue(key(n), Box::new(data(n, 8192))), Queued::Queued);
    }
    // Queued behind the two slow ones: removal takes them out before they are written.
    assert_eq!(t.remove_many(&[key(0), key(1), key(2)]), 0);
    assert!(!t.remove(&key(3)));
    assert!(t.flush(Duration::from_secs(10)));
    let held: Vec<bool> = t.contains_many(&(0..6).map(key).collect::<Vec<_>>());
    assert_eq!(held, [false, false, false, false, true, true]);
    // Written ones go from the index (counted); a clear takes queued ones too.
    assert_eq!(t.remove_many(&[key(4), key(7)]), 1);
    assert_eq!(t.stats().removed, 1);
    assert_eq!(
        t.enqueue(key(20), Box::new(data(20, 512 << 10))),
        Queued::Queued
    );
    assert_eq!(
        t.enqueue(key(21), Box::new(data(21, 512 << 10))),
        Queued::Queued
    );
    assert_eq!(t.enqueue(key(22), Box::new(data(22, 8192))), Queued::Queued);
    t.clear();
    assert!(t.flush(Duration::from_secs(10)));
    // Queued or being written when the clear came: none is on disk after it.
    assert!(t.contains_many(&[key(20), key(21), key(22)]) == [false; 3]);
    assert_eq!(t.stats().objects, 0);
    t.close();
    std::fs::remove_dir_all(&d).unwrap();
}
