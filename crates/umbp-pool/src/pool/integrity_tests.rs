//! Tests of the pool's checksums: kept per object when `integrity` is on, verified on
//! demand, a damaged object removed and counted, sampling exact.

use super::*;
use umbp_core::{Integrity, KeyBuilder, RankTopology};

fn pool(integrity: Integrity) -> Pool {
    Pool::new(PoolConfig {
        prefault: false,
        integrity,
        ..PoolConfig::with_capacity(64 << 20)
    })
    .unwrap()
}

fn key(i: u64) -> BlockKey {
    KeyBuilder::new("integrity", RankTopology::default())
        .unwrap()
        .key(0, &i.to_le_bytes())
        .unwrap()
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn objects_carry_their_checksum_only_when_integrity_is_on() {
    let on = pool(Integrity::All);
    let data = bytes(1, 10_000);
    on.put(key(1), &data).unwrap();
    assert_eq!(
        on.get(&key(1)).unwrap().checksum(),
        Some(crate::checksum(&data))
    );
    // A writer that sets no sum gets one computed at commit.
    let mut r = on.reserve(4096).unwrap();
    r.as_mut_slice().fill(7);
    on.commit(r, key(2));
    assert_eq!(
        on.get(&key(2)).unwrap().checksum(),
        Some(crate::checksum(&[7u8; 4096]))
    );
    let off = pool(Integrity::Off);
    off.put(key(1), &data).unwrap();
    let o = off.get(&key(1)).unwrap();
    assert_eq!(o.checksum(), None);
    assert!(off.verify(&o), "nothing to verify is no failure");
    assert_eq!(off.stats().verified, 0);
}

#[test]
fn a_flipped_byte_fails_verification_and_removes_the_object() {
    let p = pool(Integrity::All);
    let (good, bad) = (bytes(2, 32 << 10), bytes(3, 32 << 10));
    p.put(key(1), &good).unwrap();
    p.put(key(2), &bad).unwrap();
    let events = p.subscribe(16);
    assert!(p.debug_corrupt(&key(2), 12_345, 0x01));
    assert!(!p.debug_corrupt(&key(9), 0, 0x01), "no such key");
    let g = p.get(&key(1)).unwrap();
    assert!(p.verify(&g));
    assert_eq!(g.as_slice(), &good[..]);
    let b = p.get(&key(2)).unwrap();
    assert!(!p.verify(&b));
    // Gone from lookups at once, its memory held by our pin until dropped.
    assert!(!p.contains(&key(2)));
    assert!(p.get(&key(2)).is_none());
    assert_eq!(
        events.try_recv().unwrap(),
        PoolEvent::Removed {
            key: key(2),
            cause: RemoveCause::Corrupt
        }
    );
    // A second reader that pinned it before the removal also fails, and is not counted
    // as a second removal.
    assert!(!p.verify(&b));
    drop(b);
    let s = p.stats();
    assert_eq!((s.verified, s.corrupt_detected, s.objects), (3, 2, 1));
    p.check_invariants();
    // The key can be stored again and then verifies.
    p.put(key(2), &bad).unwrap();
    let again = p.get(&key(2)).unwrap();
    assert!(p.verify(&again));
    assert_eq!(again.as_slice(), &bad[..]);
}

#[test]
fn the_writers_sum_is_what_the_pool_keeps() {
    let p = pool(Integrity::All);
    let mut r = p.reserve(4096).unwrap();
    r.as_mut_slice().fill(1);
    // A sum of other bytes than those committed: the pool trusts the writer, so the load
    // fails, which shows the writer's sum is the one kept.
    r.set_checksum(crate::checksum(&[2u8; 4096]));
    p.commit(r, key(1));
    let o = p.get(&key(1)).unwrap();
    assert!(!p.verify(&o));
}

#[test]
fn sampling_verifies_one_load_in_n() {
    for (integrity, due) in [
        (Integrity::Off, 0),
        (Integrity::Sample { every: 4 }, 25),
        (Integrity::Sample { every: 1 }, 100),
        (Integrity::All, 100),
    ] {
        let p = pool(integrity);
        let n = (0..100).filter(|_| p.verify_due()).count();
        assert_eq!(n, due, "{integrity}");
        assert_eq!(p.stats().integrity, integrity);
    }
}
