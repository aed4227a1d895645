//! `umbp bench lookup`: latency of the standalone server's batch lookups, measured from the
//! client: `exists`, `prefix_hits` and `exists_across_ranks` (keys built in the server from
//! block hashes) over batches of which the first half is in the pool.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use umbp_client::{host_share, ClientOptions, SharedHostMemory, StandaloneClient};
use umbp_core::{BlockKey, KeyBuilder, LayerSpec, RankTopology};
use umbp_proto::Endpoint;

use crate::common::progress;
use crate::server_proc::{cpu_seconds, PrivateServer, ServerSpec};

/// Bytes of one stored object (the lookups never read it).
const OBJECT_BYTES: u64 = 4096;
/// Bytes of a block hash.
const HASH_BYTES: usize = 16;
/// The target of p99 latency, microseconds.
const TARGET_P99_US: f64 = 1000.0;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A running server's socket (default: start a private server on a temporary socket).
    #[arg(long)]
    endpoint: Option<String>,
    /// The private server's executable (default: next to this `umbp`, then PATH).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Keys per batch; the first half are stored first.
    #[arg(long, default_value_t = 8192)]
    keys: usize,
    /// Timed batches of each call.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Ranks of `exists_across_ranks` (TP ranks 0..N; every rank stores the same blocks).
    #[arg(long, default_value_t = 1)]
    ranks: u16,
    /// Untimed batches of each call first.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Copy workers of the private server.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// Latency figures of one call, microseconds, and the CPU time per call of the client and
/// (for a private server) the server process.
#[derive(Debug, Clone, Copy)]
struct Lat {
    p50: f64,
    p99: f64,
    max: f64,
    mean: f64,
    client_cpu: Option<f64>,
    server_cpu: Option<f64>,
}

fn summarize(mut us: Vec<f64>) -> Lat {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Lat {
        p50: at(0.50),
        p99: at(0.99),
        max: *us.last().expect("at least one sample"),
        mean: us.iter().sum::<f64>() / us.len() as f64,
        client_cpu: None,
        server_cpu: None,
    }
}

fn hash_of(block: usize) -> [u8; HASH_BYTES] {
    let mut h = [0u8; HASH_BYTES];
    h[..8].copy_from_slice(&(block as u64).to_le_bytes());
    h[8..].copy_from_slice(&0x756d_6270_6c6b_7570u64.to_le_bytes());
    h
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(a.keys >= 2, "--keys must be at least 2");
    ensure!(a.iters > 0, "--iters must be > 0");
    ensure!(a.ranks >= 1, "--ranks must be at least 1");
    ensure!(a.workers >= 1, "--workers must be at least 1");
    let present = a.keys / 2;
    let ranks: Vec<RankTopology> = (0..a.ranks)
        .map(|tp| RankTopology {
            tp,
            ..RankTopology::default()
        })
        .collect();
    let stored_bytes = present as u64 * OBJECT_BYTES * ranks.len() as u64;
    let server = match &a.endpoint {
        Some(_) => None,
        None => Some(PrivateServer::start(&ServerSpec {
            bin: a.server_bin.clone(),
            capacity: (stored_bytes * 2).max(64 << 20).next_multiple_of(1 << 20),
            workers: a.workers,
            busy_poll_us: None,
            extra_args: Vec::new(),
        })?),
    };
    let endpoint = match (&a.endpoint, &server) {
        (Some(e), _) => Endpoint::parse(e).context("--endpoint")?,
        (None, Some(s)) => s.endpoint.clone(),
        (None, None) => unreachable!("a private server is started without --endpoint"),
    };
    let mut opts = ClientOptions::new(endpoint.clone());
    opts.startup_timeout = Duration::from_secs(10);
    // Generous: a slow batch is a figure to report, not an error.
    opts.lookup_timeout = Duration::from_secs(10);
    let client = StandaloneClient::connect(opts)?;
    let ns = format!("bench-lookup-{}", std::process::id());
    let shm = host_share::alloc_shared_host(present as u64 * OBJECT_BYTES)?;
    let (addr, len) = (shm.span_addr(), shm.span_len());
    let server_pid = server.as_ref().and_then(PrivateServer::pid);
    let result = measure(a, &client, shm, &ns, &ranks, present, server_pid);
    // Leave a shared server as it was.
    if a.endpoint.is_some() {
        if let Err(e) = client.clear(Some(&ns)) {
            eprintln!("umbp: could not remove the benchmark's objects (namespace {ns}): {e}");
        }
    }
    client.close();
    // SAFETY: the mapping alloc_shared_host made, no longer used: the client is closed (the
    // server has a mapping of its own).
    unsafe { libc::munmap(addr as *mut libc::c_void, len as usize) };
    let rows = result?;
    if let Some(s) = server {
        s.stop()?;
    }
    let where_ = match &a.endpoint {
        Some(e) => format!("server at {e}"),
        None => format!("private server, {} copy workers", a.workers),
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?").to_string();
    println!(
        "lookup benchmark: {} keys per batch ({present} present: the first half), {} rank(s), {} timed batches per call, {where_}; {} CPUs, load average {load}",
        a.keys, a.ranks, a.iters, crate::common::default_threads()
    );
    println!("  (cli/srv CPU: CPU µs per call used by this process, every thread, and by the private server)");
    println!(
        "  {:<36} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  p99 ≤ {:.0} µs",
        "call", "p50 µs", "p99 µs", "max µs", "mean µs", "cli CPU", "srv CPU", TARGET_P99_US
    );
    let mut js = serde_json::Map::new();
    for (key, name, l) in &rows {
        let cpu = |c: Option<f64>| c.map_or_else(|| format!("{:>8}", "-"), |c| format!("{c:>8.1}"));
        println!(
            "  {:<36} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {} {}  {}",
            name,
            l.p50,
            l.p99,
            l.max,
            l.mean,
            cpu(l.client_cpu),
            cpu(l.server_cpu),
            if l.p99 <= TARGET_P99_US { "ok" } else { "MISS" }
        );
        js.insert(
            key.to_string(),
            json!({
                "p50_us": l.p50, "p99_us": l.p99, "max_us": l.max, "mean_us": l.mean,
                "client_cpu_us_per_call": l.client_cpu, "server_cpu_us_per_call": l.server_cpu,
            }),
        );
    }
    if a.json {
        let mut out = json!({
            "bench": "lookup",
            "keys": a.keys,
            "present": present,
            "ranks": a.ranks,
            "iters": a.iters,
            "private_server": a.endpoint.is_none(),
            "workers": a.workers,
            "target_p99_us": TARGET_P99_US,
            "cpus": crate::common::default_threads(),
            "load_average": load,
        });
        if let Value::Object(m) = &mut out {
            m.extend(js);
        }
        println!("{out}");
    }
    Ok(())
}

/// (JSON key, label, figures) of each call.
type Rows = Vec<(&'static str, String, Lat)>;

/// Stores the present half for every rank through `shm`, then times the calls.
fn measure(
    a: &Args,
    client: &StandaloneClient,
    shm: SharedHostMemory,
    ns: &str,
    ranks: &[RankTopology],
    present: usize,
    server_pid: Option<u32>,
) -> Result<Rows> {
    let base = KeyBuilder::new(ns, RankTopology::default())?;
    let start = shm.span_addr() + shm.offset_in_span();
    let bytes = present as u64 * OBJECT_BYTES;
    // SAFETY: the fresh mapping of at least `bytes` bytes alloc_shared_host made, used by
    // nobody else yet (the server maps it only once registered below).
    let buf = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, bytes as usize) };
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    {
        client.register_shared_host(shm)?;
        let layout = client.register_layout(vec![vec![LayerSpec {
            base_addr: start,
            num_blocks: present as u64,
            block_stride: OBJECT_BYTES,
            block_bytes: OBJECT_BYTES,
        }]])?;
        let block_ids: Vec<u64> = (0..present as u64).collect();
        for r in ranks {
            let kb = base.with_ranks(*r);
            let keys: Vec<BlockKey> = (0..present)
                .map(|i| kb.key(0, &hash_of(i)))
                .collect::<Result<_, _>>()?;
            let st = client.store(layout.id, 0, &block_ids, &keys)?.wait(None)?;
            if let Some((i, s)) = st.iter().enumerate().find(|(_, s)| !s.is_ok()) {
                bail!("storing the present half failed at key {i}: {s:?}");
            }
        }
        progress!(
            "stored {present} objects of {OBJECT_BYTES} B for each of {} rank(s)",
            ranks.len()
        );
        let keys: Vec<BlockKey> = (0..a.keys)
            .map(|i| base.key(0, &hash_of(i)))
            .collect::<Result<_, _>>()?;
        let hashes: Vec<u8> = (0..a.keys).flat_map(hash_of).collect();
        let n = a.keys;
        let mut rows = Vec::new();
        let mut time =
            |key: &'static str, name: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
                for _ in 0..a.warmup {
                    f()?;
                }
                let mut us = Vec::with_capacity(a.iters);
                let cpu0 = (
                    cpu_seconds(None),
                    server_pid.and_then(|p| cpu_seconds(Some(p))),
                );
                for _ in 0..a.iters {
                    let t0 = Instant::now();
                    f()?;
                    us.push(t0.elapsed().as_secs_f64() * 1e6);
                }
                let cpu1 = (
                    cpu_seconds(None),
                    server_pid.and_then(|p| cpu_seconds(Some(p))),
                );
                let n_calls = us.len() as f64;
                let per_call = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / n_calls);
                let mut l = summarize(us);
                l.client_cpu = per_call(cpu0.0, cpu1.0);
                l.server_cpu = per_call(cpu0.1, cpu1.1);
                progress!(
                    "{name}: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
                    l.p50,
                    l.p99,
                    l.max
                );
                rows.push((key, name.to_string(), l));
                Ok(())
            };
        time("exists", "exists", &mut || {
            let found = client.exists(&keys)?;
            let hits = found.iter().filter(|p| **p).count();
            ensure!(
                found.len() == n && hits == present && found[..present].iter().all(|p| *p),
                "exists answered {hits} of {n} present, expected the first {present}"
            );
            Ok(())
        })?;
        time("prefix_hits", "prefix_hits", &mut || {
            let p = client.prefix_hits(&keys)?;
            ensure!(p == present, "prefix_hits answered {p}, expected {present}");
            Ok(())
        })?;
        time(
            "exists_across_ranks",
            &format!("exists_across_ranks ({} ranks)", ranks.len()),
            &mut || {
                let (found, prefix) =
                    client.exists_across_ranks(ns, ranks, 0, &hashes, HASH_BYTES as u32, false)?;
                let hits = found.iter().filter(|p| **p).count();
                ensure!(
                found.len() == n && hits == present && prefix == present,
                "exists_across_ranks answered {hits} of {n} present (prefix {prefix}), expected {present}"
            );
                Ok(())
            },
        )?;
        time(
            "exists_across_ranks_prefix",
            &format!("exists_across_ranks prefix ({} ranks)", ranks.len()),
            &mut || {
                let (_, prefix) =
                    client.exists_across_ranks(ns, ranks, 0, &hashes, HASH_BYTES as u32, true)?;
                ensure!(
                    prefix == present,
                    "exists_across_ranks (prefix only) answered {prefix}, expected {present}"
                );
                Ok(())
            },
        )?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_the_sorted_samples() {
        let l = summarize((1..=100).rev().map(f64::from).collect());
        assert_eq!(l.p50, 51.0);
        assert_eq!(l.p99, 99.0);
        assert_eq!(l.max, 100.0);
        assert!((l.mean - 50.5).abs() < 1e-9);
    }
}
