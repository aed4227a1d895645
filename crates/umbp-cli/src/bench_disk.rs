//! `umbp bench disk`: the disk tier's write-behind and promote rates next to raw direct I/O
//! (`O_DIRECT` positioned writes and reads of the same object sizes, on as many threads, in
//! the same directory), in one run; then the restart time of a tier holding many objects.
//!
//! Per object size and round: the raw ceiling writes distinct objects back to back into one
//! preallocated file and reads them back; the tier gets the same objects through its
//! write-behind queue (header, checksum, segment files, index records) until it has drained,
//! and promotes them back in lookups of `--batch` keys into a sink that copies each object
//! out (as the pool's put does). The rates are bytes of objects per second; medians of the
//! rounds are shown.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use umbp_core::BlockKey;
use umbp_disk::{AlignedBuf, DiskConfig, DiskTier, ObjectBytes, Queued, Sink};
use umbp_unix::file::IoFile;

use crate::common::progress;

const GB: f64 = 1e9;
/// The target: the tier's rates against raw direct I/O at 2 MiB objects.
const TARGET_VS_RAW: f64 = 0.8;
/// The target of the restart: index rebuild of `--rebuild-objects` in at most this long.
const TARGET_REBUILD: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory to write in (on the disk to measure; its files are removed afterwards).
    #[arg(long, default_value = "/var/tmp/umbp-bench-disk")]
    dir: PathBuf,
    /// Object sizes in KiB, comma-separated.
    #[arg(long, default_value = "512,2048,8192")]
    object_kib: String,
    /// MiB moved per object size, direction and round.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// I/O threads, for the raw ceiling and the tier alike.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Keys per promote call (one lookup's misses).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Timed rounds; medians are shown.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Objects on disk for the restart measurement (0: skip it).
    #[arg(long, default_value_t = 100_000)]
    rebuild_objects: u32,
    /// Size of those objects in KiB.
    #[arg(long, default_value_t = 4)]
    rebuild_object_kib: u64,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn key(size: u64, n: u64) -> BlockKey {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(&size.to_le_bytes());
    b[8..16].copy_from_slice(&n.to_le_bytes());
    BlockKey::from_bytes(b)
}

/// Distinct objects' bytes: a few random buffers, shared by the objects cycling through them.
struct Sources(Vec<Arc<[u8]>>);

impl Sources {
    fn new(size: usize) -> Sources {
        Sources(
            (0..8)
                .map(|_| {
                    let mut v = vec![0u8; size];
                    rand::fill(&mut v[..]);
                    Arc::from(v)
                })
                .collect(),
        )
    }
    fn get(&self, n: u64) -> Arc<[u8]> {
        Arc::clone(&self.0[n as usize % self.0.len()])
    }
}

struct Shared(Arc<[u8]>);

impl ObjectBytes for Shared {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Runs `f(i)` for i in 0..n on `threads` threads; seconds taken.
fn on_threads(threads: usize, n: usize, f: impl Fn(usize) -> Result<()> + Sync) -> Result<f64> {
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return Ok(());
                        }
                        f(i)?;
                    }
                })
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().expect("bench thread panicked"))
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Raw direct writes then reads of `count` objects of `size` bytes: (write, read) GB/s.
fn raw(dir: &Path, size: u64, count: u64, threads: usize, src: &Sources) -> Result<(f64, f64)> {
    let path = dir.join("raw.dat");
    let f = IoFile::open(&path, true, true).context("opening the raw file")?;
    ensure!(f.is_direct(), "{} does not take O_DIRECT", dir.display());
    f.reserve(size * count)?;
    thread_local!(static BUF: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new()));
    let write = on_threads(threads, count as usize, |i| {
        BUF.with(|b| {
            let mut b = b.borrow_mut();
            let buf = &mut b.get(size as usize)[..size as usize];
            // The same copy into an aligned buffer the tier makes.
            buf.copy_from_slice(&src.get(i as u64));
            f.write_all_at(buf, i as u64 * size)?;
            Ok(())
        })
    })?;
    let read = on_threads(threads, count as usize, |i| {
        BUF.with(|b| {
            let mut b = b.borrow_mut();
            let buf = &mut b.get(size as usize)[..size as usize];
            ensure!(
                f.read_at(buf, i as u64 * size)? == size as usize,
                "short read"
            );
            Ok(())
        })
    })?;
    drop(f);
    std::fs::remove_file(&path)?;
    let bytes = (size * count) as f64;
    Ok((bytes / write / GB, bytes / read / GB))
}

/// The tier's write-behind then promote of the same objects: (write, promote) GB/s.
fn tier(a: &Args, size: u64, count: u64, src: &Sources) -> Result<(f64, f64)> {
    let dir = a.dir.join("tier");
    let total = size * count;
    let mut cfg = DiskConfig::new(&dir, total + total / 4 + (512 << 20));
    cfg.io_threads = a.threads;
    cfg.write_backlog_bytes = total + 1;
    cfg.segment_bytes = 256 << 20;
    let t = DiskTier::open(cfg)?;
    let start = Instant::now();
    for n in 0..count {
        let q = t.enqueue(key(size, n), Box::new(Shared(src.get(n))));
        ensure!(q == Queued::Queued, "object {n} was not queued: {q:?}");
    }
    ensure!(
        t.flush(Duration::from_secs(600)),
        "write-behind did not drain"
    );
    let write = start.elapsed().as_secs_f64();
    ensure!(t.stats().writes == count, "not every object was written");
    thread_local!(static DST: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) });
    let sink: Sink = Arc::new(|_k: &BlockKey, b: &[u8]| {
        DST.with(|d| {
            let mut d = d.borrow_mut();
            d.resize(b.len(), 0);
            d.copy_from_slice(b);
        });
        true
    });
    let keys: Vec<BlockKey> = (0..count).map(|n| key(size, n)).collect();
    let start = Instant::now();
    for chunk in keys.chunks(a.batch) {
        let got = t.promote_prefix(
            chunk,
            Instant::now() + Duration::from_secs(60),
            Arc::clone(&sink),
        );
        ensure!(got == chunk.len(), "promoted {got} of {}", chunk.len());
    }
    let read = start.elapsed().as_secs_f64();
    t.clear();
    drop(t);
    std::fs::remove_dir_all(&dir)?;
    Ok((total as f64 / write / GB, total as f64 / read / GB))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Writes `n` objects, reopens the tier: (objects rebuilt, rebuild time, whole open time).
fn restart(a: &Args) -> Result<(u64, Duration, Duration)> {
    let dir = a.dir.join("restart");
    let size = a.rebuild_object_kib << 10;
    let n = u64::from(a.rebuild_objects);
    let src = Sources::new(size as usize);
    let mut cfg = DiskConfig::new(&dir, (n * (size + 8192)).max(64 << 20) + (512 << 20));
    cfg.io_threads = a.threads;
    cfg.write_backlog_bytes = n * size + 1;
    {
        let t = DiskTier::open(cfg.clone())?;
        let start = Instant::now();
        for i in 0..n {
            t.enqueue(key(size, i), Box::new(Shared(src.get(i))));
        }
        ensure!(
            t.flush(Duration::from_secs(600)),
            "write-behind did not drain"
        );
        ensure!(t.stats().objects == n, "not every object was written");
        progress!(
            "restart: {n} objects of {} KiB written in {:.1} s",
            a.rebuild_object_kib,
            start.elapsed().as_secs_f64()
        );
    }
    let start = Instant::now();
    let t = DiskTier::open(cfg)?;
    let open = start.elapsed();
    let s = t.stats();
    t.clear();
    drop(t);
    std::fs::remove_dir_all(&dir)?;
    Ok((s.rebuilt_objects, Duration::from_micros(s.rebuild_us), open))
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(
        a.threads > 0 && a.batch > 0 && a.rounds > 0,
        "--threads, --batch and --rounds must be above 0"
    );
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let sizes: Vec<u64> = a
        .object_kib
        .split(',')
        .map(|s| s.trim().parse::<u64>().map(|k| k << 10))
        .collect::<Result<_, _>>()
        .context("--object-kib: comma-separated KiB")?;
    println!(
        "disk tier vs raw O_DIRECT in {} ({} threads each, {} MiB per size and round, median of {} rounds; promote in lookups of {} keys)",
        a.dir.display(),
        a.threads,
        a.mib,
        a.rounds,
        a.batch
    );
    println!(
        "{:>8} | {:>10} {:>12} {:>6} | {:>10} {:>12} {:>6}",
        "object", "raw write", "write-behind", "ratio", "raw read", "promote", "ratio"
    );
    let mut rows = Vec::new();
    let mut verdict = true;
    for &size in &sizes {
        let count = ((a.mib << 20) / size).max(1);
        let src = Sources::new(size as usize);
        let (mut rw, mut rr, mut tw, mut tr) = (vec![], vec![], vec![], vec![]);
        for r in 0..a.rounds {
            progress!("{} KiB: round {}", size >> 10, r + 1);
            let (w, rd) = raw(&a.dir, size, count, a.threads, &src)?;
            let (w2, rd2) = tier(a, size, count, &src)?;
            rw.push(w);
            rr.push(rd);
            tw.push(w2);
            tr.push(rd2);
        }
        let (rw, rr, tw, tr) = (median(rw), median(rr), median(tw), median(tr));
        let (wr, pr) = (tw / rw, tr / rr);
        if size == 2 << 20 {
            verdict &= wr >= TARGET_VS_RAW && pr >= TARGET_VS_RAW;
        }
        println!(
            "{:>5} KiB | {:>6.2} GB/s {:>7.2} GB/s {:>6.2} | {:>5.2} GB/s {:>7.2} GB/s {:>6.2}",
            size >> 10,
            rw,
            tw,
            wr,
            rr,
            tr,
            pr
        );
        rows.push(
            json!({"object_bytes": size, "raw_write_gbps": rw, "write_behind_gbps": tw,
            "write_ratio": wr, "raw_read_gbps": rr, "promote_gbps": tr, "promote_ratio": pr}),
        );
    }
    let mut out = json!({"dir": a.dir, "threads": a.threads, "sizes": rows});
    if sizes.contains(&(2 << 20)) {
        println!(
            "target at 2 MiB: write-behind and promote >= {TARGET_VS_RAW} of raw: {}",
            if verdict { "met" } else { "NOT met" }
        );
        out["target_2mib_met"] = Value::Bool(verdict);
    }
    if a.rebuild_objects > 0 {
        let (n, rebuild, open) = restart(a)?;
        let met = rebuild <= TARGET_REBUILD;
        println!(
            "restart: index of {n} objects rebuilt in {:.1} ms (open in all {:.1} ms; target <= {} s: {})",
            rebuild.as_secs_f64() * 1e3,
            open.as_secs_f64() * 1e3,
            TARGET_REBUILD.as_secs(),
            if met { "met" } else { "NOT met" }
        );
        out["restart"] = json!({"objects": n, "rebuild_ms": rebuild.as_secs_f64() * 1e3,
            "open_ms": open.as_secs_f64() * 1e3, "target_met": met});
    }
    if a.json {
        println!("{out}");
    }
    Ok(())
}
