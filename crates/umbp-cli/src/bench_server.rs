//! `umbp bench server`: KV blocks through the standalone server from several client
//! processes at once, beside embedded mode and a plain-copy ceiling measured in the same run.
//!
//! A private server is started; for each client count that many client processes are
//! spawned (this executable again, `umbp bench server-client`), each with its own KV cache
//! (host memory shared through a memfd, or CUDA memory registered by IPC) and its own keys.
//! The parent drives them through their stdin (one command per phase, so every client starts
//! a phase together) and reads when each began and finished from their stdout; a direction's
//! figure is every client's bytes over the wall time from the first start to the last finish.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};
use umbp_client::{host_share, ClientOptions, KeyStatus, StandaloneClient};
use umbp_core::{BlockKey, GroupLayout, KeyBuilder, KvLayout, LayerSpec, PoolConfig, RankTopology};
use umbp_cuda::{Device, DeviceBuffer, Stream};
use umbp_proto::completion::monotonic_ns;
use umbp_proto::Endpoint;
use umbp_store::{EmbeddedStore, KeyResult, Session, StoreConfig};

use crate::common::human_bytes;
use crate::common::progress;
use crate::raw::Raw;
use crate::server_proc::{PrivateServer, ServerSpec};

const GB: f64 = 1e9;
/// Targets of the issue: host, 2 and 4 clients, against the ceiling; CUDA, one client,
/// against embedded mode.
const TARGET_HOST_VS_CEILING: f64 = 0.8;
const TARGET_CUDA_VS_EMBEDDED: f64 = 0.95;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Client process counts to run, comma-separated.
    #[arg(long, default_value = "1,2,4")]
    clients: String,
    /// Piece sizes (bytes of one layer of one block) in KiB, comma-separated (default: 64;
    /// with --cuda 64,8).
    #[arg(long)]
    block_kib: Option<String>,
    /// Layers per block (one piece each).
    #[arg(long, default_value_t = 8)]
    layers: u64,
    /// Blocks each client stores and loads per round.
    #[arg(long, default_value_t = 256)]
    blocks: u64,
    /// Timed rounds (after one untimed warm-up round); the median and the best are shown.
    #[arg(long, default_value_t = 20)]
    rounds: u32,
    /// Transfers each client has in flight per direction and round: that many key sets of
    /// its blocks, every transfer submitted at once and then waited for, as an engine does
    /// with several requests in one step. 1 measures one transfer's latency; more measure
    /// what one client sustains. Server and embedded mode alike.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    in_flight: u32,
    /// Copy workers of the server and of embedded mode (default: every core).
    #[arg(long)]
    workers: Option<usize>,
    /// KV caches in CUDA memory (client: registered by IPC; embedded: registered directly).
    #[arg(long)]
    cuda: bool,
    /// CUDA device ordinal (with --cuda).
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// The server's executable (default: next to this `umbp`, then PATH).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Clients as before the direct paths: transfers over gRPC, answered by their replies
    /// only (no transfer channel, no completion page), to measure what those save.
    #[arg(long)]
    replies_only: bool,
    /// Clients that send transfers over gRPC (no transfer channel) but are answered through
    /// the completion page.
    #[arg(long, conflicts_with = "replies_only")]
    no_channel: bool,
    /// The private server's --busy-poll-us (default: the server's own default).
    #[arg(long)]
    server_busy_poll_us: Option<u64>,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// The client process of `umbp bench server` (not for direct use).
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    id: u32,
    #[arg(long)]
    blocks: u64,
    #[arg(long)]
    layers: u64,
    #[arg(long)]
    piece_bytes: u64,
    #[arg(long)]
    namespace: String,
    #[arg(long)]
    cuda: bool,
    #[arg(long, default_value_t = 0)]
    device: i32,
    #[arg(long, default_value_t = 1)]
    in_flight: u32,
    #[arg(long)]
    replies_only: bool,
    #[arg(long)]
    no_channel: bool,
}

fn parse_list(s: &str, flag: &str) -> Result<Vec<u64>> {
    let v: Vec<u64> = s
        .split(',')
        .map(|x| x.trim())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| anyhow!("{flag}: {x:?} is not a positive whole number"))
        })
        .collect::<Result<_>>()?;
    ensure!(!v.is_empty(), "{flag}: give at least one value, e.g. 1,2,4");
    Ok(v)
}

/// The shape of one KV cache: `2 × blocks` blocks of `layers` pieces, layer-first; blocks
/// `0..blocks` are stored, and loaded back into blocks `blocks..2 × blocks`.
#[derive(Debug, Clone, Copy)]
struct Shape {
    blocks: u64,
    layers: u64,
    piece: u64,
}

impl Shape {
    fn len(&self) -> u64 {
        2 * self.blocks * self.layers * self.piece
    }

    /// Bytes moved each way by one cache.
    fn moved(&self) -> u64 {
        self.blocks * self.layers * self.piece
    }

    /// Offset of layer `l`'s stored half (its loaded half follows it).
    fn layer_offset(&self, l: u64) -> u64 {
        l * 2 * self.blocks * self.piece
    }

    fn layer_specs(&self, base: u64) -> Vec<LayerSpec> {
        (0..self.layers)
            .map(|l| LayerSpec {
                base_addr: base + self.layer_offset(l),
                num_blocks: 2 * self.blocks,
                block_stride: self.piece,
                block_bytes: self.piece,
            })
            .collect()
    }

    fn sources(&self) -> Vec<u64> {
        (0..self.blocks).collect()
    }

    fn targets(&self) -> Vec<u64> {
        (self.blocks..2 * self.blocks).collect()
    }

    /// The stored half of layer `l` of cache `id`: words that differ per cache, layer and
    /// block, so a block loaded into the wrong place is caught.
    fn pattern(&self, id: u32, l: u64, out: &mut [u8]) {
        let words_per_piece = self.piece / 8;
        for (w, c) in out.chunks_exact_mut(8).enumerate() {
            let w = w as u64;
            let (b, o) = (w / words_per_piece, w % words_per_piece);
            let v = (u64::from(id) << 56) ^ (l << 44) ^ (b << 24) ^ o ^ 0x9E37_79B9_7F4A_7C15;
            c.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Checks that the loaded half of every layer of `cache` equals its stored half.
    fn verify(&self, cache: &[u8]) -> Result<()> {
        let half = (self.blocks * self.piece) as usize;
        for l in 0..self.layers {
            let at = self.layer_offset(l) as usize;
            let (src, dst) = (&cache[at..at + half], &cache[at + half..at + 2 * half]);
            if src != dst {
                let i = src.iter().zip(dst).position(|(a, b)| a != b).unwrap_or(0);
                bail!(
                    "layer {l}: loaded block {} differs from stored block {} at byte {}",
                    self.blocks + i as u64 / self.piece,
                    i as u64 / self.piece,
                    i as u64 % self.piece
                );
            }
        }
        Ok(())
    }
}

/// Host memory in a sealed memfd (what a client shares with the server), unmapped on drop.
#[derive(Debug)]
struct HostBuf {
    addr: u64,
    len: u64,
    fd: Option<umbp_client::SharedHostMemory>,
}

impl HostBuf {
    fn new(len: u64) -> Result<Self> {
        let shm = host_share::alloc_shared_host(len)?;
        ensure!(
            shm.offset_in_span() == 0,
            "unexpected offset of shared memory"
        );
        let b = HostBuf {
            addr: shm.span_addr(),
            len: shm.span_len(),
            fd: Some(shm),
        };
        // Fault every page in now, outside the timed phases.
        // SAFETY: the whole mapping is ours and nobody else uses it yet.
        unsafe { std::ptr::write_bytes(b.addr as *mut u8, 0, b.len as usize) };
        Ok(b)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: our live mapping; writers (the server, copy workers) are idle whenever the
        // benchmark reads it.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len as usize) }
    }

    #[allow(clippy::mut_from_ref)]
    fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as `bytes`; the benchmark writes only between transfers.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len as usize) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping alloc_shared_host made; every registration of it is gone (the
        // server maps the memfd itself and keeps its own mapping).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

/// One KV cache: host memory or CUDA memory, with what fills and checks it.
enum Cache {
    Host(HostBuf),
    Cuda {
        dev: Arc<Device>,
        buf: DeviceBuffer,
        stream: Stream,
    },
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cache::Host(h) => write!(f, "Cache::Host({:#x}+{})", h.addr, h.len),
            Cache::Cuda { buf, .. } => write!(f, "Cache::Cuda({:#x}+{})", buf.ptr(), buf.len()),
        }
    }
}

impl Cache {
    fn new(shape: &Shape, id: u32, cuda: Option<&Arc<Device>>) -> Result<Self> {
        let half = (shape.blocks * shape.piece) as usize;
        match cuda {
            None => {
                let h = HostBuf::new(shape.len())?;
                let m = h.bytes_mut();
                for l in 0..shape.layers {
                    let at = shape.layer_offset(l) as usize;
                    shape.pattern(id, l, &mut m[at..at + half]);
                }
                Ok(Cache::Host(h))
            }
            Some(dev) => {
                let buf = dev.alloc(shape.len())?;
                let stream = dev.stream()?;
                let mut host = vec![0u8; half];
                for l in 0..shape.layers {
                    shape.pattern(id, l, &mut host);
                    // SAFETY: inside `buf`; `host` lives until the stream is synchronized.
                    unsafe {
                        dev.copy_htod(
                            buf.ptr() + shape.layer_offset(l),
                            host.as_ptr(),
                            half as u64,
                            &stream,
                        )
                    }?;
                    stream.synchronize()?;
                }
                Ok(Cache::Cuda {
                    dev: Arc::clone(dev),
                    buf,
                    stream,
                })
            }
        }
    }

    fn base(&self) -> u64 {
        match self {
            Cache::Host(h) => h.addr,
            Cache::Cuda { buf, .. } => buf.ptr(),
        }
    }

    /// Overwrites the loaded half of every layer (so the last load must bring the bytes).
    fn clobber(&self, shape: &Shape) -> Result<()> {
        let half = shape.blocks * shape.piece;
        for l in 0..shape.layers {
            let at = shape.layer_offset(l) + half;
            match self {
                Cache::Host(h) => h.bytes_mut()[at as usize..(at + half) as usize].fill(0xA5),
                Cache::Cuda { dev, buf, stream } => {
                    // SAFETY: inside `buf`, which no transfer uses meanwhile.
                    unsafe { dev.memset(buf.ptr() + at, 0xA5, half, stream) }?
                }
            }
        }
        if let Cache::Cuda { stream, .. } = self {
            stream.synchronize()?;
        }
        Ok(())
    }

    fn verify(&self, shape: &Shape) -> Result<()> {
        match self {
            Cache::Host(h) => shape.verify(&h.bytes()[..shape.len() as usize]),
            Cache::Cuda { dev, buf, stream } => {
                let mut host = vec![0u8; shape.len() as usize];
                // SAFETY: `host` is as long as `buf`'s used part and outlives the copy.
                unsafe { dev.copy_dtoh(host.as_mut_ptr(), buf.ptr(), shape.len(), stream) }?;
                stream.synchronize()?;
                shape.verify(&host)
            }
        }
    }
}

/// Key set `set` of client `id`: one key per block.
fn keys_of(kb: &KeyBuilder, id: u32, set: u32, blocks: u64) -> Result<Vec<BlockKey>> {
    (0..blocks)
        .map(|b| {
            let mut h = [0u8; 20];
            h[..4].copy_from_slice(&id.to_le_bytes());
            h[4..8].copy_from_slice(&set.to_le_bytes());
            h[8..16].copy_from_slice(&b.to_le_bytes());
            Ok(kb.key(0, &h)?)
        })
        .collect()
}

/// The key sets of one client, one per transfer in flight.
fn key_sets(kb: &KeyBuilder, id: u32, in_flight: u32, blocks: u64) -> Result<Vec<Vec<BlockKey>>> {
    (0..in_flight)
        .map(|set| keys_of(kb, id, set, blocks))
        .collect()
}

// ---------------------------------------------------------------------------------------
// The client process.

/// `umbp bench server-client`: registers its cache, says `ready`, then runs one command per
/// line of stdin (`store`, `load`, `verify-store`: store then overwrite the loaded half,
/// `verify-load`: load then check it, `quit`), answering `done <start ns> <end ns>`.
pub fn run_client(a: &ClientArgs) -> Result<()> {
    let r = client_main(a);
    if let Err(e) = &r {
        println!("error client {}: {e:#}", a.id);
    }
    r
}

fn client_main(a: &ClientArgs) -> Result<()> {
    let shape = Shape {
        blocks: a.blocks,
        layers: a.layers,
        piece: a.piece_bytes,
    };
    let dev = if a.cuda {
        let d = Device::open(a.device)?;
        // This thread fills, clears and reads the cache back.
        d.bind_thread()?;
        Some(d)
    } else {
        None
    };
    let mut cache = Cache::new(&shape, a.id, dev.as_ref())?;
    let mut opts = ClientOptions::new(Endpoint::parse(&a.endpoint)?);
    opts.client_name = format!("umbp bench server client {}", a.id);
    opts.transfer_timeout = Duration::from_secs(120);
    opts.completion_page = !a.replies_only;
    opts.transfer_channel = !a.replies_only && !a.no_channel;
    let client = StandaloneClient::connect(opts)?;
    match &mut cache {
        Cache::Host(h) => {
            let shm = h.fd.take().expect("a new buffer has its memfd");
            client.register_shared_host(shm)?;
        }
        Cache::Cuda { buf, .. } => {
            // SAFETY: `buf` stays allocated until after the client is closed.
            unsafe { client.register_cuda_memory(buf.ptr(), buf.len()) }?;
        }
    }
    let layout = client.register_layout(vec![shape.layer_specs(cache.base())])?;
    let kb = KeyBuilder::new(&a.namespace, RankTopology::default())?;
    let sets = key_sets(&kb, a.id, a.in_flight.max(1), shape.blocks)?;
    let (src, dst) = (shape.sources(), shape.targets());
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut line = String::new();
    let stdin = std::io::stdin();
    loop {
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let cmd = line.trim();
        let (store, verify) = match cmd {
            "store" => (true, false),
            "load" => (false, false),
            "verify-store" => (true, true),
            "verify-load" => (false, true),
            "quit" => break,
            c => bail!("unknown command {c:?} from the parent"),
        };
        let t0 = monotonic_ns();
        // Every key set's transfer is submitted before the first is waited for. Loads of
        // several sets land on the same blocks; every set holds the same bytes.
        let trs = sets
            .iter()
            .map(|keys| {
                if store {
                    client.store(layout.id, 0, &src, keys)
                } else {
                    client.load(layout.id, 0, &dst, keys)
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for tr in &trs {
            let st = tr.wait(None)?;
            if let Some((i, s)) = st.iter().enumerate().find(|(_, s)| **s != KeyStatus::Done) {
                bail!(
                    "{} of key {i} ended {s:?}, not done",
                    if store { "store" } else { "load" }
                );
            }
        }
        let t1 = monotonic_ns();
        let tm = trs[0]
            .timing()
            .context("an answered transfer has its timing")?;
        if verify {
            if store {
                cache.clobber(&shape)?;
            } else {
                cache.verify(&shape)?;
            }
        }
        let by_page = trs
            .iter()
            .filter(|t| t.timing().is_some_and(|t| t.completion_page));
        // µs, or -1 where the transfer did not record it.
        let us = |d: Option<Duration>| d.map_or(-1, |d| d.as_micros() as i64);
        writeln!(
            out,
            "done {t0} {t1} {} {} {} {} {} {}",
            tm.round_trip.as_micros(),
            tm.server.as_micros(),
            tm.copy.as_micros(),
            by_page.count(),
            us(tm.to_server),
            us(tm.to_caller),
        )?;
        out.flush()?;
    }
    client.close();
    drop(cache);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The parent.

#[derive(Debug)]
struct Kid {
    id: u32,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Kid {
    fn read_line(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.stdout.read_line(&mut l)? == 0 {
            let st = self.child.wait()?;
            bail!("client process {} exited ({st}) before answering", self.id);
        }
        let l = l.trim().to_string();
        if let Some(e) = l.strip_prefix("error ") {
            bail!("{e}");
        }
        Ok(l)
    }
}

/// Where the first client's transfer of one phase spent its time, in µs: its whole call
/// (submit to `wait` returning), the gRPC round trip inside the client, the server's
/// handling, and the copy job inside that; with the completion page, from the call to the
/// server reading the request and from the server publishing the answer to the client
/// seeing it (-1: not recorded); and how many of every client's transfers the completion
/// page answered.
#[derive(Debug, Clone, Copy, Default)]
struct Breakdown {
    call: u64,
    round_trip: u64,
    server: u64,
    copy: u64,
    to_server: i64,
    to_caller: i64,
    by_page: u64,
}

/// Sends `cmd` to every client, then collects their (start, end); returns the wall time
/// from the first start to the last end, and the first client's breakdown.
fn phase(kids: &mut [Kid], cmd: &str) -> Result<(f64, Breakdown)> {
    for k in kids.iter_mut() {
        writeln!(k.stdin, "{cmd}")
            .and_then(|_| k.stdin.flush())
            .with_context(|| format!("client process {} is gone", k.id))?;
    }
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut breakdown: Option<Breakdown> = None;
    let mut by_page = 0;
    for k in kids.iter_mut() {
        let l = k.read_line()?;
        let f: Vec<&str> = l.split_whitespace().collect();
        let ["done", a, b, rtt, srv, copy, pages, to_server, to_caller] = f[..] else {
            bail!("client process {} answered {l:?}", k.id);
        };
        by_page += pages.parse::<u64>()?;
        let (a, b): (u64, u64) = (a.parse()?, b.parse()?);
        first = first.min(a);
        last = last.max(b);
        breakdown.get_or_insert(Breakdown {
            call: b.saturating_sub(a) / 1000,
            round_trip: rtt.parse()?,
            server: srv.parse()?,
            copy: copy.parse()?,
            to_server: to_server.parse()?,
            to_caller: to_caller.parse()?,
            by_page: 0,
        });
    }
    let mut b = breakdown.unwrap_or_default();
    b.by_page = by_page;
    Ok((last.saturating_sub(first) as f64 / 1e9, b))
}

/// Median of each field of `v` (non-empty).
fn median_breakdown(v: &[Breakdown]) -> Breakdown {
    fn median<T: Ord + Copy>(v: &[Breakdown], f: fn(&Breakdown) -> T) -> T {
        let mut x: Vec<T> = v.iter().map(f).collect();
        x.sort_unstable();
        x[x.len() / 2]
    }
    Breakdown {
        call: median(v, |b| b.call),
        round_trip: median(v, |b| b.round_trip),
        server: median(v, |b| b.server),
        copy: median(v, |b| b.copy),
        to_server: median(v, |b| b.to_server),
        to_caller: median(v, |b| b.to_caller),
        by_page: median(v, |b| b.by_page),
    }
}

fn breakdown_json(b: &Breakdown, embedded_us: f64) -> Value {
    json!({
        "client_call_us": b.call,
        "round_trip_us": b.round_trip,
        "server_us": b.server,
        "copy_job_us": b.copy,
        "embedded_job_us": embedded_us,
        "to_server_us": (b.to_server >= 0).then_some(b.to_server),
        "to_caller_us": (b.to_caller >= 0).then_some(b.to_caller),
        "answered_by_completion_page": b.by_page,
    })
}

/// Seconds of each direction, one per timed round.
#[derive(Debug, Clone, Default)]
struct Samples {
    store: Vec<f64>,
    load: Vec<f64>,
}

impl Samples {
    fn add(&mut self, (store, load): (f64, f64)) {
        self.store.push(store);
        self.load.push(load);
    }
}

/// Which figure of the rounds a table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stat {
    /// The fastest round.
    Best,
    /// The median round.
    Median,
}

impl Stat {
    fn of(self, v: &[f64]) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        match self {
            Stat::Best => v[0],
            Stat::Median => v[v.len() / 2],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Stat::Best => "best",
            Stat::Median => "median",
        }
    }
}

/// One client count and piece size.
struct Run<'a> {
    a: &'a Args,
    shape: Shape,
    clients: usize,
    workers: usize,
}

impl Run<'_> {
    /// Bytes every client together moves each way.
    fn bytes(&self) -> u64 {
        self.clients as u64 * self.shape.moved() * u64::from(self.a.in_flight)
    }
}

/// The client processes of one run.
#[derive(Debug)]
struct ServerRun {
    kids: Vec<Kid>,
}

impl ServerRun {
    /// Starts `r.clients` client processes and waits until each has registered its cache.
    fn start(r: &Run<'_>, endpoint: &Endpoint) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find this executable to re-run it")?;
        let mut run = ServerRun {
            kids: Vec::with_capacity(r.clients),
        };
        for id in 0..r.clients as u32 {
            let mut cmd = Command::new(&exe);
            cmd.args(["bench", "server-client", "--endpoint"])
                .arg(endpoint.to_string())
                .args(["--id", &id.to_string()])
                .args(["--blocks", &r.shape.blocks.to_string()])
                .args(["--layers", &r.shape.layers.to_string()])
                .args(["--piece-bytes", &r.shape.piece.to_string()])
                .args(["--namespace", "bench-server"])
                .args(["--device", &r.a.device.to_string()])
                .args(["--in-flight", &r.a.in_flight.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            if r.a.cuda {
                cmd.arg("--cuda");
            }
            if r.a.replies_only {
                cmd.arg("--replies-only");
            }
            if r.a.no_channel {
                cmd.arg("--no-channel");
            }
            let mut child = cmd
                .spawn()
                .with_context(|| format!("cannot start {}", exe.display()))?;
            let stdin = child.stdin.take().expect("piped");
            let stdout = BufReader::new(child.stdout.take().expect("piped"));
            run.kids.push(Kid {
                id,
                child,
                stdin,
                stdout,
            });
        }
        for k in run.kids.iter_mut() {
            let l = k.read_line()?;
            ensure!(l == "ready", "client process {} said {l:?}", k.id);
        }
        Ok(run)
    }

    /// Every client stores, then every client loads (checking the bytes when `verify`);
    /// then the pool is emptied. Seconds of each direction.
    fn round(&mut self, raw: &Raw, verify: bool) -> Result<((f64, f64), [Breakdown; 2])> {
        let (s, bs) = phase(
            &mut self.kids,
            if verify { "verify-store" } else { "store" },
        )?;
        let (l, bl) = phase(&mut self.kids, if verify { "verify-load" } else { "load" })?;
        raw.clear(None)?;
        Ok(((s, l), [bs, bl]))
    }

    /// Tells every client to quit and checks that each exits 0.
    fn finish(mut self) -> Result<()> {
        let kids = std::mem::take(&mut self.kids);
        for mut k in kids {
            let _ = writeln!(k.stdin, "quit").and_then(|_| k.stdin.flush());
            drop(k.stdin);
            let st = k.child.wait()?;
            ensure!(st.success(), "client process {} exited with {st}", k.id);
        }
        Ok(())
    }
}

impl Drop for ServerRun {
    fn drop(&mut self) {
        // Only after an error: the clients may be stuck, so they are killed.
        for k in &mut self.kids {
            let _ = k.child.kill();
            let _ = k.child.wait();
        }
    }
}

/// Embedded mode: one session and one cache per client, in this process.
struct EmbeddedRun<'s> {
    store: &'s EmbeddedStore,
    shape: Shape,
    vs: Vec<Virtual>,
}

struct Virtual {
    /// Declared before the cache: released first.
    session: Session,
    layout: u32,
    /// One key set per transfer in flight.
    sets: Vec<Vec<BlockKey>>,
    cache: Cache,
}

impl<'s> EmbeddedRun<'s> {
    fn new(r: &Run<'_>, store: &'s EmbeddedStore, dev: Option<&Arc<Device>>) -> Result<Self> {
        let kb = KeyBuilder::new("bench-server-embedded", RankTopology::default())?;
        let mut vs = Vec::with_capacity(r.clients);
        for id in 0..r.clients as u32 {
            let cache = Cache::new(&r.shape, id, dev)?;
            let session = store.open_session()?;
            match (&cache, dev) {
                (Cache::Host(h), _) => {
                    // SAFETY: `cache` outlives the session (dropped after it, see `Virtual`).
                    unsafe { session.register_memory(h.addr, h.len) }?;
                }
                (Cache::Cuda { buf, .. }, Some(d)) => {
                    // SAFETY: as above.
                    unsafe { session.register_cuda_memory(buf.ptr(), buf.len(), d.ordinal()) }?;
                }
                (Cache::Cuda { .. }, None) => unreachable!("CUDA caches need a device"),
            }
            let layout = session.register_layout(KvLayout::new(vec![GroupLayout::new(
                r.shape.layer_specs(cache.base()),
            )?])?)?;
            vs.push(Virtual {
                session,
                layout,
                sets: key_sets(&kb, id, r.a.in_flight, r.shape.blocks)?,
                cache,
            });
        }
        if dev.is_some() {
            ensure!(
                store.wait_pool_registered(Duration::from_secs(300)),
                "the embedded pool's CUDA registration did not finish in 300 s"
            );
        }
        Ok(EmbeddedRun {
            store,
            shape: r.shape,
            vs,
        })
    }

    /// Every client's job of one direction at once; seconds from the first submit to the
    /// last finish.
    fn direction(&self, store_dir: bool) -> Result<f64> {
        let (src, dst) = (self.shape.sources(), self.shape.targets());
        let barrier = Barrier::new(self.vs.len());
        let times: Vec<Result<(Instant, Instant)>> = std::thread::scope(|s| {
            let hs: Vec<_> = self
                .vs
                .iter()
                .map(|v| {
                    let (barrier, src, dst) = (&barrier, &src, &dst);
                    s.spawn(move || -> Result<(Instant, Instant)> {
                        barrier.wait();
                        let t0 = Instant::now();
                        let jobs = v
                            .sets
                            .iter()
                            .map(|keys| {
                                if store_dir {
                                    v.session.store(v.layout, 0, src, keys.clone())
                                } else {
                                    v.session.load(v.layout, 0, dst, keys.clone())
                                }
                            })
                            .collect::<std::result::Result<Vec<_>, _>>()?;
                        for job in &jobs {
                            let res = job.wait(Duration::from_secs(120))?;
                            if let Some((i, k)) =
                                res.iter().enumerate().find(|(_, k)| **k != KeyResult::Done)
                            {
                                bail!("embedded: key {i} ended {k:?}, not done");
                            }
                        }
                        Ok((t0, Instant::now()))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("a benchmark thread panicked"))
                .collect()
        });
        let times: Vec<(Instant, Instant)> = times.into_iter().collect::<Result<_>>()?;
        let first = times
            .iter()
            .map(|t| t.0)
            .min()
            .expect("one client at least");
        let last = times
            .iter()
            .map(|t| t.1)
            .max()
            .expect("one client at least");
        Ok((last - first).as_secs_f64())
    }

    fn round(&self, verify: bool) -> Result<(f64, f64)> {
        let s = self.direction(true)?;
        if verify {
            for v in &self.vs {
                v.cache.clobber(&self.shape)?;
            }
        }
        let l = self.direction(false)?;
        if verify {
            for v in &self.vs {
                v.cache.verify(&self.shape)?;
            }
        }
        self.store.clear()?;
        Ok((s, l))
    }
}

/// The ceiling: one thread per client copying that client's stored half of every layer into
/// its loaded half (the same bytes in the same pieces as a transfer moves), once per transfer
/// in flight, in the embedded run's host caches. Seconds of (libc memcpy, streaming copy).
fn ceiling_round(emb: &EmbeddedRun<'_>, passes: u32) -> (f64, f64) {
    let shape = emb.shape;
    let half = (shape.blocks * shape.piece) as usize;
    let piece = shape.piece as usize;
    let run = |streaming: bool| -> f64 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for v in &emb.vs {
                let Cache::Host(h) = &v.cache else { continue };
                s.spawn(move || {
                    let m = h.bytes_mut();
                    for l in (0..passes).flat_map(|_| 0..shape.layers) {
                        let at = shape.layer_offset(l) as usize;
                        let (src, dst) = m[at..at + 2 * half].split_at_mut(half);
                        for (dp, sp) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                            if streaming {
                                // SAFETY: equal-length pieces of two disjoint halves.
                                unsafe {
                                    umbp_copy::memcpy::copy(dp.as_mut_ptr(), sp.as_ptr(), dp.len())
                                };
                            } else {
                                dp.copy_from_slice(sp);
                            }
                        }
                    }
                    umbp_copy::memcpy::fence();
                });
            }
        });
        t0.elapsed().as_secs_f64()
    };
    (run(false), run(true))
}

pub fn run(a: &Args) -> Result<()> {
    let clients = parse_list(&a.clients, "--clients")?;
    let block_kib = a
        .block_kib
        .as_deref()
        .unwrap_or(if a.cuda { "64,8" } else { "64" });
    let pieces: Vec<u64> = parse_list(block_kib, "--block-kib")?
        .into_iter()
        .map(|k| k << 10)
        .collect();
    ensure!(
        a.layers > 0 && a.blocks > 0 && a.rounds > 0,
        "--layers, --blocks and --rounds must be > 0"
    );
    ensure!(
        clients.iter().all(|c| *c <= 64),
        "--clients: at most 64 client processes"
    );
    let workers = a
        .workers
        .unwrap_or_else(crate::common::default_threads)
        .max(1);
    let dev = if a.cuda {
        match Device::open(a.device).and_then(|d| d.bind_thread().map(|()| d)) {
            Ok(d) => Some(d),
            Err(e) => {
                println!(
                    "SKIP: umbp bench server --cuda needs a CUDA GPU (device {}): {e}",
                    a.device
                );
                if a.json {
                    println!(
                        "{}",
                        json!({"bench": "server", "mode": "cuda", "skipped": true, "reason": e.to_string()})
                    );
                }
                return Ok(());
            }
        }
    } else {
        None
    };
    let max_total = clients.iter().max().copied().unwrap_or(1)
        * pieces.iter().max().copied().unwrap_or(0)
        * a.blocks
        * a.layers
        * u64::from(a.in_flight);
    let capacity = (max_total as f64 * 1.3) as u64 + (64 << 20);
    let capacity = capacity.next_multiple_of(64 << 20);
    let mode = if a.cuda { "cuda" } else { "host" };
    progress!(
        "{mode} memory: {} layers × {} blocks per client, pieces of {:?} KiB, clients {:?}, pool {}, {workers} copy workers",
        a.layers,
        a.blocks,
        pieces.iter().map(|p| p >> 10).collect::<Vec<_>>(),
        clients,
        human_bytes(capacity)
    );
    let server = PrivateServer::start(&ServerSpec {
        bin: a.server_bin.clone(),
        capacity,
        workers,
        busy_poll_us: a.server_busy_poll_us,
    })?;
    let raw = Raw::new(server.endpoint.clone(), Duration::from_secs(30))?;
    let t = Instant::now();
    let store = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: true,
            ..PoolConfig::with_capacity(capacity)
        },
        num_workers: workers,
        ..StoreConfig::default()
    })?;
    progress!("embedded store ready in {:.2} s", t.elapsed().as_secs_f64());
    let (mut rows, mut medians) = (Vec::new(), Vec::new());
    for &piece in &pieces {
        for &c in &clients {
            let r = Run {
                a,
                shape: Shape {
                    blocks: a.blocks,
                    layers: a.layers,
                    piece,
                },
                clients: c as usize,
                workers,
            };
            progress!(
                "{c} client process(es), {} KiB pieces: server, embedded{} interleaved, {} rounds after a warm-up round",
                piece >> 10,
                if a.cuda { "" } else { " and ceiling" },
                a.rounds
            );
            let mut srv_run = ServerRun::start(&r, &server.endpoint)?;
            let emb_run = EmbeddedRun::new(&r, &store, dev.as_ref())?;
            let (mut srv, mut emb, mut ceil) =
                (Samples::default(), Samples::default(), Samples::default());
            let mut parts: [Vec<Breakdown>; 2] = Default::default();
            let gbps = |s: f64| r.bytes() as f64 / s / GB;
            for round in 0..=a.rounds {
                let verify = round == a.rounds;
                let (sv, bd) = srv_run.round(&raw, verify)?;
                let em = emb_run.round(verify)?;
                let ce = (!a.cuda).then(|| ceiling_round(&emb_run, a.in_flight));
                progress!(
                    "  round {round}{}: server store {:.2} load {:.2}, embedded store {:.2} load {:.2}{} GB/s",
                    if round == 0 { " (warm-up)" } else { "" },
                    gbps(sv.0),
                    gbps(sv.1),
                    gbps(em.0),
                    gbps(em.1),
                    ce.map_or(String::new(), |(m, s)| format!(
                        ", memcpy {:.2} streaming {:.2}",
                        gbps(m),
                        gbps(s)
                    ))
                );
                if round > 0 {
                    parts[0].push(bd[0]);
                    parts[1].push(bd[1]);
                    srv.add(sv);
                    emb.add(em);
                    if let Some(c) = ce {
                        ceil.add(c);
                    }
                }
            }
            srv_run.finish()?;
            drop(emb_run);
            let ceil = (!a.cuda).then_some(ceil);
            let (bs, bl) = (median_breakdown(&parts[0]), median_breakdown(&parts[1]));
            let (es, el) = (
                Stat::Median.of(&emb.store) * 1e6,
                Stat::Median.of(&emb.load) * 1e6,
            );
            if c == 1 && a.in_flight == 1 {
                for (dir, b, e) in [("store", bs, es), ("load", bl, el)] {
                    let legs = if b.to_server >= 0 && b.to_caller >= 0 {
                        format!(
                            "; call to server {} µs, published to seen {} µs",
                            b.to_server, b.to_caller
                        )
                    } else {
                        String::new()
                    };
                    progress!(
                        "  one {dir} transfer, median µs: client call {} = {} {} (server {} (copy job {})) + the rest; embedded job {e:.0}{legs}",
                        b.call,
                        if b.by_page > 0 { "to the completion page's wake-up" } else { "gRPC round trip" },
                        b.round_trip,
                        b.server,
                        b.copy
                    );
                }
            }
            let mut best = row(&r, Stat::Best, &srv, &emb, ceil.as_ref());
            let mut med = row(&r, Stat::Median, &srv, &emb, ceil.as_ref());
            if c == 1 && a.in_flight == 1 {
                let parts =
                    json!({"store": breakdown_json(&bs, es), "load": breakdown_json(&bl, el)});
                best["median_breakdown"] = parts.clone();
                med["median_breakdown"] = parts;
            }
            rows.push(best);
            medians.push(med);
        }
    }
    store.close();
    drop(store);
    server.stop()?;
    print_header(a, mode, workers);
    print_table(a, Stat::Median, &medians);
    print_table(a, Stat::Best, &rows);
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "server",
                "mode": mode,
                "layers": a.layers,
                "blocks_per_client": a.blocks,
                "in_flight": a.in_flight,
                "completion_page": !a.replies_only,
                "transfer_channel": !a.replies_only && !a.no_channel,
                "server_busy_poll_us": a.server_busy_poll_us,
                "rounds": a.rounds,
                "workers": workers,
                "results": rows,
                "median_results": medians,
            })
        );
    }
    Ok(())
}

fn row(r: &Run<'_>, stat: Stat, srv: &Samples, emb: &Samples, ceil: Option<&Samples>) -> Value {
    let bytes = r.bytes() as f64;
    let g = |s: f64| bytes / s / GB;
    let (ss, sl) = (stat.of(&srv.store), stat.of(&srv.load));
    let (es, el) = (stat.of(&emb.store), stat.of(&emb.load));
    let mut v = json!({
        "clients": r.clients,
        "piece_bytes": r.shape.piece,
        "bytes_each_way": bytes as u64,
        "workers": r.workers,
        "stat": stat.name(),
        "server_store_gbps": g(ss),
        "server_load_gbps": g(sl),
        "embedded_store_gbps": g(es),
        "embedded_load_gbps": g(el),
        "store_vs_embedded": es / ss,
        "load_vs_embedded": el / sl,
    });
    if let (Some(c), Value::Object(o)) = (ceil, &mut v) {
        // `store` holds the memcpy rounds, `load` the streaming ones.
        let (m, st) = (stat.of(&c.store), stat.of(&c.load));
        let c = m.min(st);
        o.insert("memcpy_gbps".into(), json!(g(m)));
        o.insert("stream_gbps".into(), json!(g(st)));
        o.insert("ceiling_gbps".into(), json!(g(c)));
        o.insert("store_vs_ceiling".into(), json!(c / ss));
        o.insert("load_vs_ceiling".into(), json!(c / sl));
    }
    v
}

/// How the clients send and are answered.
fn paths(a: &Args) -> &'static str {
    if a.replies_only {
        "over gRPC, answered by the replies"
    } else if a.no_channel {
        "over gRPC, answered through the completion page"
    } else {
        "on the transfer channel, answered through the completion page"
    }
}

fn print_header(a: &Args, mode: &str, workers: usize) {
    println!(
        "server benchmark ({mode} memory): {} layers × {} blocks per client process and transfer, {} transfer(s) in flight per client, each way; {} timed rounds after a warm-up; {workers} copy workers in the server and in embedded mode; transfers {}",
        a.layers,
        a.blocks,
        a.in_flight,
        a.rounds,
        paths(a)
    );
    if let Some(us) = a.server_busy_poll_us {
        println!("  the server's transfer channels busy-poll {us} µs after each request and reply (--busy-poll-us)");
    }
    if !a.cuda {
        println!(
            "  ceiling: the faster of libc memcpy and UMBP's streaming copy, one thread per client, the same bytes in the same pieces"
        );
    }
}

fn print_table(a: &Args, stat: Stat, rows: &[Value]) {
    let f = |v: &Value, k: &str| v[k].as_f64();
    let num = |x: Option<f64>| match x {
        Some(x) => format!("{x:>7.2}"),
        None => format!("{:>7}", "-"),
    };
    println!("  {} of the rounds:", stat.name());
    println!(
        "  {:>7} {:>7} {:>10} | {:^15} | {:^15} | {:>7} | {:^15} | {:^15}",
        "", "", "", "server GB/s", "embedded GB/s", "ceiling", "server/ceiling", "server/embedded"
    );
    println!(
        "  {:>7} {:>7} {:>10} | {:>7} {:>7} | {:>7} {:>7} | {:>7} | {:>7} {:>7} | {:>7} {:>7}",
        "clients",
        "piece",
        "each way",
        "store",
        "load",
        "store",
        "load",
        "GB/s",
        "store",
        "load",
        "store",
        "load"
    );
    let mut misses = Vec::new();
    for v in rows {
        let c = v["clients"].as_u64().unwrap_or(0);
        let p = v["piece_bytes"].as_u64().unwrap_or(0);
        println!(
            "  {c:>7} {:>7} {:>10} | {} {} | {} {} | {} | {} {} | {} {}",
            format!("{} KiB", p >> 10),
            human_bytes(v["bytes_each_way"].as_u64().unwrap_or(0)),
            num(f(v, "server_store_gbps")),
            num(f(v, "server_load_gbps")),
            num(f(v, "embedded_store_gbps")),
            num(f(v, "embedded_load_gbps")),
            num(f(v, "ceiling_gbps")),
            num(f(v, "store_vs_ceiling")),
            num(f(v, "load_vs_ceiling")),
            num(f(v, "store_vs_embedded")),
            num(f(v, "load_vs_embedded")),
        );
        let (key, target, applies) = if a.cuda {
            ("embedded", TARGET_CUDA_VS_EMBEDDED, c == 1)
        } else {
            ("ceiling", TARGET_HOST_VS_CEILING, c == 2 || c == 4)
        };
        if applies {
            for dir in ["store", "load"] {
                let x = f(v, &format!("{dir}_vs_{key}")).unwrap_or(0.0);
                if x < target {
                    misses.push(format!("{c} clients, {} KiB, {dir} {x:.2}", p >> 10));
                }
            }
        }
    }
    let target = if a.cuda {
        format!("CUDA, 1 client ≥ {TARGET_CUDA_VS_EMBEDDED} of embedded")
    } else {
        format!("host, 2 and 4 clients ≥ {TARGET_HOST_VS_CEILING} of the ceiling")
    };
    if misses.is_empty() {
        println!("  target ({target}): met");
    } else {
        println!("  target ({target}): MISSED by {}", misses.join(", "));
    }
}
