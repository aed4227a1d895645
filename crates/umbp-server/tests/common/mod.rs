//! Shared by the server's integration tests: the real server binary started on a private
//! socket, clients in child processes (the test binary run again in a role), raw gRPC calls.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;
use umbp_client::Transfer;
use umbp_core::{BlockKey, ErrorKind, KeyBuilder, KeyOutcome, LayerSpec, RankTopology};
use umbp_proto::v1::store_client::StoreClient;
use umbp_proto::{v1, Endpoint};

/// The env var that selects a child role.
pub const ROLE: &str = "UMBP_TEST_ROLE";

pub const BLOCK: u64 = 64 << 10;
pub const BLOCKS: u64 = 32;

/// A private directory for sockets.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("umbp-srv-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The server binary: `UMBP_SERVER_BIN` when set (tests run on another machine), else the
/// one cargo built.
pub fn server_bin() -> PathBuf {
    std::env::var_os("UMBP_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_umbp_standalone_server")))
}

/// A running `umbp_standalone_server`.
pub struct Server {
    pub child: Child,
    pub endpoint: Endpoint,
    pub log: PathBuf,
}

impl Server {
    pub fn start(sock: &Path, extra: &[&str]) -> Server {
        Self::start_limited(sock, extra, None)
    }

    /// With `address_space` bytes of virtual memory at most (`RLIMIT_AS`): an allocation past
    /// it fails, and the server aborts instead of taking the machine's memory.
    pub fn start_limited(sock: &Path, extra: &[&str], address_space: Option<u64>) -> Server {
        let limits: Vec<_> = address_space
            .map(|a| (libc::RLIMIT_AS, a))
            .into_iter()
            .collect();
        Self::start_with_limits(sock, extra, &limits)
    }

    /// With each `(resource, value)` resource limit set (soft and hard) in the server.
    pub fn start_with_limits(
        sock: &Path,
        extra: &[&str],
        limits: &[(libc::__rlimit_resource_t, u64)],
    ) -> Server {
        let log = sock.with_extension("log");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut cmd = Command::new(server_bin());
        if !limits.is_empty() {
            let limits = limits.to_vec();
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    for &(resource, limit) in &limits {
                        let r = libc::rlimit {
                            rlim_cur: limit,
                            rlim_max: limit,
                        };
                        if libc::setrlimit(resource, &r) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let child = cmd
            .args([
                "--address",
                sock.to_str().unwrap(),
                "--capacity",
                "256MiB",
                "--prefault",
                "false",
                "--workers",
                "4",
                "--log",
                "info,umbp_server=debug",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(f)
            .spawn()
            .unwrap();
        let endpoint = Endpoint::parse(sock.to_str().unwrap()).unwrap();
        let s = Server {
            child,
            endpoint,
            log,
        };
        s.wait_ready();
        s
    }

    /// Waits until the server has logged that it is ready (its socket is bound earlier, before
    /// its pool and tiers exist).
    pub fn wait_ready(&self) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if std::os::unix::net::UnixStream::connect(self.endpoint.path()).is_ok()
                && self.log_text().contains("standalone server ready")
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("server did not start; log:\n{}", self.log_text());
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let st = wait_timeout(&mut self.child, Duration::from_secs(20))
            .expect("server did not stop after SIGTERM");
        std::mem::forget(self);
        st
    }

    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::forget(self);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn wait_timeout(c: &mut Child, d: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < d {
        if let Some(s) = c.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Runs this test binary again as `role` (the test function named `test` dispatches on it).
pub fn spawn_role(test: &str, role: &str, endpoint: &Endpoint, env: &[(&str, String)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("UMBP_TEST_ENDPOINT", endpoint.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Waits until the child prints a line containing `marker`.
pub fn wait_line(c: &mut Child, marker: &str) {
    let out = c.stdout.take().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "child ended before printing {marker:?}"
        );
        if line.contains(marker) {
            break;
        }
    }
    // Keep draining so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while r.read_line(&mut sink).unwrap_or(0) > 0 {
            sink.clear();
        }
    });
}

pub fn role_endpoint() -> Endpoint {
    Endpoint::parse(&std::env::var("UMBP_TEST_ENDPOINT").unwrap()).unwrap()
}

pub fn keys(tag: &str, n: u64) -> Vec<BlockKey> {
    let b = KeyBuilder::new(&format!("test-{tag}"), RankTopology::default()).unwrap();
    (0..n)
        .map(|i| b.key(0, &i.to_le_bytes()).unwrap())
        .collect()
}

/// The byte at `i` of block `b` in pattern `seed`.
pub fn pattern(seed: u64, b: u64, i: u64) -> u8 {
    (seed
        .wrapping_mul(31)
        .wrapping_add(b.wrapping_mul(7))
        .wrapping_add(i.wrapping_mul(13))
        % 251) as u8
}

/// Zeroed memory of a private anonymous mapping of its own, as an engine's KV cache is: the
/// client moves only whole pages that hold nothing else (a heap buffer's first and last page
/// hold other objects, and it refuses those). Unmapped on drop.
pub struct PageBuf {
    ptr: *mut u8,
    len: usize,
}

impl PageBuf {
    pub fn zeroed(len: usize) -> PageBuf {
        // SAFETY: a new mapping at an address of the kernel's choosing; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes");
        PageBuf { ptr: p.cast(), len }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and writable; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping this buffer's own mapping; no slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A KV-cache-like buffer registered with `client`, with one layout of `BLOCKS` blocks.
pub struct Cache {
    pub buf: PageBuf,
    pub layout: u32,
}

pub fn cache(client: &umbp_client::StandaloneClient) -> Cache {
    let buf = PageBuf::zeroed((BLOCK * BLOCKS) as usize);
    let addr = buf.as_ptr() as u64;
    // SAFETY: the buffer lives as long as the Cache (and no other thread touches it now).
    unsafe { client.register_host_memory(addr, buf.len() as u64) }.unwrap();
    let layout = client
        .register_layout(vec![vec![LayerSpec {
            base_addr: addr,
            num_blocks: BLOCKS,
            block_stride: BLOCK,
            block_bytes: BLOCK,
        }]])
        .unwrap();
    assert_eq!(layout.object_bytes, vec![BLOCK]);
    Cache {
        buf,
        layout: layout.id,
    }
}

impl Cache {
    pub fn fill(&mut self, seed: u64) {
        for b in 0..BLOCKS {
            for i in 0..BLOCK {
                self.buf[(b * BLOCK + i) as usize] = pattern(seed, b, i);
            }
        }
    }

    /// Whether `client` stores blocks `ids` of this cache under `keys(tag, BLOCKS)` with every
    /// key stored or already present.
    pub fn stores_all(
        &self,
        client: &umbp_client::StandaloneClient,
        ids: &[u64],
        tag: &str,
    ) -> bool {
        client
            .store(self.layout, 0, ids, &keys(tag, BLOCKS))
            .unwrap()
            .wait(None)
            .unwrap()
            .iter()
            .all(KeyOutcome::is_ok)
    }

    /// Whether `client` loads `keys(tag, BLOCKS)` into blocks `ids` with every key done.
    pub fn loads_all(
        &self,
        client: &umbp_client::StandaloneClient,
        ids: &[u64],
        tag: &str,
    ) -> bool {
        client
            .load(self.layout, 0, ids, &keys(tag, BLOCKS))
            .unwrap()
            .wait(None)
            .unwrap()
            .iter()
            .all(|s| *s == KeyOutcome::Done)
    }

    pub fn check(&self, seed: u64, blocks: &[u64]) {
        for &b in blocks {
            for i in 0..BLOCK {
                assert_eq!(
                    self.buf[(b * BLOCK + i) as usize],
                    pattern(seed, b, i),
                    "block {b} byte {i}"
                );
            }
        }
    }
}

/// A transfer's outcomes once answered, or the kind and message of why it failed: it could not
/// be started, or it failed as a whole (then every key reads failed).
pub fn answered(t: umbp_client::Result<Transfer>) -> Result<Vec<KeyOutcome>, (ErrorKind, String)> {
    let t = t.map_err(|e| (e.kind(), e.to_string()))?;
    let s = t.wait(None).map_err(|e| (e.kind(), e.to_string()))?;
    match t.failure() {
        Some(f) => Err(f),
        None => Ok(s),
    }
}

pub fn client(endpoint: &Endpoint) -> umbp_client::StandaloneClient {
    let mut o = umbp_client::ClientOptions::new(endpoint.clone());
    o.startup_timeout = Duration::from_secs(10);
    o.transfer_timeout = Duration::from_secs(20);
    umbp_client::StandaloneClient::connect(o).unwrap()
}

/// A runtime and a raw generated client (no session unless the test attaches).
pub fn raw(
    endpoint: &Endpoint,
) -> (
    tokio::runtime::Runtime,
    StoreClient<tonic::transport::Channel>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ch = {
        let _g = rt.enter();
        umbp_client::unix_channel(endpoint)
    };
    (
        rt,
        StoreClient::new(ch)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20),
    )
}

pub fn stats(endpoint: &Endpoint) -> v1::StatsReply {
    let (rt, mut g) = raw(endpoint);
    rt.block_on(g.stats(v1::StatsRequest {}))
        .unwrap()
        .into_inner()
}

/// The stats once at most `sessions` sessions remain (sessions of clients that just exited are
/// released in the background for a moment), waiting up to a second.
pub fn stats_settled(endpoint: &Endpoint, sessions: u64) -> v1::StatsReply {
    let t = Instant::now();
    loop {
        let s = stats(endpoint);
        if s.sessions <= sessions || t.elapsed() > Duration::from_secs(1) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Bytes in, bytes out: sends undecoded request bodies.
#[derive(Debug, Clone, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut v = vec![0u8; buf.remaining()];
        buf.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

/// Every method of the service, by path.
pub const METHODS: &[&str] = &[
    "Ping",
    "Stats",
    "Clear",
    "Exists",
    "Attach",
    "Detach",
    "RegisterHostMemory",
    "RegisterCudaIpc",
    "RegisterCudaVmm",
    "DeregisterMemory",
    "RegisterLayout",
    "Transfer",
    "CancelTransfer",
    "RegisterCompletionPage",
];

/// Calls `method` with an undecoded body.
pub async fn raw_call(
    ch: tonic::transport::Channel,
    method: &str,
    body: Vec<u8>,
) -> Result<Vec<u8>, Status> {
    let mut g = tonic::client::Grpc::new(ch);
    g.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path =
        tonic::codegen::http::uri::PathAndQuery::try_from(format!("/umbp.v1.Store/{method}"))
            .unwrap();
    g.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// Attaches a raw client (a session of its own, on the raw client's connection).
pub fn attach(
    rt: &tokio::runtime::Runtime,
    g: &mut StoreClient<tonic::transport::Channel>,
) -> v1::AttachReply {
    rt.block_on(g.attach(v1::AttachRequest {
        client_name: "raw".into(),
        protocol: umbp_proto::PROTOCOL,
    }))
    .unwrap()
    .into_inner()
}

/// Asks the side channel for a transfer channel of session `sid`; the socket and the first
/// eight bytes of the answer ([`umbp_proto::channel::CHANNEL_OPENED`] or
/// [`umbp_proto::FD_REFUSED`]).
pub fn open_channel(
    server: &Server,
    sid: u64,
    secret: &[u8],
) -> (std::os::unix::net::UnixStream, [u8; 8]) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(server.endpoint.fd_socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let h = umbp_proto::FdHeader {
        session_id: sid,
        secret: secret.try_into().unwrap(),
        count: 0,
    };
    s.write_all(&h.encode()).unwrap();
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack).unwrap();
    (s, ack)
}

/// The next reply on a channel; None when the server ended it (a clean end: a read that
/// times out fails the test).
pub fn channel_reply(s: &mut std::os::unix::net::UnixStream) -> Option<v1::ChannelReply> {
    use prost::Message;
    match umbp_proto::channel::read_frame(s, 1 << 20) {
        Ok(f) => f.map(|f| v1::ChannelReply::decode(f.as_slice()).unwrap()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
        Err(e) => panic!("no answer on the channel: {e}"),
    }
}
