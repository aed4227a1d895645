//! The remote tier: a node pool's objects shared with other nodes through an existing Redis or
//! Valkey deployment (one server or a cluster).
//!
//! UMBP does not build a distributed store; it puts one behind the node pool:
//!
//! - **Writes are behind the store.** A writer thread follows the pool's commits and copies
//!   objects to the remote store from the pool (pinned only while it sends them), in pipelined
//!   batches, bounded by a backlog in bytes and optionally a rate. When the remote is slow or
//!   down, objects past the backlog are dropped and counted; the engine never waits for it.
//!   With [`WritePolicy::OnReuse`] an object is written only when lookups hit it a second time,
//!   sparing the network for one-off prefixes.
//! - **Lookups consult it for what the pool misses.** [`RemoteTier::fetch_prefix`] and
//!   [`RemoteTier::fetch_present`] get the missing objects (pipelined per node, in chunks),
//!   check them ([`object`]: key, length and checksum; any mismatch is a miss) and put them in
//!   the pool, so the copy path still reads local DRAM. The caller waits at most the tier's
//!   timeout; whatever has not arrived by then is a miss.
//! - **Failures are misses.** A connection error marks the remote down for a back-off period
//!   during which lookups miss at once and writes are dropped; the next attempt after it
//!   reconnects. Every such event is counted in [`RemoteStats`].
//!
//! Remote eviction is the remote store's own: set `maxmemory` and `maxmemory-policy
//! allkeys-lru` there, and/or give objects a TTL ([`RemoteConfig::ttl`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;
use umbp_core::address::redact_url;
use umbp_core::{options, BlockKey};
use umbp_pool::{CommitOutcome, Pool, PoolEvent};

mod conn;
pub mod object;

pub use conn::Target;
use conn::{Backend, Conn};

/// Errors of the remote tier's set-up (its operations never fail the caller: they miss).
#[derive(Debug, Error)]
pub enum RemoteError {
    /// `remote_url` cannot be used.
    #[error("remote_url {url:?}: {why}")]
    Url {
        /// The URL, password redacted.
        url: String,
        /// What is wrong and what to write instead.
        why: String,
    },
    /// Another setting is out of range.
    #[error("{name}: {why}")]
    Setting {
        /// The option's name.
        name: &'static str,
        /// What to change.
        why: String,
    },
    /// The Redis client refused the configuration.
    #[error("the Redis client refused the remote tier's configuration: {0}")]
    Client(String),
    /// A thread could not be started.
    #[error("cannot start the remote tier's {what} thread: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// When objects are written to the remote store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritePolicy {
    /// Every object, as soon as it is committed to the pool.
    #[default]
    Eager,
    /// An object the second time a lookup hits it in the pool (hits of one key less than a
    /// second apart count once: vLLM looks a waiting request up again every step).
    OnReuse,
}

impl WritePolicy {
    /// Parses `eager` or `on_reuse`.
    pub fn parse(s: &str) -> Result<WritePolicy, RemoteError> {
        match s {
            "eager" => Ok(WritePolicy::Eager),
            "on_reuse" => Ok(WritePolicy::OnReuse),
            other => Err(RemoteError::Setting {
                name: "remote_write",
                why: format!("{other:?} is neither \"eager\" nor \"on_reuse\""),
            }),
        }
    }

    /// The policy's name as options spell it.
    pub fn name(self) -> &'static str {
        match self {
            WritePolicy::Eager => "eager",
            WritePolicy::OnReuse => "on_reuse",
        }
    }
}

/// Everything that shapes a remote tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://host:port`, or `redis+cluster://host:port,host:port` (user and password as in
    /// `redis://user:password@host:port`).
    pub url: String,
    /// Expiry of written objects (`None`: kept until the remote store evicts them).
    pub ttl: Option<Duration>,
    /// When objects are written.
    pub write: WritePolicy,
    /// How long a lookup waits for the remote store, and how long each connect and each
    /// answer may take.
    pub timeout: Duration,
    /// Bytes of objects waiting to be written; beyond it new objects are dropped (counted).
    pub write_backlog_bytes: u64,
    /// Write rate limit in bytes per second (0: none).
    pub write_bytes_per_s: u64,
    /// A file holding a secret the nodes share (at least 16 bytes; a final newline is not
    /// part of it): values are then sealed with a keyed MAC (HMAC-SHA256) instead of a
    /// checksum, and only values sealed with the same secret are taken ([`object`]).
    /// [`RemoteConfig::new`] takes it from `UMBP_REMOTE_SECRET_FILE`.
    pub secret_file: Option<PathBuf>,
}

/// The environment variable naming the remote tier's secret file.
pub const SECRET_FILE_ENV: &str = "UMBP_REMOTE_SECRET_FILE";

/// The secret file `UMBP_REMOTE_SECRET_FILE` names, if set and not empty.
pub fn secret_file_from_env() -> Option<PathBuf> {
    std::env::var_os(SECRET_FILE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Reads the secret of `path` into a MAC key; errors name the file and what to change. Warns
/// when other users may read the file.
fn read_secret(path: &Path) -> Result<object::MacKey, RemoteError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |why: String| RemoteError::Setting {
        name: "remote secret file",
        why: format!("{}: {why}", path.display()),
    };
    let bytes = std::fs::read(path).map_err(|e| {
        bad(format!(
            "cannot read it ({e}); name a file this user can read"
        ))
    })?;
    let secret = bytes
        .strip_suffix(b"\r\n")
        .or_else(|| bytes.strip_suffix(b"\n"))
        .unwrap_or(&bytes);
    let key = object::MacKey::new(secret).map_err(bad)?;
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            log::warn!(
                "remote tier: the secret file {} is readable by other users (mode {:o}); \
                 chmod 600 it",
                path.display(),
                m.permissions().mode() & 0o777
            );
        }
    }
    Ok(key)
}

impl RemoteConfig {
    /// A configuration with the defaults for everything but the URL.
    pub fn new(url: impl Into<String>) -> RemoteConfig {
        RemoteConfig {
            url: url.into(),
            ttl: Some(options::REMOTE_TTL_S.default_u64())
                .filter(|&s| s > 0)
                .map(Duration::from_secs),
            write: WritePolicy::parse(options::REMOTE_WRITE.default_str())
                .expect("the schema's remote_write default is a policy"),
            timeout: Duration::from_millis(options::REMOTE_TIMEOUT_MS.default_u64()),
            write_backlog_bytes: options::REMOTE_WRITE_BACKLOG.default_u64(),
            write_bytes_per_s: options::REMOTE_WRITE_MB_PER_S
                .default_u64()
                .saturating_mul(1_000_000),
            secret_file: secret_file_from_env(),
        }
    }

    /// Checks every setting (the ranges of the connector's options); parses the URL.
    pub fn validate(&self) -> Result<Target, RemoteError> {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        for (spec, v) in [
            (&options::REMOTE_TIMEOUT_MS, ms),
            (&options::REMOTE_WRITE_BACKLOG, self.write_backlog_bytes),
        ] {
            spec.check_u64(v).map_err(|e| RemoteError::Setting {
                name: spec.name,
                why: e.to_string(),
            })?;
        }
        Target::parse(&self.url)
    }
}

/// Keys per pipelined fetch: one round trip per node per chunk.
const FETCH_CHUNK: usize = 32;
/// Objects and bytes per pipelined write.
const WRITE_BATCH: usize = 32;
const WRITE_BATCH_BYTES: u64 = 32 << 20;
/// Lookups queued for the fetch threads beyond those being served; more miss at once.
const FETCH_QUEUE: usize = 16;
const FETCH_THREADS: usize = 2;
/// Pool events the writer may lag behind before the pool drops them (counted by the pool).
const EVENT_QUEUE: usize = 1 << 16;
/// How long the remote is left alone after a failure.
const BACKOFF: Duration = Duration::from_secs(1);
/// How long clearing a namespace may take in all (a `SCAN` that never ends stops there).
const CLEAR_DEADLINE: Duration = Duration::from_secs(60);
/// Bounds of the writer's bookkeeping sets (cleared when full: at worst an object is written
/// twice or once too few).
const MAX_TRACKED: usize = 1 << 20;

/// Counters of the remote tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Keys the pool missed that were asked of the remote store.
    pub lookup_keys: u64,
    /// Objects fetched, checked and put in the pool.
    pub hits: u64,
    /// Keys the remote store did not have.
    pub misses: u64,
    /// Values rejected by their header or checksum (counted as misses too).
    pub corrupt: u64,
    /// Lookups that gave up waiting after the timeout.
    pub timeouts: u64,
    /// Lookups answered without asking because the remote was down (back-off) or busy.
    pub skipped_lookups: u64,
    /// Bytes fetched into the pool.
    pub bytes_fetched: u64,
    /// Objects written.
    pub writes: u64,
    /// Bytes written (payloads).
    pub bytes_written: u64,
    /// Objects not written: backlog full, or the remote down or failing.
    pub writes_dropped: u64,
    /// Objects that left the pool before their turn to be written.
    pub writes_evicted: u64,
    /// Failed requests (connects, commands, timeouts).
    pub errors: u64,
    /// Whether the last request succeeded.
    pub connected: bool,
    /// Bytes waiting to be written.
    pub backlog_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    lookup_keys: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    timeouts: AtomicU64,
    skipped_lookups: AtomicU64,
    bytes_fetched: AtomicU64,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    writes_dropped: AtomicU64,
    writes_evicted: AtomicU64,
    errors: AtomicU64,
    connected: AtomicBool,
    backlog_bytes: AtomicU64,
    /// Pool commits the writer has taken from the pool's queue.
    commits_seen: AtomicU64,
    /// The writer holds a batch it has not finished sending.
    writing: AtomicBool,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A set that forgets everything when it grows past [`MAX_TRACKED`].
#[derive(Debug, Default)]
struct Tracked<V> {
    map: HashMap<BlockKey, V>,
}

impl<V> Tracked<V> {
    fn insert(&mut self, k: BlockKey, v: V) {
        if self.map.len() >= MAX_TRACKED {
            self.map.clear();
        }
        self.map.insert(k, v);
    }
}

/// How often lookups hit a committed object not written yet (on-reuse policy).
#[derive(Debug, Default, Clone, Copy)]
struct Reuse {
    hits: u8,
    last: Option<Instant>,
}

/// Hits of one key closer together than this count as one (on-reuse policy).
const REUSE_WINDOW: Duration = Duration::from_secs(1);

/// What the fetch threads are asked.
struct FetchJob {
    keys: Vec<BlockKey>,
    /// Stop at the first key the remote lacks.
    prefix: bool,
    /// The caller stops waiting then; a job still queued at that time is not served.
    deadline: Instant,
    /// Set when a fetch thread takes the job (a job that waited in the queue all along says
    /// nothing about the remote).
    started: Arc<AtomicBool>,
    /// Per chunk: (index of its first key, which of its keys are now in the pool).
    reply: mpsc::Sender<(usize, Vec<bool>)>,
}

#[derive(Debug)]
struct Inner {
    cfg: RemoteConfig,
    /// How values are sealed (from the secret file, if any).
    seal: object::Seal,
    /// The largest object this node's layouts make ([`RemoteTier::allow_object_bytes`]):
    /// a fetched value is read only that far (0: none registered, nothing is fetched).
    max_object_bytes: AtomicU64,
    backend: Backend,
    pool: Arc<Pool>,
    c: Counters,
    closed: AtomicBool,
    /// No request before this instant (after a failure).
    down_until: Mutex<Option<Instant>>,
    /// Whether the remote's being down was logged as a warning (cleared on success).
    reported_down: AtomicBool,
    /// Keys the fetchers put in the pool: their commits are not written back.
    from_remote: Mutex<HashSet<BlockKey>>,
    /// On-reuse policy: committed keys not written yet, and how often lookups hit them.
    candidates: Mutex<Tracked<Reuse>>,
    /// The writer's queue: pool commits (through the forwarder thread), objects to write, stop.
    to_writer: Mutex<Option<SyncSender<WriterMsg>>>,
    /// `Write` messages sent and not yet taken by the writer.
    writes_queued: AtomicU64,
    /// The pool's commits before the tier subscribed to them.
    puts_before: u64,
}

/// What the writer thread is told.
#[derive(Debug)]
enum WriterMsg {
    /// A pool event.
    Pool(PoolEvent),
    /// Write this object of the pool (on-reuse promotion, or `write_keys`).
    Write(BlockKey),
    /// Stop.
    Stop,
}

impl Inner {
    fn send_writes(&self, keys: impl IntoIterator<Item = BlockKey>) {
        if let Some(tx) = self.to_writer.lock().as_ref() {
            for k in keys {
                self.writes_queued.fetch_add(1, Ordering::AcqRel);
                // Never waits (a lookup calls this): a full queue drops the write.
                if tx.try_send(WriterMsg::Write(k)).is_err() {
                    self.writes_queued.fetch_sub(1, Ordering::AcqRel);
                    add(&self.c.writes_dropped, 1);
                }
            }
        }
    }
}

impl Inner {
    /// The longest value a fetch reads: the largest allowed object and its header.
    fn value_limit(&self) -> u64 {
        self.max_object_bytes.load(Ordering::Relaxed) + self.seal.header_bytes() as u64
    }

    fn is_down(&self) -> bool {
        let mut d = self.down_until.lock();
        match *d {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *d = None;
                false
            }
            None => false,
        }
    }

    fn failed(&self, what: &str, e: &redis::RedisError) {
        add(&self.c.errors, 1);
        let was = self.c.connected.swap(false, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + BACKOFF);
        // The first failure of a remote that never answered (a wrong password, a TLS
        // mismatch) is a warning too, not only the loss of a connected one.
        let first = !self.reported_down.swap(true, Ordering::Relaxed);
        if was || first {
            log::warn!(
                "remote tier {}: {what} failed ({e}); lookups miss and writes are dropped for {} s, then it retries",
                redact_url(&self.cfg.url),
                BACKOFF.as_secs()
            );
        } else {
            log::debug!("remote tier: {what} failed again: {e}");
        }
    }

    fn unresponsive(&self) {
        let was = self.c.connected.swap(false, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + BACKOFF);
        if was {
            log::warn!(
                "remote tier {}: a lookup got no answer within {} ms; lookups miss for {} s, then it retries",
                redact_url(&self.cfg.url),
                self.cfg.timeout.as_millis(),
                BACKOFF.as_secs()
            );
        }
    }

    fn succeeded(&self) {
        self.reported_down.store(false, Ordering::Relaxed);
        if !self.c.connected.swap(true, Ordering::Relaxed) {
            log::info!("remote tier {}: connected", redact_url(&self.cfg.url));
        }
    }

    /// A connection, made if `slot` has none (and the remote is not in back-off).
    fn conn<'s>(&self, slot: &'s mut Option<Conn>) -> Option<&'s mut Conn> {
        if slot.is_none() {
            if self.is_down() {
                return None;
            }
            match self.backend.connect(self.cfg.timeout) {
                Ok(c) => {
                    *slot = Some(c);
                    self.succeeded();
                }
                Err(e) => {
                    self.failed("connecting", &e);
                    return None;
                }
            }
        }
        slot.as_mut()
    }
}

/// A running remote tier. Dropping it (or [`RemoteTier::close`]) stops its threads.
#[derive(Debug)]
pub struct RemoteTier {
    inner: Arc<Inner>,
    fetch_tx: Mutex<Option<SyncSender<FetchJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl RemoteTier {
    /// Starts the tier in front of `pool`: checks the configuration (not the remote: a remote
    /// that is down at start is a remote that misses), subscribes to the pool's commits and
    /// starts the writer and fetch threads.
    pub fn start(cfg: RemoteConfig, pool: Arc<Pool>) -> Result<RemoteTier, RemoteError> {
        let target = cfg.validate()?;
        let seal = match &cfg.secret_file {
            Some(path) => object::Seal::Keyed(Box::new(read_secret(path)?)),
            None => object::Seal::Checksum,
        };
        let backend = Backend::new(&target, cfg.timeout)?;
        let events = pool.subscribe(EVENT_QUEUE);
        // After subscribing: a commit racing with this line is counted here and also seen as
        // an event, so `flush` may return one such commit early (only commits made while the
        // tier starts). Read before subscribing, it would never return.
        let puts_before = pool.stats().puts;
        let inner = Arc::new(Inner {
            cfg,
            seal,
            max_object_bytes: AtomicU64::new(0),
            backend,
            pool,
            c: Counters::default(),
            closed: AtomicBool::new(false),
            down_until: Mutex::new(None),
            reported_down: AtomicBool::new(false),
            from_remote: Mutex::new(HashSet::new()),
            candidates: Mutex::new(Tracked::default()),
            to_writer: Mutex::new(None),
            writes_queued: AtomicU64::new(0),
            puts_before,
        });
        // Bounded: when the writer lags this far, the forwarder waits, the pool's own queue
        // fills and the pool drops (and counts) events instead of anything growing.
        let (to_writer, writer_rx) = mpsc::sync_channel::<WriterMsg>(EVENT_QUEUE);
        *inner.to_writer.lock() = Some(to_writer.clone());
        let (fetch_tx, fetch_rx) = mpsc::sync_channel::<FetchJob>(FETCH_QUEUE);
        let fetch_rx = Arc::new(std::sync::Mutex::new(fetch_rx));
        let tier = RemoteTier {
            inner: Arc::clone(&inner),
            fetch_tx: Mutex::new(Some(fetch_tx)),
            threads: Mutex::new(Vec::new()),
        };
        let spawn = |name: String, what: &'static str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|source| RemoteError::Thread { what, source })
        };
        // The forwarder blocks on the pool's events and hands them to the writer; it ends at
        // the first event after the writer is gone (not joined: it may wait for one forever).
        spawn(
            "umbp-remote-events".into(),
            "event forwarder",
            Box::new(move || {
                for ev in events {
                    if to_writer.send(WriterMsg::Pool(ev)).is_err() {
                        return;
                    }
                }
            }),
        )?;
        let w = Arc::clone(&inner);
        let h = spawn(
            "umbp-remote-write".into(),
            "writer",
            Box::new(move || writer(&w, writer_rx)),
        )?;
        tier.threads.lock().push(h);
        for i in 0..FETCH_THREADS {
            let (f, rx) = (Arc::clone(&inner), Arc::clone(&fetch_rx));
            let h = spawn(
                format!("umbp-remote-fetch-{i}"),
                "fetch",
                Box::new(move || fetcher(&f, &rx)),
            )?;
            tier.threads.lock().push(h);
        }
        log::info!(
            "remote tier {}: values {}; writes {}{}, timeout {} ms, backlog {} MiB",
            redact_url(&inner.cfg.url),
            match inner.seal {
                object::Seal::Checksum => "checksummed (XXH3: catches accidents, not forgeries)",
                object::Seal::Keyed(_) => "sealed with the secret file's key (HMAC-SHA256)",
            },
            inner.cfg.write.name(),
            inner
                .cfg
                .ttl
                .map_or(String::new(), |t| format!(", TTL {} s", t.as_secs())),
            inner.cfg.timeout.as_millis(),
            inner.cfg.write_backlog_bytes >> 20
        );
        Ok(tier)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RemoteConfig {
        &self.inner.cfg
    }

    /// Lets fetches read objects of up to `bytes` (a registered layout's object size): a
    /// remote value is read only as far as the largest size allowed, so a planted huge value
    /// costs no more memory than a real one. Until a size is allowed, nothing is fetched.
    pub fn allow_object_bytes(&self, bytes: u64) {
        self.inner
            .max_object_bytes
            .fetch_max(bytes, Ordering::Relaxed);
    }

    /// Fetches `keys` (those the pool missed, in prefix order) into the pool, stopping at the
    /// first the remote lacks; waits at most the tier's timeout. Returns how many keys from
    /// the first are now in the pool.
    pub fn fetch_prefix(&self, keys: &[BlockKey]) -> usize {
        self.fetch_prefix_by(keys, Instant::now() + self.inner.cfg.timeout)
    }

    /// [`fetch_prefix`](Self::fetch_prefix), waiting until `deadline` at most (one deadline
    /// for the several calls of one lookup).
    pub fn fetch_prefix_by(&self, keys: &[BlockKey], deadline: Instant) -> usize {
        let got = self.fetch(keys, true, deadline);
        got.iter().take_while(|p| **p).count()
    }

    /// When a lookup that starts now must be answered.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.inner.cfg.timeout
    }

    /// Fetches every key of `keys` (those the pool missed) that the remote holds into the pool;
    /// waits at most the tier's timeout. Returns which are now in the pool.
    pub fn fetch_present(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.fetch(keys, false, self.deadline())
    }

    fn fetch(&self, keys: &[BlockKey], prefix: bool, deadline: Instant) -> Vec<bool> {
        let mut got = vec![false; keys.len()];
        if keys.is_empty() {
            return got;
        }
        let c = &self.inner.c;
        if self.inner.is_down() {
            add(&c.skipped_lookups, 1);
            return got;
        }
        if self.inner.max_object_bytes.load(Ordering::Relaxed) == 0 {
            // No layout registered: nothing here could load what it fetched.
            log::debug!("remote tier: no object size allowed yet; the lookup misses");
            return got;
        }
        if Instant::now() >= deadline {
            return got;
        }
        let (tx, rx) = mpsc::channel();
        let started = Arc::new(AtomicBool::new(false));
        let job = FetchJob {
            keys: keys.to_vec(),
            prefix,
            deadline,
            started: Arc::clone(&started),
            reply: tx,
        };
        let sent = match self.fetch_tx.lock().as_ref() {
            Some(s) => s.try_send(job),
            None => return got,
        };
        match sent {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                add(&c.skipped_lookups, 1);
                return got;
            }
        }
        let chunks = keys.len().div_ceil(FETCH_CHUNK);
        let mut seen = 0;
        while seen < chunks {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((at, present)) => {
                    let stop = prefix && present.iter().any(|p| !p);
                    got[at..at + present.len()].copy_from_slice(&present);
                    seen += 1;
                    if stop {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    add(&c.timeouts, 1);
                    if seen == 0 && started.load(Ordering::Acquire) {
                        // A fetch thread asked and not one chunk came back within the
                        // timeout: the remote is unresponsive, not merely busy with a long
                        // prefix (or this job queued behind others). Leave it alone a while.
                        self.inner.unresponsive();
                    }
                    break;
                }
                // The fetcher finished early (prefix stop, or an error: the rest missed).
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        got
    }

    /// Tells the tier that lookups hit `keys` in the pool (the on-reuse policy writes an object
    /// at its second hit; a no-op with the eager policy).
    pub fn note_hits(&self, keys: impl IntoIterator<Item = BlockKey>) {
        if self.inner.cfg.write != WritePolicy::OnReuse {
            return;
        }
        let mut cand = self.inner.candidates.lock();
        if cand.map.is_empty() {
            return;
        }
        let mut promoted = Vec::new();
        let now = Instant::now();
        for k in keys {
            if let Some(r) = cand.map.get_mut(&k) {
                // vLLM asks again for a request that waits, every scheduler step: hits of
                // one key closer than REUSE_WINDOW count once.
                if r.last.is_some_and(|t| now.duration_since(t) < REUSE_WINDOW) {
                    continue;
                }
                r.last = Some(now);
                r.hits += 1;
                if r.hits >= 2 {
                    cand.map.remove(&k);
                    promoted.push(k);
                }
            }
        }
        drop(cand);
        self.inner.send_writes(promoted);
    }

    /// Queues the pool's objects of `keys` for writing, whatever the policy (objects not in
    /// the pool are passed over). For publishing what a pool already holds, and benchmarks.
    pub fn write_keys(&self, keys: &[BlockKey]) {
        self.inner.send_writes(keys.iter().copied());
    }

    /// Deletes the remote copies of `keys` (best effort, bounded by the timeout). Returns how
    /// many delete requests were sent.
    pub fn delete(&self, keys: &[BlockKey]) -> usize {
        let mut slot = None;
        let Some(con) = self.inner.conn(&mut slot) else {
            return 0;
        };
        let names: Vec<String> = keys.iter().map(object::remote_key).collect();
        match con.del_many(&names) {
            Ok(()) => names.len(),
            Err(e) => {
                self.inner.failed("deleting", &e);
                0
            }
        }
    }

    /// Deletes every remote object of the namespace whose id is `namespace_id` (as in
    /// [`BlockKey::namespace_id`]): every rank, every group, whichever node wrote it. Waits
    /// for it (each request bounded by the timeout); returns how many were deleted, or `None`
    /// when the remote failed (counted, logged).
    pub fn clear_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        let mut pattern = String::from(object::REMOTE_KEY_PREFIX);
        for b in namespace_id {
            pattern.push_str(&format!("{b:02x}"));
        }
        pattern.push('*');
        // A reset must not be skipped because of a back-off: it connects whatever the state.
        let mut con = match self.inner.backend.connect(self.inner.cfg.timeout) {
            Ok(c) => c,
            Err(e) => {
                self.inner.failed("connecting to clear a namespace", &e);
                log::warn!(
                    "remote tier: the namespace's remote objects ({pattern}) were NOT deleted; they expire by TTL or eviction, or delete them with redis-cli"
                );
                return None;
            }
        };
        // Each request is bounded by the timeout; the whole sweep by a minute.
        let deadline = Instant::now() + CLEAR_DEADLINE;
        match con.delete_matching(&pattern, deadline) {
            Ok(n) => {
                log::info!("remote tier: deleted {n} objects of the namespace ({pattern})");
                Some(n)
            }
            Err(e) => {
                self.inner.failed("clearing a namespace", &e);
                log::warn!(
                    "remote tier: the namespace's remote objects ({pattern}) may not all be deleted; they expire by TTL or eviction, or delete them with redis-cli"
                );
                None
            }
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> RemoteStats {
        let c = &self.inner.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            lookup_keys: l(&c.lookup_keys),
            hits: l(&c.hits),
            misses: l(&c.misses),
            corrupt: l(&c.corrupt),
            timeouts: l(&c.timeouts),
            skipped_lookups: l(&c.skipped_lookups),
            bytes_fetched: l(&c.bytes_fetched),
            writes: l(&c.writes),
            bytes_written: l(&c.bytes_written),
            writes_dropped: l(&c.writes_dropped),
            writes_evicted: l(&c.writes_evicted),
            errors: l(&c.errors),
            connected: c.connected.load(Ordering::Relaxed),
            backlog_bytes: l(&c.backlog_bytes),
        }
    }

    /// Waits until every pool commit so far has been written (or dropped, or passed over by
    /// the policy), or `timeout` passes; whether it drained.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (i, end) = (&self.inner, Instant::now() + timeout);
        loop {
            let c = &i.c;
            if c.commits_seen.load(Ordering::Acquire) + i.puts_before >= i.pool.stats().puts
                && c.backlog_bytes.load(Ordering::Acquire) == 0
                && !c.writing.load(Ordering::Acquire)
                && i.writes_queued.load(Ordering::Acquire) == 0
            {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the threads (the writer drops what it has not written).
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.fetch_tx.lock().take();
        if let Some(tx) = self.inner.to_writer.lock().take() {
            // A full queue means the writer is busy: it sees `closed` after its batch.
            let _ = tx.try_send(WriterMsg::Stop);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.close();
    }
}

/// A fetch thread: serves lookups, one at a time, with its own connection.
fn fetcher(inner: &Inner, jobs: &std::sync::Mutex<Receiver<FetchJob>>) {
    // Two connections: the next chunk's request travels on one while the last chunk's
    // objects are checked and copied into the pool from the other.
    let mut slots: [Option<Conn>; 2] = [None, None];
    // Connect at start, so the first lookup does not pay for it (a cluster connection asks
    // every node for its slots).
    for slot in &mut slots {
        if inner.conn(slot).is_none() {
            break;
        }
    }
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if Instant::now() >= job.deadline {
            // Its caller has given up: asking now would only load the remote.
            add(&inner.c.skipped_lookups, 1);
            continue;
        }
        job.started.store(true, Ordering::Release);
        serve_fetch(inner, &mut slots, job);
    }
}

type Values = Vec<Option<Vec<u8>>>;

/// One pipelined `GETRANGE` of `chunk` on `slot`'s connection; `None` when it failed (counted,
/// the connection dropped: a timed-out pipeline may still answer later).
fn get_chunk(inner: &Inner, slot: &mut Option<Conn>, chunk: &[BlockKey]) -> Option<Values> {
    let Some(con) = inner.conn(slot) else {
        add(&inner.c.skipped_lookups, 1);
        return None;
    };
    let names: Vec<String> = chunk.iter().map(object::remote_key).collect();
    let limit = inner.value_limit();
    let mut res = con.get_many(&names, limit);
    if res.as_ref().is_err_and(is_redirect) {
        // The cluster moved slots: a new connection reads the new slot map; once.
        *slot = None;
        res = match inner.conn(slot) {
            Some(con) => con.get_many(&names, limit),
            None => return None,
        };
    }
    if res.as_ref().is_err_and(conn::is_wrong_type) {
        // A key of the chunk holds a list or a hash (someone else's, or planted): that key
        // is a bad object, the others are read one by one.
        res = match inner.conn(slot) {
            Some(con) => con.get_each(&names, limit),
            None => return None,
        };
    }
    match res {
        Ok(v) => {
            inner.succeeded();
            Some(v)
        }
        Err(e) if is_transport(&e) => {
            // A timed-out pipeline may still answer later: never reuse the connection.
            *slot = None;
            inner.failed("a lookup", &e);
            None
        }
        Err(e) => {
            // The remote answered with errors (a slot still migrating, say): this chunk
            // misses, and no back-off follows; the connection is made again next time, so
            // that it reads the cluster's slot map afresh.
            *slot = None;
            add(&inner.c.errors, 1);
            log::warn!("remote tier: a lookup was refused: {e}");
            None
        }
    }
}

/// Whether `e` (maybe one of a pipeline's errors) says the cluster's slots moved.
fn is_redirect(e: &redis::RedisError) -> bool {
    if e.is_cluster_error() {
        return true;
    }
    // A pipeline's errors come as one error listing them; the sync cluster pipeline does not
    // follow redirections itself.
    let text = e.to_string();
    text.contains("Moved:") || text.contains("Ask:") || text.contains("TryAgain")
}

/// Checks the values of `chunk` and puts the good ones in the pool; which keys are now
/// there, and whether a prefix broke.
fn take_chunk(
    inner: &Inner,
    chunk: &[BlockKey],
    values: Values,
    prefix: bool,
) -> (Vec<bool>, bool) {
    let c = &inner.c;
    let limit = inner.value_limit();
    let mut present = Vec::with_capacity(chunk.len());
    let mut stop = false;
    for (key, v) in chunk.iter().zip(values) {
        if stop {
            present.push(false);
            continue;
        }
        let ok = match v {
            None => {
                add(&c.misses, 1);
                false
            }
            Some(v) => match Ok(&v)
                .and_then(|v| {
                    if v.len() as u64 > limit {
                        Err(object::Reject::TooLarge)
                    } else {
                        object::parse(&inner.seal, key, v)
                    }
                })
                .and_then(|(payload, check)| put_fetched(inner, *key, payload, check))
            {
                Ok(stored) => stored,
                Err(why) => {
                    add(&c.corrupt, 1);
                    add(&c.misses, 1);
                    log::warn!(
                        "remote tier: the value under {} is not its object ({why:?}); taken as a miss",
                        object::remote_key(key)
                    );
                    false
                }
            },
        };
        present.push(ok);
        stop = prefix && !ok;
    }
    (present, stop)
}

fn serve_fetch(inner: &Inner, slots: &mut [Option<Conn>; 2], job: FetchJob) {
    add(&inner.c.lookup_keys, job.keys.len() as u64);
    let chunks: Vec<&[BlockKey]> = job.keys.chunks(FETCH_CHUNK).collect();
    let Some(mut values) = get_chunk(inner, &mut slots[0], chunks[0]) else {
        return;
    };
    for ci in 0..chunks.len() {
        let (this, other) = slots.split_at_mut(1);
        let next_slot = if ci % 2 == 0 {
            &mut other[0]
        } else {
            &mut this[0]
        };
        let next_chunk = chunks.get(ci + 1).copied();
        let current = std::mem::take(&mut values);
        // The next chunk's request travels while this one is checked, copied and answered;
        // the answer goes out before waiting for the next chunk.
        let next = std::thread::scope(|s| {
            let ahead = match next_chunk {
                Some(nc) => std::thread::Builder::new()
                    .name("umbp-remote-ahead".into())
                    .spawn_scoped(s, move || get_chunk(inner, next_slot, nc))
                    .map_err(|_| ()),
                None => Err(()),
            };
            let (present, stop) = take_chunk(inner, chunks[ci], current, job.prefix);
            // The caller gone (timed out) or a prefix broken: no more chunks (a fetched-ahead
            // one is dropped).
            let go_on = job.reply.send((ci * FETCH_CHUNK, present)).is_ok() && !stop;
            match ahead {
                Ok(h) => h.join().ok().flatten().filter(|_| go_on),
                // No thread could be started: the next chunk is fetched here, after this one.
                Err(()) => match (next_chunk, go_on) {
                    (Some(nc), true) => {
                        // The failed spawn took the slot's connection with it: a new one.
                        log::debug!("remote tier: no look-ahead thread; fetching in turn");
                        get_chunk(inner, &mut None, nc)
                    }
                    _ => None,
                },
            }
        });
        match next {
            Some(v) => values = v,
            None => return,
        }
    }
}

/// Puts a fetched object in the pool, its checksum or MAC checked while it is copied in:
/// `Ok(true)` stored (or already there), `Ok(false)` no room, `Err` a bad checksum or MAC
/// (nothing stored).
fn put_fetched(
    inner: &Inner,
    key: BlockKey,
    payload: &[u8],
    check: object::Check<'_>,
) -> Result<bool, object::Reject> {
    if inner.pool.contains(&key) {
        return Ok(true);
    }
    // Never evicts: on the lookup path a fetch must not push out what the same lookup just
    // counted (or an earlier chunk of it). What does not fit in the free room misses.
    let mut r = match inner.pool.try_reserve(payload.len() as u64) {
        Ok(r) => r,
        Err(e) => {
            log::debug!("remote tier: a fetched object did not fit in the pool: {e}");
            return Ok(false);
        }
    };
    // On an error, dropping the reservation frees it; nothing was visible.
    object::copy_checked(r.as_mut_slice(), payload, check)?;
    {
        let mut fr = inner.from_remote.lock();
        if fr.len() >= MAX_TRACKED {
            fr.clear();
        }
        fr.insert(key);
    }
    // Already present: another fetch (or the engine) committed it first. Its entry in the
    // set stays for that commit's event (one entry per key).
    if inner.pool.commit(r, key) == CommitOutcome::Stored {
        add(&inner.c.hits, 1);
        add(&inner.c.bytes_fetched, payload.len() as u64);
    }
    Ok(true)
}

/// The writer thread's queue of objects to write.
#[derive(Debug, Default)]
struct Backlog {
    keys: VecDeque<(BlockKey, u64)>,
    bytes: u64,
}

/// The writer thread: follows the pool's commits, writes objects in pipelined batches.
fn writer(inner: &Inner, rx: Receiver<WriterMsg>) {
    let mut slot: Option<Conn> = None;
    let _ = inner.conn(&mut slot);
    let mut backlog = Backlog::default();
    let mut rate = Rate::new(inner.cfg.write_bytes_per_s);
    let c = &inner.c;
    loop {
        // Block for work only when there is none.
        let first = if backlog.keys.is_empty() {
            c.writing.store(false, Ordering::Release);
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return,
            }
        } else {
            None
        };
        c.writing.store(true, Ordering::Release);
        for m in first.into_iter().chain(rx.try_iter()) {
            match m {
                WriterMsg::Stop => return,
                WriterMsg::Pool(PoolEvent::Stored { key, bytes }) => {
                    c.commits_seen.fetch_add(1, Ordering::Release);
                    if inner.from_remote.lock().remove(&key) {
                        continue;
                    }
                    match inner.cfg.write {
                        WritePolicy::Eager => enqueue(inner, &mut backlog, key, bytes),
                        WritePolicy::OnReuse => {
                            inner.candidates.lock().insert(key, Reuse::default())
                        }
                    }
                }
                WriterMsg::Pool(PoolEvent::Removed { key, .. }) => {
                    if inner.cfg.write == WritePolicy::OnReuse {
                        inner.candidates.lock().map.remove(&key);
                    }
                }
                WriterMsg::Write(key) => {
                    match inner.pool.peek(&key).map(|o| o.len()) {
                        Some(bytes) => enqueue(inner, &mut backlog, key, bytes),
                        None => add(&c.writes_evicted, 1),
                    }
                    inner.writes_queued.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if backlog.keys.is_empty() {
            continue;
        }
        if inner.is_down() {
            // The remote is failing: what waits is dropped, not kept for later.
            add(&c.writes_dropped, backlog.keys.len() as u64);
            backlog = Backlog::default();
            c.backlog_bytes.store(0, Ordering::Relaxed);
            continue;
        }
        // One batch, pinned until its bytes are copied into the pipeline.
        let mut batch = Vec::new();
        let mut batch_bytes = 0u64;
        while batch.len() < WRITE_BATCH && batch_bytes < WRITE_BATCH_BYTES {
            let Some((key, bytes)) = backlog.keys.pop_front() else {
                break;
            };
            backlog.bytes -= bytes;
            let Some(obj) = inner.pool.peek(&key) else {
                add(&c.writes_evicted, 1);
                continue;
            };
            batch_bytes += obj.len();
            batch.push((key, object::remote_key(&key), obj));
        }
        c.backlog_bytes.store(backlog.bytes, Ordering::Relaxed);
        if batch.is_empty() {
            continue;
        }
        let pairs: Vec<(String, object::Encoded<'_>)> = batch
            .iter()
            .map(|(key, name, obj)| {
                (
                    name.clone(),
                    object::Encoded {
                        seal: &inner.seal,
                        key,
                        payload: obj.as_slice(),
                    },
                )
            })
            .collect();
        let n = pairs.len() as u64;
        // The objects' bytes go into the pipeline here; the pins end with it.
        let prepared = inner.backend.prepare_sets(&pairs, inner.cfg.ttl);
        drop(pairs);
        drop(batch);
        rate.wait(batch_bytes, &inner.closed);
        let Some(con) = inner.conn(&mut slot) else {
            add(&c.writes_dropped, n);
            continue;
        };
        let mut res = con.run_sets(&prepared);
        if res.as_ref().is_err_and(is_redirect) {
            // The cluster moved slots: a new connection reads the new slot map; once.
            slot = None;
            res = match inner.conn(&mut slot) {
                Some(con) => con.run_sets(&prepared),
                None => {
                    add(&c.writes_dropped, n);
                    continue;
                }
            };
        }
        match res {
            Ok(()) => {
                inner.succeeded();
                add(&c.writes, n);
                add(&c.bytes_written, batch_bytes);
            }
            Err(e) if is_transport(&e) => {
                slot = None;
                add(&c.writes_dropped, n);
                inner.failed("a write", &e);
            }
            Err(e) => {
                // The remote answered with an error (full: OOM under `noeviction`, read-only
                // replica, ...): this batch is lost, the connection and the lookups are fine.
                add(&c.writes_dropped, n);
                add(&c.errors, 1);
                log::warn!("remote tier: a write batch of {n} objects was refused: {e}");
            }
        }
    }
}

/// Whether `e` says the connection failed (then the remote is left alone for a while), not
/// that the remote refused a command.
fn is_transport(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

fn enqueue(inner: &Inner, backlog: &mut Backlog, key: BlockKey, bytes: u64) {
    if backlog.bytes + bytes > inner.cfg.write_backlog_bytes {
        add(&inner.c.writes_dropped, 1);
        return;
    }
    backlog.bytes += bytes;
    backlog.keys.push_back((key, bytes));
    inner
        .c
        .backlog_bytes
        .store(backlog.bytes, Ordering::Relaxed);
}

/// A byte-rate limit (none at 0 bytes/s).
#[derive(Debug)]
struct Rate {
    per_s: u64,
    start: Instant,
    sent: u64,
}

impl Rate {
    fn new(per_s: u64) -> Rate {
        Rate {
            per_s,
            start: Instant::now(),
            sent: 0,
        }
    }

    fn wait(&mut self, bytes: u64, closed: &AtomicBool) {
        if self.per_s == 0 {
            return;
        }
        // Restart the window after idle periods, so idle time earns no burst.
        let due = Duration::from_secs_f64(self.sent as f64 / self.per_s as f64);
        let elapsed = self.start.elapsed();
        if elapsed > due + Duration::from_secs(1) {
            self.start = Instant::now();
            self.sent = 0;
        }
        self.sent += bytes;
        let due = Duration::from_secs_f64(self.sent as f64 / self.per_s as f64);
        while let Some(left) = due.checked_sub(self.start.elapsed()) {
            if closed.load(Ordering::Acquire) || left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
}
