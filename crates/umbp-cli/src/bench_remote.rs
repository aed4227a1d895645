//! `umbp bench remote`: the remote tier's put and get rates next to raw pipelined `SET` / `GET`
//! of the same object sizes against the same Redis, in the same run.
//!
//! Per object size and round: raw `SET`s of distinct values as large as the tier's (header
//! included),
//! in pipelines as deep as the tier's, then raw `GET`s of them; then the tier: one node's pool
//! objects written by its tier until the writer has drained (pinned, headed and checksummed,
//! sent), and fetched by a second node's tier into its own pool (checked, copied in). Every
//! byte fetched is compared.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use redis::cluster::{cluster_pipe, ClusterClientBuilder, ClusterConnection};
use serde_json::{json, Value};
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::Pool;
use umbp_store::{RemoteConfig, WritePolicy};

use crate::common::progress;

const GB: f64 = 1e9;
/// The target: the tier's rates against raw SET / GET.
const TARGET_VS_RAW: f64 = 0.8;
/// Objects per pipeline, as the tier's writer and fetchers use.
const PIPELINE: usize = 32;
/// Bytes of the tier's header on each value.
const HEADER: usize = umbp_remote::object::HEADER_BYTES;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The remote store: redis://host:port or redis+cluster://host:port,... (default: a private
    /// `redis-server` on a free loopback port; needs redis-server on PATH). Keys of its own
    /// are written and deleted; nothing else is touched.
    #[arg(long)]
    url: Option<String>,
    /// Object sizes in KiB, comma-separated.
    #[arg(long, default_value = "512,1024,2048")]
    object_kib: String,
    /// MiB moved per object size, direction and round.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// Timed rounds (after an untimed warm-up); medians are shown.
    #[arg(long, default_value_t = 6)]
    rounds: u32,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Also time a tier with a secret (HMAC-SHA256 values, as with UMBP_REMOTE_SECRET_FILE)
    /// in the same rounds, and print keyed / checksummed.
    #[arg(long)]
    keyed: bool,
}

/// A private `redis-server`, killed on drop.
struct PrivateRedis {
    child: Child,
    port: u16,
}

impl PrivateRedis {
    fn start() -> Result<PrivateRedis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = std::env::temp_dir();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server (apt-get install redis-server, or pass --url)")?;
        let r = PrivateRedis { child, port };
        let t = Instant::now();
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        loop {
            if let Ok(mut c) = client.get_connection() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return Ok(r);
                }
            }
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "redis-server on port {port} never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A raw connection of the same kind the tier makes.
enum Raw {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

impl Raw {
    fn open(target: &umbp_remote::Target) -> Result<Raw> {
        Ok(match target {
            umbp_remote::Target::Single(u) => {
                Raw::Single(redis::Client::open(u.as_str())?.get_connection()?)
            }
            umbp_remote::Target::Cluster(seeds) => Raw::Cluster(Box::new(
                ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                    .build()?
                    .get_connection()?,
            )),
        })
    }

    fn set(&mut self, keys: &[String], values: &[Vec<u8>]) -> Result<()> {
        for (chunk, vals) in keys.chunks(PIPELINE).zip(values.chunks(PIPELINE)) {
            match self {
                Raw::Single(c) => {
                    let mut p = redis::pipe();
                    for (k, v) in chunk.iter().zip(vals) {
                        p.cmd("SET").arg(k).arg(v.as_slice()).ignore();
                    }
                    p.exec(c)?;
                }
                Raw::Cluster(c) => {
                    let mut p = cluster_pipe();
                    for (k, v) in chunk.iter().zip(vals) {
                        p.cmd("SET").arg(k).arg(v.as_slice()).ignore();
                    }
                    p.exec(c)?;
                }
            }
        }
        Ok(())
    }

    /// Bytes received.
    fn get(&mut self, keys: &[String]) -> Result<u64> {
        let mut got = 0u64;
        for chunk in keys.chunks(PIPELINE) {
            let vals: Vec<Option<Vec<u8>>> = match self {
                Raw::Single(c) => {
                    let mut p = redis::pipe();
                    for k in chunk {
                        p.cmd("GET").arg(k);
                    }
                    p.query(c)?
                }
                Raw::Cluster(c) => {
                    let mut p = cluster_pipe();
                    for k in chunk {
                        p.cmd("GET").arg(k);
                    }
                    p.query(c)?
                }
            };
            for v in vals {
                got += v.context("a raw GET found no value")?.len() as u64;
            }
        }
        Ok(got)
    }

    fn del(&mut self, keys: &[String]) -> Result<()> {
        for chunk in keys.chunks(PIPELINE * 8) {
            match self {
                Raw::Single(c) => {
                    let mut p = redis::pipe();
                    for k in chunk {
                        p.cmd("DEL").arg(k).ignore();
                    }
                    p.exec(c)?;
                }
                Raw::Cluster(c) => {
                    let mut p = cluster_pipe();
                    for k in chunk {
                        p.cmd("DEL").arg(k).ignore();
                    }
                    p.exec(c)?;
                }
            }
        }
        Ok(())
    }
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (j, c) in v.chunks_mut(8).enumerate() {
        let x = ((i as u64) << 32 | j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
    v
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of each of the four measurements of one round.
#[derive(Debug, Default)]
struct Times {
    raw_set: Vec<f64>,
    raw_get: Vec<f64>,
    tier_put: Vec<f64>,
    tier_get: Vec<f64>,
    keyed_put: Vec<f64>,
    keyed_get: Vec<f64>,
}

/// The tier's configuration; sealed with the secret in `secret_file` when given, else
/// checksummed (whatever UMBP_REMOTE_SECRET_FILE says).
fn tier_config(url: &str, bytes: u64, secret_file: Option<&std::path::Path>) -> RemoteConfig {
    RemoteConfig {
        write: WritePolicy::Eager,
        timeout: Duration::from_secs(60),
        write_backlog_bytes: bytes * 2,
        secret_file: secret_file.map(std::path::Path::to_path_buf),
        ..RemoteConfig::new(url)
    }
}

/// A secret file of 32 bytes (mode 600) for the keyed rounds; removed on drop.
struct SecretFile(std::path::PathBuf);

impl SecretFile {
    fn new() -> Result<SecretFile> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = std::env::temp_dir().join(format!("umbp-bench-secret-{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let secret: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(73) ^ 0x5A).collect();
        f.write_all(&secret)?;
        Ok(SecretFile(path))
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What one object size's rounds reuse: allocated and faulted in once, so no round pays
/// for page faults the other does not.
struct Fixture {
    size: usize,
    n: usize,
    /// The raw SETs' distinct values (object plus header bytes each).
    values: Vec<Vec<u8>>,
    /// The tier's objects.
    payloads: Vec<Vec<u8>>,
    /// Node A's and node B's pools.
    pa: Arc<Pool>,
    pb: Arc<Pool>,
}

impl Fixture {
    fn new(size: usize, n: usize) -> Result<Fixture> {
        let bytes = (size * n) as u64;
        let cap = ((bytes as f64 * 1.3) as u64 + (64 << 20)).next_multiple_of(2 << 20);
        let mk_pool = || -> Result<Arc<Pool>> {
            Ok(Arc::new(Pool::new(PoolConfig {
                prefault: true,
                ..PoolConfig::with_capacity(cap)
            })?))
        };
        Ok(Fixture {
            size,
            n,
            values: (0..n).map(|i| payload(i + n, size + HEADER)).collect(),
            payloads: (0..n).map(|i| payload(i, size)).collect(),
            pa: mk_pool()?,
            pb: mk_pool()?,
        })
    }
}

/// One round of one size: raw SET and GET, and the tier's put and get, raw first in even
/// rounds and the tier first in odd ones (the machine's state after one must not favour the
/// other).
fn round(
    url: &str,
    raw: &mut Raw,
    f: &Fixture,
    round: u32,
    t: &mut Times,
    secret: Option<&SecretFile>,
) -> Result<()> {
    let keyed = |t: &mut Times| match secret {
        Some(s) => tier_round(url, f, round, t, Some(&s.0)),
        None => Ok(()),
    };
    if round.is_multiple_of(2) {
        raw_round(raw, f, round, t)?;
        tier_round(url, f, round, t, None)?;
        keyed(t)
    } else {
        keyed(t)?;
        tier_round(url, f, round, t, None)?;
        raw_round(raw, f, round, t)
    }
}

fn raw_round(raw: &mut Raw, f: &Fixture, round: u32, t: &mut Times) -> Result<()> {
    let raw_keys: Vec<String> = (0..f.n)
        .map(|i| format!("umbp-bench-raw:{}:{round}:{i}", std::process::id()))
        .collect();
    let s = Instant::now();
    raw.set(&raw_keys, &f.values)?;
    t.raw_set.push(s.elapsed().as_secs_f64());
    let s = Instant::now();
    let got = raw.get(&raw_keys)?;
    t.raw_get.push(s.elapsed().as_secs_f64());
    ensure!(
        got == ((f.size + HEADER) * f.n) as u64,
        "raw GET returned {got} bytes"
    );
    raw.del(&raw_keys)
}

/// One put and get of every object through two tiers (node A writes, node B fetches);
/// keyed (with `secret`) or checksummed.
fn tier_round(
    url: &str,
    f: &Fixture,
    round: u32,
    t: &mut Times,
    secret: Option<&std::path::Path>,
) -> Result<()> {
    let (n, bytes) = (f.n, (f.size * f.n) as u64);
    let kb = KeyBuilder::new(
        &format!(
            "umbp-bench-remote-{}-{round}-{}",
            std::process::id(),
            secret.is_some()
        ),
        RankTopology::default(),
    )?;
    let keys: Vec<BlockKey> = (0..n)
        .map(|i| kb.key(0, &(i as u64).to_le_bytes()))
        .collect::<Result<_, _>>()?;
    f.pa.clear();
    f.pb.clear();
    // The objects are in node A's pool before its tier starts: the tier's own work (pin,
    // header and checksum, send) is timed, not the engine's copies into the pool.
    for (k, p) in keys.iter().zip(&f.payloads) {
        f.pa.put(*k, p)?;
    }
    let (put_times, get_times) = match secret {
        Some(_) => (&mut t.keyed_put, &mut t.keyed_get),
        None => (&mut t.tier_put, &mut t.tier_get),
    };
    let ta = umbp_store::start_remote_tier(tier_config(url, bytes, secret), &f.pa)?;
    let s = Instant::now();
    ta.write_keys(&keys);
    ensure!(
        ta.flush(Duration::from_secs(120)),
        "the tier's writer did not drain in 120 s"
    );
    put_times.push(s.elapsed().as_secs_f64());
    let st = ta.stats();
    ensure!(
        st.writes == n as u64 && st.writes_dropped == 0,
        "the tier wrote {} of {n} objects ({} dropped, {} errors)",
        st.writes,
        st.writes_dropped,
        st.errors
    );
    let tb = umbp_store::start_remote_tier(tier_config(url, bytes, secret), &f.pb)?;
    // As a registered layout of this object size would allow.
    tb.allow_object_bytes(f.size as u64);
    let s = Instant::now();
    let present = tb.fetch_present(&keys, Arc::new(umbp_store::PoolFill::new(&f.pb)));
    get_times.push(s.elapsed().as_secs_f64());
    let missing = present.iter().filter(|p| !**p).count();
    ensure!(
        missing == 0,
        "the tier fetched {} of {n} objects",
        n - missing
    );
    for (i, (k, p)) in keys.iter().zip(&f.payloads).enumerate() {
        let o = f.pb.get(k).context("a fetched object is not in the pool")?;
        ensure!(o.as_slice() == p.as_slice(), "object {i}: bytes differ");
    }
    let deleted = ta.delete(&keys);
    ensure!(deleted == n, "deleted {deleted} of {n} objects");
    Ok(())
}

pub fn run(a: &Args) -> Result<()> {
    let sizes: Vec<usize> = a
        .object_kib
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map(|k| k << 10)
                .map_err(|_| anyhow::anyhow!("--object-kib: {s:?} is not a number of KiB"))
        })
        .collect::<Result<_>>()?;
    ensure!(
        a.rounds > 0 && a.mib > 0 && sizes.iter().all(|s| *s > 0),
        "--rounds, --mib and every --object-kib must be > 0"
    );
    let private = match &a.url {
        Some(_) => None,
        None => {
            if Command::new("redis-server")
                .arg("--version")
                .stdout(Stdio::null())
                .status()
                .is_err()
            {
                println!("SKIP: umbp bench remote needs --url or redis-server on PATH (apt-get install redis-server)");
                if a.json {
                    println!("{}", json!({"bench": "remote", "skipped": true}));
                }
                return Ok(());
            }
            Some(PrivateRedis::start()?)
        }
    };
    let url = match (&a.url, &private) {
        (Some(u), _) => u.clone(),
        (None, Some(p)) => format!("redis://127.0.0.1:{}", p.port),
        (None, None) => bail!("no remote"),
    };
    let target = umbp_remote::Target::parse(&url)?;
    let mut raw = Raw::open(&target)
        .with_context(|| format!("cannot connect to {}", umbp_core::address::redact_url(&url)))?;
    progress!(
        "remote {}: objects of {:?} KiB, {} MiB per size and direction, {} rounds after a warm-up",
        umbp_core::address::redact_url(&url),
        sizes.iter().map(|s| s >> 10).collect::<Vec<_>>(),
        a.mib,
        a.rounds
    );
    let secret = if a.keyed {
        Some(SecretFile::new()?)
    } else {
        None
    };
    let mut rows = Vec::new();
    for &size in &sizes {
        let n = ((a.mib << 20) as usize / size).max(1);
        let bytes = (n * size) as f64;
        let mut t = Times::default();
        let fixture = Fixture::new(size, n)?;
        for r in 0..=a.rounds {
            let mut one = Times::default();
            round(&url, &mut raw, &fixture, r, &mut one, secret.as_ref())?;
            let g = |v: &[f64]| bytes / v[0] / GB;
            progress!(
                "  {} KiB round {r}{}: raw SET {:.2} GET {:.2}, tier put {:.2} get {:.2} GB/s",
                size >> 10,
                if r == 0 { " (warm-up)" } else { "" },
                g(&one.raw_set),
                g(&one.raw_get),
                g(&one.tier_put),
                g(&one.tier_get)
            );
            if secret.is_some() {
                progress!(
                    "  {} KiB round {r}: keyed put {:.2} get {:.2} GB/s",
                    size >> 10,
                    g(&one.keyed_put),
                    g(&one.keyed_get)
                );
            }
            if r > 0 {
                t.raw_set.extend(one.raw_set);
                t.raw_get.extend(one.raw_get);
                t.tier_put.extend(one.tier_put);
                t.tier_get.extend(one.tier_get);
                t.keyed_put.extend(one.keyed_put);
                t.keyed_get.extend(one.keyed_get);
            }
        }
        let g = |v: &mut Vec<f64>| bytes / median(v) / GB;
        let (rs, rg, tp, tg) = (
            g(&mut t.raw_set),
            g(&mut t.raw_get),
            g(&mut t.tier_put),
            g(&mut t.tier_get),
        );
        let mut row = json!({
            "object_bytes": size,
            "objects": n,
            "raw_set_gbps": rs,
            "raw_get_gbps": rg,
            "tier_put_gbps": tp,
            "tier_get_gbps": tg,
            "put_vs_raw": tp / rs,
            "get_vs_raw": tg / rg,
        });
        if secret.is_some() {
            let (kp, kg) = (g(&mut t.keyed_put), g(&mut t.keyed_get));
            row["keyed_put_gbps"] = json!(kp);
            row["keyed_get_gbps"] = json!(kg);
            row["keyed_put_vs_checksummed"] = json!(kp / tp);
            row["keyed_get_vs_checksummed"] = json!(kg / tg);
        }
        rows.push(row);
    }
    print_table(&url, a, &rows);
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "remote",
                "url": umbp_core::address::redact_url(&url),
                "mib": a.mib,
                "rounds": a.rounds,
                "results": rows,
            })
        );
    }
    Ok(())
}

fn print_table(url: &str, a: &Args, rows: &[Value]) {
    println!(
        "remote tier benchmark against {} ({} MiB per object size and direction, medians of {} rounds; raw: pipelined SET / GET of {PIPELINE} values of the same size)",
        umbp_core::address::redact_url(url),
        a.mib,
        a.rounds
    );
    println!(
        "  {:>8} | {:^15} | {:^15} | {:^15}",
        "", "raw GB/s", "tier GB/s", "tier / raw"
    );
    println!(
        "  {:>8} | {:>7} {:>7} | {:>7} {:>7} | {:>7} {:>7}",
        "object", "SET", "GET", "put", "get", "put", "get"
    );
    let mut misses = Vec::new();
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let kib = r["object_bytes"].as_u64().unwrap_or(0) >> 10;
        println!(
            "  {:>8} | {:>7.2} {:>7.2} | {:>7.2} {:>7.2} | {:>7.2} {:>7.2}",
            format!("{kib} KiB"),
            f("raw_set_gbps"),
            f("raw_get_gbps"),
            f("tier_put_gbps"),
            f("tier_get_gbps"),
            f("put_vs_raw"),
            f("get_vs_raw")
        );
        for d in ["put", "get"] {
            let x = f(&format!("{d}_vs_raw"));
            if x < TARGET_VS_RAW {
                misses.push(format!("{kib} KiB {d} {x:.2}"));
            }
        }
    }
    if rows.iter().any(|r| r.get("keyed_put_gbps").is_some()) {
        println!("  keyed (HMAC-SHA256) tier, same rounds:");
        for r in rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
            println!(
                "  {:>8} | put {:>5.2} GB/s ({:.2} of checksummed) | get {:>5.2} GB/s ({:.2})",
                format!("{} KiB", r["object_bytes"].as_u64().unwrap_or(0) >> 10),
                f("keyed_put_gbps"),
                f("keyed_put_vs_checksummed"),
                f("keyed_get_gbps"),
                f("keyed_get_vs_checksummed")
            );
        }
    }
    if misses.is_empty() {
        println!("  target (tier ≥ {TARGET_VS_RAW} of raw SET / GET): met");
    } else {
        println!(
            "  target (tier ≥ {TARGET_VS_RAW} of raw SET / GET): MISSED by {}",
            misses.join(", ")
        );
    }
}
