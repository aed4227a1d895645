//! The remote tier against real Redis processes: a three-node cluster (and one plain server)
//! started from the distribution's `redis-server`, on loopback ports of their own.
//!
//! Without `redis-server` on PATH these tests say so and pass, unless `UMBP_REQUIRE_REDIS=1`
//! (set by scripts/test.sh, which installs it), where they fail.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use umbp_core::{BlockKey, GroupLayout, KeyBuilder, KvLayout, LayerSpec, PoolConfig, RankTopology};
use umbp_pool::Pool;
use umbp_remote::{object, RemoteConfig, RemoteTier, WritePolicy};
use umbp_store::{start_remote_tier, EmbeddedStore, PoolFill, StoreConfig};

mod common;
use common::have_redis;

/// A free port whose cluster-bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < 55000 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

struct Node {
    port: u16,
    child: Child,
}

/// Redis servers in a temporary directory; killed on drop.
struct Redis {
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl Redis {
    fn start(n: usize, cluster: bool) -> Result<Redis> {
        Redis::start_with(n, cluster, &[])
    }

    fn start_with(n: usize, cluster: bool, extra: &[&str]) -> Result<Redis> {
        let dir =
            std::env::temp_dir().join(format!("umbp-redis-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir)?;
        let mut r = Redis {
            dir,
            nodes: Vec::new(),
        };
        for _ in 0..n {
            let port = free_port();
            let d = r.dir.join(port.to_string());
            std::fs::create_dir_all(&d)?;
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .arg("--dir")
                .arg(&d)
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if cluster {
                cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]);
            }
            let child = cmd.spawn().context("starting redis-server")?;
            r.nodes.push(Node { port, child });
        }
        for n in &r.nodes {
            r.wait_ping(n.port)?;
        }
        if cluster {
            let mut cmd = Command::new("redis-cli");
            cmd.arg("--cluster").arg("create");
            for n in &r.nodes {
                cmd.arg(format!("127.0.0.1:{}", n.port));
            }
            let out = cmd
                .args(["--cluster-replicas", "0", "--cluster-yes"])
                .output()?;
            ensure!(
                out.status.success(),
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            let t = Instant::now();
            while !r
                .cli(r.nodes[0].port, &["cluster", "info"])?
                .contains("cluster_state:ok")
            {
                ensure!(
                    t.elapsed() < Duration::from_secs(20),
                    "the cluster never became ok"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(r)
    }

    fn wait_ping(&self, port: u16) -> Result<()> {
        let t = Instant::now();
        while self.cli(port, &["ping"]).unwrap_or_default().trim() != "PONG" {
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "redis on {port} never answered"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn cli(&self, port: u16, args: &[&str]) -> Result<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "-c"])
            .args(args)
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn url(&self) -> String {
        if self.nodes.len() == 1 {
            format!("redis://127.0.0.1:{}", self.nodes[0].port)
        } else {
            let seeds: Vec<String> = self
                .nodes
                .iter()
                .map(|n| format!("127.0.0.1:{}", n.port))
                .collect();
            format!("redis+cluster://{}", seeds.join(","))
        }
    }

    /// The node that owns `key`'s slot.
    fn owner(&self, key: &str) -> Result<usize> {
        let slot: u16 = self
            .cli(self.nodes[0].port, &["cluster", "keyslot", key])?
            .trim()
            .parse()?;
        let nodes = self.cli(self.nodes[0].port, &["cluster", "nodes"])?;
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let port: u16 = f[1]
                .split(['@', ':'])
                .nth(1)
                .context("host:port@bus")?
                .parse()?;
            for range in &f[8..] {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>()) {
                    if (a..=b).contains(&slot) {
                        return self
                            .nodes
                            .iter()
                            .position(|n| n.port == port)
                            .context("owner not ours");
                    }
                }
            }
        }
        bail!("no node owns slot {slot}")
    }

    fn signal(&self, i: usize, sig: libc_sig::Sig) {
        libc_sig::send(self.nodes[i].child.id(), sig);
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            libc_sig::send(n.child.id(), libc_sig::Sig::Cont);
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Signals through `kill`, to keep this test free of a libc dependency.
mod libc_sig {
    #[derive(Clone, Copy)]
    pub enum Sig {
        Stop,
        Cont,
    }
    pub fn send(pid: u32, s: Sig) {
        let name = match s {
            Sig::Stop => "-STOP",
            Sig::Cont => "-CONT",
        };
        let _ = std::process::Command::new("kill")
            .args([name, &pid.to_string()])
            .status();
    }
}

fn pool() -> Arc<Pool> {
    Arc::new(Pool::new(PoolConfig::with_capacity(256 << 20)).unwrap())
}

fn keys(ns: &str, n: usize) -> Vec<BlockKey> {
    let kb = KeyBuilder::new(ns, RankTopology::default()).unwrap();
    (0..n)
        .map(|i| kb.key(0, &(i as u64).to_le_bytes()).unwrap())
        .collect()
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 131 + j * 7) as u8).collect()
}

/// Generous: these tests run side by side, each with its own Redis processes, on 2 cores.
fn config(url: String) -> RemoteConfig {
    RemoteConfig {
        timeout: Duration::from_millis(2000),
        ..RemoteConfig::new(url)
    }
}

/// The largest object these tests store, as a registered layout would allow it: fetches read
/// values up to it.
const MAX_OBJECT: u64 = 1 << 20;

/// A tier that fetches objects of up to [`MAX_OBJECT`] bytes.
fn start_tier(cfg: RemoteConfig, pool: Arc<Pool>) -> Result<RemoteTier> {
    let t = start_remote_tier(cfg, &pool)?;
    t.allow_object_bytes(MAX_OBJECT);
    Ok(t)
}

/// Where a fetch into `pool` goes: a fill of it made when the lookup begins, as the store's
/// lookups make one.
fn fill(pool: &Arc<Pool>) -> Arc<PoolFill> {
    Arc::new(PoolFill::new(pool))
}

/// The stopped-node test's timeout.
const SHORT: Duration = Duration::from_millis(300);

/// Node A stores `n` objects; waits until its tier wrote them.
fn node_a_stores(url: &str, ks: &[BlockKey], len: usize) -> Result<(Arc<Pool>, RemoteTier)> {
    let pa = pool();
    let ta = start_tier(config(url.to_string()), Arc::clone(&pa))?;
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, len))?;
    }
    ensure!(
        ta.flush(Duration::from_secs(10)),
        "node A's writes never drained"
    );
    let s = ta.stats();
    ensure!(s.writes == ks.len() as u64, "node A wrote {s:?}");
    Ok((pa, ta))
}

fn check_restored(p: &Pool, ks: &[BlockKey], len: usize) {
    for (i, k) in ks.iter().enumerate() {
        let o = p
            .get(k)
            .unwrap_or_else(|| panic!("key {i} not in the pool"));
        assert!(
            o.as_slice() == payload(i, len).as_slice(),
            "key {i}: bytes differ"
        );
    }
}

#[test]
fn cluster_node_b_restores_what_node_a_stored() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(3, true)?;
    let ks = keys("remote-it-a", 48);
    let len = 512 << 10;
    let (_pa, ta) = node_a_stores(&r.url(), &ks, len)?;
    assert!(ta.stats().connected);

    let pb = pool();
    let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
    // The first fetch also connects to the cluster; on a loaded machine it may run past its
    // deadline, which is a miss by design (seen once in CI at load 4): ask again.
    // A tier that failed to connect counts as down for a moment and skips lookups: keep
    // asking for a while.
    let mut got = 0;
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        got = tb.fetch_prefix(&ks, fill(&pb));
        if got == ks.len() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(got, ks.len(), "{:?}", tb.stats());
    check_restored(&pb, &ks, len);
    let s = tb.stats();
    assert_eq!(s.corrupt, 0, "{s:?}");
    assert!(s.hits >= 48, "{s:?}");
    // Fetched objects are not written back.
    assert!(tb.flush(Duration::from_secs(2)));
    assert_eq!(tb.stats().writes, 0);
    // Another namespace never meets these objects.
    let other = keys("remote-it-other", 4);
    assert_eq!(tb.fetch_prefix(&other, fill(&pb)), 0);
    assert_eq!(tb.fetch_present(&other, fill(&pb)), [false; 4]);
    Ok(())
}

#[test]
fn a_corrupted_remote_object_is_a_miss() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(3, true)?;
    let ks = keys("remote-it-corrupt", 8);
    let len = 64 << 10;
    let (_pa, _ta) = node_a_stores(&r.url(), &ks, len)?;
    // Overwrite key 3's value, as an operator with redis-cli would.
    let name = object::remote_key(&ks[3]);
    let owner = r.owner(&name)?;
    let out = r.cli(r.nodes[owner].port, &["set", &name, "not an object"])?;
    assert_eq!(out.trim(), "OK");
    // And key 5's payload by one byte (same length, bad checksum).
    let name5 = object::remote_key(&ks[5]);
    let out = r.cli(r.nodes[0].port, &["setrange", &name5, "100", "X"])?;
    assert!(out.trim().parse::<u64>().is_ok(), "setrange: {out}");

    let pb = pool();
    let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
    assert_eq!(
        tb.fetch_prefix(&ks, fill(&pb)),
        3,
        "the prefix stops at the corrupted object"
    );
    let present = tb.fetch_present(&ks, fill(&pb));
    assert_eq!(
        present,
        [true, true, true, false, true, false, true, true],
        "corrupted objects are misses"
    );
    assert!(!pb.contains(&ks[3]) && !pb.contains(&ks[5]));
    check_restored(&pb, &[ks[0], ks[1], ks[2]], len);
    assert!(tb.stats().corrupt >= 2, "{:?}", tb.stats());
    Ok(())
}

/// Issue 29, item 10: one key of another type (a list planted under an object's name) failed
/// the whole pipelined chunk: the 31 other keys of its chunk missed too. Now only it misses.
#[test]
fn a_key_of_another_type_misses_alone() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    for cluster in [false, true] {
        let r = Redis::start(if cluster { 3 } else { 1 }, cluster)?;
        let ns = format!("remote-it-wrongtype-{cluster}");
        let ks = keys(&ns, 8);
        let len = 4 << 10;
        let (_pa, _ta) = node_a_stores(&r.url(), &ks, len)?;
        let name = object::remote_key(&ks[3]);
        let port = r.nodes[if cluster { r.owner(&name)? } else { 0 }].port;
        r.cli(port, &["del", &name])?;
        let out = r.cli(port, &["rpush", &name, "not", "a", "string"])?;
        assert_eq!(out.trim(), "3", "rpush: {out}");
        let pb = pool();
        let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
        assert_eq!(
            tb.fetch_present(&ks, fill(&pb)),
            [true, true, true, false, true, true, true, true],
            "cluster {cluster}"
        );
        assert_eq!(tb.fetch_prefix(&ks, fill(&pb)), 3);
        check_restored(&pb, &ks[..3], len);
    }
    Ok(())
}

/// Issue 29, item 10: a value of any size was read whole (a 512 MiB value drove the server
/// to 1 GiB). Now a fetch reads a value only as far as the largest object a registered layout
/// makes, and a longer one is a miss.
#[test]
fn an_oversized_value_is_a_miss_and_is_not_read_whole() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(1, false)?;
    let ks = keys("remote-it-oversized", 4);
    let len = 4 << 10;
    let (_pa, _ta) = node_a_stores(&r.url(), &ks, len)?;
    let name = object::remote_key(&ks[2]);
    let port = r.nodes[0].port;
    // 64 MiB under key 2 (zero-padded by SETRANGE).
    let out = r.cli(
        port,
        &["setrange", &name, &((64 << 20) - 1).to_string(), "x"],
    )?;
    assert_eq!(out.trim(), (64 << 20).to_string(), "setrange: {out}");
    let sent = |r: &Redis| -> Result<u64> {
        let info = r.cli(port, &["info", "stats"])?;
        let line = info
            .lines()
            .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
            .context("no total_net_output_bytes in INFO")?;
        Ok(line.trim().parse()?)
    };
    // No layout registered: nothing is fetched at all.
    let p0 = pool();
    let t0 = start_remote_tier(config(r.url()), &p0)?;
    assert_eq!(t0.fetch_present(&ks, fill(&p0)), [false; 4]);
    drop(t0);
    let pb = pool();
    let tb = start_remote_tier(config(r.url()), &pb)?;
    tb.allow_object_bytes(len as u64);
    let before = sent(&r)?;
    assert_eq!(tb.fetch_present(&ks, fill(&pb)), [true, true, false, true]);
    let read = sent(&r)? - before;
    assert!(read < 1 << 20, "{read} bytes sent for 3 objects of 4 KiB");
    assert!(tb.stats().corrupt >= 1, "{:?}", tb.stats());
    check_restored(&pb, &ks[..2], len);
    // A larger allowed size (another layout) reads it, and rejects it as not an object.
    tb.allow_object_bytes(128 << 20);
    assert_eq!(tb.fetch_present(&ks[2..3], fill(&pb)), [false]);
    Ok(())
}

/// Issue 29, item 10: a value with a valid header and XXH3 checksum was loaded from anyone
/// who could write the remote store. With a secret file, values carry an HMAC-SHA256 and only
/// values sealed with the same secret are taken.
#[test]
fn a_keyed_tier_takes_only_values_sealed_with_its_secret() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(1, false)?;
    let secret = |name: &str, text: &str| -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let p = r.dir.join(name);
        std::fs::write(&p, text)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
        Ok(p)
    };
    let ours = secret("ours", "k7Jc0q2v9XbN4mLr8sTz1wYe6uAh3dGf\n")?;
    let theirs = secret("theirs", "another secret of thirty-two bytes")?;
    let keyed = |path: &PathBuf| RemoteConfig {
        secret_file: Some(path.clone()),
        ..config(r.url())
    };
    let ks = keys("remote-it-keyed", 4);
    let len = 8 << 10;
    let pa = pool();
    let ta = start_tier(keyed(&ours), Arc::clone(&pa))?;
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, len))?;
    }
    ensure!(ta.flush(Duration::from_secs(10)), "writes never drained");
    // A checksummed value, valid as such, planted under key 1 by someone without the secret.
    let mut planted = Vec::new();
    object::encode_into(
        &object::Seal::Checksum,
        &ks[1],
        &payload(1, len),
        &mut planted,
    );
    let mut con = redis::Client::open(r.url())?.get_connection()?;
    let () = redis::cmd("SET")
        .arg(object::remote_key(&ks[1]))
        .arg(planted)
        .query(&mut con)?;
    let fetch = |cfg: RemoteConfig| -> Result<(Vec<bool>, Arc<Pool>, u64)> {
        let p = pool();
        let t = start_tier(cfg, Arc::clone(&p))?;
        let got = t.fetch_present(&ks, fill(&p));
        Ok((got, p, t.stats().corrupt))
    };
    let (got, pb, _) = fetch(keyed(&ours))?;
    assert_eq!(got, [true, false, true, true], "the same secret");
    check_restored(&pb, &ks[..1], len);
    let (got, _, corrupt) = fetch(keyed(&theirs))?;
    assert_eq!((got, corrupt), (vec![false; 4], 4), "another secret");
    let (got, _, corrupt) = fetch(config(r.url()))?;
    assert_eq!(
        (got, corrupt),
        (vec![false, true, false, false], 3),
        "no secret: only the checksummed value"
    );
    // Secrets too short, or files that cannot be read, stop the tier at start-up.
    let short = secret("short", "tiny\n")?;
    let e = start_remote_tier(keyed(&short), &pool())
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 16"), "{e}");
    let e = start_remote_tier(keyed(&r.dir.join("absent")), &pool())
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot read it"), "{e}");
    Ok(())
}

#[test]
fn a_stopped_cluster_node_makes_lookups_miss_within_the_timeout() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(3, true)?;
    let ks = keys("remote-it-stopped", 24);
    let len = 16 << 10;
    let (pa, ta) = node_a_stores(&r.url(), &ks, len)?;
    let pb = pool();
    let tb = start_tier(
        RemoteConfig {
            timeout: SHORT,
            ..config(r.url())
        },
        Arc::clone(&pb),
    )?;
    // Connect B before the failure, as a running engine would be: both fetch threads.
    assert_eq!(tb.fetch_prefix(&ks[..1], fill(&pb)), 1);
    assert_eq!(tb.fetch_prefix(&ks[..1], fill(&pb)), 1);

    // SIGSTOP: the node accepts connections and never answers (worse than a crash).
    let victim = r.owner(&object::remote_key(&ks[2]))?;
    r.signal(victim, libc_sig::Sig::Stop);
    let t = Instant::now();
    let got = tb.fetch_prefix(&ks[1..], fill(&pb));
    let took = t.elapsed();
    assert!(
        got < ks.len() - 1,
        "a stopped node's keys cannot be fetched"
    );
    assert!(
        took < SHORT + Duration::from_millis(150),
        "the lookup took {took:?} with a 300 ms timeout"
    );
    // Back-off: the next lookups miss at once instead of waiting again.
    let t = Instant::now();
    tb.fetch_prefix(&ks[1..], fill(&pb));
    assert!(t.elapsed() < Duration::from_millis(50), "{:?}", t.elapsed());
    assert!(
        tb.stats().skipped_lookups + tb.stats().timeouts >= 2,
        "{:?}",
        tb.stats()
    );
    // The node pools keep working.
    let extra = keys("remote-it-stopped-extra", 4);
    for (i, k) in extra.iter().enumerate() {
        pa.put(*k, &payload(i, len))?;
    }
    check_restored(&pa, &extra, len);
    // Writes while the node is stopped are dropped (and counted), never queued forever.
    let t = Instant::now();
    while ta.stats().writes_dropped + ta.stats().writes < 4 + ks.len() as u64 {
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", ta.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    r.signal(victim, libc_sig::Sig::Cont);
    // After the back-off the tier reconnects by itself.
    let t = Instant::now();
    while tb.fetch_prefix(&ks[1..], fill(&pb)) < ks.len() - 1 {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never recovered: {:?}",
            tb.stats()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    check_restored(&pb, &ks, len);
    Ok(())
}

#[test]
fn on_reuse_writes_at_the_second_hit_and_one_server_urls_work() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(1, false)?;
    let pa = pool();
    let ta = start_tier(
        RemoteConfig {
            write: WritePolicy::OnReuse,
            ttl: Some(Duration::from_secs(60)),
            ..config(r.url())
        },
        Arc::clone(&pa),
    )?;
    let ks = keys("remote-it-reuse", 4);
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, 4096))?;
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(ta.stats().writes, 0, "on_reuse writes nothing at commit");
    ta.note_hits([ks[0], ks[1]]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(ta.stats().writes, 0, "one hit is not a reuse yet");
    ta.note_hits([ks[0]]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        ta.stats().writes,
        0,
        "hits less than a second apart count once"
    );
    std::thread::sleep(Duration::from_millis(900));
    ta.note_hits([ks[0]]);
    assert!(ta.flush(Duration::from_secs(5)));
    let t = Instant::now();
    while ta.stats().writes < 1 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(ta.stats().writes, 1);
    let ttl: i64 = r
        .cli(r.nodes[0].port, &["ttl", &object::remote_key(&ks[0])])?
        .trim()
        .parse()?;
    assert!((1..=60).contains(&ttl), "TTL {ttl}");

    let pb = pool();
    let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
    assert_eq!(
        tb.fetch_present(&ks, fill(&pb)),
        [true, false, false, false]
    );
    check_restored(&pb, &ks[..1], 4096);
    // Clearing the namespace on one server (SCAN + UNLINK) leaves other namespaces.
    let other = keys("remote-it-reuse-other", 2);
    pb.put(other[0], &payload(0, 4096))?;
    tb.write_keys(&other);
    assert!(tb.flush(Duration::from_secs(5)));
    assert_eq!(tb.clear_namespace(&ks[0].namespace_id()), Some(1));
    let pc = pool();
    let tc = start_tier(config(r.url()), Arc::clone(&pc))?;
    assert_eq!(tc.fetch_present(&ks[..1], fill(&pc)), [false]);
    assert_eq!(tc.fetch_present(&other, fill(&pc)), [true, false]);
    Ok(())
}

#[test]
fn a_remote_that_is_down_misses_at_once_and_drops_writes() -> Result<()> {
    // Nothing listens on this port.
    let port = free_port();
    let pa = pool();
    let ta = start_tier(config(format!("redis://127.0.0.1:{port}")), Arc::clone(&pa))?;
    let ks = keys("remote-it-down", 8);
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, 4096))?;
    }
    // The writes fail and are dropped, never queued without bound.
    let t = Instant::now();
    while ta.stats().writes_dropped < 8 {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", ta.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Lookups of what the pool misses answer at once: a miss.
    let missing = keys("remote-it-down-missing", 8);
    let t = Instant::now();
    assert_eq!(ta.fetch_prefix(&missing, fill(&pa)), 0);
    assert_eq!(ta.fetch_present(&missing, fill(&pa)), [false; 8]);
    assert!(
        t.elapsed() < Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    let s = ta.stats();
    assert!(!s.connected && s.errors >= 1 && s.writes == 0, "{s:?}");
    // The pool itself is untouched.
    check_restored(&pa, &ks, 4096);
    Ok(())
}

#[test]
fn a_full_remote_refuses_writes_without_failing_lookups() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start_with(
        1,
        false,
        &["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"],
    )?;
    let pa = pool();
    let ta = start_tier(config(r.url()), Arc::clone(&pa))?;
    let ks = keys("remote-it-full", 16);
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, 256 << 10))?;
        // One object per batch: what fits is written, the rest is refused.
        assert!(ta.flush(Duration::from_secs(5)));
    }
    let s = ta.stats();
    assert!(s.writes >= 1 && s.writes_dropped >= 1, "{s:?}");
    assert!(s.errors >= 1, "{s:?}");
    // A refusal is no connection failure: lookups still ask, and find what was written.
    let missing = keys("remote-it-full-missing", 2);
    assert_eq!(ta.fetch_prefix(&missing, fill(&pa)), 0);
    let s2 = ta.stats();
    assert_eq!(s2.skipped_lookups, 0, "{s2:?}");
    let pb = pool();
    let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
    let got = tb
        .fetch_present(&ks, fill(&pb))
        .iter()
        .filter(|p| **p)
        .count() as u64;
    assert_eq!(got, s.writes);
    Ok(())
}

/// A self-signed certificate for 127.0.0.1, made with the `openssl` command.
fn self_signed(dir: &std::path::Path) -> Result<(PathBuf, PathBuf)> {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .context("running openssl")?;
    ensure!(
        out.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((cert, key))
}

#[test]
fn tls_with_rediss_urls() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("umbp-redis-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (cert, key) = self_signed(&dir)?;
    let port = free_port();
    let (c, k) = (cert.display().to_string(), key.display().to_string());
    let mut child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            &c,
            "--tls-key-file",
            &k,
            "--tls-ca-cert-file",
            &c,
        ])
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let result = (|| -> Result<()> {
        let url = format!("rediss://127.0.0.1:{port}/#insecure");
        let ks = keys("remote-it-tls", 6);
        let pa = pool();
        let ta = start_tier(config(url.clone()), Arc::clone(&pa))?;
        let t = Instant::now();
        loop {
            for (i, k) in ks.iter().enumerate() {
                pa.put(*k, &payload(i, 8192))?;
            }
            ta.write_keys(&ks);
            assert!(ta.flush(Duration::from_secs(5)));
            if ta.stats().writes >= 6 {
                break;
            }
            // The server may still be starting: the tier backs off and retries.
            ensure!(t.elapsed() < Duration::from_secs(10), "{:?}", ta.stats());
            std::thread::sleep(Duration::from_millis(1100));
        }
        let pb = pool();
        let tb = start_tier(config(url), Arc::clone(&pb))?;
        assert_eq!(tb.fetch_prefix(&ks, fill(&pb)), 6);
        check_restored(&pb, &ks, 8192);
        // Without #insecure the self-signed certificate is refused: the remote is down for
        // this tier, its lookups miss, nothing hangs.
        let pc = pool();
        let tc = start_tier(
            config(format!("rediss://127.0.0.1:{port}")),
            Arc::clone(&pc),
        )?;
        let t = Instant::now();
        assert_eq!(tc.fetch_prefix(&ks, fill(&pc)), 0);
        assert!(t.elapsed() < Duration::from_secs(3));
        let s = tc.stats();
        assert!(!s.connected && s.errors >= 1, "{s:?}");
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[test]
fn lookups_follow_a_resharding_cluster() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(3, true)?;
    let ks = keys("remote-it-reshard", 40);
    let len = 8 << 10;
    let (_pa, _ta) = node_a_stores(&r.url(), &ks, len)?;
    let pb = pool();
    let tb = start_tier(config(r.url()), Arc::clone(&pb))?;
    // B knows the slot map from before the move.
    assert_eq!(tb.fetch_prefix(&ks[..1], fill(&pb)), 1);
    let id =
        |port: u16| -> Result<String> { Ok(r.cli(port, &["cluster", "myid"])?.trim().to_string()) };
    let (from, to) = (id(r.nodes[0].port)?, id(r.nodes[1].port)?);
    let out = Command::new("redis-cli")
        .args([
            "--cluster",
            "reshard",
            &format!("127.0.0.1:{}", r.nodes[0].port),
        ])
        .args(["--cluster-from", &from, "--cluster-to", &to])
        .args(["--cluster-slots", "5000", "--cluster-yes"])
        .output()?;
    ensure!(
        out.status.success(),
        "reshard failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Every object moved with its slots; B follows the redirections.
    assert_eq!(
        tb.fetch_prefix(&ks, fill(&pb)),
        ks.len(),
        "{:?}",
        tb.stats()
    );
    check_restored(&pb, &ks, len);
    Ok(())
}

#[test]
fn a_password_and_a_database_in_a_one_server_url_are_used() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(1, false)?;
    let port = r.nodes[0].port;
    r.cli(port, &["config", "set", "requirepass", "s3cret"])?;
    let url = |pw: &str, db: u32| format!("redis://:{pw}@127.0.0.1:{port}/{db}");
    let ks = keys("remote-it-auth", 4);
    let pa = pool();
    let ta = start_tier(config(url("s3cret", 3)), Arc::clone(&pa))?;
    for (i, k) in ks.iter().enumerate() {
        pa.put(*k, &payload(i, 4096))?;
    }
    ta.write_keys(&ks);
    assert!(ta.flush(Duration::from_secs(5)));
    assert!(ta.stats().writes >= 4, "{:?}", ta.stats());
    // The same database finds them; another database of the same server does not; a wrong
    // password is an error (the remote is down for that tier), not a hang.
    let pb = pool();
    let tb = start_tier(config(url("s3cret", 3)), Arc::clone(&pb))?;
    assert_eq!(tb.fetch_prefix(&ks, fill(&pb)), 4);
    check_restored(&pb, &ks, 4096);
    let pc = pool();
    let tc = start_tier(config(url("s3cret", 0)), Arc::clone(&pc))?;
    assert_eq!(tc.fetch_prefix(&ks, fill(&pc)), 0);
    assert_eq!(tc.stats().misses, 1, "{:?}", tc.stats());
    let pd = pool();
    let td = start_tier(config(url("wrong", 3)), Arc::clone(&pd))?;
    assert_eq!(td.fetch_prefix(&ks, fill(&pd)), 0);
    let s = td.stats();
    assert!(!s.connected && s.errors >= 1, "{s:?}");
    Ok(())
}

/// A store with a remote tier in its chain, and a layout of `len`-byte objects over `buf`
/// (so its remote tier reads values that large).
fn remote_store(url: String, buf: &[u8], len: u64) -> Result<EmbeddedStore> {
    let s = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: false,
            ..PoolConfig::with_capacity(16 << 20)
        },
        num_workers: 1,
        remote: Some(config(url)),
        ..StoreConfig::default()
    })?;
    // SAFETY: `buf` outlives the store: the caller closes the store before dropping it.
    unsafe { s.register_memory(buf.as_ptr() as u64, buf.len() as u64) }?;
    s.register_layout(KvLayout::new(vec![GroupLayout::new(vec![LayerSpec {
        base_addr: buf.as_ptr() as u64,
        num_blocks: buf.len() as u64 / len,
        block_stride: len,
        block_bytes: len,
    }])?])?)?;
    Ok(s)
}

/// The remote tier as the store runs it, in its chain: what store A commits is written
/// through, store B's lookups fill its pool from the remote (through each lookup's fill),
/// B's evictions leave the shared remote alone, and B's namespace reset clears it.
#[test]
fn two_stores_share_objects_through_their_chains() -> Result<()> {
    if !have_redis() {
        return Ok(());
    }
    let r = Redis::start(1, false)?;
    let len = 64 << 10;
    let ks = keys("remote-it-store", 6);
    let (buf_a, buf_b) = (vec![0u8; 2 * len], vec![0u8; 2 * len]);
    let a = remote_store(r.url(), &buf_a, len as u64)?;
    let b = remote_store(r.url(), &buf_b, len as u64)?;
    for (i, k) in ks.iter().enumerate() {
        a.pool().put(*k, &payload(i, len))?;
    }
    ensure!(
        a.flush_remote(Duration::from_secs(10)),
        "A's writes never drained"
    );
    assert_eq!(a.remote_stats().map(|s| s.writes), Some(6));

    // B's first lookup also connects: on a loaded machine it may run past its deadline,
    // which is a miss by design; ask again.
    let t = Instant::now();
    let mut got = b.prefix_hits(&ks)?;
    while got < ks.len() && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
        got = b.prefix_hits(&ks)?;
    }
    assert_eq!(got, ks.len(), "{:?}", b.remote_stats());
    check_restored(b.pool(), &ks, len);
    let s = b.remote_stats().expect("a remote tier");
    assert_eq!((s.hits, s.corrupt), (6, 0), "{s:?}");
    // What B fetched is not written back.
    assert!(b.flush_remote(Duration::from_secs(2)));
    assert_eq!(b.remote_stats().map(|s| s.writes), Some(0));

    // B's eviction leaves the remote (other nodes read it): a lookup fills them back.
    assert_eq!(b.evict(&ks[..2])?, 2);
    assert_eq!(b.exists(&ks[..2])?, [true, true]);
    check_restored(b.pool(), &ks[..2], len);

    // B's namespace reset clears the remote first: nothing comes back, in B or in a new
    // store.
    b.clear_namespace("remote-it-store")?;
    assert_eq!(b.prefix_hits(&ks)?, 0);
    let buf_c = vec![0u8; 2 * len];
    let c = remote_store(r.url(), &buf_c, len as u64)?;
    assert_eq!(c.exists(&ks)?, [false; 6]);
    for s in [&a, &b, &c] {
        s.close();
    }
    Ok(())
}
