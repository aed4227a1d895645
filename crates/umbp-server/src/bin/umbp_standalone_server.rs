//! `umbp_standalone_server`: the node-local UMBP pool server.
//!
//! Every setting comes from a flag or, when the flag is absent, from its `UMBP_*` environment
//! variable, or else its default (shown by `--help`). A flag that sets what a connector option
//! sets in embedded mode takes its default and range from that option's schema
//! (`umbp_core::options`); the server's own flags take theirs from `umbp_server`.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::builder::{PossibleValuesParser, RangedU64ValueParser};
use clap::Parser;
use umbp_core::options::{self, Kind, OptionSpec};
use umbp_core::{HugepageSize, Integrity, PoolConfig};
use umbp_proto::{Endpoint, DEFAULT_ENDPOINT};
use umbp_server::{
    Access, ServerConfig, DEFAULT_BUSY_POLL, DEFAULT_COPY_WORKERS, DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_SOCKET_MODE,
};
use umbp_store::{CudaOptions, RemoteConfig, StoreConfig, WritePolicy};

/// UMBP standalone server: one host-DRAM KV-cache pool per node, shared by every engine and
/// worker on the host over gRPC on a Unix-domain socket. Clients register their KV cache
/// memory (no KV bytes cross the socket) and the server copies. SIGTERM or SIGINT stops it:
/// new transfers are refused, in-flight ones get the grace period, the socket is removed, and
/// it exits 0.
#[derive(Debug, Parser)]
#[command(name = "umbp_standalone_server", version, about, long_about = None)]
struct Args {
    /// Socket to listen on: unix:///abs/path or /abs/path (TCP is not served). The descriptor
    /// side channel listens beside it at <path>.fds.
    #[arg(long, env = "UMBP_STANDALONE_ADDRESS", default_value = DEFAULT_ENDPOINT)]
    address: String,
    /// Pool size in bytes (suffixes K, M, G, T, KiB, MiB, GiB, TiB are accepted).
    #[arg(long, env = "UMBP_DRAM_CAPACITY", default_value_t = schema_bytes(&options::CAPACITY_BYTES), value_parser = parse_bytes)]
    capacity: ByteCount,
    /// Occupancy (fraction of capacity) above which eviction starts.
    #[arg(
        long = "high-watermark",
        env = "UMBP_DRAM_HIGH_WM",
        default_value_t = options::DRAM_HIGH_WATERMARK.default_f64()
    )]
    high_watermark: f64,
    /// Occupancy eviction brings the pool down to.
    #[arg(
        long = "low-watermark",
        env = "UMBP_DRAM_LOW_WM",
        default_value_t = options::DRAM_LOW_WATERMARK.default_f64()
    )]
    low_watermark: f64,
    /// Back the pool with huge pages (falls back to normal pages, logged, when there are none).
    #[arg(long = "use-hugepages", env = "UMBP_DRAM_USE_HUGEPAGES", default_value_t = options::DRAM_USE_HUGEPAGES.default_bool(), action = clap::ArgAction::Set, value_parser = parse_bool)]
    use_hugepages: bool,
    /// Huge page size: 2MiB or 1GiB (2M, 2MB, 1G, 1GB and the byte counts are accepted too).
    #[arg(
        long = "hugepage-size",
        env = "UMBP_DRAM_HUGEPAGE_SIZE",
        default_value = options::DRAM_HUGEPAGE_SIZE.default_str()
    )]
    hugepage_size: String,
    /// Bind the pool's memory to this NUMA node (default: no binding).
    #[arg(long = "numa-node", env = "UMBP_DRAM_NUMA_NODE")]
    numa_node: Option<u32>,
    /// Touch every page of the pool at start so copies never take page faults.
    #[arg(long, env = "UMBP_DRAM_PREFAULT", default_value_t = options::DRAM_PREFAULT.default_bool(), action = clap::ArgAction::Set, value_parser = parse_bool)]
    prefault: bool,
    /// Which objects eviction takes first: s3fifo (a burst of one-off prompts leaves without
    /// flushing the shared prefixes) or lru (exact least recently used).
    #[arg(long = "eviction-policy", env = "UMBP_EVICTION_POLICY", default_value = options::EVICTION_POLICY.default_str(), value_parser = PossibleValuesParser::new(options::EVICTION_POLICIES))]
    eviction_policy: String,
    /// Which stored blocks the pool keeps: all, or on_reuse (the second time a key is stored
    /// or looked up; the first store is skipped and counted).
    #[arg(long = "store-admission", env = "UMBP_STORE_ADMISSION", default_value = options::STORE_ADMISSION.default_str(), value_parser = PossibleValuesParser::new(options::STORE_ADMISSIONS))]
    store_admission: String,
    /// Checksums of the pool's objects: all (every load verifies its object), sample (one
    /// load in --integrity-sample-every) or off. A damaged object fails its load, is removed
    /// and counted (umbp_corrupt_detected_total).
    #[arg(long, env = "UMBP_INTEGRITY", default_value = options::INTEGRITY.default_str(), value_parser = PossibleValuesParser::new(options::INTEGRITIES))]
    integrity: String,
    /// With --integrity sample, one load in this many verifies its object.
    #[arg(long = "integrity-sample-every", env = "UMBP_INTEGRITY_SAMPLE_EVERY", default_value_t = options::INTEGRITY_SAMPLE_EVERY.default_u64())]
    integrity_sample_every: u64,
    /// Copy worker threads, shared by every client.
    #[arg(long, env = "UMBP_NUM_WORKERS", default_value_t = DEFAULT_COPY_WORKERS)]
    workers: usize,
    /// Default transfer deadline in milliseconds (a client may ask for less or more per call).
    #[arg(long = "timeout-ms", env = "UMBP_TIMEOUT_MS", default_value_t = options::TIMEOUT_MS.default_u64())]
    timeout_ms: u64,
    /// Mode of the socket files, octal. 0600: only this user; --allow-group makes it 0660.
    #[arg(long = "socket-mode", env = "UMBP_SOCKET_MODE", default_value_t = SocketMode(DEFAULT_SOCKET_MODE), value_parser = parse_mode)]
    socket_mode: SocketMode,
    /// Also accept clients running as this uid (repeatable). The socket mode must let them
    /// connect too.
    #[arg(long = "allow-uid", env = "UMBP_ALLOW_UIDS", value_delimiter = ',')]
    allow_uid: Vec<u32>,
    /// Accept clients in this group (gid or name): the socket files are given to the group
    /// and made 0660 unless --socket-mode says otherwise.
    #[arg(long = "allow-group", env = "UMBP_ALLOW_GROUP")]
    allow_group: Option<String>,
    /// Milliseconds in-flight transfers get to finish after SIGTERM before being cancelled.
    #[arg(
        long = "shutdown-grace-ms",
        env = "UMBP_SHUTDOWN_GRACE_MS",
        default_value_t = millis(DEFAULT_SHUTDOWN_GRACE)
    )]
    shutdown_grace_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (off by default; loopback only unless
    /// --metrics-allow-remote).
    #[arg(long = "metrics-address", env = "UMBP_METRICS_ADDRESS")]
    metrics_address: Option<SocketAddr>,
    /// Allow a non-loopback --metrics-address.
    #[arg(long = "metrics-allow-remote")]
    metrics_allow_remote: bool,
    /// Largest gRPC message accepted or sent, in bytes.
    #[arg(long = "max-message-bytes", env = "UMBP_MAX_MESSAGE_BYTES", default_value_t = umbp_proto::DEFAULT_MAX_MESSAGE_BYTES as u64, value_parser = clap::value_parser!(u64).range(4096..=1 << 30))]
    max_message_bytes: u64,
    /// Descriptors the clients of one uid may make the server hold at once (connections,
    /// sessions, descriptors sent and not yet registered, transfer channels); past it that
    /// uid is refused with a message, other uids are not. Default: half of what the server has
    /// for clients (its RLIMIT_NOFILE, raised to the hard limit, less a reserve). Lower it
    /// when several uids you do not trust may connect.
    #[arg(long = "max-fds-per-uid", env = "UMBP_MAX_FDS_PER_UID", value_parser = clap::value_parser!(u64).range(16..))]
    max_fds_per_uid: Option<u64>,
    /// A shared remote tier behind the pool, on an existing Redis / Valkey: redis://host:port
    /// (one server) or redis+cluster://host:port,host:port (a cluster; user:password@ before
    /// the hosts; rediss:// and rediss+cluster:// for TLS). Off when unset. See docs/remote.md.
    /// A password in it shows in `ps` to every local user: give it in UMBP_REMOTE_URL or
    /// --remote-url-file instead.
    #[arg(long = "remote-url", env = "UMBP_REMOTE_URL")]
    remote_url: Option<String>,
    /// A file holding the remote tier's URL (first line), e.g. readable only by the server's
    /// user: the password stays out of the command line.
    #[arg(
        long = "remote-url-file",
        env = "UMBP_REMOTE_URL_FILE",
        conflicts_with = "remote_url"
    )]
    remote_url_file: Option<std::path::PathBuf>,
    /// A file holding a secret every node of the remote tier shares (16 bytes or more;
    /// readable by the server's user only): values are then sealed with HMAC-SHA256 instead
    /// of an XXH3 checksum, and values written without the secret are misses.
    #[arg(long = "remote-secret-file", env = "UMBP_REMOTE_SECRET_FILE")]
    remote_secret_file: Option<std::path::PathBuf>,
    /// Expiry of objects written to the remote tier, in seconds (0: none; the remote's
    /// maxmemory-policy evicts).
    #[arg(long = "remote-ttl-s", env = "UMBP_REMOTE_TTL_S", default_value_t = options::REMOTE_TTL_S.default_u64(), value_parser = schema_range(&options::REMOTE_TTL_S))]
    remote_ttl_s: u64,
    /// When objects go to the remote tier: eager (every stored object), on_reuse (the second
    /// time a lookup hits it) or never (this server only reads what others wrote).
    #[arg(long = "remote-write", env = "UMBP_REMOTE_WRITE", default_value = options::REMOTE_WRITE.default_str(), value_parser = PossibleValuesParser::new(options::REMOTE_WRITES))]
    remote_write: String,
    /// How long a lookup waits for the remote tier, in ms (also each connect and answer).
    #[arg(long = "remote-timeout-ms", env = "UMBP_REMOTE_TIMEOUT_MS", default_value_t = options::REMOTE_TIMEOUT_MS.default_u64(), value_parser = schema_range(&options::REMOTE_TIMEOUT_MS))]
    remote_timeout_ms: u64,
    /// Bytes of objects waiting to be written to the remote tier before new ones are dropped
    /// (suffixes as --capacity).
    #[arg(long = "remote-write-backlog", env = "UMBP_REMOTE_WRITE_BACKLOG", default_value_t = schema_bytes(&options::REMOTE_WRITE_BACKLOG), value_parser = parse_bytes)]
    remote_write_backlog: ByteCount,
    /// Upper bound of the remote tier's write rate in MB/s (0: none).
    #[arg(
        long = "remote-write-mb-per-s",
        env = "UMBP_REMOTE_WRITE_MB_PER_S",
        default_value_t = options::REMOTE_WRITE_MB_PER_S.default_u64()
    )]
    remote_write_mb_per_s: u64,
    /// A local disk tier under the pool in this existing directory (off when unset): evicted
    /// objects are written behind to it, lookups read what the pool misses back from it, and
    /// a restarted server finds what the last one wrote. One server per directory. See
    /// docs/disk.md.
    #[arg(long = "disk-dir", env = "UMBP_DISK_DIR")]
    disk_dir: Option<std::path::PathBuf>,
    /// Bytes of --disk-dir the disk tier may fill (suffixes as --capacity).
    #[arg(long = "disk-capacity", env = "UMBP_DISK_CAPACITY", default_value_t = schema_bytes(&options::DISK_CAPACITY_BYTES), value_parser = parse_bytes)]
    disk_capacity: ByteCount,
    /// Upper bound of the disk tier's write rate in MB/s (0: none).
    #[arg(
        long = "disk-write-mb-per-s",
        env = "UMBP_DISK_WRITE_MB_PER_S",
        default_value_t = options::DISK_WRITE_MB_PER_S.default_u64()
    )]
    disk_write_mb_per_s: u64,
    /// When objects go to the disk tier: on_evict (when the pool evicts them) or eager (also
    /// as soon as they are stored, written behind; a crash loses only the last moments').
    #[arg(long = "disk-write", env = "UMBP_DISK_WRITE", default_value = options::DISK_WRITE.default_str(), value_parser = PossibleValuesParser::new(options::DISK_WRITES))]
    disk_write: String,
    /// Seconds a clean stop may spend writing the pool's objects the disk tier lacks (0: none
    /// are written on stop).
    #[arg(long = "disk-close-write-s", env = "UMBP_DISK_CLOSE_WRITE_S", default_value_t = options::DISK_CLOSE_WRITE_S.default_u64(), value_parser = schema_range(&options::DISK_CLOSE_WRITE_S))]
    disk_close_write_s: u64,
    /// GPU memory per direction for the CUDA copy path's staging slots (two slots; 2 × this
    /// per GPU the server copies for, allocated when the first client registers CUDA memory of
    /// that GPU; suffixes as --capacity). 0: the copy engines only. See docs/benchmarks.md.
    #[arg(long = "cuda-staging-bytes", env = "UMBP_CUDA_STAGING_BYTES", default_value_t = schema_bytes(&options::CUDA_STAGING_BYTES), value_parser = parse_bytes)]
    cuda_staging_bytes: ByteCount,
    /// Microseconds a transfer channel's server thread watches its socket after each request
    /// and reply before it sleeps on it (0: it always sleeps). Watching spares each transfer
    /// the wake-up of a sleeping thread (tens of µs on a VM), at the cost of up to this much
    /// of one core per transfer. See docs/standalone.md.
    #[arg(long = "busy-poll-us", env = "UMBP_BUSY_POLL_US", default_value_t = micros(DEFAULT_BUSY_POLL), value_parser = clap::value_parser!(u64).range(0..=100_000))]
    busy_poll_us: u64,
    /// Milliseconds a hit a lookup reports is kept from eviction for the load that follows
    /// (the load gives it back; one that runs out first is counted as expired). 0: lookups
    /// keep nothing. See docs/disk.md ("Lookup leases").
    #[arg(long = "lookup-lease-ms", env = "UMBP_LOOKUP_LEASE_MS", default_value_t = umbp_core::DEFAULT_LOOKUP_LEASE_MS, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    lookup_lease_ms: u64,
    /// Bytes of objects the keys of one namespace may pin (the `Pin` call: kept from eviction
    /// until the pin runs out), so that one tenant cannot pin the pool full; every namespace
    /// together may pin half the pool. 0: a quarter of the pool. See docs/standalone.md.
    #[arg(long = "pin-namespace-bytes", env = "UMBP_PIN_NAMESPACE_BYTES", default_value = "0", value_parser = parse_bytes)]
    pin_namespace_bytes: ByteCount,
    /// Keep the pool in a memfd and hand it, with every object, to the server that replaces
    /// this one: a newer one started with --take-over, or under systemd (with
    /// FileDescriptorStoreMax=2) the unit's next start. See docs/standalone.md ("Upgrading").
    #[arg(long = "hand-over", env = "UMBP_HAND_OVER")]
    hand_over: bool,
    /// Take the pool of the server running at --address (one started with --hand-over): it
    /// stops, and this one serves every object it held. With none running, start as usual.
    #[arg(long = "take-over", env = "UMBP_TAKE_OVER")]
    take_over: bool,
    /// Log filter (tracing's EnvFilter syntax, e.g. info or umbp_server=debug).
    #[arg(long, env = "UMBP_LOG", default_value = DEFAULT_LOG_FILTER)]
    log: String,
}

/// The log filter without `--log` / `UMBP_LOG`, and when theirs cannot be used.
const DEFAULT_LOG_FILTER: &str = "info";

/// A byte count as the flags take it (`68719476736`, `64GiB`, `512M`) and `--help` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ByteCount(u64);

impl fmt::Display for ByteCount {
    /// The largest binary unit that divides the count exactly (`64GiB`), else plain bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        match units
            .iter()
            .find(|(shift, _)| self.0 != 0 && self.0.is_multiple_of(1 << shift))
        {
            Some((shift, unit)) => write!(f, "{}{unit}", self.0 >> shift),
            None => write!(f, "{}", self.0),
        }
    }
}

/// A socket file mode, shown in octal (`600`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketMode(u32);

impl fmt::Display for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:o}", self.0)
    }
}

/// The default of a byte-count option of the schema.
fn schema_bytes(spec: &OptionSpec) -> ByteCount {
    ByteCount(spec.default_u64())
}

/// The range of an integer option of the schema, as a flag's value parser.
///
/// # Panics
/// If the option is not an integer (a bug the flag tests catch).
fn schema_range(spec: &OptionSpec) -> RangedU64ValueParser<u64> {
    match spec.kind {
        Kind::Int { min, max, .. } => clap::value_parser!(u64).range(min..=max),
        _ => panic!("option `{}` is not an integer", spec.name),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn parse_bytes(s: &str) -> Result<ByteCount, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 68719476736 or 64GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?}; use K, M, G or T (powers of 1024)"
            ))
        }
    };
    n.checked_mul(mult)
        .map(ByteCount)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean; use true or false")),
    }
}

fn parse_mode(s: &str) -> Result<SocketMode, String> {
    let m = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|_| format!("{s:?} is not an octal mode such as 600 or 660"))?;
    if m & !0o777 != 0 {
        return Err(format!(
            "{s:?}: only permission bits (at most 777) are allowed"
        ));
    }
    if m & 0o600 != 0o600 {
        return Err(format!("{s:?}: the owner needs read and write (6xx)"));
    }
    Ok(SocketMode(m))
}

fn group_id(g: &str) -> anyhow::Result<u32> {
    if let Ok(n) = g.parse() {
        return Ok(n);
    }
    let c = std::ffi::CString::new(g).context("group name contains a NUL byte")?;
    // SAFETY: a NUL-terminated name; getgrnam returns null or a pointer to static storage,
    // read at once.
    let gr = unsafe { libc::getgrnam(c.as_ptr()) };
    if gr.is_null() {
        bail!("--allow-group {g:?}: no such group");
    }
    // SAFETY: non-null, pointing at a valid struct group.
    Ok(unsafe { (*gr).gr_gid })
}

fn config(a: &Args) -> anyhow::Result<ServerConfig> {
    let endpoint = Endpoint::parse(&a.address).context("--address / UMBP_STANDALONE_ADDRESS")?;
    let hugepage_size: HugepageSize = a
        .hugepage_size
        .parse()
        .map_err(|e| anyhow::anyhow!("--hugepage-size / UMBP_DRAM_HUGEPAGE_SIZE: {e}"))?;
    if a.workers == 0 {
        bail!("--workers / UMBP_NUM_WORKERS must be at least 1");
    }
    if a.timeout_ms == 0 {
        bail!("--timeout-ms / UMBP_TIMEOUT_MS must be at least 1");
    }
    let allow_gid = a.allow_group.as_deref().map(group_id).transpose()?;
    let mut socket_mode = a.socket_mode.0;
    if allow_gid.is_some() && socket_mode == DEFAULT_SOCKET_MODE {
        socket_mode = 0o660;
    }
    let remote_url = match (&a.remote_url, &a.remote_url_file) {
        (_, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--remote-url-file {}: cannot read it", path.display()))?;
            let url = text.lines().next().unwrap_or("").trim().to_string();
            anyhow::ensure!(
                !url.is_empty(),
                "--remote-url-file {}: the file is empty; write the URL on its first line",
                path.display()
            );
            Some(url)
        }
        (url, None) => url.clone(),
    };
    let remote_write =
        WritePolicy::parse(&a.remote_write).context("--remote-write / UMBP_REMOTE_WRITE")?;
    let mut cfg = ServerConfig::new(endpoint, a.capacity.0);
    cfg.store = StoreConfig {
        pool: PoolConfig {
            capacity_bytes: a.capacity.0,
            high_watermark: a.high_watermark,
            low_watermark: a.low_watermark,
            use_hugepages: a.use_hugepages,
            hugepage_size,
            numa_node: a.numa_node,
            prefault: a.prefault,
            eviction_policy: a
                .eviction_policy
                .parse()
                .context("--eviction-policy / UMBP_EVICTION_POLICY")?,
            store_admission: a
                .store_admission
                .parse()
                .context("--store-admission / UMBP_STORE_ADMISSION")?,
            lookup_lease_ms: a.lookup_lease_ms,
            keep_namespace_bytes: a.pin_namespace_bytes.0,
            integrity: Integrity::from_options(&a.integrity, a.integrity_sample_every)
                .context("--integrity / --integrity-sample-every (UMBP_INTEGRITY*)")?,
            ..PoolConfig::default()
        },
        num_workers: a.workers,
        timeout: Duration::from_millis(a.timeout_ms),
        disk: disk_config(a)?,
        remote: remote_url.map(|url| RemoteConfig {
            url,
            ttl: (a.remote_ttl_s > 0).then(|| Duration::from_secs(a.remote_ttl_s)),
            write: remote_write,
            timeout: Duration::from_millis(a.remote_timeout_ms),
            write_backlog_bytes: a.remote_write_backlog.0,
            write_bytes_per_s: a.remote_write_mb_per_s.saturating_mul(1_000_000),
            secret_file: a.remote_secret_file.clone(),
        }),
        cuda: CudaOptions {
            staging_bytes: a.cuda_staging_bytes.0,
            ..CudaOptions::default()
        },
    };
    cfg.store
        .validate()
        .map_err(|e| anyhow::anyhow!("{e} (flags --capacity, --high-watermark, --low-watermark, --remote-*, --cuda-staging-bytes, ... or their UMBP_DRAM_* / UMBP_REMOTE_* / UMBP_CUDA_* variables)"))?;
    cfg.socket_mode = socket_mode;
    cfg.access = Access {
        own_uid: cfg.access.own_uid,
        allow_uids: a.allow_uid.clone(),
        allow_gid,
    };
    cfg.shutdown_grace = Duration::from_millis(a.shutdown_grace_ms);
    cfg.metrics_address = a.metrics_address;
    cfg.metrics_allow_remote = a.metrics_allow_remote;
    cfg.max_message_bytes = a.max_message_bytes as usize;
    cfg.busy_poll = Duration::from_micros(a.busy_poll_us);
    cfg.max_fds_per_uid = a.max_fds_per_uid.map(|n| n as usize);
    cfg.hand_over = a.hand_over;
    cfg.take_over = a.take_over;
    Ok(cfg)
}

/// The disk tier's settings, checked with the flags' names (None without --disk-dir).
fn disk_config(a: &Args) -> anyhow::Result<Option<umbp_store::DiskConfig>> {
    let Some(dir) = &a.disk_dir else {
        return Ok(None);
    };
    anyhow::ensure!(
        dir.is_dir(),
        "--disk-dir / UMBP_DISK_DIR {}: not an existing directory; create it (on a local NVMe \
         file system) or point the flag at one",
        dir.display()
    );
    let dir = std::path::absolute(dir)
        .with_context(|| format!("--disk-dir / UMBP_DISK_DIR {}", dir.display()))?;
    let mut d = umbp_store::DiskConfig::new(dir, a.disk_capacity.0);
    d.write_bytes_per_s = a.disk_write_mb_per_s.saturating_mul(1_000_000);
    d.write = a
        .disk_write
        .parse()
        .context("--disk-write / UMBP_DISK_WRITE")?;
    d.close_write = std::time::Duration::from_secs(a.disk_close_write_s);
    d.validate().map_err(|e| {
        anyhow::anyhow!(
            "{e} (flags --disk-dir, --disk-capacity, --disk-write-mb-per-s, --disk-write, \
             --disk-close-write-s or their UMBP_DISK_* variables)"
        )
    })?;
    Ok(Some(d))
}

async fn signalled() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install the SIGTERM/SIGINT handlers; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

/// Keeps glibc's allocator from handing freed request buffers back to the kernel after every
/// request. A lookup of 8,192 keys decodes a 512 KiB message into fresh buffers; with the
/// default (dynamic) thresholds the arena's top was trimmed each time and the next request
/// faulted its pages in again (about 110 page faults per lookup). Memory up to the trim
/// threshold stays with the process instead.
#[cfg(target_env = "gnu")]
fn tune_allocator() {
    // Allocations below this come from the arenas, not from a fresh mmap (a message is at most
    // --max-message-bytes, 16 MiB by default).
    const MMAP_THRESHOLD: libc::c_int = 32 << 20;
    // Free memory at an arena's top is returned to the kernel only past this.
    const TRIM_THRESHOLD: libc::c_int = 64 << 20;
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

#[cfg(not(target_env = "gnu"))]
fn tune_allocator() {}

fn main() {
    tune_allocator();
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|e| {
        eprintln!(
            "umbp_standalone_server: --log / UMBP_LOG {:?}: {e}; using {DEFAULT_LOG_FILTER}",
            args.log
        );
        tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let code = match run(&args) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("{e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(args: &Args) -> anyhow::Result<()> {
    let cfg = config(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .thread_name("umbp-server")
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    let disk = cfg.store.disk.as_ref().map(|d| d.dir.clone());
    rt.block_on(umbp_server::serve(cfg, signalled()))
        .map_err(|e| match (&e, disk) {
            (umbp_server::ServerError::Store(umbp_store::StoreError::Disk(_)), Some(dir)) => {
                anyhow::anyhow!("{e} (--disk-dir / UMBP_DISK_DIR {})", dir.display())
            }
            _ => e.into(),
        })?;
    // Blocking release threads still finishing are not waited for past this point.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::options::DefaultValue;

    #[test]
    fn byte_counts_modes_and_booleans_parse() {
        assert_eq!(parse_bytes("68719476736").unwrap(), ByteCount(64 << 30));
        assert_eq!(parse_bytes("64GiB").unwrap(), ByteCount(64 << 30));
        assert_eq!(parse_bytes("512M").unwrap(), ByteCount(512 << 20));
        assert_eq!(parse_bytes("64 GiB").unwrap(), ByteCount(64 << 30));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5PB").is_err());
        for n in [0, 1, 4095, 4096, 3 << 20, 64 << 30, 5 << 40, (1 << 40) + 1] {
            let shown = ByteCount(n).to_string();
            assert_eq!(parse_bytes(&shown).unwrap(), ByteCount(n), "{shown}");
        }
        assert_eq!(ByteCount(64 << 30).to_string(), "64GiB");
        assert_eq!(parse_mode("600").unwrap(), SocketMode(0o600));
        assert_eq!(parse_mode("660").unwrap(), SocketMode(0o660));
        assert_eq!(SocketMode(0o660).to_string(), "660");
        assert!(parse_mode("644x").is_err());
        assert!(parse_mode("400").is_err());
        assert!(parse_mode("1777").is_err());
        assert!(parse_bool("yes").unwrap());
        assert!(!parse_bool("0").unwrap());
        assert!(parse_bool("maybe").is_err());
    }

    #[test]
    fn flags_override_the_environment_and_bad_values_name_the_flag() {
        let a = Args::parse_from(["s", "--address", "/tmp/x.sock", "--capacity", "1GiB"]);
        let c = config(&a).unwrap();
        assert_eq!(c.endpoint.path(), std::path::Path::new("/tmp/x.sock"));
        assert_eq!(c.store.pool.capacity_bytes, 1 << 30);
        assert_eq!(c.socket_mode, 0o600);
        let a = Args::parse_from(["s", "--address", "tcp://1.2.3.4:5"]);
        assert!(format!("{:#}", config(&a).unwrap_err()).contains("--address"));
        let a = Args::parse_from(["s", "--address", "/tmp/x.sock", "--low-watermark", "0.95"]);
        assert!(format!("{:#}", config(&a).unwrap_err()).contains("watermark"));
        let a = Args::parse_from(["s", "--address", "/tmp/x.sock", "--allow-group", "0"]);
        assert_eq!(config(&a).unwrap().socket_mode, 0o660);
    }

    /// The flags that set what a connector option sets in embedded mode, and that option.
    const SCHEMA_FLAGS: &[(&str, &OptionSpec)] = &[
        ("capacity", &options::CAPACITY_BYTES),
        ("high_watermark", &options::DRAM_HIGH_WATERMARK),
        ("low_watermark", &options::DRAM_LOW_WATERMARK),
        ("use_hugepages", &options::DRAM_USE_HUGEPAGES),
        ("hugepage_size", &options::DRAM_HUGEPAGE_SIZE),
        ("numa_node", &options::DRAM_NUMA_NODE),
        ("prefault", &options::DRAM_PREFAULT),
        ("eviction_policy", &options::EVICTION_POLICY),
        ("store_admission", &options::STORE_ADMISSION),
        ("integrity", &options::INTEGRITY),
        ("integrity_sample_every", &options::INTEGRITY_SAMPLE_EVERY),
        ("timeout_ms", &options::TIMEOUT_MS),
        ("remote_url", &options::REMOTE_URL),
        ("remote_ttl_s", &options::REMOTE_TTL_S),
        ("remote_write", &options::REMOTE_WRITE),
        ("remote_timeout_ms", &options::REMOTE_TIMEOUT_MS),
        ("remote_write_backlog", &options::REMOTE_WRITE_BACKLOG),
        ("remote_write_mb_per_s", &options::REMOTE_WRITE_MB_PER_S),
        ("disk_dir", &options::DISK_DIR),
        ("disk_capacity", &options::DISK_CAPACITY_BYTES),
        ("disk_write_mb_per_s", &options::DISK_WRITE_MB_PER_S),
        ("disk_write", &options::DISK_WRITE),
        ("disk_close_write_s", &options::DISK_CLOSE_WRITE_S),
        ("cuda_staging_bytes", &options::CUDA_STAGING_BYTES),
    ];

    /// The server's own flags (no connector option sets the same thing). `workers` is one:
    /// the server copies for every engine of the node, so it does not take `num_workers`'s
    /// default.
    const SERVER_FLAGS: &[&str] = &[
        "address",
        "workers",
        "socket_mode",
        "allow_uid",
        "allow_group",
        "shutdown_grace_ms",
        "metrics_address",
        "metrics_allow_remote",
        "max_message_bytes",
        "remote_url_file",
        "remote_secret_file",
        "busy_poll_us",
        "lookup_lease_ms",
        "pin_namespace_bytes",
        "max_fds_per_uid",
        "hand_over",
        "take_over",
        "log",
    ];

    /// Whether a flag's default text means the option's default, read as the flag reads it.
    fn means_the_default(spec: &OptionSpec, text: &str) -> bool {
        match spec.kind {
            Kind::Bool => parse_bool(text) == Ok(spec.default_bool()),
            Kind::Int {
                unit: options::Unit::Bytes,
                ..
            } => parse_bytes(text) == Ok(ByteCount(spec.default_u64())),
            Kind::Int { .. } => text.parse::<u64>() == Ok(spec.default_u64()),
            Kind::Fraction => text.parse::<f64>() == Ok(spec.default_f64()),
            Kind::HugepageSize => {
                text.parse::<HugepageSize>() == spec.default_str().parse::<HugepageSize>()
            }
            Kind::Choice(_) | Kind::Text(_) => text == spec.default_str(),
            // The scheduler's options: no server flag sets a priority.
            Kind::Priority => false,
        }
    }

    #[test]
    fn every_flag_defaults_to_its_schema_option_or_is_the_servers_own() {
        use clap::CommandFactory;
        let command = Args::command();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let Some((_, spec)) = SCHEMA_FLAGS.iter().find(|(flag, _)| *flag == id) else {
                assert!(
                    SERVER_FLAGS.contains(&id),
                    "--{}: add it to SCHEMA_FLAGS (with its connector option) or SERVER_FLAGS",
                    arg.get_long().unwrap_or(id)
                );
                continue;
            };
            match spec.default {
                DefaultValue::Unset => assert!(
                    defaults.is_empty(),
                    "--{id} has default {defaults:?}, option `{}` none",
                    spec.name
                ),
                _ => assert!(
                    defaults.len() == 1 && means_the_default(spec, &defaults[0]),
                    "--{id} has default {defaults:?}, option `{}` {:?}",
                    spec.name,
                    spec.default
                ),
            }
        }
        for (flag, _) in SCHEMA_FLAGS {
            assert!(
                command.get_arguments().any(|a| a.get_id() == *flag),
                "SCHEMA_FLAGS names --{flag}, which the server no longer has"
            );
        }
    }

    #[test]
    fn range_checked_flags_take_the_schemas_range() {
        for (flag, spec) in [
            ("--remote-ttl-s", &options::REMOTE_TTL_S),
            ("--remote-timeout-ms", &options::REMOTE_TIMEOUT_MS),
        ] {
            let Kind::Int { min, max, .. } = spec.kind else {
                unreachable!()
            };
            let parses = |n: u64| Args::try_parse_from(["s", flag, &n.to_string()]).is_ok();
            assert!(parses(min) && parses(max) && !parses(max + 1), "{flag}");
            assert!(min == 0 || !parses(min - 1), "{flag}");
        }
    }

    #[test]
    fn the_default_flags_configure_the_schemas_pool() {
        let a = Args::parse_from(["s", "--address", "/tmp/x.sock"]);
        let c = config(&a).unwrap();
        let pool = &c.store.pool;
        let schema_pool = PoolConfig::default();
        assert_eq!(
            (pool.capacity_bytes, pool.high_watermark, pool.low_watermark),
            (
                schema_pool.capacity_bytes,
                schema_pool.high_watermark,
                schema_pool.low_watermark
            )
        );
        assert_eq!(
            (pool.use_hugepages, pool.hugepage_size, pool.prefault),
            (
                schema_pool.use_hugepages,
                schema_pool.hugepage_size,
                schema_pool.prefault
            )
        );
        assert_eq!(c.store.num_workers, DEFAULT_COPY_WORKERS);
        assert_eq!(
            c.store.cuda.staging_bytes,
            options::CUDA_STAGING_BYTES.default_u64()
        );
    }
}
