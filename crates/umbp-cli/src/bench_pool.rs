use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use serde_json::json;
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{EvictionPolicy, Pool};

use crate::common::progress;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Objects to store.
    #[arg(long, default_value_t = 100_000)]
    objects: u64,
    /// Bytes per object.
    #[arg(long, default_value_t = 32 * 1024)]
    object_bytes: u64,
    /// Threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Keys per batch lookup.
    #[arg(long, default_value_t = 1024)]
    lookup_batch: usize,
    /// Eviction policy: lru or s3fifo.
    #[arg(long, default_value_t = EvictionPolicy::default())]
    eviction_policy: EvictionPolicy,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn keys(ns: &str, n: u64) -> Result<Vec<BlockKey>> {
    let kb = KeyBuilder::new(ns, RankTopology::default())?;
    Ok((0..n)
        .map(|i| {
            let mut h = [0u8; 32];
            h[..8].copy_from_slice(&i.to_le_bytes());
            h[8..16].copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
            kb.key(0, &h).expect("valid hash")
        })
        .collect())
}

/// Runs `f(thread, chunk)` over `items` split into `threads` chunks, returning seconds taken.
fn parallel<T: Sync>(threads: usize, items: &[T], f: impl Fn(&[T]) + Sync) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for chunk in items.chunks(items.len().div_ceil(threads).max(1)) {
            let f = &f;
            s.spawn(move || f(chunk));
        }
    });
    t0.elapsed().as_secs_f64()
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(a.objects > 0, "--objects must be greater than 0");
    ensure!(a.object_bytes > 0, "--object-bytes must be greater than 0");
    ensure!(a.lookup_batch > 0, "--lookup-batch must be greater than 0");
    let threads = a
        .threads
        .unwrap_or_else(crate::common::default_threads)
        .max(1);
    let footprint = umbp_pool::alloc::size_class(a.object_bytes);
    // Room for every object below the 0.9 high watermark.
    let capacity = (a.objects * footprint * 100 / 85).next_multiple_of(1 << 20);
    progress!(
        "pool of {:.2} GiB for {} objects of {} bytes, {threads} threads",
        capacity as f64 / (1u64 << 30) as f64,
        a.objects,
        a.object_bytes
    );
    let pool = Arc::new(Pool::new(PoolConfig {
        eviction_policy: a.eviction_policy,
        ..PoolConfig::with_capacity(capacity)
    })?);
    let placement = pool.placement().clone();
    let prefault_s_per_gib = placement.prefault_seconds / (capacity as f64 / (1u64 << 30) as f64);
    let all = keys("bench-pool", a.objects)?;

    progress!("reserve → write → commit of {} objects", a.objects);
    let secs = parallel(threads, &all, |chunk| {
        for k in chunk {
            let mut r = pool
                .reserve(a.object_bytes)
                .expect("room below the high watermark");
            r.as_mut_slice()[..8.min(a.object_bytes as usize)].fill(1);
            pool.commit(r, *k);
        }
    });
    let reserve_commit_per_s = a.objects as f64 / secs;
    ensure!(
        pool.stats().objects == a.objects,
        "objects missing after the fill"
    );

    progress!("batch lookups ({} keys per batch)", a.lookup_batch);
    let lookup = |threads: usize| {
        let mut best = 0f64;
        for _ in 0..3 {
            let secs = parallel(threads, &all, |chunk| {
                for batch in chunk.chunks(a.lookup_batch) {
                    let hits = pool.exists_many(batch);
                    assert!(hits.iter().all(|h| *h), "lookup missed a stored key");
                }
            });
            best = best.max(a.objects as f64 / secs);
        }
        best
    };
    let lookup_keys_per_s = lookup(threads);
    let lookup_keys_per_s_1thread = lookup(1);

    progress!("pinned reads");
    let secs = parallel(threads, &all, |chunk| {
        for k in chunk {
            let g = pool.get(k).expect("stored");
            assert_eq!(g.as_slice()[0], 1);
        }
    });
    let get_per_s = a.objects as f64 / secs;

    progress!(
        "{} more objects into the full pool (eviction)",
        a.objects / 2
    );
    let more = keys("bench-pool-more", a.objects / 2)?;
    let ev0 = pool.stats().evictions;
    let secs = parallel(threads, &more, |chunk| {
        for k in chunk {
            let mut r = pool.reserve(a.object_bytes).expect("eviction makes room");
            r.as_mut_slice()[0] = 2;
            pool.commit(r, *k);
        }
    });
    let s = pool.stats();
    let evictions = s.evictions - ev0;
    let put_with_eviction_per_s = more.len() as f64 / secs;
    let evictions_per_s = evictions as f64 / secs;
    let metadata_ratio = s.metadata_bytes as f64 / s.capacity_bytes as f64;

    println!(
        "pool benchmark: {} objects × {} bytes, {threads} threads",
        a.objects, a.object_bytes
    );
    println!(
        "  reserve+commit        {:>14.0} objects/s",
        reserve_commit_per_s
    );
    println!(
        "  batch lookup          {:>14.0} keys/s ({:.0} on 1 thread)",
        lookup_keys_per_s, lookup_keys_per_s_1thread
    );
    println!("  pinned read           {:>14.0} objects/s", get_per_s);
    println!(
        "  put with eviction     {:>14.0} objects/s ({} evictions, {:.0}/s)",
        put_with_eviction_per_s, evictions, evictions_per_s
    );
    println!(
        "  metadata              {:>14} bytes = {:.3}% of capacity",
        s.metadata_bytes,
        metadata_ratio * 100.0
    );
    println!("  prefault              {:>14.3} s/GiB", prefault_s_per_gib);
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "pool",
                "eviction_policy": a.eviction_policy.as_str(),
                "objects": a.objects,
                "object_bytes": a.object_bytes,
                "threads": threads,
                "capacity_bytes": s.capacity_bytes,
                "reserve_commit_per_s": reserve_commit_per_s,
                "lookup_keys_per_s": lookup_keys_per_s,
                "lookup_keys_per_s_1thread": lookup_keys_per_s_1thread,
                "get_per_s": get_per_s,
                "put_with_eviction_per_s": put_with_eviction_per_s,
                "evictions": evictions,
                "evictions_per_s": evictions_per_s,
                "metadata_bytes": s.metadata_bytes,
                "metadata_ratio": metadata_ratio,
                "prefault_s_per_gib": prefault_s_per_gib,
            })
        );
    }
    Ok(())
}
