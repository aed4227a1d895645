//! `umbp ping`, `umbp stats` and `umbp clear`: operations on a running standalone server.
//!
//! They speak the protocol directly ([`crate::raw::Raw`]) and never attach a session, so they neither
//! show up in the statistics they read nor wait for a server that is not there.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde_json::json;
use umbp_proto::{Endpoint, DEFAULT_ENDPOINT};

use crate::common::human_bytes;
use crate::raw::Raw;

/// Where the server is and how long to wait for it.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The server's socket: unix:///abs/path or /abs/path (its --address).
    #[arg(long, env = "UMBP_STANDALONE_ADDRESS", default_value = DEFAULT_ENDPOINT)]
    endpoint: String,
    /// How long to wait for the answer, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

impl Target {
    fn raw(&self) -> Result<Raw> {
        let ep = Endpoint::parse(&self.endpoint).context("--endpoint / UMBP_STANDALONE_ADDRESS")?;
        Raw::new(ep, Duration::from_millis(self.timeout_ms.max(1)))
    }
}

#[derive(Debug, clap::Args)]
pub struct PingArgs {
    #[command(flatten)]
    target: Target,
}

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    target: Target,
    /// Print one JSON object (raw numbers) instead of the table; with --watch, one per refresh.
    #[arg(long)]
    json: bool,
    /// Refresh a one-screen summary every SECS seconds (default 2): occupancy, hit rate over
    /// the last minute, GB/s each way, evictions, sessions, remote tier.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// With --watch: stop after this many refreshes (default: until interrupted).
    #[arg(long, requires = "watch")]
    count: Option<u64>,
    /// Embedded engines instead of the server (--endpoint is then unused): the connector's
    /// `lookup_dir`, whose workers' lookup sockets are asked what their pools hold (with
    /// --watch, or once).
    #[arg(long, value_name = "DIR")]
    lookup_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ClearArgs {
    #[command(flatten)]
    target: Target,
    /// Remove only the objects of this key namespace (default: every object of every engine).
    #[arg(long)]
    namespace: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct PinsArgs {
    #[command(flatten)]
    target: Target,
    /// Only the pins of this key namespace (the name an engine's keys are built with).
    #[arg(long)]
    namespace: Option<String>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// `3d 4h 5m 6.7s`-style duration.
fn human_duration(ms: u64) -> String {
    let s = ms / 1000;
    let (d, h, m) = (s / 86400, s / 3600 % 24, s / 60 % 60);
    let secs = (ms % 60_000) as f64 / 1000.0;
    match (d, h, m) {
        (0, 0, 0) => format!("{secs:.1}s"),
        (0, 0, _) => format!("{m}m {secs:.0}s"),
        (0, _, _) => format!("{h}h {m}m {secs:.0}s"),
        _ => format!("{d}d {h}h {m}m"),
    }
}

pub fn ping(a: &PingArgs) -> Result<()> {
    let raw = a.target.raw()?;
    let t0 = Instant::now();
    let r = raw.ping()?;
    let rtt = t0.elapsed();
    println!("UMBP server at {}", raw.endpoint);
    println!("  boot id   {}", r.boot_id);
    println!("  version   {}", r.version);
    println!(
        "  uptime    {} ({} ms)",
        human_duration(r.uptime_ms),
        r.uptime_ms
    );
    println!("  answered  in {:.3} ms", rtt.as_secs_f64() * 1e3);
    Ok(())
}

/// `umbp pins`: a standalone server's live pins by key namespace.
pub fn pins(a: &PinsArgs) -> Result<()> {
    let raw = a.target.raw()?;
    let want = match &a.namespace {
        Some(n) => Some(
            umbp_core::KeyBuilder::new(n, umbp_core::RankTopology::default())
                .map_err(|e| anyhow!("--namespace {n:?}: {e}"))?
                .namespace_id(),
        ),
        None => None,
    };
    let rows: Vec<_> = raw
        .pins()?
        .namespaces
        .into_iter()
        .filter(|p| want.is_none_or(|w| p.namespace_id == w))
        .collect();
    if a.json {
        let list: Vec<_> = rows
            .iter()
            .map(|p| {
                json!({
                    "namespace_id": umbp_core::key::hex(&p.namespace_id),
                    "objects": p.objects,
                    "bytes": p.bytes,
                    "soonest_ms": p.soonest_ms,
                    "latest_ms": p.latest_ms,
                })
            })
            .collect();
        println!(
            "{}",
            json!({ "endpoint": raw.endpoint.to_string(), "namespaces": list })
        );
        return Ok(());
    }
    println!("pins of the UMBP server at {}", raw.endpoint);
    if rows.is_empty() {
        println!("  none");
        return Ok(());
    }
    println!(
        "  {:<32}  {:>8}  {:>10}  runs out in",
        "namespace id", "objects", "bytes"
    );
    for p in &rows {
        println!(
            "  {:<32}  {:>8}  {:>10}  {} to {}",
            umbp_core::key::hex(&p.namespace_id),
            p.objects,
            human_bytes(p.bytes),
            human_duration(p.soonest_ms),
            human_duration(p.latest_ms)
        );
    }
    Ok(())
}

pub fn stats(a: &StatsArgs) -> Result<()> {
    if a.watch.is_some() || a.lookup_dir.is_some() {
        let timeout = Duration::from_millis(a.target.timeout_ms.max(1));
        let source = match &a.lookup_dir {
            Some(dir) => crate::watch::Source::Engines {
                dir: dir.clone(),
                timeout,
            },
            None => crate::watch::Source::Server(Box::new(a.target.raw()?)),
        };
        let every = a.watch.unwrap_or(0.0);
        if a.watch.is_some() && !(0.1..=86_400.0).contains(&every) {
            return Err(anyhow!(
                "--watch {every}: give a number of seconds from 0.1 to 86400"
            ));
        }
        let count = if a.watch.is_some() { a.count } else { Some(1) };
        let once = a.watch.is_none();
        return crate::watch::run(&source, Duration::from_secs_f64(every), count, a.json, once);
    }
    let raw = a.target.raw()?;
    let s = raw.stats()?;
    let p: umbp_pool::PoolCounters = umbp_proto::counters::pool_counters(&s);
    let remote: Option<umbp_store::RemoteStats> = s
        .remote
        .as_ref()
        .map(|r| umbp_proto::counters::from_wire(&r.counters));
    let disk: Option<umbp_store::DiskStats> = s
        .disk
        .as_ref()
        .map(|d| umbp_proto::counters::from_wire(&d.counters));
    let pins: Option<umbp_pool::KeepStats> = s
        .pins
        .as_ref()
        .map(|p| umbp_proto::counters::from_wire(&p.counters));
    if a.json {
        let mut out = json!({
            "endpoint": raw.endpoint.to_string(),
            "boot_id": s.boot_id,
            "sessions": s.sessions,
            "registrations": s.registrations,
            "layouts": s.layouts,
            "transfers_in_flight": s.transfers_in_flight,
            "pending_descriptors": s.pending_descriptors,
            "stores": s.stores,
            "loads": s.loads,
            "store_bytes": s.store_bytes,
            "load_bytes": s.load_bytes,
            "placement": s.placement,
            "cuda_imports": s.cuda_imports,
            "channel_transfers": s.channel_transfers,
            "transfer_channels": s.transfer_channels,
            "integrity": s.integrity,
            "integrity_sample_every": s.integrity_sample_every,
            "remote": remote.as_ref().map(counters_json),
            "disk": disk.as_ref().map(counters_json),
            "pins": pins.as_ref().map(counters_json),
        });
        // Every pool counter by its model's name, beside the rest.
        if let (Some(o), serde_json::Value::Object(pool)) = (out.as_object_mut(), counters_json(&p))
        {
            o.extend(pool);
        }
        println!("{out}");
        return Ok(());
    }
    let pct = |n: u64, d: u64| {
        if d == 0 {
            String::new()
        } else {
            format!(" ({:.1} %)", 100.0 * n as f64 / d as f64)
        }
    };
    let b = |n: u64| {
        if n < 1024 {
            format!("{n} B")
        } else {
            format!("{} ({n} B)", human_bytes(n))
        }
    };
    println!("UMBP server at {} (boot id {})", raw.endpoint, s.boot_id);
    println!("pool");
    println!("  capacity             {}", b(p.capacity_bytes));
    println!(
        "  used                 {}{}",
        b(p.used_bytes),
        pct(p.used_bytes, p.capacity_bytes)
    );
    println!("  objects              {}", p.objects);
    println!("  metadata             {}", b(p.metadata_bytes));
    println!("  placement            {}", s.placement);
    println!("  reservations         {}", p.reservations);
    println!("  pinned               {}", p.pinned);
    println!("lookups");
    println!(
        "  hits                 {}{}",
        p.hits,
        pct(p.hits, p.hits + p.misses)
    );
    println!("  misses               {}", p.misses);
    println!(
        "  leases               {} taken, {} used by loads, {} expired, {} refused, {} ended, {} held ({})",
        p.leases,
        p.leases_released,
        p.leases_expired,
        p.leases_refused,
        p.leases_ended,
        p.leases_active,
        b(p.leased_bytes)
    );
    println!("pool objects");
    println!("  puts                 {}", p.puts);
    println!("  duplicate puts       {}", p.duplicate_puts);
    println!("  gets                 {}", p.gets);
    println!("  evictions            {}", p.evictions);
    println!("  bytes in             {}", b(p.bytes_in));
    println!("  bytes out            {}", b(p.bytes_out));
    println!("integrity");
    println!(
        "  checksums            {}",
        match s.integrity.as_str() {
            "sample" => format!("sample (1 load in {})", s.integrity_sample_every),
            other => other.to_owned(),
        }
    );
    println!("  verified             {}", p.verified);
    println!("  corrupt detected     {}", p.corrupt_detected);
    println!("transfers");
    println!("  stores               {}", s.stores);
    println!("  loads                {}", s.loads);
    println!("  store bytes          {}", b(s.store_bytes));
    println!("  load bytes           {}", b(s.load_bytes));
    println!("  in flight            {}", s.transfers_in_flight);
    println!("  on transfer channels {}", s.channel_transfers);
    println!("clients");
    println!("  sessions             {}", s.sessions);
    println!("  registrations        {}", s.registrations);
    println!("  layouts              {}", s.layouts);
    println!("  cuda imports         {}", s.cuda_imports);
    println!("  transfer channels    {}", s.transfer_channels);
    println!("  pending descriptors  {}", s.pending_descriptors);
    match &remote {
        None => println!("remote tier          off (--remote-url)"),
        Some(r) => {
            println!(
                "remote tier          {}",
                if r.connected {
                    "connected"
                } else {
                    "not connected"
                }
            );
            println!(
                "  lookups              {} keys asked, {} hits, {} misses ({} corrupt), {} timed out, {} skipped",
                r.lookup_keys, r.hits, r.misses, r.corrupt, r.timeouts, r.skipped_lookups
            );
            println!("  fetched              {}", b(r.bytes_fetched));
            println!(
                "  writes               {} ({}), {} dropped, {} evicted first, backlog {}",
                r.writes,
                b(r.bytes_written),
                r.writes_dropped,
                r.writes_evicted,
                b(r.backlog_bytes)
            );
            println!("  errors               {}", r.errors);
        }
    }
    if let Some(p) = &pins {
        println!(
            "pins                 {} objects ({}); {} granted, {} renewed, {} released, {} expired, {} refused, {} ended",
            p.pinned,
            b(p.pinned_bytes),
            p.granted,
            p.renewed,
            p.released,
            p.expired,
            p.refused,
            p.ended
        );
    }
    match &disk {
        None => println!("disk tier            off (--disk-dir)"),
        Some(d) => {
            println!(
                "disk tier            {}{}",
                b(d.used_bytes),
                pct(d.used_bytes, d.capacity_bytes)
            );
            println!(
                "  objects              {} ({} found at start-up in {} ms)",
                d.objects,
                d.rebuilt_objects,
                d.rebuild_us / 1000
            );
            println!(
                "  writes               {} ({}), {} dropped, {} errors, backlog {}",
                d.writes,
                b(d.bytes_written),
                d.writes_dropped,
                d.write_errors,
                b(d.backlog_bytes)
            );
            println!(
                "  lookups              {} keys asked, {} promoted, {} misses ({} corrupt), {} timed out, {} read errors",
                d.lookup_keys, d.hits, d.misses, d.corrupt, d.timeouts, d.read_errors
            );
            println!("  read                 {}", b(d.bytes_read));
            println!("  segments evicted     {}", d.segments_evicted);
            println!(
                "  eager                {} queued on store ({} left the pool first), {} evicted already on disk",
                d.eager_queued, d.eager_gone, d.already_present
            );
            println!(
                "  evictions            {} queued ({} copied out for full-pool stores), {} dropped, {} on disk already",
                d.evicted_queued, d.evicted_copied, d.evicted_dropped, d.already_present
            );
            println!("  removed              {}", d.removed);
        }
    }
    Ok(())
}

pub fn clear(a: &ClearArgs) -> Result<()> {
    let ns = a.namespace.as_deref().filter(|n| !n.is_empty());
    if let Some(n) = ns {
        umbp_core::KeyBuilder::new(n, Default::default())
            .map_err(|e| anyhow!("--namespace {n:?}: {e}"))?;
    }
    let raw = a.target.raw()?;
    let removed = raw.clear(ns)?;
    match ns {
        Some(n) => println!(
            "removed {removed} objects of namespace {n:?} from the UMBP server at {}",
            raw.endpoint
        ),
        None => println!(
            "removed {removed} objects (every namespace) from the UMBP server at {}",
            raw.endpoint
        ),
    }
    Ok(())
}

/// A group of counters as a JSON object, every field of its model by name (a flag as a bool).
fn counters_json<S: umbp_core::CounterSet>(s: &S) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (f, v) in s.pairs() {
        let v = match f.kind {
            umbp_core::CounterKind::Flag => json!(v != 0),
            umbp_core::CounterKind::Counter | umbp_core::CounterKind::Gauge => json!(v),
        };
        m.insert(f.name.to_owned(), v);
    }
    serde_json::Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_durations_read_well() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(64 << 30), "64.00 GiB");
        assert_eq!(human_duration(1500), "1.5s");
        assert_eq!(human_duration(61_000), "1m 1s");
        assert_eq!(human_duration(3_600_000 + 120_000), "1h 2m 0s");
        assert_eq!(human_duration(2 * 86_400_000), "2d 0h 0m");
    }

    #[test]
    fn an_absent_server_is_named_with_the_fix() {
        let ep = Endpoint::parse("/nonexistent-umbp-dir/x.sock").unwrap();
        let raw = Raw::new(ep, Duration::from_secs(2)).unwrap();
        let e = format!("{:#}", raw.ping().unwrap_err());
        assert!(
            e.contains("no socket at /nonexistent-umbp-dir/x.sock"),
            "{e}"
        );
        assert!(e.contains("UMBP_STANDALONE_ADDRESS"), "{e}");
    }
}
