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
use umbp_core::{
    GroupLayout, Integrity, KeyBuilder, KeyOutcome, LayerSpec, PoolConfig, RankTopology,
};
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
    /// Integrity settings to measure side by side (comma-separated: off, sample, all), each
    /// with a pool and engine of its own, rounds interleaved; printed as ratios to the first.
    /// Also prints the checksum's own speed beside CRC32C's.
    #[arg(long, value_delimiter = ',', default_value = "off")]
    verify: Vec<String>,
    /// With `sample` in --verify: one load in this many verifies its object.
    #[arg(long, default_value_t = umbp_core::options::INTEGRITY_SAMPLE_EVERY.default_u64())]
    sample_every: u64,
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
    let settings = a
        .verify
        .iter()
        .map(|v| Integrity::from_options(v.trim(), a.sample_every))
        .collect::<Result<Vec<_>, _>>()?;
    ensure!(!settings.is_empty(), "--verify needs at least one setting");
    // One pool and engine per setting, alive together so the rounds interleave (a machine
    // whose speed drifts moves every setting alike).
    let mover: Arc<dyn Mover> = match a.batch_blocks {
        Some(n) => Arc::new(Batched(n.max(1))),
        None => Arc::new(HostMover),
    };
    let batch = mover.batch_size(object_bytes, a.layers as usize);
    let mut arms = Vec::new();
    for &integrity in &settings {
        let pool = Arc::new(Pool::new(PoolConfig {
            integrity,
            ..PoolConfig::with_capacity(capacity)
        })?);
        let registry = Arc::new(MemoryRegistry::new());
        // SAFETY: `cache` lives until the end of this function, after the engines are closed.
        unsafe { registry.register(base, cache_len as u64, MemoryKind::Host)? };
        let engine = CopyEngine::new(Arc::clone(&pool), registry, Arc::clone(&mover), workers)?;
        arms.push(Arm {
            integrity,
            pool,
            engine,
            store: f64::MAX,
            load: f64::MAX,
        });
    }
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

    let ceil_src = vec![1u8; total as usize];
    let mut ceil_dst = vec![0u8; total as usize];
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
        let contiguous: Vec<f64> = candidates
            .iter()
            .map(|&c| contiguous_copy(&ceil_src, &mut ceil_dst, workers, c))
            .collect();
        for arm in &mut arms {
            arm.pool.clear();
            // What this store reads (an earlier arm's load may have written source blocks).
            let expected: Vec<Vec<u8>> = if round == 0 {
                sources
                    .iter()
                    .take(16)
                    .map(|&b| block_bytes(&cache, &layout, b))
                    .collect()
            } else {
                Vec::new()
            };
            let t0 = Instant::now();
            let job = arm
                .engine
                .submit(Direction::Store, keys.clone(), layout.plan(&sources)?)?;
            let s = wait(job)?.max(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            let job = arm
                .engine
                .submit(Direction::Load, keys.clone(), layout.plan(&targets)?)?;
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
                continue;
            }
            progress!(
                "round {round}, integrity {}: store {:.2} GB/s, load {:.2} GB/s",
                arm.integrity,
                total as f64 / s / 1e9,
                total as f64 / l / 1e9,
            );
            arm.store = arm.store.min(s);
            arm.load = arm.load.min(l);
        }
        if round == 0 {
            progress!("warm-up done, restored bytes verified");
            continue;
        }
        progress!(
            "round {round}: contiguous {}",
            candidates
                .iter()
                .zip(&contiguous)
                .map(|(c, t)| format!("{} {:.2} GB/s", c.name(), total as f64 / t / 1e9))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (b, t) in best_contiguous.iter_mut().zip(&contiguous) {
            *b = b.min(*t);
        }
    }
    for arm in &arms {
        arm.engine.close();
        let st = arm.pool.stats();
        ensure!(
            st.corrupt_detected == 0,
            "integrity {}: {} objects failed their checksum",
            arm.integrity,
            st.corrupt_detected
        );
    }
    let gb = |secs: f64| total as f64 / secs / 1e9;
    let first = &arms[0];
    let (store_gbps, load_gbps) = (gb(first.store), gb(first.load));
    let gbps = 2.0 * total as f64 / (first.store + first.load) / 1e9;
    // The ceiling is the fastest contiguous copy of the same bytes: the C library's `memcpy`
    // or any of UMBP's streaming copies this CPU runs.
    let contiguous_gbps: Vec<(HostCopy, f64)> = candidates
        .iter()
        .zip(&best_contiguous)
        .map(|(c, t)| (*c, gb(*t)))
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
    let mut rows = Vec::new();
    if arms.len() > 1 || first.integrity != Integrity::Off {
        println!(
            "integrity (ratios to {}; sample verifies 1 load in {}):",
            first.integrity.as_str(),
            a.sample_every
        );
        println!("  setting      store GB/s  ratio   load GB/s  ratio");
        for arm in &arms {
            let (st, ld) = (gb(arm.store), gb(arm.load));
            println!(
                "  {:<10} {st:>10.2}  {:>5.3}  {ld:>10.2}  {:>5.3}",
                arm.integrity.as_str(),
                st / store_gbps,
                ld / load_gbps
            );
            rows.push(json!({
                "integrity": arm.integrity.as_str(),
                "store_gbps": st,
                "load_gbps": ld,
                "store_ratio": st / store_gbps,
                "load_ratio": ld / load_gbps,
            }));
        }
        let hs = checksum_speeds();
        println!(
            "checksum speed, one thread (GB/s): xxh3-64 {:.2} hot / {:.2} cold; crc32c {:.2} hot / {:.2} cold",
            hs.xxh3_hot, hs.xxh3_cold, hs.crc_hot, hs.crc_cold
        );
        rows.push(json!({
            "checksum_gbps": {
                "xxh3_hot": hs.xxh3_hot, "xxh3_cold": hs.xxh3_cold,
                "crc32c_hot": hs.crc_hot, "crc32c_cold": hs.crc_cold,
            }
        }));
    }
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
                "ratio": ratio,
                "store_ratio": store_gbps / ceiling_gbps,
                "load_ratio": load_gbps / ceiling_gbps,
                "integrity": rows,
                "engine_copy": engine_copy.name(),
                "batch_blocks": batch,
                "engine_copy_how": if a.host_copy == "auto" { cal.how } else { "--host-copy" },
                "calibration_gbps": cal.gbps.iter().map(|(c, g)| (c.name(), *g)).collect::<std::collections::BTreeMap<_, _>>(),
                "contiguous_gbps": contiguous_gbps.iter().map(|(c, g)| (c.name(), *g)).collect::<std::collections::BTreeMap<_, _>>(),
            })
        );
    }
    drop(arms);
    drop(cache);
    Ok(())
}

/// One integrity setting's pool, engine and best times.
struct Arm {
    integrity: Integrity,
    pool: Arc<Pool>,
    engine: CopyEngine,
    store: f64,
    load: f64,
}

/// How fast one thread checksums: the pool's XXH3-64 and CRC32C (hardware instructions where
/// the CPU has them), on 32 KiB in cache ("hot") and on 256 MiB read once ("cold").
struct HashSpeeds {
    xxh3_hot: f64,
    xxh3_cold: f64,
    crc_hot: f64,
    crc_cold: f64,
}

fn checksum_speeds() -> HashSpeeds {
    const HOT: usize = 32 << 10;
    const COLD: usize = 256 << 20;
    let buf: Vec<u8> = (0..COLD)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let best = |f: &dyn Fn() -> u64, bytes: usize, reps: usize| -> f64 {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            let mut acc = 0u64;
            for _ in 0..reps {
                acc ^= f();
            }
            std::hint::black_box(acc);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        (bytes * reps) as f64 / best / 1e9
    };
    let hot = &buf[..HOT];
    let reps = (1usize << 30) / HOT;
    let chunks = |f: fn(&[u8]) -> u64| buf.chunks(HOT).fold(0u64, |a, c| a ^ f(c));
    HashSpeeds {
        xxh3_hot: best(
            &|| umbp_pool::checksum(std::hint::black_box(hot)),
            HOT,
            reps,
        ),
        xxh3_cold: best(&|| chunks(umbp_pool::checksum), COLD, 1),
        crc_hot: best(
            &|| u64::from(crc32c::crc32c(std::hint::black_box(hot))),
            HOT,
            reps,
        ),
        crc_cold: best(&|| chunks(|c| u64::from(crc32c::crc32c(c))), COLD, 1),
    }
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
