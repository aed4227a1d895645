//! Concurrency stress: 8 threads, 10⁶ operations mixing reserve, commit, abandoned
//! reservations, pinned reads (some held across other operations), batch lookups, removes,
//! explicit and background eviction, and clears. Every byte read is checked against what was
//! written for that key, and bytes of held pins are re-checked when released, so a pinned
//! object that was freed and reused would be caught.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::{rngs::StdRng, Rng, SeedableRng};
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{EvictionPolicy, PinnedObject, Pool, PoolError, StoreAdmission};

const THREADS: usize = 8;
const OPS_PER_THREAD: usize = 125_000;
const KEYS: u64 = 20_000;

/// Object size of key `k`: 1..=24 KiB, fixed per key (all writers of a key agree).
fn size_of(k: u64) -> usize {
    1024 * (1 + (k.wrapping_mul(2654435761) % 24) as usize)
}

/// Fills `buf` with key `k`'s content: 8-byte words derived from the key and position.
fn fill(k: u64, buf: &mut [u8]) {
    for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(k, i).to_le_bytes());
    }
}

#[inline]
fn word(k: u64, i: usize) -> u64 {
    (k << 32 | i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k
}

fn verify(k: u64, bytes: &[u8]) {
    assert_eq!(bytes.len(), size_of(k), "wrong object size for key {k}");
    for (i, chunk) in bytes.chunks_exact(8).enumerate() {
        let got = u64::from_le_bytes(chunk.try_into().unwrap());
        assert_eq!(got, word(k, i), "key {k}: word {i} corrupted");
    }
}

#[test]
fn eight_threads_a_million_operations_every_byte_checked() {
    stress(EvictionPolicy::Lru, StoreAdmission::default());
}

#[test]
fn s3fifo_on_reuse_under_eight_threads_every_byte_checked() {
    stress(EvictionPolicy::S3Fifo, StoreAdmission::OnReuse);
}

fn stress(eviction_policy: EvictionPolicy, store_admission: StoreAdmission) {
    let pool = Arc::new(
        Pool::new(PoolConfig {
            capacity_bytes: 16 << 20,
            segment_bytes: 256 << 10,
            prefault: true,
            eviction_policy,
            store_admission,
            ..PoolConfig::default()
        })
        .unwrap(),
    );
    let kb = KeyBuilder::new("stress", RankTopology::default()).unwrap();
    let keys: Arc<Vec<BlockKey>> = Arc::new(
        (0..KEYS)
            .map(|k| kb.key(0, &k.to_le_bytes()).unwrap())
            .collect(),
    );
    let reads_checked = Arc::new(AtomicU64::new(0));
    let bytes_checked = Arc::new(AtomicU64::new(0));
    let fulls = Arc::new(AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (pool, keys) = (Arc::clone(&pool), Arc::clone(&keys));
            let (reads_checked, bytes_checked, fulls) = (&reads_checked, &bytes_checked, &fulls);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(t as u64);
                let mut held: Vec<(u64, PinnedObject)> = Vec::new();
                // Skewed key choice: a hot set gets most traffic, so reads hit.
                let pick = |rng: &mut StdRng| {
                    if rng.random_bool(0.7) {
                        rng.random_range(0..KEYS / 10)
                    } else {
                        rng.random_range(0..KEYS)
                    }
                };
                for op in 0..OPS_PER_THREAD {
                    let roll = rng.random_range(0..1000);
                    if roll < 400 {
                        // reserve → write → commit (or abandon)
                        let k = pick(&mut rng);
                        if pool.contains(&keys[k as usize]) {
                            continue;
                        }
                        match pool.reserve(size_of(k) as u64) {
                            Ok(mut r) => {
                                fill(k, r.as_mut_slice());
                                if rng.random_bool(0.02) {
                                    drop(r); // abandoned reservation
                                } else {
                                    pool.commit(r, keys[k as usize]);
                                }
                            }
                            Err(PoolError::Full { .. }) => {
                                fulls.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("reserve: {e}"),
                        }
                    } else if roll < 800 {
                        // pinned read, verified; sometimes held across later operations
                        let k = pick(&mut rng);
                        if let Some(pin) = pool.get(&keys[k as usize]) {
                            verify(k, pin.as_slice());
                            reads_checked.fetch_add(1, Ordering::Relaxed);
                            bytes_checked.fetch_add(pin.len(), Ordering::Relaxed);
                            if held.len() < 16 && rng.random_bool(0.2) {
                                held.push((k, pin));
                            }
                        }
                    } else if roll < 880 {
                        // release a held pin after re-checking its bytes
                        if !held.is_empty() {
                            let (k, pin) = held.swap_remove(rng.random_range(0..held.len()));
                            verify(k, pin.as_slice());
                        }
                    } else if roll < 960 {
                        let batch: Vec<BlockKey> =
                            (0..32).map(|_| keys[pick(&mut rng) as usize]).collect();
                        assert_eq!(pool.exists_many(&batch).len(), 32);
                    } else if roll < 970 {
                        pool.remove(&keys[pick(&mut rng) as usize]);
                    } else if roll < 999 {
                        pool.evict_to_low_watermark();
                    } else if op % 31 == 0 {
                        pool.clear();
                    }
                }
                for (k, pin) in held {
                    verify(k, pin.as_slice());
                }
            });
        }
    });
    let s = pool.stats();
    println!(
        "stress: {} reads verified ({} MiB), {} puts, {} evictions, {} full, stats {:?}",
        reads_checked.load(Ordering::Relaxed),
        bytes_checked.load(Ordering::Relaxed) >> 20,
        s.puts,
        s.evictions,
        fulls.load(Ordering::Relaxed),
        s
    );
    assert_eq!(s.pinned, 0);
    assert_eq!(s.reservations, 0);
    assert!(s.evictions > 10_000, "the test must drive eviction hard");
    assert!(reads_checked.load(Ordering::Relaxed) > 50_000);
    pool.check_invariants();
    // Everything left is intact.
    for (k, key) in keys.iter().enumerate() {
        if let Some(pin) = pool.get(key) {
            verify(k as u64, pin.as_slice());
        }
    }
}
