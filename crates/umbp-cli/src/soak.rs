//! `umbp soak`: client processes storing, loading and looking up KV blocks for a given time
//! while the pool under them is restarted and cleared, every loaded byte checked, and every
//! object accounted for at the end.
//!
//! An arm is a pool and its clients. The server arm starts a private `umbp_standalone_server`
//! with a disk tier and N client processes (this executable again, `umbp soak-client`), each
//! attached on the real Unix socket with a KV region of host memory registered. The embedded
//! arm is one client process with N worker threads, each with a session of an embedded store
//! (with a disk tier) that process owns. `--mode both` runs the two at once.
//!
//! Every worker runs a random mix over its own namespace and one all workers of the arm
//! share: stores of runs of keys, loads, and lookups (prefix hits or exists) followed by a
//! load of the hits. A block's bytes are a function of its key and offset, so any worker
//! checks any block it loads, whoever stored it. The pool is smaller than the keys' blocks, so
//! it evicts. Meanwhile the parent restarts the pool (the server by SIGTERM, every Nth time by
//! SIGKILL; the embedded store by a clean close and reopen) and clears a namespace now and
//! then, telling the workers when; it pauses the workers now and then to check the pool's
//! counters (`objects = puts - evictions - removed`), samples RSS and descriptors of every
//! process, and prints a progress line.
//!
//! At the end every worker audits what it saw present: each key is looked up and loaded (and
//! checked) again. A key not found is explained when a SIGKILL came after the last time a
//! worker saw it present (lost at the crash); the rest must be covered by the losses the
//! counters report (dropped writes, dropped disk segments, unreadable objects), or they are
//! unaccounted. A hit on a key of a worker's own namespace that a clear removed (and nobody
//! stored again) with no restart in between is counted too. The soak fails (exit 1) on any
//! wrong byte, any unaccounted key, any identity that does not hold, or a client process that
//! failed.
//!
//! The flags are in `args`, the keys and block bytes in `content`, the figures and the
//! identities in `counts`, the pool connection in `backend`, a worker's mix, ledger and audit
//! in `worker`, the client process in `client`, the parent's side of an arm in `arm`, the
//! samples in `sample`, the verdict in `result` and the printing in `report`; this file runs
//! the arms.

mod args;
mod arm;
mod backend;
mod client;
mod content;
mod counts;
mod findings;
mod report;
mod result;
mod sample;
mod worker;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::json;

pub use args::{Args, ClientArgs, ModeArg};
pub use client::run_client;

use arm::Arm;
use result::evaluate;

/// A fresh private directory for the disk tiers, removed at the end.
struct SoakDir(PathBuf);

impl SoakDir {
    fn new() -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("umbp-soak-{}-{nanos:08x}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| {
            format!(
                "cannot create {} for the disk tiers; set TMPDIR to a writable directory with room for --disk-mib per arm",
                dir.display()
            )
        })?;
        Ok(SoakDir(dir))
    }
}

impl Drop for SoakDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn validate(a: &Args) -> Result<()> {
    ensure!((1..=64).contains(&a.clients), "--clients: 1 to 64");
    ensure!(
        a.layers > 0 && a.piece_kib > 0 && a.piece_kib.is_multiple_of(4),
        "--layers must be > 0 and --piece-kib a positive multiple of 4"
    );
    ensure!(
        a.max_batch > 0 && u64::from(a.max_batch) <= a.slots,
        "--max-batch must be between 1 and --slots ({})",
        a.slots
    );
    ensure!(
        a.private_keys >= a.max_batch && a.shared_keys >= a.max_batch,
        "--private-keys and --shared-keys must be at least --max-batch ({})",
        a.max_batch
    );
    ensure!(
        (0.0..=1.0).contains(&a.shared_fraction),
        "--shared-fraction must be between 0 and 1"
    );
    ensure!(a.pool_mib >= 16, "--pool-mib must be at least 16");
    ensure!(
        a.disk_mib << 20 >= umbp_disk::MIN_CAPACITY,
        "--disk-mib must be at least {}",
        umbp_disk::MIN_CAPACITY >> 20
    );
    ensure!(a.copy_workers > 0, "--copy-workers must be > 0");
    ensure!(
        !a.sample_every.is_zero() && !a.progress_every.is_zero() && !a.check_every.is_zero(),
        "--sample-every, --progress-every and --check-every must be > 0"
    );
    Ok(())
}

/// When a periodic event is due next (never for a zero period); `phase` staggers the arms.
struct Every {
    period: Duration,
    next: Option<Instant>,
}

impl Every {
    fn new(t0: Instant, period: Duration, phase: f64) -> Self {
        Every {
            period,
            next: (!period.is_zero()).then(|| t0 + period.mul_f64(1.0 + phase)),
        }
    }

    /// Whether it is due at `now` (and if so, when it is due next).
    fn due(&mut self, now: Instant) -> bool {
        match self.next {
            Some(n) if now >= n => {
                self.next = Some(now.max(n) + self.period);
                true
            }
            _ => false,
        }
    }
}

pub fn run(a: &Args) -> Result<()> {
    validate(a)?;
    let dir = SoakDir::new()?;
    let mut arms = Vec::new();
    if matches!(a.mode, ModeArg::Server | ModeArg::Both) {
        arms.push(Arm::server(a, &dir.0)?);
    }
    if matches!(a.mode, ModeArg::Embedded | ModeArg::Both) {
        arms.push(Arm::embedded(a, &dir.0)?);
    }
    eprintln!(
        "[umbp soak] running {} for {}: restart every {}, SIGKILL every {} restarts, clear every {}, check every {}",
        arms.iter().map(|x| x.name).collect::<Vec<_>>().join(" and "),
        args::show_duration(a.duration),
        args::show_duration(a.restart_every),
        a.kill_every,
        args::show_duration(a.clear_every),
        args::show_duration(a.check_every),
    );
    let t0 = Instant::now();
    let n = arms.len();
    // Per arm: restart, clear, check; the second arm half a period later.
    let mut timers: Vec<[Every; 3]> = (0..n)
        .map(|i| {
            let phase = i as f64 / 2.0;
            [
                Every::new(t0, a.restart_every, phase),
                Every::new(t0, a.clear_every, phase),
                Every::new(t0, a.check_every, phase * 0.5 + 0.25),
            ]
        })
        .collect();
    let mut sample = Every::new(t0, a.sample_every, -1.0);
    let mut progress = Every::new(t0, a.progress_every, 0.0);
    while t0.elapsed() < a.duration {
        for arm in arms.iter_mut() {
            arm.drain();
        }
        if arms.iter().any(|x| !x.problems.is_empty()) {
            eprintln!("[umbp soak] a client process failed: stopping early");
            break;
        }
        let now = Instant::now();
        if sample.due(now) {
            arms.iter_mut().for_each(Arm::sample);
        }
        for (arm, t) in arms.iter_mut().zip(timers.iter_mut()) {
            if t[0].due(now) {
                arm.restart()
                    .with_context(|| format!("restarting the {} arm's pool", arm.name))?;
            }
            if t[1].due(now) {
                arm.clear()?;
            }
            if t[2].due(now) {
                arm.check()?;
            }
        }
        if progress.due(now) {
            arms.iter_mut().for_each(Arm::refresh);
            report::progress(t0.elapsed(), &arms);
        }
        std::thread::sleep(Duration::from_millis(100).min(a.duration.saturating_sub(t0.elapsed())));
    }
    let ran = t0.elapsed();
    eprintln!(
        "[umbp soak] {}: pausing, checking and auditing",
        args::show_duration(ran)
    );
    for arm in arms.iter_mut() {
        arm.sample();
        arm.finish()
            .with_context(|| format!("finishing the {} arm", arm.name))?;
    }
    let results: Vec<_> = arms.iter().map(evaluate).collect();
    report::summary(a, ran, &arms, &results);
    let ok = results.iter().all(|r| r.ok());
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "soak",
                "ok": ok,
                "duration_s": ran.as_secs_f64(),
                "seed": a.seed,
                "clients": a.clients,
                "layers": a.layers,
                "piece_bytes": a.piece_kib << 10,
                "pool_bytes": a.pool_mib << 20,
                "disk_bytes": a.disk_mib << 20,
                "wrong_bytes": results.iter().map(|r| r.counts.wrong_bytes).sum::<u64>(),
                "unaccounted": results.iter().map(|r| r.unaccounted()).sum::<u64>(),
                "arms": results.iter().zip(&arms).map(|(r, arm)| r.to_json(arm)).collect::<Vec<_>>(),
            })
        );
    }
    if !ok {
        let f: Vec<String> = results.iter().flat_map(|r| r.failures()).collect();
        bail!("the soak found problems: {}", f.join("; "));
    }
    Ok(())
}
