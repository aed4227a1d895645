use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde_json::json;
use umbp_copy::memcpy::{self, HostCopy};
use umbp_copy::{
    BlockCopy, CopyEngine, Direction, HostMover, MemoryKind, MemoryRegistry, MoveResult, Mover,
    OrderToken,
};
use umbp_core::{GroupLayout, KeyBuilder, KeyOutcome, LayerSpec, PoolConfig, RankTopology};
use umbp_pool::Pool;

use crate::common::progress;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Layers per block.
    #[arg(long, default_value_t = 32)]
    layers: u64,
    /// Bytes of one layer of one block (one contiguous piece).
    #[arg(long, default_value_t = 32 * 1024)]
    piece_bytes: u64,
    /// Random blocks moved each way per round.
    #[arg(long, default_value_t = 1000)]
    blocks: u64,
    /// Blocks in the KV cache the random blocks are drawn from.
    #[arg(long, default_value_t = 1500)]
    cache_blocks: u64,
    /// Copy worker threads (default: every core).
    #[arg(long)]
    workers: Option<usize>,
    /// Measured rounds (the best of each is reported).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// The engine's bulk copy: `auto` (what the engine measured fastest at its start) or one
    /// of `stream16`, `stream32`, `stream64`, `libc` (the same as `UMBP_HOST_COPY`).
    #[arg(long, default_value = "auto")]
    host_copy: String,
    /// Blocks each worker copies per call (default: the host mover's own choice).
    #[arg(long)]
    batch_blocks: Option<usize>,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// The host mover with another number of blocks per call, to measure the engine's batching.
#[derive(Debug)]
struct Batched(usize);

impl Mover for Batched {
    fn batch_size(&self, _object_bytes: u64, _pieces_per_block: usize) -> usize {
        self.0
    }

    unsafe fn gather(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        // SAFETY: forwarded contract.
        unsafe { HostMover.gather(blocks, after) }
    }

    unsafe fn scatter(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        // SAFETY: forwarded contract.
        unsafe { HostMover.scatter(blocks, after) }
    }
}

/// Copy of `src` into `dst` split over `threads` threads with `how`; seconds taken.
fn contiguous_copy(src: &[u8], dst: &mut [u8], threads: usize, how: HostCopy) -> f64 {
    let per = src.len().div_ceil(threads);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (d, sc) in dst.chunks_mut(per).zip(src.chunks(per)) {
            s.spawn(move || {
                // SAFETY: `d` and `sc` are equal-length, distinct buffers; `how` is supported.
                unsafe { memcpy::copy_with(how, d.as_mut_ptr(), sc.as_ptr(), d.len()) };
                memcpy::fence();
            });
        }
    });
    t0.elapsed().as_secs_f64()
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(
        a.layers > 0 && a.piece_bytes > 0,
        "--layers and --piece-bytes must be > 0"
    );
    ensure!(a.blocks > 0, "--blocks must be > 0");
    ensure!(
        a.cache_blocks >= a.blocks,
        "--cache-blocks must be at least --blocks"
    );
    ensure!(a.rounds > 0, "--rounds must be > 0");
    let workers = a
        .workers
        .unwrap_or_else(crate::common::default_threads)
        .max(1);
    let object_bytes = a.layers * a.piece_bytes;
    let total = a.blocks * object_bytes;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    progress!(
        "KV cache: {} layers × {} blocks × {} B pieces ({:.2} GiB, layer-first); moving {} random blocks ({:.2} GiB) each way, {workers} workers",
        a.layers, a.cache_blocks, a.piece_bytes, gib(a.layers * a.cache_blocks * a.piece_bytes), a.blocks, gib(total)
    );
    let cache_len = (a.layers * a.cache_blocks * a.piece_bytes) as usize;
    let mut cache: Vec<u8> = Vec::with_capacity(cache_len);
    cache.extend((0..cache_len / 8).flat_map(|i| (i as u64 ^ 0x5A5A).to_le_bytes()));
    cache.resize(cache_len, 0);
    let base = cache.as_ptr() as u64;
    let layout = GroupLayout::new(
        (0..a.layers)
            .map(|l| LayerSpec {
                base_addr: base + l * a.cache_blocks * a.piece_bytes,
                num_blocks: a.cache_blocks,
                block_stride: a.piece_bytes,
                block_bytes: a.piece_bytes,
            })
            .collect(),
    )?;
    let capacity = (total * 5 / 4).next_multiple_of(1 << 20);
    let pool = Arc::new(Pool::new(PoolConfig::with_capacity(capacity))?);
    let registry = Arc::new(MemoryRegistry::new());
    // SAFETY: `cache` lives until the end of this function, after the engine is closed.
    unsafe { registry.register(base, cache_len as u64, MemoryKind::Host)? };
    let mover: Arc<dyn Mover> = match a.batch_blocks {
        Some(n) => Arc::new(Batched(n.max(1))),
        None => Arc::new(HostMover),
    };
    let batch = mover.batch_size(object_bytes, a.layers as usize);
    let engine = CopyEngine::new(Arc::clone(&pool), registry, mover, workers)?;
    let cal = memcpy::calibrate(workers).clone();
    if a.host_copy != "auto" {
        let Some(c) = HostCopy::from_name(&a.host_copy) else {
            bail!(
                "--host-copy {}: not one of auto, stream16, stream32, stream64, libc",
                a.host_copy
            );
        };
        ensure!(
            memcpy::set(c),
            "--host-copy {}: this CPU cannot run it",
            a.host_copy
        );
    }
    let engine_copy = memcpy::chosen();
    progress!(
        "engine copy: {} ({}; measured at start, GB/s: {})",
        engine_copy.name(),
        if a.host_copy == "auto" {
            cal.how
        } else {
            "--host-copy"
        },
        cal.gbps
            .iter()
            .map(|(c, g)| format!("{} {g:.1}", c.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let candidates: Vec<HostCopy> = HostCopy::ALL
        .into_iter()
        .filter(|c| c.supported())
        .collect();
    let kb = KeyBuilder::new("bench-copy", RankTopology::default())?;

    let mut rng = StdRng::seed_from_u64(42);
    let mut ids: Vec<u64> = (0..a.cache_blocks).collect();
    ids.shuffle(&mut rng);
    let sources: Vec<u64> = ids[..a.blocks as usize].to_vec();
    ids.shuffle(&mut rng);
    let targets: Vec<u64> = ids[..a.blocks as usize].to_vec();
    let keys: Vec<_> = sources
        .iter()
        .map(|b| kb.key(0, &b.to_le_bytes()))
        .collect::<Result<_, _>>()?;
    let expected: Vec<Vec<u8>> = sources
        .iter()
        .take(16)
        .map(|&b| block_bytes(&cache, &layout, b))
        .collect();

    let ceil_src = vec![1u8; total as usize];
    let mut ceil_dst = vec![0u8; total as usize];
    let (mut best_store, mut best_load) = (f64::MAX, f64::MAX);
    let mut best_contiguous = vec![f64::MAX; candidates.len()];
    let wait = |job: umbp_copy::JobHandle| -> Result<f64> {
        let t0 = Instant::now();
        let res = job.wait(Duration::from_secs(600))?;
        let secs = t0.elapsed().as_secs_f64();
        if let Some(bad) = res.iter().find(|r| **r != KeyOutcome::Done) {
            bail!("a key did not transfer: {bad:?}");
        }
        Ok(secs)
    };
    for round in 0..=a.rounds {
        pool.clear();
        let contiguous: Vec<f64> = candidates
            .iter()
            .map(|&c| contiguous_copy(&ceil_src, &mut ceil_dst, workers, c))
            .collect();
        let t0 = Instant::now();
        let job = engine.submit(Direction::Store, keys.clone(), layout.plan(&sources)?)?;
        let s = wait(job)?.max(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let job = engine.submit(Direction::Load, keys.clone(), layout.plan(&targets)?)?;
        let l = wait(job)?.max(t0.elapsed().as_secs_f64());
        if round == 0 {
            // Warm-up round: verify bytes, do not time.
            for (i, want) in expected.iter().enumerate() {
                ensure!(
                    &block_bytes(&cache, &layout, targets[i]) == want,
                    "restored block {} differs from stored block {}",
                    targets[i],
                    sources[i]
                );
            }
            progress!("warm-up done, restored bytes verified");
            continue;
        }
        progress!(
            "round {round}: store {:.2} GB/s, load {:.2} GB/s; contiguous {}",
            total as f64 / s / 1e9,
            total as f64 / l / 1e9,
            candidates
                .iter()
                .zip(&contiguous)
                .map(|(c, t)| format!("{} {:.2} GB/s", c.name(), total as f64 / t / 1e9))
                .collect::<Vec<_>>()
                .join(", ")
        );
        best_store = best_store.min(s);
        best_load = best_load.min(l);
        for (b, t) in best_contiguous.iter_mut().zip(&contiguous) {
            *b = b.min(*t);
        }
    }
    engine.close();
    let store_gbps = total as f64 / best_store / 1e9;
    let load_gbps = total as f64 / best_load / 1e9;
    let gbps = 2.0 * total as f64 / (best_store + best_load) / 1e9;
    // The ceiling is the fastest contiguous copy of the same bytes: the C library's `memcpy`
    // or any of UMBP's streaming copies this CPU runs.
    let contiguous_gbps: Vec<(HostCopy, f64)> = candidates
        .iter()
        .zip(&best_contiguous)
        .map(|(c, t)| (*c, total as f64 / t / 1e9))
        .collect();
    let of = |want: fn(&HostCopy) -> bool| {
        contiguous_gbps
            .iter()
            .filter(|(c, _)| want(c))
            .map(|(_, g)| *g)
            .fold(0.0, f64::max)
    };
    let memcpy_gbps = of(|c| *c == HostCopy::Libc);
    let stream_gbps = of(|c| *c != HostCopy::Libc);
    let ceiling_gbps = memcpy_gbps.max(stream_gbps);
    let ratio = gbps / ceiling_gbps;
    println!(
        "copy benchmark: {} blocks × {} layers × {} B, {workers} workers",
        a.blocks, a.layers, a.piece_bytes
    );
    println!(
        "  store (cache → pool)   {store_gbps:>8.2} GB/s  ratio {:.2}",
        store_gbps / ceiling_gbps
    );
    println!(
        "  load  (pool → cache)   {load_gbps:>8.2} GB/s  ratio {:.2}",
        load_gbps / ceiling_gbps
    );
    println!("  both, averaged         {gbps:>8.2} GB/s  ratio {ratio:.2}");
    println!(
        "  contiguous memcpy      {memcpy_gbps:>8.2} GB/s  (C library memcpy, same threads, same bytes)"
    );
    println!(
        "  contiguous streaming   {stream_gbps:>8.2} GB/s  (UMBP's fastest streaming copy; ceiling = the faster: {ceiling_gbps:.2})"
    );
    for (c, g) in &contiguous_gbps {
        println!("    {:<9} {g:>8.2} GB/s contiguous", c.name());
    }
    println!(
        "  engine copy: {} (calibration at start: {})",
        engine_copy.name(),
        cal.gbps
            .iter()
            .map(|(c, g)| format!("{} {g:.1} GB/s", c.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "copy",
                "cpu": cpu_model(),
                "layers": a.layers,
                "piece_bytes": a.piece_bytes,
                "blocks": a.blocks,
                "workers": workers,
                "bytes_each_way": total,
                "store_gbps": store_gbps,
                "load_gbps": load_gbps,
                "gbps": gbps,
                "ceiling_gbps": ceiling_gbps,
                "memcpy_gbps": memcpy_gbps,
                "stream_gbps": stream_gbps,
                "engine_copy": engine_copy.name(),
                "batch_blocks": batch,
                "engine_copy_how": if a.host_copy == "auto" { cal.how } else { "--host-copy" },
                "calibration_gbps": cal.gbps.iter().map(|(c, g)| (c.name(), *g)).collect::<std::collections::BTreeMap<_, _>>(),
                "contiguous_gbps": contiguous_gbps.iter().map(|(c, g)| (c.name(), *g)).collect::<std::collections::BTreeMap<_, _>>(),
                "ratio": ratio,
                "store_ratio": store_gbps / ceiling_gbps,
                "load_ratio": load_gbps / ceiling_gbps,
            })
        );
    }
    drop(cache);
    Ok(())
}

fn block_bytes(cache: &[u8], layout: &GroupLayout, b: u64) -> Vec<u8> {
    let base = cache.as_ptr() as u64;
    layout
        .layers()
        .iter()
        .flat_map(|l| {
            let at = (l.base_addr - base + b * l.block_stride) as usize;
            cache[at..at + l.block_bytes as usize].to_vec()
        })
        .collect()
}

/// The CPU's model name (`/proc/cpuinfo`), for the results.
fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}
