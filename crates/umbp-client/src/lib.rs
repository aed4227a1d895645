//! Client of the UMBP standalone server.
//!
//! [`StandaloneClient`] is synchronous (for the Python bindings and engine threads): it makes
//! its own small async runtime when it connects (never at import) and refuses to be used in a
//! forked child. It registers memory without sending KV bytes: host memory is shared with the
//! server through a sealed memfd ([`host_share`]), CUDA memory by IPC handle or exported VMM
//! descriptors; descriptors travel over the server's side channel.
//!
//! **Restarts.** The client remembers what it registered. When a call finds its session gone
//! (the server restarted, or the connection broke) that call fails, and the next one attaches
//! again and replays every registration and layout by itself; ids handed out by the client
//! stay valid across it. Objects stored before a restart are gone with the old server.
//!
//! **Stalls.** A lookup past its deadline fails, and later lookups fail at once until the
//! stalled one is answered; the same for transfers (a transfer past its deadline stays
//! pending until the server answers; its memory may be written until then).

use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use tonic::transport::{Channel, Endpoint as TonicEndpoint};
use tonic::Status;
use umbp_core::{options, BlockKey, ErrorKind, FailureKind, KeyOutcome, LayerSpec, RankTopology};
use umbp_cuda::DeviceExport;
use umbp_proto::completion::{self, ALL_DONE, PENDING, REPLIED, WAIT_SLICE};
use umbp_proto::v1::{self, store_client::StoreClient};
use umbp_proto::{errors, Endpoint, PROTOCOL, SECRET_BYTES};

use crate::channel::{Pending, TransferChannel};
use crate::completions::{Completions, Lease};

mod channel;
mod completions;
mod error;
mod eta;
mod fdsend;
pub mod host_share;
mod peer;

pub use peer::SERVER_UIDS_ENV;

pub use error::ClientError;
pub use host_share::SharedHostMemory;
pub use umbp_proto::v1::StatsReply as ServerStats;

/// Result of the client.
pub type Result<T> = std::result::Result<T, ClientError>;

/// How a client connects and how long it waits.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The server's socket.
    pub endpoint: Endpoint,
    /// How long [`StandaloneClient::connect`] waits for the server to answer.
    pub startup_timeout: Duration,
    /// Deadline of a lookup.
    pub lookup_timeout: Duration,
    /// Deadline of a transfer (sent to the server, which cancels it past that).
    pub transfer_timeout: Duration,
    /// Deadline of other calls (attach, registrations, stats, clear).
    pub control_timeout: Duration,
    /// Shown in the server's logs.
    pub client_name: String,
    /// Largest gRPC message sent or accepted.
    pub max_message_bytes: usize,
    /// Whether transfers are answered through a completion page (the server wakes the
    /// waiting caller from its copy worker) as well as by their replies. On by default; off
    /// only to measure what the page saves.
    pub completion_page: bool,
    /// Whether transfers are sent on a transfer channel (a socket the calling thread writes
    /// to and a server thread reads, no runtime on either end) rather than over gRPC. On by
    /// default; off only to measure what the channel saves.
    pub transfer_channel: bool,
}

impl ClientOptions {
    /// Defaults for `endpoint`: the connector options' `startup_timeout_ms`,
    /// `lookup_timeout_ms` and `timeout_ms` (transfers and other calls), completion page and
    /// transfer channel on.
    pub fn new(endpoint: Endpoint) -> Self {
        let option_ms = |spec: &options::OptionSpec| Duration::from_millis(spec.default_u64());
        ClientOptions {
            endpoint,
            startup_timeout: option_ms(&options::STARTUP_TIMEOUT_MS),
            lookup_timeout: option_ms(&options::LOOKUP_TIMEOUT_MS),
            transfer_timeout: option_ms(&options::TIMEOUT_MS),
            control_timeout: option_ms(&options::TIMEOUT_MS),
            client_name: format!("pid {}", std::process::id()),
            max_message_bytes: umbp_proto::DEFAULT_MAX_MESSAGE_BYTES,
            completion_page: true,
            transfer_channel: true,
        }
    }
}

/// What happened to one key of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyStatus {
    /// Stored, or loaded.
    Done,
    /// Store skipped: the key was already in the pool.
    AlreadyPresent,
    /// Load failed: not in the pool.
    Missing,
    /// Store failed: no room even after eviction.
    PoolFull,
    /// Cancelled before it ran.
    Cancelled,
    /// Not done within the transfer's deadline (cancelled by the server).
    TimedOut,
    /// Failed, for the reason named, with the server's message.
    Failed {
        /// Why, in the vocabulary the embedded store uses too.
        kind: FailureKind,
        /// The server's message.
        message: String,
    },
}

impl KeyStatus {
    /// The key's outcome in the vocabulary shared with the embedded store.
    pub fn outcome(&self) -> KeyOutcome {
        match self {
            KeyStatus::Done => KeyOutcome::Done,
            KeyStatus::AlreadyPresent => KeyOutcome::AlreadyPresent,
            KeyStatus::Missing => KeyOutcome::Missing,
            KeyStatus::PoolFull => KeyOutcome::PoolFull,
            KeyStatus::Cancelled => KeyOutcome::Cancelled,
            KeyStatus::TimedOut => KeyOutcome::TimedOut,
            KeyStatus::Failed { kind, .. } => KeyOutcome::Failed(*kind),
        }
    }

    /// Whether the key's transfer succeeded (a store of a present key counts).
    pub fn is_ok(&self) -> bool {
        self.outcome().is_ok()
    }

    /// The status's name: done, already_present, missing, pool_full, cancelled, timed_out,
    /// failed.
    pub fn name(&self) -> &'static str {
        self.outcome().name()
    }
}

/// A registered layout: the client's id and the bytes of one object per group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutInfo {
    /// The client's id of the layout (stable across re-attaches).
    pub id: u32,
    /// Bytes of one object of each group.
    pub object_bytes: Vec<u64>,
}

/// The server's session of this client.
#[derive(Debug, Clone)]
struct Attachment {
    /// Counts attaches of this client: server ids are valid in one generation only.
    generation: u64,
    session_id: u64,
    boot_id: String,
    secret: [u8; SECRET_BYTES],
    fd_socket: std::path::PathBuf,
    /// Slots of the completion page this session accepted (0: none; replies only).
    completion_slots: u32,
    /// The session's transfer channel, when the server opened one.
    channel: Option<Arc<TransferChannel>>,
}

/// Where a registration's memory comes from (kept to register it again).
#[derive(Debug)]
enum Source {
    Host(SharedHostMemory),
    Cuda,
}

#[derive(Debug)]
struct RegionRecord {
    /// The client's range.
    addr: u64,
    len: u64,
    source: Source,
    /// (generation, server region id).
    server: Option<(u64, u64)>,
}

#[derive(Debug)]
struct LayoutRecord {
    groups: Vec<Vec<LayerSpec>>,
    object_bytes: Vec<u64>,
    /// (generation, server layout id).
    server: Option<(u64, u32)>,
}

#[derive(Debug, Default)]
struct Records {
    next_region: u64,
    next_layout: u32,
    regions: BTreeMap<u64, RegionRecord>,
    layouts: BTreeMap<u32, LayoutRecord>,
}

#[derive(Debug)]
struct Inner {
    opts: ClientOptions,
    /// Shut down by [`Inner`]'s drop (see there).
    rt: ManuallyDrop<tokio::runtime::Runtime>,
    grpc: StoreClient<Channel>,
    pid: u32,
    attachment: RwLock<Option<Attachment>>,
    /// Held while attaching (one attach at a time).
    attaching: Mutex<()>,
    records: Mutex<Records>,
    generation: AtomicU64,
    next_transfer: AtomicU64,
    closed: AtomicBool,
    /// Lookups / transfers past their deadline and still unanswered.
    stalled_lookups: Arc<AtomicU64>,
    stalled_transfers: Arc<AtomicU64>,
    attaches: AtomicU64,
    socket: CurrentSocket,
    /// The completion page (None where it could not be made: replies only).
    completions: Option<Arc<Completions>>,
    /// How long transfers take, so that callers are awake when their answer comes.
    eta: eta::TransferEta,
}

impl Inner {
    fn rt(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }
}

/// How long `close` waits for the server to answer its detach.
const DETACH_WAIT: Duration = Duration::from_millis(200);

/// How long dropping the last handle of a client waits for its runtime's threads.
const RUNTIME_SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

impl Drop for Inner {
    /// Shuts the runtime down without ever panicking or hanging: the last handle may be
    /// dropped by one of the runtime's own tasks (a transfer still in flight when every other
    /// handle went away), where a runtime cannot wait for its threads, or in a forked child,
    /// where those threads do not exist; and a thread that does not finish (one waiting for a
    /// lock its process will never release, such as the Python GIL at interpreter exit) is
    /// waited for only so long.
    fn drop(&mut self) {
        // SAFETY: `rt` is taken here, once, and `self` is not used afterwards.
        let rt = unsafe { ManuallyDrop::take(&mut self.rt) };
        if std::process::id() == self.pid {
            // Its reader thread ends with it (not in a forked child: a shutdown there would
            // end the parent's channel, which shares the socket).
            if let Some(ch) = self.attachment.get_mut().take().and_then(|a| a.channel) {
                ch.close();
            }
        }
        if std::process::id() != self.pid {
            std::mem::forget(rt);
        } else if tokio::runtime::Handle::try_current().is_ok() {
            rt.shutdown_background();
        } else {
            rt.shutdown_timeout(RUNTIME_SHUTDOWN_WAIT);
        }
    }
}

/// A synchronous client of the standalone server (see the crate docs).
#[derive(Debug, Clone)]
pub struct StandaloneClient {
    inner: Arc<Inner>,
}

/// The error of a call the server (or the connection) failed with `s`, by the kind the
/// server sent: the server or the connection gone is [`ClientError::Disconnected`], anything
/// else a refusal of that kind.
fn status_error(call: &'static str, endpoint: &Endpoint, s: Status) -> ClientError {
    match errors::kind_of_status(&s) {
        ErrorKind::Unavailable => ClientError::Disconnected {
            endpoint: endpoint.to_string(),
            reason: s.message().to_string(),
        },
        kind => ClientError::Refused {
            call,
            kind,
            message: s.message().to_string(),
        },
    }
}

/// A gRPC channel to the server at `endpoint` over its Unix socket, connected lazily (for
/// tools that speak the protocol directly). Must be called inside a Tokio runtime.
pub fn unix_channel(endpoint: &Endpoint) -> Channel {
    channel_with(endpoint, Arc::default())
}

/// A descriptor of the channel's current connection (a duplicate), so that [`close`] can
/// shut the socket down: the server then sees the connection end and releases the session
/// at once, even while calls of this client are still in flight.
///
/// [`close`]: StandaloneClient::close
type CurrentSocket = Arc<Mutex<Option<OwnedFd>>>;

fn channel_with(endpoint: &Endpoint, current: CurrentSocket) -> Channel {
    let path = endpoint.path().to_path_buf();
    TonicEndpoint::from_static("http://umbp.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_| {
            let (path, current) = (path.clone(), Arc::clone(&current));
            async move {
                let s = tokio::net::UnixStream::connect(&path).await?;
                // Nothing goes to a process of another user (a reconnection too).
                peer::check_server(s.as_fd(), &path).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string())
                })?;
                // The channel makes one connection at a time: a new one replaces the last.
                *current.lock() = Some(s.as_fd().try_clone_to_owned()?);
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
}

/// Shuts down the socket `current` holds a descriptor of (both directions: every call on it
/// fails, and the server sees the connection end).
fn shut_down(current: &CurrentSocket) {
    if let Some(fd) = current.lock().take() {
        let _ = std::os::unix::net::UnixStream::from(fd).shutdown(std::net::Shutdown::Both);
    }
}

/// Whether a failed call means the session is gone (the server must be attached again): the
/// server forgot it, or the server or the connection went away.
fn session_lost(s: &Status) -> bool {
    errors::kind_of_status(s).is_disconnect()
}

impl StandaloneClient {
    /// Connects to the server at `opts.endpoint`, waiting up to `opts.startup_timeout` for
    /// it to answer, and attaches.
    pub fn connect(opts: ClientOptions) -> Result<Self> {
        // One runtime thread: the request, the connection and the answer stay on it, so a
        // transfer costs the fewest thread wake-ups (measured on the H200 host, a 4 KiB
        // transfer's round trip beyond the server's own time: 2 threads 180-225 µs, 1 thread
        // 130-165 µs).
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("umbp-client")
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        let socket = CurrentSocket::default();
        let channel = {
            let _g = rt.enter();
            channel_with(&opts.endpoint, Arc::clone(&socket))
        };
        let grpc = StoreClient::new(channel)
            .max_decoding_message_size(opts.max_message_bytes)
            .max_encoding_message_size(opts.max_message_bytes);
        let completions = if opts.completion_page {
            Completions::new()
                .inspect_err(|e| {
                    log::warn!(
                        "umbp: no completion page ({e}); transfers are answered by their replies only"
                    )
                })
                .ok()
        } else {
            None
        };
        let c = StandaloneClient {
            inner: Arc::new(Inner {
                opts,
                rt: ManuallyDrop::new(rt),
                grpc,
                pid: std::process::id(),
                attachment: RwLock::new(None),
                attaching: Mutex::new(()),
                records: Mutex::new(Records::default()),
                generation: AtomicU64::new(0),
                next_transfer: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                stalled_lookups: Arc::new(AtomicU64::new(0)),
                stalled_transfers: Arc::new(AtomicU64::new(0)),
                attaches: AtomicU64::new(0),
                socket,
                completions,
                eta: eta::TransferEta::default(),
            }),
        };
        c.wait_for_server()?;
        c.attachment()?;
        Ok(c)
    }

    fn wait_for_server(&self) -> Result<()> {
        let o = &self.inner.opts;
        let start = Instant::now();
        let mut last;
        loop {
            // A socket served by another user is final, and said at once.
            if let Ok(s) = std::os::unix::net::UnixStream::connect(o.endpoint.path()) {
                peer::check_server(s.as_fd(), o.endpoint.path())?;
            }
            // Neither a ping nor the pause after it runs past the deadline.
            let left = o.startup_timeout.saturating_sub(start.elapsed());
            match self.ping_once(
                Duration::from_millis(500)
                    .min(left)
                    .max(Duration::from_millis(1)),
            ) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            let left = o.startup_timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(ClientError::Unreachable {
                    endpoint: o.endpoint.to_string(),
                    waited: start.elapsed(),
                    last,
                });
            }
            std::thread::sleep(Duration::from_millis(100).min(left));
        }
    }

    fn check(&self) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(ClientError::Closed);
        }
        let now = std::process::id();
        if now != self.inner.pid {
            return Err(ClientError::Forked {
                created: self.inner.pid,
                now,
            });
        }
        Ok(())
    }

    /// Runs one RPC with a deadline.
    fn call<T, F, Fut>(&self, name: &'static str, timeout: Duration, f: F) -> Result<T>
    where
        F: FnOnce(StoreClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, Status>>,
    {
        self.check()?;
        let fut = f(self.inner.grpc.clone());
        match self
            .inner
            .rt()
            .block_on(async { tokio::time::timeout(timeout, fut).await })
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => {
                if session_lost(&s) {
                    self.lost();
                }
                Err(status_error(name, &self.inner.opts.endpoint, s))
            }
            Err(_) => Err(ClientError::Timeout {
                what: name,
                ms: timeout.as_millis() as u64,
            }),
        }
    }

    /// Forgets the current session: the next call attaches again.
    fn lost(&self) {
        self.forget_attachment(None);
    }

    /// Forgets the current session if it is still attachment `generation`.
    fn lost_attachment(&self, generation: u64) {
        self.forget_attachment(Some(generation));
    }

    fn forget_attachment(&self, only: Option<u64>) {
        // The lock is not held while logging: a log record may wait for a lock of the
        // embedding program (the Python GIL), whose holder may want this one.
        let gone = {
            let mut a = self.inner.attachment.write();
            match (&*a, only) {
                (Some(cur), Some(g)) if cur.generation != g => None,
                _ => a.take(),
            }
        };
        let had = gone.is_some();
        if let Some(ch) = gone.and_then(|a| a.channel) {
            ch.close();
        }
        if had {
            log::warn!(
                "umbp: lost the session with the server at {}; the next call attaches again",
                self.inner.opts.endpoint
            );
        }
    }

    fn ping_once(&self, timeout: Duration) -> Result<v1::PingReply> {
        self.call("ping", timeout, |mut g| async move {
            g.ping(v1::PingRequest {}).await
        })
    }

    /// The current attachment, attaching (and replaying registrations) when there is none.
    fn attachment(&self) -> Result<Attachment> {
        if let Some(a) = self.inner.attachment.read().clone() {
            return Ok(a);
        }
        let _one = self.inner.attaching.lock();
        if let Some(a) = self.inner.attachment.read().clone() {
            return Ok(a);
        }
        let t = self.inner.opts.control_timeout;
        let name = self.inner.opts.client_name.clone();
        let r = self.call("attach", t, |mut g| async move {
            g.attach(v1::AttachRequest {
                client_name: name,
                protocol: PROTOCOL,
            })
            .await
        })?;
        let secret: [u8; SECRET_BYTES] =
            r.secret
                .as_slice()
                .try_into()
                .map_err(|_| ClientError::Refused {
                    call: "attach",
                    kind: ErrorKind::Internal,
                    message: "the server sent a malformed session secret".into(),
                })?;
        let mut a = Attachment {
            generation: self.inner.generation.fetch_add(1, Ordering::AcqRel) + 1,
            session_id: r.session_id,
            boot_id: r.boot_id,
            secret,
            fd_socket: r.fd_socket.into(),
            completion_slots: 0,
            channel: None,
        };
        let n = self.inner.attaches.fetch_add(1, Ordering::Relaxed);
        if n > 0 {
            log::warn!(
                "umbp: attached again to the server at {} (boot id {}, session {}); registering memory and layouts again",
                self.inner.opts.endpoint, a.boot_id, a.session_id
            );
        }
        self.replay(&a)?;
        a.completion_slots = self.register_completions(&a);
        a.channel = self.open_channel(&a);
        *self.inner.attachment.write() = Some(a.clone());
        Ok(a)
    }

    /// Registers every recorded region and layout in attachment `a`.
    fn replay(&self, a: &Attachment) -> Result<()> {
        let mut rec = self.inner.records.lock();
        let ids: Vec<u64> = rec.regions.keys().copied().collect();
        for id in ids {
            let r = rec.regions.get_mut(&id).expect("listed");
            let sid = self.register_region_on(a, r.addr, r.len, &r.source)?;
            r.server = Some((a.generation, sid));
        }
        let lids: Vec<u32> = rec.layouts.keys().copied().collect();
        for lid in lids {
            let groups = rec.layouts[&lid].groups.clone();
            let (sid, _) = self.register_layout_on(a, &rec, &groups)?;
            rec.layouts.get_mut(&lid).expect("listed").server = Some((a.generation, sid));
        }
        Ok(())
    }

    /// Opens the transfer channel of attachment `a`; None when the client does without one
    /// or the server opened none (transfers then go over gRPC).
    fn open_channel(&self, a: &Attachment) -> Option<Arc<TransferChannel>> {
        if !self.inner.opts.transfer_channel {
            return None;
        }
        TransferChannel::open(
            &a.fd_socket,
            a.session_id,
            &a.secret,
            self.inner.opts.max_message_bytes,
            &self.inner.opts.endpoint,
        )
        .unwrap_or_else(|e| {
            log::info!("umbp: no transfer channel ({e}); transfers go over gRPC");
            None
        })
    }

    /// Registers the completion page in attachment `a`; the slots the server accepted, 0 when
    /// it refused (an older server: transfers are then answered by their replies only).
    fn register_completions(&self, a: &Attachment) -> u32 {
        let Some(c) = &self.inner.completions else {
            return 0;
        };
        let sid = a.session_id;
        let length = c.len();
        let registered = self.send_fds(a, &[c.shm.fd()]).and_then(|t| {
            let ticket = t[0];
            self.call(
                "register_completion_page",
                self.inner.opts.control_timeout,
                |mut g| async move {
                    g.register_completion_page(v1::RegisterCompletionPageRequest {
                        session_id: sid,
                        ticket,
                        length,
                    })
                    .await
                },
            )
        });
        match registered {
            Ok(r) => r.slots.min(completions::SLOTS),
            Err(e) => {
                log::info!(
                    "umbp: the server at {} took no completion page ({e}); transfers are answered by their replies only",
                    self.inner.opts.endpoint
                );
                0
            }
        }
    }

    /// Registers one region with the server in attachment `a`; returns the server's id.
    fn register_region_on(
        &self,
        a: &Attachment,
        addr: u64,
        len: u64,
        source: &Source,
    ) -> Result<u64> {
        let t = self.inner.opts.control_timeout;
        let sid = a.session_id;
        match source {
            Source::Host(shm) => {
                // Every page allocated, and charged to this process, before the server maps
                // it (the server refuses memory with holes: its copies would allocate them).
                host_share::populate(shm.span_addr(), shm.span_len())?;
                let ticket = self.send_fds(a, &[shm.fd()])?[0];
                let length = shm.span_len();
                let r = self.call("register_host_memory", t, |mut g| async move {
                    g.register_host_memory(v1::RegisterHostMemoryRequest {
                        session_id: sid,
                        ticket,
                        length,
                    })
                    .await
                })?;
                Ok(r.region_id)
            }
            Source::Cuda => {
                let export = umbp_cuda::export_device_range(addr, len)?;
                let device = Some(v1::CudaDevice {
                    uuid: export.device_uuid().to_vec(),
                });
                let r = match export {
                    DeviceExport::Legacy {
                        handle,
                        allocation_bytes,
                        offset,
                        length,
                        ..
                    } => self.call("register_cuda_memory", t, |mut g| async move {
                        g.register_cuda_ipc(v1::RegisterCudaIpcRequest {
                            session_id: sid,
                            device,
                            handle: handle.to_vec(),
                            allocation_bytes,
                            offset,
                            length,
                        })
                        .await
                    })?,
                    DeviceExport::Vmm {
                        chunks,
                        offset,
                        length,
                        ..
                    } => {
                        let fds: Vec<BorrowedFd<'_>> =
                            chunks.iter().map(|c| c.fd.as_fd()).collect();
                        let tickets = self.send_fds(a, &fds)?;
                        let chunks: Vec<v1::VmmChunk> = chunks
                            .iter()
                            .zip(tickets)
                            .map(|(c, ticket)| v1::VmmChunk {
                                ticket,
                                offset: c.offset,
                                size: c.size,
                            })
                            .collect();
                        self.call("register_cuda_memory", t, |mut g| async move {
                            g.register_cuda_vmm(v1::RegisterCudaVmmRequest {
                                session_id: sid,
                                device,
                                chunks,
                                offset,
                                length,
                            })
                            .await
                        })?
                    }
                };
                Ok(r.region_id)
            }
        }
    }

    fn send_fds(&self, a: &Attachment, fds: &[BorrowedFd<'_>]) -> Result<Vec<u64>> {
        self.check()?;
        fdsend::send_fds(&a.fd_socket, a.session_id, &a.secret, fds).inspect_err(|e| {
            if matches!(e, ClientError::Io { .. } | ClientError::Disconnected { .. }) {
                self.lost();
            }
        })
    }

    /// Translates client-address layers into region offsets of attachment `a` and registers
    /// them; returns the server's layout id and object bytes.
    fn register_layout_on(
        &self,
        a: &Attachment,
        rec: &Records,
        groups: &[Vec<LayerSpec>],
    ) -> Result<(u32, Vec<u64>)> {
        let mut out = Vec::with_capacity(groups.len());
        for (g, layers) in groups.iter().enumerate() {
            let mut runs = Vec::with_capacity(layers.len());
            for (i, l) in layers.iter().enumerate() {
                let span = l
                    .num_blocks
                    .checked_sub(1)
                    .and_then(|n| n.checked_mul(l.block_stride))
                    .and_then(|s| s.checked_add(l.block_bytes))
                    .ok_or_else(|| ClientError::Invalid(format!("group {g} layer {i}: num_blocks must be > 0 and the span must fit in 64 bits")))?;
                let region = rec
                    .regions
                    .values()
                    .find(|r| l.base_addr >= r.addr && l.base_addr.checked_add(span).is_some_and(|e| e <= r.addr + r.len))
                    .ok_or_else(|| {
                        ClientError::Unregistered(format!(
                            "group {g} layer {i}: {:#x}+{span} lies in no memory this client registered; register the KV cache tensor first",
                            l.base_addr
                        ))
                    })?;
                let (generation, server_region) = region.server.ok_or_else(|| {
                    ClientError::Unregistered(format!(
                        "group {g} layer {i}: its memory is not registered with the server"
                    ))
                })?;
                if generation != a.generation {
                    return Err(ClientError::Unregistered(
                        "memory registrations are from an earlier session".into(),
                    ));
                }
                let base_in_region = match &region.source {
                    // The server maps the memfd from the span's start.
                    Source::Host(_) | Source::Cuda => l.base_addr - region.addr,
                };
                runs.push(v1::LayoutRun {
                    region_id: server_region,
                    offset: base_in_region,
                    num_blocks: l.num_blocks,
                    block_stride: l.block_stride,
                    block_bytes: l.block_bytes,
                });
            }
            out.push(v1::LayoutGroup { runs });
        }
        let sid = a.session_id;
        let r = self.call(
            "register_layout",
            self.inner.opts.control_timeout,
            |mut g| async move {
                g.register_layout(v1::RegisterLayoutRequest {
                    session_id: sid,
                    groups: out,
                })
                .await
            },
        )?;
        Ok((r.layout_id, r.object_bytes))
    }

    /// Shares host memory `[addr, addr + len)` of this process with the server (its pages are
    /// moved into a sealed memfd at the same addresses, see [`host_share::share_host_range`])
    /// and registers it. Returns the client's region id.
    ///
    /// # Safety
    /// As [`host_share::share_host_range`]: no other thread writes the pages of the range
    /// during the call, and the memory stays allocated while registered.
    pub unsafe fn register_host_memory(&self, addr: u64, len: u64) -> Result<u64> {
        self.check()?;
        // SAFETY: forwarded contract.
        let shm = unsafe { host_share::share_host_range(addr, len) }?;
        self.add_region(shm.span_addr(), shm.span_len(), Source::Host(shm))
    }

    /// Registers memory that is already shared ([`host_share::alloc_shared_host`]).
    pub fn register_shared_host(&self, shm: SharedHostMemory) -> Result<u64> {
        self.check()?;
        self.add_region(shm.span_addr(), shm.span_len(), Source::Host(shm))
    }

    /// Registers CUDA memory `[addr, addr + len)` of this process (a KV cache tensor) by IPC
    /// handle, or by exported descriptors for virtual-memory allocations. Returns the
    /// client's region id.
    ///
    /// # Safety
    /// The memory stays allocated while registered (the server writes it on loads).
    pub unsafe fn register_cuda_memory(&self, addr: u64, len: u64) -> Result<u64> {
        self.check()?;
        self.add_region(addr, len, Source::Cuda)
    }

    fn add_region(&self, addr: u64, len: u64, source: Source) -> Result<u64> {
        let a = self.attachment()?;
        let sid = self.register_region_on(&a, addr, len, &source)?;
        let mut rec = self.inner.records.lock();
        let id = rec.next_region;
        rec.next_region += 1;
        rec.regions.insert(
            id,
            RegionRecord {
                addr,
                len,
                source,
                server: Some((a.generation, sid)),
            },
        );
        Ok(id)
    }

    /// Deregisters a region; layouts in it are dropped with it.
    pub fn deregister_memory(&self, id: u64) -> Result<()> {
        self.check()?;
        let server = {
            let mut rec = self.inner.records.lock();
            let r = rec.regions.remove(&id).ok_or_else(|| {
                ClientError::Unregistered(format!(
                    "memory region {id} is not registered by this client"
                ))
            })?;
            let (addr, end) = (r.addr, r.addr + r.len);
            rec.layouts.retain(|_, l| {
                !l.groups
                    .iter()
                    .flatten()
                    .any(|s| s.base_addr >= addr && s.base_addr < end)
            });
            r.server
        };
        let a = self.inner.attachment.read().clone();
        if let (Some(a), Some((generation, sid))) = (a, server) {
            if generation == a.generation {
                let session_id = a.session_id;
                self.call(
                    "deregister_memory",
                    self.inner.opts.control_timeout,
                    |mut g| async move {
                        g.deregister_memory(v1::DeregisterMemoryRequest {
                            session_id,
                            region_id: sid,
                        })
                        .await
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Registers a layout given in this process's addresses (each run inside a registered
    /// region). Returns the client's layout id and each group's object size.
    pub fn register_layout(&self, groups: Vec<Vec<LayerSpec>>) -> Result<LayoutInfo> {
        let a = self.attachment()?;
        let mut rec = self.inner.records.lock();
        let (sid, object_bytes) = self.register_layout_on(&a, &rec, &groups)?;
        let id = rec.next_layout;
        rec.next_layout += 1;
        rec.layouts.insert(
            id,
            LayoutRecord {
                groups,
                object_bytes: object_bytes.clone(),
                server: Some((a.generation, sid)),
            },
        );
        Ok(LayoutInfo { id, object_bytes })
    }

    /// Bytes of one object of group `group` of layout `layout`.
    pub fn object_bytes(&self, layout: u32, group: u32) -> Result<u64> {
        let rec = self.inner.records.lock();
        rec.layouts
            .get(&layout)
            .and_then(|l| l.object_bytes.get(group as usize).copied())
            .ok_or_else(|| {
                ClientError::Invalid(format!(
                    "no group {group} in layout {layout} of this client"
                ))
            })
    }

    /// The server's layout id of client layout `layout`, attaching again first if needed.
    fn server_layout(&self, layout: u32) -> Result<(Attachment, u32)> {
        let a = self.attachment()?;
        let rec = self.inner.records.lock();
        let l = rec.layouts.get(&layout).ok_or_else(|| {
            ClientError::UnknownLayout(format!(
                "no KV layout with id {layout} in this client; register the layout first"
            ))
        })?;
        match l.server {
            Some((generation, sid)) if generation == a.generation => Ok((a, sid)),
            _ => Err(ClientError::UnknownLayout(format!(
                "layout {layout} is not registered with the current server session"
            ))),
        }
    }

    /// Starts storing blocks `block_ids` of group `group` of `layout` under `keys`.
    pub fn store(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.transfer(v1::Direction::Store, layout, group, block_ids, keys)
    }

    /// Starts loading `keys` into blocks `block_ids` of group `group` of `layout`.
    pub fn load(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.transfer(v1::Direction::Load, layout, group, block_ids, keys)
    }

    fn transfer(
        &self,
        dir: v1::Direction,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.check()?;
        if keys.len() != block_ids.len() {
            return Err(ClientError::Invalid(format!(
                "{} keys for {} block ids; give one key per block",
                keys.len(),
                block_ids.len()
            )));
        }
        if self.inner.stalled_transfers.load(Ordering::Acquire) > 0 {
            return Err(ClientError::Stalled { what: "transfer" });
        }
        let (a, layout_id) = self.server_layout(layout)?;
        let transfer_id = self.inner.next_transfer.fetch_add(1, Ordering::Relaxed);
        let mut packed = Vec::with_capacity(keys.len() * umbp_proto::KEY_BYTES);
        for k in keys {
            packed.extend_from_slice(k.as_bytes());
        }
        let timeout = self.inner.opts.transfer_timeout;
        let lease = match &self.inner.completions {
            Some(c) if a.completion_slots > 0 => c.lease(a.completion_slots).map(Arc::new),
            _ => None,
        };
        let (completion_slot, completion_seq) =
            lease.as_ref().map_or((0, 0), |l| (l.slot + 1, l.seq));
        let req = v1::TransferRequest {
            session_id: a.session_id,
            layout_id,
            group,
            direction: dir as i32,
            block_ids: block_ids.to_vec(),
            keys: packed,
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
            transfer_id,
            completion_slot,
            completion_seq,
        };
        let slot = Arc::new(Slot::default());
        let n = keys.len();
        let sent = Instant::now();
        let sent_ns = completion::monotonic_ns();
        let done = Transfer {
            client: self.clone(),
            slot: Arc::clone(&slot),
            lease: lease.clone(),
            page_answer: std::sync::OnceLock::new(),
            keys: n,
            sent,
            sent_ns,
            session_id: a.session_id,
            transfer_id,
            deadline: sent + timeout,
            timeout,
            stalled_marked: AtomicBool::new(false),
            eta_key: (layout, group, dir == v1::Direction::Store),
            due: self
                .inner
                .eta
                .due((layout, group, dir == v1::Direction::Store), n, sent),
        };
        // The transfer channel first: written by this thread, no runtime hand-off.
        let mut lease = lease;
        if let Some(ch) = a.channel.as_ref().filter(|c| c.is_open()) {
            let p = Pending {
                slot: Arc::clone(&slot),
                lease: lease.take(),
                sent,
                keys: n,
                _client: self.clone(),
            };
            match ch.send(&req, p) {
                Ok(()) => return Ok(done),
                Err(p) => lease = p.lease,
            }
        }
        let s2 = Arc::clone(&slot);
        let mut grpc = self.inner.grpc.clone();
        // The task keeps the client alive until the server answers (dropping every handle
        // does not cancel a transfer); `Inner`'s drop copes with being run on this task.
        let me = self.clone();
        let l2 = lease;
        let generation = a.generation;
        self.inner.rt().spawn(async move {
            let r = grpc.transfer(req).await;
            let out = match r {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    *s2.timing.lock() = Some(TransferTiming {
                        round_trip: sent.elapsed(),
                        server: Duration::from_micros(reply.server_micros),
                        copy: Duration::from_micros(reply.copy_micros),
                        completion_page: false,
                        to_server: None,
                        to_caller: None,
                    });
                    decode_reply(reply, n)
                }
                Err(s) => {
                    // Only this transfer's session: the caller may have moved on (answered
                    // by the completion page) and attached again meanwhile.
                    if session_lost(&s) {
                        me.lost_attachment(generation);
                    }
                    Err(status_error("transfer", &me.inner.opts.endpoint, s))
                }
            };
            s2.fill(out);
            // A waiter asleep on the page wakes for the reply (the server may never have set
            // the slot: a refused or unfinished transfer).
            if let Some(l) = l2 {
                l.page().settle(l.slot, l.seq, REPLIED);
            }
        });
        Ok(done)
    }

    /// Which of `keys` are in the pool (one key per block; a single rank).
    pub fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let r = self.lookup(packed_request(keys, 1, false))?;
        Ok(r.present.iter().map(|p| *p != 0).collect())
    }

    /// How many of `keys`, from the first, are in the pool.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize> {
        Ok(self.lookup(packed_request(keys, 1, true))?.prefix as usize)
    }

    /// Per block, whether every rank of `ranks` holds it, with keys built in the server from
    /// `namespace`, `group` and the packed `hashes` (`hash_bytes` each). Returns the per-block
    /// answer (empty with `prefix_only`) and the number of leading blocks every rank holds.
    pub fn exists_across_ranks(
        &self,
        namespace: &str,
        ranks: &[RankTopology],
        group: u32,
        hashes: &[u8],
        hash_bytes: u32,
        prefix_only: bool,
    ) -> Result<(Vec<bool>, usize)> {
        let r = self.lookup(v1::ExistsRequest {
            keys: Some(v1::KeySet {
                packed: Vec::new(),
                namespace: namespace.into(),
                group,
                hash_bytes,
                hashes: hashes.to_vec(),
            }),
            ranks: ranks
                .iter()
                .map(|r| v1::Ranks {
                    tp: r.tp.into(),
                    pcp: r.pcp.into(),
                    dcp: r.dcp.into(),
                    pp: r.pp.into(),
                })
                .collect(),
            packed_ranks: 0,
            prefix_only,
        })?;
        Ok((
            r.present.iter().map(|p| *p != 0).collect(),
            r.prefix as usize,
        ))
    }

    fn lookup(&self, req: v1::ExistsRequest) -> Result<v1::ExistsReply> {
        self.check()?;
        if self.inner.stalled_lookups.load(Ordering::Acquire) > 0 {
            return Err(ClientError::Stalled { what: "lookup" });
        }
        let timeout = self.inner.opts.lookup_timeout;
        let mut g = self.inner.grpc.clone();
        let handle = self.inner.rt().spawn(async move { g.exists(req).await });
        let stalled = Arc::clone(&self.inner.stalled_lookups);
        let r = self.inner.rt().block_on(async move {
            let mut handle = handle;
            match tokio::time::timeout(timeout, &mut handle).await {
                Ok(r) => Some(r),
                Err(_) => {
                    // Left running: later lookups fail at once until this one is answered.
                    stalled.fetch_add(1, Ordering::AcqRel);
                    tokio::spawn(async move {
                        let _ = handle.await;
                        stalled.fetch_sub(1, Ordering::AcqRel);
                    });
                    None
                }
            }
        });
        match r {
            None => Err(ClientError::Timeout {
                what: "lookup",
                ms: timeout.as_millis() as u64,
            }),
            Some(Err(e)) => Err(ClientError::Internal(format!("lookup task failed: {e}"))),
            Some(Ok(Ok(r))) => Ok(r.into_inner()),
            Some(Ok(Err(s))) => Err(status_error("exists", &self.inner.opts.endpoint, s)),
        }
    }

    /// The server's boot id (asks the server).
    pub fn ping(&self) -> Result<String> {
        Ok(self.ping_once(self.inner.opts.control_timeout)?.boot_id)
    }

    /// Pool and server statistics.
    pub fn stats(&self) -> Result<ServerStats> {
        self.call(
            "stats",
            self.inner.opts.control_timeout,
            |mut g| async move { g.stats(v1::StatsRequest {}).await },
        )
    }

    /// Removes every object of the pool (every engine's), or those of one namespace.
    pub fn clear(&self, namespace: Option<&str>) -> Result<u64> {
        let namespace = namespace.unwrap_or_default().to_string();
        Ok(self
            .call(
                "clear",
                self.inner.opts.control_timeout,
                |mut g| async move { g.clear(v1::ClearRequest { namespace }).await },
            )?
            .removed)
    }

    /// The session id and boot id of the current attachment (None when detached).
    pub fn session(&self) -> Option<(u64, String)> {
        self.inner
            .attachment
            .read()
            .as_ref()
            .map(|a| (a.session_id, a.boot_id.clone()))
    }

    /// How many times this client attached (1 + re-attaches).
    pub fn attach_count(&self) -> u64 {
        self.inner.attaches.load(Ordering::Relaxed)
    }

    /// Detaches (the server releases everything of this session) and closes the client: its
    /// connection is shut down, so calls still in flight fail, and a server that stalls is
    /// not waited for (past 200 ms for the detach, not at all when it already left a
    /// call unanswered past its deadline).
    pub fn close(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) || std::process::id() != self.inner.pid {
            return;
        }
        // Taken in a statement of its own, so that the lock is not held during the call: the
        // runtime's tasks take it (a failing transfer forgets the session), and if every
        // worker blocked on it, nothing would drive the call or its timeout.
        let attachment = self.inner.attachment.write().take();
        // A server that has left a call unanswered past its deadline is not asked again: the
        // connection's close releases the session there just the same, and closing must not
        // wait on a stalled server.
        let stalled = self.inner.stalled_lookups.load(Ordering::Acquire) > 0
            || self.inner.stalled_transfers.load(Ordering::Acquire) > 0;
        if let Some(ch) = attachment.as_ref().and_then(|a| a.channel.as_ref()) {
            ch.close();
        }
        if let Some(a) = attachment.filter(|_| !stalled) {
            let mut g = self.inner.grpc.clone();
            // A detach only makes the release synchronous: the socket's shutdown below releases
            // the session just the same, so a slow answer is not waited for long.
            let t = DETACH_WAIT.min(self.inner.opts.control_timeout);
            let _ = self.inner.rt().block_on(async move {
                tokio::time::timeout(
                    t,
                    g.detach(v1::DetachRequest {
                        session_id: a.session_id,
                    }),
                )
                .await
            });
        }
        // Whatever is still in flight fails now, and the server releases the session now
        // (had the detach not been sent or answered) rather than when the last handle goes.
        shut_down(&self.inner.socket);
    }
}

fn packed_request(keys: &[BlockKey], ranks: u32, prefix_only: bool) -> v1::ExistsRequest {
    let mut packed = Vec::with_capacity(keys.len() * umbp_proto::KEY_BYTES);
    for k in keys {
        packed.extend_from_slice(k.as_bytes());
    }
    v1::ExistsRequest {
        keys: Some(v1::KeySet {
            packed,
            ..Default::default()
        }),
        ranks: Vec::new(),
        packed_ranks: ranks,
        prefix_only,
    }
}

fn decode_reply(r: v1::TransferReply, n: usize) -> Result<Vec<KeyStatus>> {
    use v1::KeyStatus as S;
    let malformed = |message: String| ClientError::Refused {
        call: "transfer",
        kind: ErrorKind::Internal,
        message,
    };
    if r.statuses.len() != n {
        return Err(malformed(format!(
            "the server answered {} statuses for {n} keys",
            r.statuses.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for &b in &r.statuses {
        out.push(match S::try_from(b as i32) {
            Ok(S::Done) => KeyStatus::Done,
            Ok(S::AlreadyPresent) => KeyStatus::AlreadyPresent,
            Ok(S::Missing) => KeyStatus::Missing,
            Ok(S::PoolFull) => KeyStatus::PoolFull,
            Ok(S::Cancelled) => KeyStatus::Cancelled,
            Ok(S::TimedOut) => KeyStatus::TimedOut,
            // Its kind and message come in `errors`.
            Ok(S::Failed) => KeyStatus::Failed {
                kind: FailureKind::Device,
                message: String::new(),
            },
            _ => return Err(malformed(format!("the server answered key status {b}"))),
        });
    }
    for e in r.errors {
        let kind = FailureKind::from_name(&e.kind).ok_or_else(|| {
            malformed(format!(
                "the server named key failure {:?}, which this client does not know",
                e.kind
            ))
        })?;
        if let Some(s) = out.get_mut(e.index as usize) {
            *s = KeyStatus::Failed {
                kind,
                message: e.message,
            };
        }
    }
    Ok(out)
}

/// A transfer's answer as every waiter reads it: the statuses, or the error's kind and
/// message (the typed error goes to the first waiter).
type Answer = std::result::Result<Vec<KeyStatus>, (ErrorKind, String)>;

/// Where a transfer's answer lands.
#[derive(Debug, Default)]
struct Slot {
    value: Mutex<Option<Answer>>,
    /// Set before the value, when the server answered.
    timing: Mutex<Option<TransferTiming>>,
    ready: Condvar,
    /// Set with the value: the error, kept typed for the first waiter.
    error: Mutex<Option<ClientError>>,
    /// Set by whoever clears the transfer's stall mark (its reply, or its completion page,
    /// whichever comes first), so it is cleared once.
    stall_cleared: AtomicBool,
}

impl Slot {
    fn fill(&self, r: Result<Vec<KeyStatus>>) {
        let mut v = self.value.lock();
        *v = Some(match r {
            Ok(s) => Ok(s),
            Err(e) => {
                let first = (e.kind(), e.to_string());
                *self.error.lock() = Some(e);
                Err(first)
            }
        });
        self.ready.notify_all();
    }
}

/// Where an answered transfer's time went ([`Transfer::timing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferTiming {
    /// From handing the request to the client's runtime to receiving the answer (the reply,
    /// or the completion page's wake-up).
    pub round_trip: Duration,
    /// In the server, from receiving the request to sending the reply (to the job's end when
    /// the completion page answered).
    pub server: Duration,
    /// In the server, the copy job alone (submission to its last key).
    pub copy: Duration,
    /// Whether the completion page answered: the server set the transfer's slot to "every
    /// key done" from its copy worker (a waiting caller is woken there, without the reply).
    /// Then `round_trip` runs to when this client first saw the slot set, and `server` to the
    /// job's end rather than to the reply.
    pub completion_page: bool,
    /// With the completion page, from the call to the server receiving the request (the
    /// encoding, the write and the server thread's wake-up), read off the host's monotonic
    /// clock on both ends. None when the reply answered, or from a server that does not write
    /// the clock readings.
    pub to_server: Option<Duration>,
    /// With the completion page, from the server publishing the slot to this client seeing
    /// it (None as for `to_server`).
    pub to_caller: Option<Duration>,
}

/// A transfer in flight. Dropping it does not cancel it.
#[derive(Debug)]
pub struct Transfer {
    client: StandaloneClient,
    slot: Arc<Slot>,
    /// Its slot of the completion page, when it has one.
    lease: Option<Arc<Lease>>,
    /// Set when the page was first seen saying every key is done (then the answer).
    page_answer: std::sync::OnceLock<TransferTiming>,
    keys: usize,
    sent: Instant,
    /// `sent` on the host's monotonic clock, in nanoseconds (see [`TransferTiming::to_server`]).
    sent_ns: u64,
    session_id: u64,
    transfer_id: u64,
    deadline: Instant,
    timeout: Duration,
    stalled_marked: AtomicBool,
    /// What kind of transfer it is for [`eta::TransferEta`], and when its answer is due.
    eta_key: eta::EtaKey,
    due: Option<Instant>,
}

impl Transfer {
    /// Per-key statuses once answered, else None. Never blocks.
    pub fn poll(&self) -> Option<Result<Vec<KeyStatus>>> {
        // The page first: once it says every key is done, that is the answer, even if the
        // reply later fails (the server died after finishing the job).
        if self.all_done() {
            return Some(Ok(self.done_by_page()));
        }
        let v = self.slot.value.lock();
        v.as_ref().map(|r| self.take(r))
    }

    /// Whether the completion page says every key is done; the first time it does, the
    /// answer is kept (with the page's times), so it never changes afterwards.
    fn all_done(&self) -> bool {
        if self.page_answer.get().is_some() {
            return true;
        }
        let Some(l) = &self.lease else {
            return false;
        };
        if l.page().load(l.slot) != completion::word(l.seq, ALL_DONE) {
            return false;
        }
        // A transfer marked stalled is answered now: later transfers need not wait for its
        // reply to go on.
        if self.stalled_marked.load(Ordering::Acquire)
            && !self.slot.stall_cleared.swap(true, Ordering::AcqRel)
        {
            self.client
                .inner
                .stalled_transfers
                .fetch_sub(1, Ordering::AcqRel);
        }
        let seen_ns = completion::monotonic_ns();
        let t = l.page().times(l.slot);
        let between =
            |from: u64, to: u64| (from > 0 && to >= from).then(|| Duration::from_nanos(to - from));
        let _ = self.page_answer.set(TransferTiming {
            round_trip: self.sent.elapsed(),
            server: Duration::from_micros(t.server_us),
            copy: Duration::from_micros(t.copy_us),
            completion_page: true,
            to_server: between(self.sent_ns, t.received_ns),
            to_caller: between(t.published_ns, seen_ns),
        });
        true
    }

    /// The answer the completion page gave: every key done.
    fn done_by_page(&self) -> Vec<KeyStatus> {
        vec![KeyStatus::Done; self.keys]
    }

    /// Sleeps on the completion page until the server sets the slot, the reply arrives or
    /// `until`; the answer when the page says every key is done. Near the time the answer is
    /// due (see [`eta`]) the caller watches the page word instead of sleeping, to be running
    /// when the answer comes rather than woken after it.
    fn wait_on_page(&self, l: &Lease, until: Instant) -> Option<Vec<KeyStatus>> {
        let pending = completion::word(l.seq, PENDING);
        let mut waited = false;
        loop {
            if self.all_done() {
                // Only an answer that came while this caller waited tells how long the
                // transfer took (not one a late caller or a second wait found).
                if waited {
                    if let Some(t) = self.page_answer.get() {
                        self.client
                            .inner
                            .eta
                            .answered(self.eta_key, self.keys, t.round_trip);
                    }
                }
                return Some(self.done_by_page());
            }
            waited = true;
            let w = l.page().load(l.slot);
            // Anything else than pending (some keys not done, the reply, a late write of an
            // earlier use): the reply says.
            if w != pending {
                return None;
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            let mut sleep = (until - now).min(WAIT_SLICE);
            if let Some(due) = self.due {
                let wake = due.checked_sub(eta::EARLY).unwrap_or(due);
                if now >= wake && now < due + eta::WATCH_PAST {
                    std::thread::yield_now();
                    continue;
                }
                if now < wake {
                    sleep = sleep.min(wake - now);
                }
            }
            l.page().wait(l.slot, pending, sleep);
        }
    }

    fn take(&self, r: &Answer) -> Result<Vec<KeyStatus>> {
        match r {
            Ok(s) => Ok(s.clone()),
            Err((kind, message)) => {
                Err(self
                    .slot
                    .error
                    .lock()
                    .take()
                    .unwrap_or_else(|| ClientError::Repeated {
                        kind: *kind,
                        message: message.clone(),
                    }))
            }
        }
    }

    /// Where the time went, once the server has answered (None before, or after a failed
    /// call).
    pub fn timing(&self) -> Option<TransferTiming> {
        if self.all_done() {
            return self.page_answer.get().copied();
        }
        *self.slot.timing.lock()
    }

    /// Whether the server has answered.
    pub fn is_done(&self) -> bool {
        self.slot.value.lock().is_some() || self.all_done()
    }

    /// Waits up to `timeout` (None: the transfer's own deadline) for the answer. Past the
    /// transfer's deadline an unanswered transfer counts as stalled: new transfers of the
    /// client fail at once until the server answers it.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<KeyStatus>> {
        let until = match timeout {
            Some(t) => Instant::now() + t,
            None => self.deadline,
        };
        if let Some(l) = &self.lease {
            if let Some(done) = self.wait_on_page(l, until) {
                return Ok(done);
            }
        }
        let mut v = self.slot.value.lock();
        while v.is_none() {
            if self.slot.ready.wait_until(&mut v, until).timed_out() {
                break;
            }
        }
        if let Some(r) = v.as_ref() {
            return self.take(r);
        }
        drop(v);
        if Instant::now() >= self.deadline && !self.stalled_marked.swap(true, Ordering::AcqRel) {
            let stalled = Arc::clone(&self.client.inner.stalled_transfers);
            stalled.fetch_add(1, Ordering::AcqRel);
            let slot = Arc::clone(&self.slot);
            self.client.inner.rt().spawn_blocking(move || {
                let mut v = slot.value.lock();
                while v.is_none() {
                    slot.ready.wait(&mut v);
                }
                if !slot.stall_cleared.swap(true, Ordering::AcqRel) {
                    stalled.fetch_sub(1, Ordering::AcqRel);
                }
            });
        }
        Err(ClientError::Timeout {
            what: "transfer",
            ms: timeout.unwrap_or(self.timeout).as_millis() as u64,
        })
    }

    /// Asks the server to stop the transfer (keys not started end cancelled); wait for the
    /// answer before reusing its memory.
    pub fn cancel(&self) -> Result<()> {
        if self.is_done() {
            return Ok(());
        }
        let (session_id, transfer_id) = (self.session_id, self.transfer_id);
        self.client.call(
            "cancel_transfer",
            self.client.inner.opts.control_timeout,
            |mut g| async move {
                g.cancel_transfer(v1::CancelTransferRequest {
                    session_id,
                    transfer_id,
                })
                .await
            },
        )?;
        Ok(())
    }
}
