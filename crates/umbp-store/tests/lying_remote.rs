//! A remote that lies about its values' lengths must not make the reader allocate them: a fake
//! Redis (a thread of this test on a loopback port) answers every `GETRANGE`, whatever range
//! was asked, with a bulk string it declares to be 512 MiB and then streams. The lookup is a
//! miss counted `corrupt`, and the process's peak resident memory grows by far less than the
//! value (with the `redis` crate's parser it grew by about 1 GiB: the value, then its copy).
//! The same fake also passes for a one-node cluster (`CLUSTER SLOTS` and `CLUSTER NODES` name
//! it as the primary of every slot), for a `redis+cluster://` remote.
//!
//! One test in this file: the peak (`VmHWM`, reset through `/proc/self/clear_refs`) is this
//! process's, so nothing else may run beside it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::Pool;
use umbp_remote::RemoteConfig;
use umbp_store::{start_remote_tier, PoolFill};

const DECLARED: u64 = 512 << 20;
const OBJECT: u64 = 64 << 10;

/// Reads one RESP command (an array of bulk strings) and returns its words, upper-cased; None
/// at EOF.
fn command(r: &mut BufReader<TcpStream>) -> Option<Vec<String>> {
    let mut line = String::new();
    r.read_line(&mut line).ok().filter(|n| *n > 0)?;
    let n: usize = line.trim().strip_prefix('*')?.parse().ok()?;
    let mut words = Vec::new();
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim().strip_prefix('$')?.parse().ok()?;
        let mut w = vec![0; len + 2];
        r.read_exact(&mut w).ok()?;
        w.truncate(len);
        words.push(String::from_utf8_lossy(&w).to_ascii_uppercase());
    }
    Some(words)
}

/// Serves one connection: `GETRANGE` gets the 512 MiB lie, streamed until the reader hangs
/// up; `CLUSTER SLOTS` and `CLUSTER NODES` make it the one primary of a cluster (at `port`);
/// anything else gets `+OK`. Counts the bytes of the lie it could send.
fn serve(s: TcpStream, port: u16, sent: &AtomicU64) {
    let mut w = s.try_clone().expect("clone the socket");
    let mut r = BufReader::new(s);
    let zeros = vec![b'z'; 1 << 20];
    while let Some(words) = command(&mut r) {
        let cmd = words.join(" ");
        let reply = match cmd.as_str() {
            "GETRANGE" => None,
            _ if cmd.starts_with("GETRANGE ") => None,
            "CLUSTER SLOTS" => Some(format!(
                "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:{port}\r\n$40\r\n{}\r\n",
                "f".repeat(40)
            )),
            "CLUSTER NODES" => {
                let line = format!(
                    "{} 127.0.0.1:{port}@0 myself,master - 0 0 1 connected 0-16383\n",
                    "f".repeat(40)
                );
                Some(format!("${}\r\n{line}\r\n", line.len()))
            }
            _ => Some("+OK\r\n".to_string()),
        };
        if let Some(reply) = reply {
            if w.write_all(reply.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        if w.write_all(format!("${DECLARED}\r\n").as_bytes()).is_err() {
            return;
        }
        let mut left = DECLARED;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            if w.write_all(&zeros[..n]).is_err() {
                return;
            }
            sent.fetch_add(n as u64, Ordering::Relaxed);
            left -= n as u64;
        }
        let _ = w.write_all(b"\r\n");
    }
}

fn status_kib(field: &str) -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("no number")?
        .parse()?)
}

fn keys(n: usize) -> Vec<BlockKey> {
    let kb = KeyBuilder::new("lying-remote", RankTopology::default()).unwrap();
    (0..n)
        .map(|i| kb.key(0, &(i as u64).to_le_bytes()).unwrap())
        .collect()
}

#[test]
fn a_declared_512_mib_value_is_a_corrupt_miss_and_is_never_held() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let sent = Arc::new(AtomicU64::new(0));
    {
        let sent = Arc::clone(&sent);
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                let sent = Arc::clone(&sent);
                std::thread::spawn(move || serve(s, port, &sent));
            }
        });
    }
    // One server, then the same fake as a one-node cluster.
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis+cluster://127.0.0.1:{port}"),
    ] {
        lookup_refuses_the_lie(&url, &sent).with_context(|| url.clone())?;
    }
    Ok(())
}

fn lookup_refuses_the_lie(url: &str, sent: &AtomicU64) -> Result<()> {
    let pool = Arc::new(Pool::new(PoolConfig {
        prefault: false,
        ..PoolConfig::with_capacity(16 << 20)
    })?);
    let tier = start_remote_tier(
        RemoteConfig {
            timeout: Duration::from_secs(5),
            ..RemoteConfig::new(url.to_string())
        },
        &pool,
    )?;
    tier.allow_object_bytes(OBJECT);
    let ks = keys(4);
    sent.store(0, Ordering::Relaxed);
    // The peak from here on is this lookup's.
    std::fs::write("/proc/self/clear_refs", "5").context("resetting VmHWM")?;
    let before = status_kib("VmRSS:")?;
    let got = tier.fetch_present(&ks, Arc::new(PoolFill::new(&pool)));
    let s = tier.stats();
    let peak = status_kib("VmHWM:")?;
    let grew_mib = peak.saturating_sub(before) as f64 / 1024.0;
    eprintln!(
        "{url}: RSS before {before} KiB, peak during the lookup {peak} KiB (+{grew_mib:.1} MiB); \
         the fake sent {} MiB of its lie before the reader hung up; {s:?}",
        sent.load(Ordering::Relaxed) >> 20
    );
    ensure!(got == vec![false; 4], "{got:?}");
    ensure!(s.corrupt >= 1 && s.hits == 0, "{s:?}");
    ensure!(s.misses >= 4, "{s:?}");
    ensure!(
        grew_mib < 64.0,
        "the lookup grew the peak RSS by {grew_mib:.1} MiB against a 512 MiB lie"
    );
    // The tier is not taken for down: the next lookup asks again (and is refused again).
    let again = tier.fetch_present(&ks[..1], Arc::new(PoolFill::new(&pool)));
    ensure!(again == vec![false], "{again:?}");
    ensure!(tier.stats().corrupt > s.corrupt, "{:?}", tier.stats());
    tier.close();
    Ok(())
}
