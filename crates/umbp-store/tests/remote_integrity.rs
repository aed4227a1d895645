//! End-to-end integrity across the remote tier, against a real `redis-server`: a value
//! carries the pool's checksum as it was when the object was stored, so a value damaged in
//! Redis, and an object damaged in the writer's DRAM before it was written, are both refused
//! by the reader (a miss, counted), and every object a reader takes is byte-exact and
//! carries its sum into the reader's pool.
//!
//! Without `redis-server` on PATH these tests say so and pass, unless `UMBP_REQUIRE_REDIS=1`.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use umbp_core::{BlockKey, Integrity, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::Pool;
use umbp_remote::{object, RemoteConfig, RemoteTier};
use umbp_store::{start_remote_tier, PoolFill};

mod common;

/// One plain `redis-server` on a loopback port of its own; killed on drop.
struct Redis {
    port: u16,
    child: Child,
    dir: std::path::PathBuf,
}

impl Redis {
    fn start() -> Result<Option<Redis>> {
        if !common::have_redis() {
            return Ok(None);
        }
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir =
            std::env::temp_dir().join(format!("umbp-integrity-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        let r = Redis { port, child, dir };
        let t = Instant::now();
        while r.cli(&["ping"]).unwrap_or_default().trim() != "PONG" {
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "redis never answered"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(r))
    }

    fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const LEN: usize = 64 << 10;

fn pool() -> Arc<Pool> {
    Arc::new(
        Pool::new(PoolConfig {
            prefault: false,
            integrity: Integrity::All,
            ..PoolConfig::with_capacity(16 << 20)
        })
        .unwrap(),
    )
}

fn tier(url: String, pool: &Arc<Pool>) -> Result<RemoteTier> {
    let t = start_remote_tier(
        RemoteConfig {
            timeout: Duration::from_millis(2000),
            ..RemoteConfig::new(url)
        },
        pool,
    )?;
    t.allow_object_bytes(LEN as u64);
    Ok(t)
}

fn keys(n: usize) -> Vec<BlockKey> {
    let kb = KeyBuilder::new("remote-integrity", RankTopology::default()).unwrap();
    (0..n)
        .map(|i| kb.key(0, &(i as u64).to_le_bytes()).unwrap())
        .collect()
}

/// Bytes never equal to `b'Z'`, the byte the test writes over one of them.
fn payload(i: usize) -> Vec<u8> {
    (0..LEN).map(|j| ((i * 131 + j * 7) % 89) as u8).collect()
}

#[test]
fn damage_in_redis_or_in_the_writers_dram_is_refused_and_the_rest_is_exact() -> Result<()> {
    let Some(r) = Redis::start()? else {
        return Ok(());
    };
    let ks = keys(8);
    let (pa, pb) = (pool(), pool());
    let a = tier(r.url(), &pa)?;
    // Objects 0-5 stored as they are; object 6's bytes are damaged in A's pool after the
    // engine's copy was summed (the sum the store computed, the bytes not those any more).
    for (i, k) in ks.iter().enumerate().take(6) {
        pa.put(*k, &payload(i))?;
    }
    let mut res = pa.reserve(LEN as u64)?;
    let mut bad = payload(6);
    res.set_checksum(umbp_pool::checksum(&bad));
    bad[4242] ^= 0x04;
    res.as_mut_slice().copy_from_slice(&bad);
    pa.commit(res, ks[6]);
    pa.put(ks[7], &payload(7))?;
    ensure!(
        a.flush(Duration::from_secs(20)),
        "A never wrote its objects"
    );
    ensure!(a.stats().writes == 8, "{:?}", a.stats());
    // Object 3's value is damaged in Redis: one payload byte overwritten with redis-cli.
    let name = object::remote_key(&ks[3]);
    let at = (object::HEADER_BYTES + 1000).to_string();
    ensure!(
        r.cli(&["setrange", &name, &at, "Z"])?.trim() == (object::HEADER_BYTES + LEN).to_string()
    );
    let b = tier(r.url(), &pb)?;
    let got = b.fetch_present(&ks, Arc::new(PoolFill::new(&pb)));
    let want: Vec<bool> = (0..8).map(|i| i != 3 && i != 6).collect();
    assert_eq!(got, want);
    let s = b.stats();
    assert_eq!((s.corrupt, s.hits), (2, 6), "{s:?}");
    for (i, k) in ks.iter().enumerate() {
        let Some(o) = pb.peek(k) else {
            assert!(i == 3 || i == 6);
            continue;
        };
        // Byte-exact, and carrying the sum A's pool kept.
        assert_eq!(o.as_slice(), &payload(i)[..], "object {i}");
        assert_eq!(o.checksum(), Some(umbp_pool::checksum(&payload(i))));
        assert!(o.verify());
    }
    // A's own load of object 6 would fail too.
    assert!(!pa.get(&ks[6]).unwrap().verify());
    a.close();
    b.close();
    Ok(())
}
