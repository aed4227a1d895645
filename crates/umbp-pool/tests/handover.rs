//! A pool handed over to another pool (as a server upgraded in place does): the taker serves
//! every committed object byte for byte from the same memory, carries pins, leaves out what
//! was being written, keeps working; a damaged or foreign image is refused with a reason.

use std::time::Duration;

use rand::{rngs::StdRng, Rng, SeedableRng};
use umbp_core::{BlockKey, KeyBuilder, MemoryBacking, PoolConfig, RankTopology};
use umbp_pool::{Pool, PoolError};

fn cfg(capacity: u64) -> PoolConfig {
    PoolConfig {
        capacity_bytes: capacity,
        segment_bytes: 1 << 20,
        prefault: false,
        backing: MemoryBacking::Memfd,
        ..PoolConfig::default()
    }
}

fn key(i: u64) -> BlockKey {
    KeyBuilder::new("handover", RankTopology::default())
        .unwrap()
        .key(0, &i.to_le_bytes())
        .unwrap()
}

fn content(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i.wrapping_mul(31) ^ j as u64 ^ (j as u64 >> 8)) as u8)
        .collect()
}

fn size(rng: &mut StdRng) -> usize {
    match rng.random_range(0..4) {
        0 => rng.random_range(1..4096),
        1 => rng.random_range(16 << 10..300 << 10),
        2 => 1 << 20,
        _ => rng.random_range((1 << 20) + 1..3 << 20),
    }
}

#[test]
fn a_taken_over_pool_serves_every_committed_object_byte_exact() {
    let mut rng = StdRng::seed_from_u64(7);
    let giver = Pool::new(cfg(320 << 20)).unwrap();
    let mut kept = Vec::new();
    for i in 0..250u64 {
        let len = size(&mut rng);
        giver.put(key(i), &content(i, len)).unwrap();
        kept.push((i, len));
    }
    // Some removed, some pinned, one reservation never committed (a write in flight).
    for (i, _) in kept.iter().filter(|(i, _)| i % 7 == 0) {
        giver.remove(&key(*i));
    }
    let pinned: Vec<BlockKey> = (0..250).filter(|i| i % 11 == 1).map(key).collect();
    giver.keep(&pinned, Duration::from_secs(600));
    let mut writing = giver.reserve(4096).unwrap();
    writing.as_mut_slice().fill(0xAB);
    let held = giver.get(&key(3));
    let live: Vec<(u64, usize)> = kept
        .iter()
        .copied()
        .filter(|(i, _)| giver.contains(&key(*i)))
        .collect();
    assert!(
        live.len() > 100,
        "the churn left too little: {}",
        live.len()
    );

    let (fd, image) = giver.hand_over(4).unwrap();
    assert_eq!(image.records.len(), live.len());
    let bytes = image.encode();
    // The giver is closed: nothing more is reserved there.
    assert!(matches!(giver.reserve(64), Err(PoolError::Closed)));
    let (taker, got) = Pool::adopt(cfg(320 << 20), fd, &bytes).unwrap();
    assert_eq!(got.generation, 5);
    assert_eq!(got.objects, live.len() as u64);
    let pinned_live = pinned.iter().filter(|k| taker.contains(k)).count() as u64;
    assert_eq!(got.pinned, pinned_live);
    assert_eq!(taker.keep_stats().pinned, pinned_live);
    // The giver goes (its reader first): the taker's memory is its own mapping.
    drop(held);
    drop(writing);
    drop(giver);
    taker.check_invariants();
    for (i, len) in &live {
        let obj = taker.get(&key(*i)).expect("a committed object was lost");
        assert_eq!(obj.as_slice(), &content(*i, *len)[..], "object {i} changed");
    }
    assert_eq!(taker.stats().objects, live.len() as u64);
    // And it goes on: stores until it evicts; every pinned object stays, every byte of
    // what is left is right.
    let pinned_now: Vec<BlockKey> = pinned
        .iter()
        .copied()
        .filter(|k| taker.contains(k))
        .collect();
    for i in 1000..1400u64 {
        let len = size(&mut rng);
        taker.put(key(i), &content(i, len)).unwrap();
    }
    taker.check_invariants();
    assert!(taker.stats().evictions > 0);
    for k in &pinned_now {
        assert!(taker.contains(k), "a pin did not survive the hand-over");
    }
    for (i, len) in &live {
        if let Some(obj) = taker.get(&key(*i)) {
            assert_eq!(obj.as_slice(), &content(*i, *len)[..], "object {i} changed");
        }
    }
}

#[test]
fn an_image_the_taker_cannot_trust_is_refused_with_the_reason() {
    let giver = Pool::new(cfg(16 << 20)).unwrap();
    giver.put(key(1), &content(1, 5000)).unwrap();
    let (fd, image) = giver.hand_over(0).unwrap();
    let good = image.encode();
    let why = |r: Result<(Pool, umbp_pool::Adopted), PoolError>| match r {
        Err(PoolError::Image { reason }) => reason,
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("taken over"),
    };
    let mut damaged = good.clone();
    damaged[100] ^= 0x10;
    let r = why(Pool::adopt(
        cfg(16 << 20),
        fd.try_clone().unwrap(),
        &damaged,
    ));
    assert!(r.contains("damaged"), "{r}");
    let r = why(Pool::adopt(cfg(32 << 20), fd.try_clone().unwrap(), &good));
    assert!(r.contains("--capacity"), "{r}");
    let other_segments = PoolConfig {
        segment_bytes: 2 << 20,
        ..cfg(16 << 20)
    };
    let r = why(Pool::adopt(other_segments, fd.try_clone().unwrap(), &good));
    assert!(r.contains("--segment-bytes"), "{r}");
    // The untouched image still takes the pool over.
    let (taker, got) = Pool::adopt(cfg(16 << 20), fd, &good).unwrap();
    assert_eq!(got.objects, 1);
    assert_eq!(
        taker.get(&key(1)).unwrap().as_slice(),
        &content(1, 5000)[..]
    );
}

#[test]
fn anonymous_memory_cannot_be_handed_over() {
    let pool = Pool::new(PoolConfig {
        backing: MemoryBacking::Anonymous,
        ..cfg(8 << 20)
    })
    .unwrap();
    match pool.hand_over(0) {
        Err(PoolError::Image { reason }) => assert!(reason.contains("memfd"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // Nothing was closed by the refusal.
    pool.put(key(1), b"still here").unwrap();
}

/// Each object's place in S3-FIFO (its queue, its use count, its order) survives a hand-over:
/// objects the giver had promoted to its main queue, or used, are where they were in the taker,
/// so an upgrade does not turn the hot part of a pool into the first to be evicted.
#[test]
fn s3fifo_places_survive_a_hand_over() {
    let c = PoolConfig {
        eviction_policy: umbp_core::EvictionPolicy::S3Fifo,
        ..cfg(16 << 20)
    };
    let giver = Pool::new(c.clone()).unwrap();
    let obj = 256 << 10;
    // Used objects among new ones, through enough churn that S3-FIFO moves the used ones to
    // its main queue and evicts unused ones (the background evictor: wait for it).
    let mut next = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while giver.stats().promotions < 8 || giver.stats().evictions < 16 {
        assert!(std::time::Instant::now() < deadline, "{:?}", giver.stats());
        giver.put(key(next), &content(next, obj)).unwrap();
        if next.is_multiple_of(4) {
            let _ = giver.get(&key(next));
        }
        next += 1;
        if next.is_multiple_of(16) {
            // Use a few older ones again.
            for i in next.saturating_sub(12)..next {
                let _ = giver.get(&key(i));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    std::thread::sleep(Duration::from_millis(100)); // let the evictor finish its round
    for i in next - 6..next {
        let _ = giver.get(&key(i)); // used, and twice: counts of 1 and 2 to carry
        if i % 2 == 0 {
            let _ = giver.get(&key(i));
        }
    }
    let (fd, first) = giver.hand_over(0).unwrap();
    let placed = |img: &umbp_pool::image::Image| {
        let mut v: Vec<_> = img
            .records
            .iter()
            .map(|r| (r.place.expect("format 2 carries places"), r.key))
            .collect();
        v.sort_by_key(|(p, _)| p.rank);
        v.into_iter()
            .map(|(p, k)| (k, p.queue, p.freq))
            .collect::<Vec<_>>()
    };
    let before = placed(&first);
    assert!(before.iter().any(|&(_, q, _)| q == 1), "nothing in main");
    assert!(before.iter().any(|&(_, q, _)| q == 0), "nothing in small");
    assert!(before.iter().any(|&(_, _, f)| f > 0), "nothing used");
    let (taker, got) = Pool::adopt(c, fd, &first.encode()).unwrap();
    assert_eq!(got.objects as usize, before.len());
    let (_fd, second) = taker.hand_over(1).unwrap();
    // Same queue, same count, same order (by when each entered its queue), every object.
    assert_eq!(placed(&second), before);
}
