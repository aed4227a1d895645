//! Tests of the pool: commits and reservations, pins and lookups, namespaces, eviction
//! (synchronous and in the background), events and closing.

use std::time::Duration;

use super::*;
use umbp_core::{KeyBuilder, RankTopology};

fn pool(capacity: u64, segment: u64) -> Pool {
    Pool::new(PoolConfig {
        segment_bytes: segment,
        prefault: false,
        ..PoolConfig::with_capacity(capacity)
    })
    .unwrap()
}

fn key(i: u64) -> BlockKey {
    KeyBuilder::new("t", RankTopology::default())
        .unwrap()
        .key(0, &i.to_le_bytes())
        .unwrap()
}

#[test]
fn peek_pins_without_counting_a_lookup() {
    let p = Pool::new(PoolConfig::with_capacity(64 << 20)).unwrap();
    let (a, b) = (key(1), key(2));
    p.put(a, &[1u8; 4096]).unwrap();
    p.put(b, &[2u8; 4096]).unwrap();
    let before = p.stats();
    let o = p.peek(&a).unwrap();
    assert_eq!(o.as_slice(), &[1u8; 4096][..]);
    assert_eq!(p.stats().pinned, before.pinned + 1);
    drop(o);
    let after = p.stats();
    assert_eq!(
        (after.hits, after.gets, after.pinned),
        (before.hits, before.gets, before.pinned)
    );
    assert!(p.peek(&key(3)).is_none());
    assert_eq!(
        p.stats().misses,
        before.misses,
        "a peek miss is no lookup miss"
    );
}

#[test]
fn clear_namespace_removes_only_that_namespace() {
    let p = pool(1 << 20, 64 << 10);
    let other = KeyBuilder::new("other", RankTopology::default()).unwrap();
    for i in 0..20u64 {
        p.put(key(i), &[1; 100]).unwrap();
        p.put(other.key(0, &i.to_le_bytes()).unwrap(), &[2; 100])
            .unwrap();
    }
    assert_eq!(p.clear_namespace(&key(0).namespace_id()), 20);
    assert!((0..20).all(|i| !p.contains(&key(i))));
    assert!((0..20u64).all(|i| p.contains(&other.key(0, &i.to_le_bytes()).unwrap())));
    assert_eq!(p.stats().objects, 20);
    assert_eq!(p.clear_namespace(&key(0).namespace_id()), 0);
    assert_eq!(p.clear(), 20);
}

#[test]
fn a_fill_read_before_a_clear_commits_nothing_after_it() {
    let p = pool(1 << 20, 64 << 10);
    // A promotion that began before a clear (its epoch read then) and commits after it.
    let before = p.clear_epoch();
    let r = p.reserve(100).unwrap();
    {
        let c = p.begin_clear();
        assert_eq!(c.all(), 0);
        // While it runs, the epoch has not moved yet: it moves when the clear ends.
        assert_eq!(p.clear_epoch(), before);
    }
    assert_eq!(p.clear_epoch(), before + 1);
    assert_eq!(p.commit_unless_cleared(r, key(1), before), None);
    assert!(!p.contains(&key(1)));
    // Its room went back: the pool is empty.
    assert_eq!(p.stats().used_bytes, 0);
    // One that began after the clear commits.
    let now = p.clear_epoch();
    let r = p.reserve(100).unwrap();
    assert_eq!(
        p.commit_unless_cleared(r, key(1), now),
        Some(CommitOutcome::Stored)
    );
    // Pool::clear and clear_namespace are clears too.
    p.clear_namespace(&key(1).namespace_id());
    assert_eq!(p.clear_epoch(), now + 1);
    p.clear();
    assert_eq!(p.clear_epoch(), now + 2);
    // holds_many answers without counting a lookup.
    p.put(key(2), &[2; 100]).unwrap();
    let s = p.stats();
    assert_eq!(p.holds_many(&[key(2), key(3)]), vec![true, false]);
    let t = p.stats();
    assert_eq!((t.hits, t.misses), (s.hits, s.misses));
}

#[test]
fn readers_see_only_committed_objects() {
    let p = pool(1 << 20, 64 << 10);
    let mut r = p.reserve(1000).unwrap();
    r.as_mut_slice().fill(9);
    assert!(!p.contains(&key(1)));
    assert!(p.get(&key(1)).is_none());
    assert_eq!(p.commit(r, key(1)), CommitOutcome::Stored);
    let g = p.get(&key(1)).unwrap();
    assert_eq!(g.as_slice(), &[9u8; 1000][..]);
}

#[test]
fn first_committed_writer_wins() {
    let p = pool(1 << 20, 64 << 10);
    let mut a = p.reserve(10).unwrap();
    let mut b = p.reserve(10).unwrap();
    a.as_mut_slice().fill(1);
    b.as_mut_slice().fill(2);
    assert_eq!(p.commit(b, key(5)), CommitOutcome::Stored);
    assert_eq!(p.commit(a, key(5)), CommitOutcome::AlreadyPresent);
    assert_eq!(p.get(&key(5)).unwrap().as_slice(), &[2u8; 10]);
    let s = p.stats();
    assert_eq!((s.puts, s.duplicate_puts, s.objects), (1, 1, 1));
    p.check_invariants();
}

#[test]
fn abandoned_reservations_are_reclaimed() {
    let p = pool(1 << 20, 64 << 10);
    let r = p.reserve(300 << 10).unwrap();
    assert!(p.stats().used_bytes >= 300 << 10);
    assert_eq!(p.stats().reservations, 1);
    drop(r);
    let s = p.stats();
    assert_eq!((s.used_bytes, s.reservations), (0, 0));
}

#[test]
fn pinned_objects_survive_remove_and_clear() {
    let p = pool(1 << 20, 64 << 10);
    p.put(key(1), &[7; 4096]).unwrap();
    let pin = p.get(&key(1)).unwrap();
    assert!(p.remove(&key(1)));
    assert!(!p.contains(&key(1)));
    // Fill the pool: the pinned slot must not be reused.
    for i in 10..400 {
        let _ = p.put(key(i), &[0xEE; 4096]);
    }
    // The background evictor stops here, so the counts below are not taken mid-eviction
    // (it could remove an entry between `check_invariants`' two reads).
    p.close();
    assert_eq!(pin.as_slice(), &[7u8; 4096][..]);
    p.clear();
    assert_eq!(pin.as_slice(), &[7u8; 4096][..]);
    let used_with_pin = p.stats().used_bytes;
    drop(pin);
    assert_eq!(p.stats().used_bytes, used_with_pin - 4096);
    p.check_invariants();
}

#[test]
fn full_pool_evicts_synchronously_or_reports_full() {
    let p = pool(1 << 20, 64 << 10);
    for i in 0..1000 {
        p.put(key(i), &[1; 16 << 10]).unwrap();
    }
    assert!(p.stats().evictions > 900);
    // Pin everything that is left: a new object cannot fit and nothing is evictable.
    let pins: Vec<_> = (0..1000).filter_map(|i| p.get(&key(i))).collect();
    assert!(!pins.is_empty());
    let mut held = Vec::new();
    loop {
        match p.reserve(16 << 10) {
            Ok(r) => held.push(r),
            Err(PoolError::Full { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    let e = p.try_reserve(16 << 10).unwrap_err().to_string();
    assert!(e.contains("pool full") && e.contains("retry"), "{e}");
}

#[test]
fn too_large_is_distinct() {
    let p = pool(1 << 20, 64 << 10);
    assert!(matches!(
        p.reserve(2 << 20),
        Err(PoolError::TooLarge { .. })
    ));
    assert!(matches!(p.reserve(0), Err(PoolError::TooLarge { .. })));
}

#[test]
fn background_eviction_brings_usage_to_low_watermark() {
    let p = Pool::new(PoolConfig {
        segment_bytes: 64 << 10,
        prefault: false,
        high_watermark: 0.5,
        low_watermark: 0.25,
        ..PoolConfig::with_capacity(4 << 20)
    })
    .unwrap();
    for i in 0..200 {
        p.put(key(i), &[3; 16 << 10]).unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while p.stats().used_bytes > p.capacity() / 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let s = p.stats();
    assert!(s.used_bytes <= p.capacity() / 2, "{s:?}");
    assert!(s.evictions > 0);
    // The survivors are the most recently stored keys.
    assert!(p.contains(&key(199)));
    assert!(!p.contains(&key(0)));
}

#[test]
fn lookups_do_not_pin_or_refresh() {
    for policy in crate::EvictionPolicy::ALL {
        lookups_do_not_pin_or_refresh_with(policy);
    }
}

fn lookups_do_not_pin_or_refresh_with(policy: crate::EvictionPolicy) {
    // A high watermark of 1.0 keeps the background evictor out: only the synchronous
    // eviction of a full pool runs, so which keys go is decided by the policy alone (with the
    // defaults the evictor could drop key 0 while the pool fills, before the lookups below).
    let p = pool_with(policy, crate::StoreAdmission::All);
    for i in 0..64 {
        p.put(key(i), &[1; 16 << 10]).unwrap();
    }
    // Looking key 0 up must not save it from eviction.
    assert!(p.exists_many(&[key(0)])[0]);
    assert_eq!(p.prefix_hits(&[key(0), key(1), key(999)]), 2);
    p.put(key(100), &[1; 16 << 10]).unwrap();
    assert!(!p.contains(&key(0)), "{policy}");
    assert_eq!(p.stats().pinned, 0);
    // A pinned read does refresh (LRU) or count a use (S3-FIFO): key 1 survives the next
    // eviction, key 2 does not.
    drop(p.get(&key(1)).unwrap());
    p.put(key(101), &[1; 16 << 10]).unwrap();
    assert!(p.contains(&key(1)), "{policy}");
    assert!(!p.contains(&key(2)), "{policy}");
}

#[test]
fn events_report_stores_and_removals() {
    let p = pool(1 << 20, 64 << 10);
    let rx = p.subscribe(1024);
    p.put(key(1), &[1; 100]).unwrap();
    p.remove(&key(1));
    p.put(key(2), &[1; 100]).unwrap();
    p.clear();
    let evs: Vec<_> = rx.try_iter().collect();
    assert_eq!(
        evs,
        vec![
            PoolEvent::Stored {
                key: key(1),
                bytes: 100
            },
            PoolEvent::Removed {
                key: key(1),
                cause: RemoveCause::Removed
            },
            PoolEvent::Stored {
                key: key(2),
                bytes: 100
            },
            PoolEvent::Removed {
                key: key(2),
                cause: RemoveCause::Cleared
            },
        ]
    );
}

#[test]
fn closed_pool_refuses_reservations() {
    let p = pool(1 << 20, 64 << 10);
    p.close();
    assert!(matches!(p.reserve(10), Err(PoolError::Closed)));
}

/// A 1 MiB pool of 64 KiB segments that only the synchronous eviction of a full pool evicts
/// from (high watermark 1.0), with `policy` and `admission`.
fn pool_with(policy: crate::EvictionPolicy, admission: crate::StoreAdmission) -> Pool {
    Pool::new(PoolConfig {
        segment_bytes: 64 << 10,
        prefault: false,
        high_watermark: 1.0,
        low_watermark: 0.5,
        eviction_policy: policy,
        store_admission: admission,
        ..PoolConfig::with_capacity(1 << 20)
    })
    .unwrap()
}

#[test]
fn s3fifo_keeps_reused_objects_through_a_one_off_scan_and_lru_does_not() {
    use crate::{EvictionPolicy, StoreAdmission};
    for policy in EvictionPolicy::ALL {
        let p = pool_with(policy, StoreAdmission::All);
        // 16 objects read once, then a scan of 256 one-offs through a pool of 64.
        for i in 0..16 {
            p.put(key(i), &[1; 16 << 10]).unwrap();
        }
        for i in 0..16 {
            drop(p.get(&key(i)).unwrap());
        }
        for i in 1000..1256 {
            p.put(key(i), &[2; 16 << 10]).unwrap();
        }
        let kept = (0..16).filter(|&i| p.contains(&key(i))).count();
        let s = p.stats();
        assert_eq!(s.eviction_policy, policy);
        assert_eq!(s.evictions, s.evictions_small + s.evictions_main);
        match policy {
            EvictionPolicy::S3Fifo => {
                assert_eq!(kept, 16);
                assert_eq!(s.promotions, 16);
                assert_eq!(s.evictions_main, 0);
            }
            EvictionPolicy::Lru => {
                assert_eq!(kept, 0);
                assert_eq!(s.evictions_small, 0);
            }
        }
    }
}

#[test]
fn on_reuse_stores_a_key_the_second_time_it_is_seen() {
    use crate::{EvictionPolicy, StoreAdmission};
    let p = pool_with(EvictionPolicy::S3Fifo, StoreAdmission::OnReuse);
    assert_eq!(p.put(key(1), &[1; 4096]).unwrap(), CommitOutcome::Skipped);
    assert!(!p.contains(&key(1)));
    assert_eq!(p.put(key(1), &[1; 4096]).unwrap(), CommitOutcome::Stored);
    // The first missing key of a prefix lookup counts as seen; the keys after it do not.
    assert_eq!(p.prefix_hits(&[key(1), key(2), key(3)]), 1);
    let r = p.reserve(4096).unwrap();
    assert_eq!(p.commit(r, key(2)), CommitOutcome::Stored);
    assert_eq!(p.put(key(3), &[1; 4096]).unwrap(), CommitOutcome::Skipped);
    // So does a read that missed.
    assert!(p.get(&key(4)).is_none());
    assert_eq!(p.put(key(4), &[1; 4096]).unwrap(), CommitOutcome::Stored);
    let s = p.stats();
    assert_eq!(s.store_admission, StoreAdmission::OnReuse);
    assert_eq!(s.admissions_skipped, 2);
    assert_eq!(s.objects, 3);
    assert_eq!(
        s.used_bytes,
        3 * 4096,
        "a skipped commit frees its reservation"
    );
}

#[test]
fn admit_now_stores_a_first_sighting_under_on_reuse_and_counts_it() {
    use crate::{Admit, EvictionPolicy, StoreAdmission};
    let p = pool_with(EvictionPolicy::S3Fifo, StoreAdmission::OnReuse);
    // A writer that asks first (the copy engine) and commits as asked.
    assert!(p.admit_as(&key(1), Admit::Now));
    let r = p.reserve(4096).unwrap();
    assert_eq!(p.commit_as(r, key(1), Admit::Now), CommitOutcome::Stored);
    // A commit without asking first is stored too.
    let r = p.reserve(4096).unwrap();
    assert_eq!(p.commit_as(r, key(2), Admit::Now), CommitOutcome::Stored);
    // The policy's commit of a new key is still skipped, and then remembered: asking "now"
    // for a key the window already knows forces nothing.
    let r = p.reserve(4096).unwrap();
    assert_eq!(p.commit(r, key(3)), CommitOutcome::Skipped);
    let r = p.reserve(4096).unwrap();
    assert_eq!(p.commit_as(r, key(3), Admit::Now), CommitOutcome::Stored);
    let s = p.stats();
    assert_eq!(
        (s.objects, s.admissions_forced, s.admissions_skipped),
        (3, 2, 1)
    );
    // With `all` every commit is stored: nothing is forced.
    let all = pool_with(EvictionPolicy::S3Fifo, StoreAdmission::All);
    let r = all.reserve(4096).unwrap();
    assert_eq!(all.commit_as(r, key(1), Admit::Now), CommitOutcome::Stored);
    assert_eq!(all.stats().admissions_forced, 0);
}

#[test]
fn watermark_eviction_hands_objects_to_the_spill_hook_pinned() {
    use std::sync::{Arc, Mutex as StdMutex};
    let p = Pool::new(PoolConfig {
        segment_bytes: 64 << 10,
        prefault: false,
        high_watermark: 0.5,
        low_watermark: 0.25,
        ..PoolConfig::with_capacity(4 << 20)
    })
    .unwrap();
    let held: Arc<StdMutex<Vec<(BlockKey, PinnedObject)>>> = Arc::default();
    let h = Arc::clone(&held);
    p.set_spill(Some(Arc::new(move |k, obj, kind| {
        assert_eq!(kind, SpillKind::Behind);
        h.lock().unwrap().push((k, obj))
    })));
    for i in 0..100u64 {
        p.put(key(i), &[i as u8; 16 << 10]).unwrap();
    }
    p.evict_to_low_watermark();
    let spilled = std::mem::take(&mut *held.lock().unwrap());
    assert!(!spilled.is_empty());
    let used_pinned = p.stats().used_bytes;
    for (k, obj) in &spilled {
        // Out of lookups, bytes intact while the pin lives.
        assert!(!p.contains(k));
        let i = (0..100).find(|i| key(*i) == *k).unwrap();
        assert!(obj.as_slice().iter().all(|b| *b == i as u8));
    }
    drop(spilled);
    // The last pins freed the memory.
    assert!(p.stats().used_bytes < used_pinned);
    p.set_spill(None);
    p.check_invariants();
}

#[test]
fn a_full_pools_reservations_hand_every_evicted_object_to_the_spill_hook_now() {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    for policy in [crate::EvictionPolicy::S3Fifo, crate::EvictionPolicy::Lru] {
        let p = Pool::new(PoolConfig {
            segment_bytes: 64 << 10,
            prefault: false,
            // No background eviction: every eviction is a reservation's.
            high_watermark: 1.0,
            low_watermark: 0.99,
            eviction_policy: policy,
            ..PoolConfig::with_capacity(4 << 20)
        })
        .unwrap();
        let now = Arc::new(AtomicU64::new(0));
        let n = Arc::clone(&now);
        p.set_spill(Some(Arc::new(move |k, obj, kind| {
            assert_eq!(kind, SpillKind::Now);
            let i = u64::from(obj.as_slice()[0]);
            assert_eq!(k, key(i), "the bytes of the evicted key");
            // Released here: the reservation gets the memory.
            drop(obj);
            n.fetch_add(1, Ordering::Relaxed);
        })));
        // Small objects fill the pool, then objects of several segments need whole segments
        // emptied (the segment fallback) as well as the policy's order.
        for i in 0..200u64 {
            p.put(key(i), &[i as u8; 16 << 10]).unwrap();
        }
        for i in 200..240u64 {
            p.put(key(i), &[i as u8; 200 << 10]).unwrap();
        }
        let s = p.stats();
        assert!(s.evictions > 100, "{policy:?}: {s:?}");
        assert_eq!(now.load(Ordering::Relaxed), s.evictions, "{policy:?}");
        assert_eq!(s.pinned, 0);
        p.set_spill(None);
        p.check_invariants();
    }
}

#[test]
fn live_pins_are_listed_by_namespace_most_bytes_first() {
    let p = pool(8 << 20, 1 << 20);
    let other = KeyBuilder::new("other-tenant", RankTopology::default()).unwrap();
    let theirs: Vec<BlockKey> = (0..3u64)
        .map(|i| other.key(0, &i.to_le_bytes()).unwrap())
        .collect();
    for i in 0..5 {
        p.put(key(i), &[1u8; 4096]).unwrap();
    }
    for k in &theirs {
        p.put(*k, &[2u8; 1024]).unwrap();
    }
    p.keep(&[key(0), key(1)], Duration::from_secs(60));
    p.keep(&[key(2)], Duration::from_secs(5));
    p.keep(&theirs, Duration::from_secs(30));
    let listed = p.pins_by_namespace();
    assert_eq!(listed.len(), 2, "{listed:?}");
    let (mine, them) = (listed[0], listed[1]);
    assert_eq!((mine.objects, mine.bytes), (3, 3 * 4096));
    assert_eq!(mine.namespace_id, key(0).namespace_id());
    assert!(
        mine.soonest_ms <= 5_000 && mine.latest_ms > 55_000,
        "{mine:?}"
    );
    assert_eq!((them.objects, them.bytes), (3, 3 * 1024));
    // Released pins leave the list.
    p.release_kept(&theirs);
    assert_eq!(p.pins_by_namespace().len(), 1);
}
