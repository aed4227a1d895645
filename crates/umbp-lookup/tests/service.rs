//! Real lookup services on real Unix sockets.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_lookup::{socket_path, LookupClient, LookupError, LookupServer, LookupTarget};

/// A worker that holds a set of block hashes and can be told to stall.
#[derive(Default)]
struct Worker {
    held: Mutex<HashSet<Vec<u8>>>,
    stall_ms: AtomicU64,
    /// `Ping` answers this many bytes when non-zero.
    describe_bytes: AtomicUsize,
    /// Prefix lookups panic while set.
    panics: std::sync::atomic::AtomicBool,
    /// `Holds` requests answered (they must never arrive as `Exists`).
    holds_asked: AtomicU64,
}

impl LookupTarget for Worker {
    fn prefix_hits(&self, _g: u32, packed: &[u8], hl: usize) -> Result<u32, String> {
        std::thread::sleep(Duration::from_millis(self.stall_ms.load(Ordering::Relaxed)));
        assert!(
            !self.panics.load(Ordering::Relaxed),
            "the test store panics"
        );
        let held = self.held.lock();
        Ok(packed.chunks(hl).take_while(|h| held.contains(*h)).count() as u32)
    }
    fn exists(&self, _g: u32, packed: &[u8], hl: usize) -> Result<Vec<bool>, String> {
        let held = self.held.lock();
        Ok(packed.chunks(hl).map(|h| held.contains(h)).collect())
    }
    fn holds(&self, _g: u32, packed: &[u8], hl: usize) -> Result<Vec<bool>, String> {
        self.holds_asked.fetch_add(1, Ordering::Relaxed);
        let held = self.held.lock();
        Ok(packed.chunks(hl).map(|h| held.contains(h)).collect())
    }
    fn clear(&self) -> u64 {
        let mut h = self.held.lock();
        let n = h.len() as u64;
        h.clear();
        n
    }
    fn describe(&self) -> String {
        match self.describe_bytes.load(Ordering::Relaxed) {
            0 => "test worker".into(),
            n => "x".repeat(n),
        }
    }
}

fn hashes(ids: std::ops::Range<u32>) -> Vec<u8> {
    ids.flat_map(|i| {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&i.to_le_bytes());
        h
    })
    .collect()
}

struct Engine {
    _dir: PathBuf,
    workers: Vec<Arc<Worker>>,
    servers: Vec<LookupServer>,
    client: LookupClient,
}

fn engine(name: &str, n: u32, timeout_ms: u64) -> Engine {
    let dir = std::env::temp_dir().join(format!("umbp-lookup-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut workers = Vec::new();
    let mut servers = Vec::new();
    let mut paths = Vec::new();
    for w in 0..n {
        let worker = Arc::new(Worker::default());
        let path = socket_path(&dir, "t", 0, w);
        servers.push(LookupServer::bind(&path, worker.clone()).unwrap());
        workers.push(worker);
        paths.push(path);
    }
    let client = LookupClient::new(paths, Duration::from_millis(timeout_ms));
    Engine {
        _dir: dir,
        workers,
        servers,
        client,
    }
}

fn hold(w: &Worker, ids: std::ops::Range<u32>) {
    let hs = hashes(ids);
    w.held.lock().extend(hs.chunks(32).map(<[u8]>::to_vec));
}

#[test]
fn a_block_hits_only_when_every_worker_holds_it() {
    let e = engine("all", 3, 1000);
    e.client.wait_ready(Duration::from_secs(5)).unwrap();
    hold(&e.workers[0], 0..100);
    hold(&e.workers[1], 0..60);
    hold(&e.workers[2], 0..80);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..100), 32), 60);
    let ex = e.client.exists_all(0, &hashes(55..65), 32);
    assert_eq!(ex, [vec![true; 5], vec![false; 5]].concat());
    // Large requests go through the shared buffer; the answers must not change.
    hold(&e.workers[0], 0..5000);
    hold(&e.workers[1], 0..4000);
    hold(&e.workers[2], 0..4500);
    let big = hashes(0..5000);
    assert!(big.len() > 16 << 10);
    assert_eq!(e.client.prefix_hits(0, &big, 32), 4000);
    let ex = e.client.exists_all(0, &big, 32);
    assert_eq!(ex.iter().filter(|x| **x).count(), 4000);
    assert!(!ex[4000]);
    // And a second large request reuses the attached buffer.
    assert_eq!(e.client.prefix_hits(0, &hashes(0..3000), 32), 3000);
    assert_eq!(e.client.clear(Duration::from_secs(5)).unwrap(), 13500);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..100), 32), 0);
}

#[test]
fn holds_asks_every_worker_and_says_nothing_when_one_is_gone() {
    let mut e = engine("holds", 2, 1000);
    e.client.wait_ready(Duration::from_secs(5)).unwrap();
    hold(&e.workers[0], 0..10);
    hold(&e.workers[1], 0..6);
    let small = e.client.holds_all(0, &hashes(4..8), 32);
    assert_eq!(small, Some(vec![true, true, false, false]));
    // Through the shared buffer too (over 16 KiB of hashes).
    hold(&e.workers[0], 0..3000);
    hold(&e.workers[1], 0..2000);
    let big = e.client.holds_all(0, &hashes(0..3000), 32).unwrap();
    assert_eq!(big.iter().filter(|x| **x).count(), 2000);
    for w in &e.workers {
        assert_eq!(
            w.holds_asked.load(Ordering::Relaxed),
            2,
            "one Holds per call"
        );
    }
    // A worker that does not answer: not "nothing is held" (that would report every
    // tracked block removed) but no answer.
    e.servers.pop().unwrap().shutdown();
    assert_eq!(e.client.holds_all(0, &hashes(0..4), 32), None);
    assert_eq!(e.client.exists_all(0, &hashes(0..4), 32), vec![false; 4]);
}

#[test]
fn a_dead_worker_is_a_miss_not_a_hang() {
    let mut e = engine("dead", 2, 1000);
    hold(&e.workers[0], 0..10);
    hold(&e.workers[1], 0..10);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..10), 32), 10);
    e.servers.pop().unwrap().shutdown();
    let t0 = Instant::now();
    assert_eq!(e.client.prefix_hits(0, &hashes(0..10), 32), 0);
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    let err = e.client.wait_ready(Duration::from_millis(200)).unwrap_err();
    assert!(err.to_string().contains("-w1.sock"), "{err}");
}

#[test]
fn a_stalled_worker_misses_at_once_until_its_answer_arrives() {
    let e = engine("stall", 2, 100);
    hold(&e.workers[0], 0..10);
    hold(&e.workers[1], 0..10);
    e.workers[1].stall_ms.store(600, Ordering::Relaxed);
    let t0 = Instant::now();
    assert_eq!(e.client.prefix_hits(0, &hashes(0..10), 32), 0);
    let first = t0.elapsed();
    assert!(
        first >= Duration::from_millis(90) && first < Duration::from_millis(400),
        "{first:?}"
    );
    e.workers[1].stall_ms.store(0, Ordering::Relaxed);
    let t1 = Instant::now();
    assert_eq!(e.client.prefix_hits(0, &hashes(0..10), 32), 0);
    assert!(
        t1.elapsed() < Duration::from_millis(50),
        "later lookups miss at once"
    );
    // Once the late answer has been drained, the worker answers again.
    let deadline = Instant::now() + Duration::from_secs(5);
    while e.client.prefix_hits(0, &hashes(0..10), 32) != 10 {
        assert!(Instant::now() < deadline, "worker never recovered");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sockets_of_live_engines_are_not_taken_over() {
    let e = engine("inuse", 1, 1000);
    let path = e.client.paths()[0].clone();
    let err = LookupServer::bind(&path, Arc::new(Worker::default())).unwrap_err();
    assert!(matches!(err, LookupError::InUse(_)));
    assert!(err.to_string().contains("lookup_instance"));
    // A stale socket file (its server gone without cleanup) is replaced.
    let stale = path.with_file_name("umbp-stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let s = LookupServer::bind(&stale, Arc::new(Worker::default())).unwrap();
    s.shutdown();
    assert!(!stale.exists(), "shutdown removes the socket");
}

#[test]
fn malformed_requests_get_errors_and_the_server_goes_on() {
    use std::io::{Read, Write};
    let e = engine("bad", 1, 1000);
    let path = e.client.paths()[0].clone();
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    // A prefix request whose hashes are not whole 32-byte hashes.
    let mut frame = b"UMBL".to_vec();
    frame.extend_from_slice(&[2, 0, 0, 0]);
    frame.extend_from_slice(&13u32.to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&32u32.to_le_bytes());
    frame.extend_from_slice(&[1, 2, 3, 4, 5]);
    s.write_all(&frame).unwrap();
    let mut h = [0u8; 12];
    s.read_exact(&mut h).unwrap();
    assert_eq!(&h[..4], b"UMBR");
    assert_eq!(h[4], 1, "error status");
    // Garbage closes that connection only.
    s.write_all(b"garbage!garbage!").unwrap();
    hold(&e.workers[0], 0..3);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..3), 32), 3);
}

#[test]
fn a_regular_file_at_the_socket_path_is_never_deleted() {
    let dir = std::env::temp_dir().join(format!("umbp-lookup-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("not-a-socket.sock");
    std::fs::write(&path, b"precious").unwrap();
    let err = LookupServer::bind(&path, Arc::new(Worker::default())).unwrap_err();
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    let msg = err.to_string();
    assert!(
        msg.contains("not a socket") && msg.contains("lookup_dir"),
        "{msg}"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn shutdown_removes_only_the_socket_it_bound() {
    let e = engine("inode", 1, 1000);
    let path = e.client.paths()[0].clone();
    // A tmp cleaner removes the first server's socket; a newer server binds the same path.
    std::fs::remove_file(&path).unwrap();
    let newer = Arc::new(Worker::default());
    hold(&newer, 0..4);
    let s2 = LookupServer::bind(&path, newer).unwrap();
    drop(e); // the old server shuts down
    assert!(
        path.exists(),
        "the old server removed the newer server's socket"
    );
    let c = LookupClient::new(vec![path.clone()], Duration::from_secs(2));
    assert_eq!(c.prefix_hits(0, &hashes(0..4), 32), 4);
    s2.shutdown();
    assert!(!path.exists(), "shutdown removes its own socket");
}

#[test]
fn shutdown_never_waits_on_a_client_that_does_not_read() {
    use std::io::Write;
    let e = engine("unread", 1, 1000);
    e.workers[0]
        .describe_bytes
        .store(64 << 20, Ordering::Relaxed);
    let path = e.client.paths()[0].clone();
    // A ping whose 64 MiB answer the client never reads.
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let mut ping = b"UMBL".to_vec();
    ping.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
    s.write_all(&ping).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let Engine { servers, .. } = e;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        for srv in servers {
            srv.shutdown();
        }
        let _ = tx.send(t0.elapsed());
    });
    let took = rx
        .recv_timeout(Duration::from_secs(1))
        .expect("shutdown did not return within 1 s with an unread 64 MiB reply pending");
    println!("shutdown with an unread 64 MiB reply pending took {took:?}");
    assert!(!path.exists());
    drop(s);
}

fn limited(name: &str, limits: umbp_lookup::ServerLimits) -> (PathBuf, Arc<Worker>, LookupServer) {
    let dir = std::env::temp_dir().join(format!("umbp-lookup-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = socket_path(&dir, "t", 0, 0);
    let w = Arc::new(Worker::default());
    let s = LookupServer::bind_with_limits(&path, w.clone(), limits).unwrap();
    (path, w, s)
}

/// True once the server has closed `s` (reads end of stream after anything it sent).
fn closed_by_server(s: &mut std::os::unix::net::UnixStream, within: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

#[test]
fn idle_and_stalled_connections_are_closed_and_clients_reconnect() {
    use std::io::Write;
    let (path, w, _s) = limited(
        "timeouts",
        umbp_lookup::ServerLimits {
            idle_timeout: Duration::from_millis(200),
            io_timeout: Duration::from_millis(200),
            ..Default::default()
        },
    );
    hold(&w, 0..8);
    let mut idle = std::os::unix::net::UnixStream::connect(&path).unwrap();
    assert!(
        closed_by_server(&mut idle, Duration::from_secs(3)),
        "idle connection kept"
    );
    // Halfway through a frame, then silence.
    let mut half = std::os::unix::net::UnixStream::connect(&path).unwrap();
    half.write_all(b"UMBL\x02\0\0\0\xff\0\0\0\0\0").unwrap();
    assert!(
        closed_by_server(&mut half, Duration::from_secs(3)),
        "stalled request kept"
    );
    // A client whose pooled connection the server closed reconnects instead of missing.
    let c = LookupClient::new(vec![path.clone()], Duration::from_secs(2));
    assert_eq!(c.prefix_hits(0, &hashes(0..8), 32), 8);
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(
        c.prefix_hits(0, &hashes(0..8), 32),
        8,
        "a lookup after an idle close missed"
    );
}

#[test]
fn requests_over_the_key_limit_are_refused_with_the_limit() {
    use std::io::{Read, Write};
    let (path, w, _s) = limited(
        "maxkeys",
        umbp_lookup::ServerLimits {
            max_keys: 1000,
            ..Default::default()
        },
    );
    hold(&w, 0..1001);
    let c = LookupClient::new(vec![path.clone()], Duration::from_secs(2));
    assert_eq!(c.prefix_hits(0, &hashes(0..1000), 32), 1000);
    // Over the limit, in few bytes (1-byte hashes) and through the shared buffer: misses.
    let one_byte: Vec<u8> = (0..1001u32).map(|i| i as u8).collect();
    assert_eq!(c.prefix_hits(0, &one_byte, 1), 0);
    assert_eq!(c.prefix_hits(0, &hashes(0..1001), 32), 0);
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let mut body = 0u32.to_le_bytes().to_vec();
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&one_byte);
    let mut f = b"UMBL\x03\0\0\0".to_vec();
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    s.write_all(&f).unwrap();
    let mut h = [0u8; 12];
    s.read_exact(&mut h).unwrap();
    assert_eq!(h[4], 1);
    let mut msg = vec![0u8; u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize];
    s.read_exact(&mut msg).unwrap();
    let msg = String::from_utf8(msg).unwrap();
    assert!(
        msg.contains("1001 hashes") && msg.contains("limit of 1000"),
        "{msg}"
    );
    // A body larger than the limit allows is refused from its header, before it is read.
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    s.write_all(b"UMBL\x03\0\0\0\0\0\0\x04").unwrap();
    s.read_exact(&mut h).unwrap();
    assert_eq!(h[4], 1);
    assert!(closed_by_server(&mut s, Duration::from_secs(3)));
}

#[test]
fn at_the_connection_limit_the_idlest_connection_makes_room() {
    let (path, w, _s) = limited(
        "maxconn",
        umbp_lookup::ServerLimits {
            max_connections: 8,
            ..Default::default()
        },
    );
    hold(&w, 0..2);
    let mut first = std::os::unix::net::UnixStream::connect(&path).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let _rest: Vec<_> = (0..7)
        .map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let c = LookupClient::new(vec![path.clone()], Duration::from_secs(2));
    assert_eq!(c.prefix_hits(0, &hashes(0..2), 32), 2);
    assert!(
        closed_by_server(&mut first, Duration::from_secs(2)),
        "the idlest connection was not closed"
    );
}

#[test]
fn a_panicking_store_fails_one_request_and_the_service_goes_on() {
    let e = engine("panic", 1, 1000);
    hold(&e.workers[0], 0..3);
    e.workers[0].panics.store(true, Ordering::Relaxed);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..3), 32), 0);
    e.workers[0].panics.store(false, Ordering::Relaxed);
    assert_eq!(e.client.prefix_hits(0, &hashes(0..3), 32), 3);
}
