//! The gRPC service: every request checked against its caller (uid, connection, session)
//! before anything is touched, then answered by the shared store.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use umbp_copy::KeyResult;
use umbp_core::{BlockKey, CoreError, ErrorKind, KeyBuilder, RankTopology};
use umbp_proto::errors::status;
use umbp_proto::v1::{self, store_server::Store};
use umbp_proto::{completion, Endpoint, KEY_BYTES, PROTOCOL};
use umbp_store::{EmbeddedStore, RegionOffset, RelativeLayer, StoreError};

use crate::listen::PeerInfo;
use crate::metrics::{Gauges, Metrics};
use crate::sessions::{Backing, ClientSession, CompletionMapping, EndReason, Sessions};
use crate::Access;

/// Everything the service's handlers share.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) store: Arc<EmbeddedStore>,
    pub(crate) sessions: Arc<Sessions>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) boot_id: String,
    pub(crate) started: Instant,
    pub(crate) access: Access,
    pub(crate) endpoint: Endpoint,
    pub(crate) max_message_bytes: usize,
    /// How long a transfer channel's reader watches its socket before blocking on it.
    pub(crate) busy_poll: Duration,
    /// Set when the server starts shutting down: new transfers are refused.
    pub(crate) draining: AtomicBool,
    pub(crate) in_flight: AtomicU64,
}

impl State {
    /// Statistics of the pool and the sessions.
    pub(crate) fn gauges(&self) -> Gauges {
        let t = self.sessions.totals();
        let mut g = Gauges {
            sessions: self.sessions.len() as u64,
            registrations: t.registrations,
            layouts: t.layouts,
            transfers_in_flight: self.in_flight.load(Ordering::Relaxed),
            ..Gauges::default()
        };
        if let Ok(p) = self.store.stats() {
            g.capacity_bytes = p.capacity_bytes;
            g.used_bytes = p.used_bytes;
            g.objects = p.objects;
            g.hits = p.hits;
            g.misses = p.misses;
            g.evictions = p.evictions;
            g.reservations = p.reservations;
            g.pinned = p.pinned;
        }
        g.remote = self.store.remote_stats();
        g
    }
}

/// The `umbp.v1.Store` service.
#[derive(Debug, Clone)]
pub(crate) struct Service {
    pub(crate) state: Arc<State>,
}

/// The gRPC status of a store error: its kind (in the details, and as the code), and the
/// message that says what to change. A released session is the client's lost session.
pub(crate) fn status_of(e: &StoreError) -> Status {
    let kind = match e {
        StoreError::SessionReleased(_) => ErrorKind::SessionLost,
        e => e.kind(),
    };
    status(kind, e.to_string())
}

fn invalid(msg: impl Into<String>) -> Status {
    status(ErrorKind::InvalidArgument, msg)
}

/// Splits packed 64-byte keys.
pub(crate) fn unpack_keys(b: &[u8], what: &str) -> Result<Vec<BlockKey>, Status> {
    if !b.len().is_multiple_of(KEY_BYTES) {
        return Err(invalid(format!(
            "{what}: {} bytes is not a whole number of {KEY_BYTES}-byte keys",
            b.len()
        )));
    }
    Ok(b.chunks_exact(KEY_BYTES)
        .map(|c| BlockKey::from_bytes(c.try_into().expect("64 bytes")))
        .collect())
}

fn ranks(r: &v1::Ranks) -> Result<RankTopology, Status> {
    let f = |v: u32, n: &str| {
        u16::try_from(v)
            .map_err(|_| invalid(format!("ranks.{n} = {v} is out of range (at most 65535)")))
    };
    Ok(RankTopology {
        tp: f(r.tp, "tp")?,
        pcp: f(r.pcp, "pcp")?,
        dcp: f(r.dcp, "dcp")?,
        pp: f(r.pp, "pp")?,
    })
}

/// The most blocks per rank one `Exists` request may name: 1,048,576 (a 16M-token prompt in
/// blocks of 16).
pub(crate) const MAX_LOOKUP_BLOCKS: usize = 1 << 20;
/// The most keys (blocks × ranks) one `Exists` request may make the server build and look up:
/// 4,194,304. Keys are built one rank at a time, so a request holds at most
/// [`MAX_LOOKUP_BLOCKS`] of them (64 MiB) at once.
pub(crate) const MAX_LOOKUP_KEYS: usize = 1 << 22;

/// The keys of an `Exists` request, checked against the limits before any is built, and then
/// handed out one rank at a time.
enum LookupKeys {
    /// Keys the client built, rank-major.
    Packed { keys: Vec<BlockKey>, n: usize },
    /// Block hashes the server turns into each rank's keys.
    Hashes {
        base: KeyBuilder,
        ranks: Vec<RankTopology>,
        group: u32,
        hashes: Vec<u8>,
        hash_len: usize,
    },
}

impl LookupKeys {
    fn parse(r: &mut v1::ExistsRequest) -> Result<Self, Status> {
        let ks = r.keys.as_mut().ok_or_else(|| invalid("keys are missing"))?;
        if !ks.packed.is_empty() {
            let keys = unpack_keys(&ks.packed, "keys.packed")?;
            let n_ranks = r.packed_ranks.max(1) as usize;
            if !keys.len().is_multiple_of(n_ranks) {
                return Err(invalid(format!(
                    "{} packed keys do not split into {n_ranks} ranks",
                    keys.len()
                )));
            }
            let n = keys.len() / n_ranks;
            check_lookup_size(n, n_ranks)?;
            return Ok(LookupKeys::Packed { keys, n });
        }
        let hash_len = ks.hash_bytes as usize;
        if ks.hashes.is_empty() {
            return Ok(LookupKeys::Packed {
                keys: Vec::new(),
                n: 0,
            });
        }
        if r.ranks.is_empty() {
            return Err(invalid(
                "hashes given without ranks; name at least one rank",
            ));
        }
        if hash_len == 0 || !ks.hashes.len().is_multiple_of(hash_len) {
            return Err(invalid(format!(
                "keys.hashes: {} bytes is not a whole number of hash_bytes = {hash_len} hashes",
                ks.hashes.len()
            )));
        }
        check_lookup_size(ks.hashes.len() / hash_len, r.ranks.len())?;
        let base = KeyBuilder::new(&ks.namespace, RankTopology::default())
            .map_err(|e| invalid(e.to_string()))?;
        // The builder refuses a hash length it cannot take: find out before the lookup runs.
        base.keys_packed(ks.group, &ks.hashes[..hash_len], hash_len)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(LookupKeys::Hashes {
            base,
            ranks: r.ranks.iter().map(ranks).collect::<Result<_, _>>()?,
            group: ks.group,
            hashes: std::mem::take(&mut ks.hashes),
            hash_len,
        })
    }

    /// Blocks per rank.
    fn blocks(&self) -> usize {
        match self {
            LookupKeys::Packed { n, .. } => *n,
            LookupKeys::Hashes {
                hashes, hash_len, ..
            } => hashes.len() / hash_len,
        }
    }

    fn n_ranks(&self) -> usize {
        match self {
            LookupKeys::Packed { keys, n } => keys.len().checked_div(*n).unwrap_or(1),
            LookupKeys::Hashes { ranks, .. } => ranks.len(),
        }
    }

    /// Rank `i`'s keys, in block order.
    fn rank(&self, i: usize) -> Result<std::borrow::Cow<'_, [BlockKey]>, CoreError> {
        Ok(match self {
            LookupKeys::Packed { keys, n } => keys[i * n..(i + 1) * n].into(),
            LookupKeys::Hashes {
                base,
                ranks,
                group,
                hashes,
                hash_len,
            } => base
                .with_ranks(ranks[i])
                .keys_packed(*group, hashes, *hash_len)?
                .into(),
        })
    }
}

/// Refuses an `Exists` request over [`MAX_LOOKUP_BLOCKS`] or [`MAX_LOOKUP_KEYS`].
fn check_lookup_size(blocks: usize, ranks: usize) -> Result<(), Status> {
    if blocks > MAX_LOOKUP_BLOCKS {
        return Err(invalid(format!(
            "an Exists request of {blocks} blocks per rank is over the server's limit of \
             {MAX_LOOKUP_BLOCKS}; look the prefix up in parts of at most that many blocks"
        )));
    }
    match blocks.checked_mul(ranks) {
        Some(k) if k <= MAX_LOOKUP_KEYS => Ok(()),
        _ => Err(invalid(format!(
            "an Exists request of {blocks} blocks × {ranks} ranks is over the server's limit of \
             {MAX_LOOKUP_KEYS} keys; look the prefix up in parts, or for fewer ranks at once"
        ))),
    }
}

/// How many pages of the server's mapping `[addr, addr + len)` of client memory are not in
/// memory (`mincore`): pages the client never allocated (or that were swapped out), which the
/// server's copies would allocate and have charged to the server. None when the kernel cannot
/// tell.
fn pages_missing(addr: u64, len: u64) -> Option<usize> {
    let page = umbp_pool::shared_fd::page_size();
    let mut v = vec![0u8; len.div_ceil(page) as usize];
    // SAFETY: `[addr, addr + len)` is the server's live mapping of the memfd, page-aligned;
    // mincore writes one byte per page into `v`, which has one per page.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, v.as_mut_ptr()) };
    (rc == 0).then(|| v.iter().filter(|b| **b & 1 == 0).count())
}

/// A client's name as the logs and `stats` show it: control characters escaped (a newline
/// in a name must not forge a log line), at most 128 characters.
fn printable_name(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.chars().take(128).collect()
}

fn key_status(r: &KeyResult, timed_out: bool) -> v1::KeyStatus {
    use v1::KeyStatus as S;
    match r {
        KeyResult::Pending => S::TimedOut,
        KeyResult::Done => S::Done,
        KeyResult::AlreadyPresent => S::AlreadyPresent,
        KeyResult::Missing => S::Missing,
        KeyResult::PoolFull => S::PoolFull,
        KeyResult::Cancelled if timed_out => S::TimedOut,
        KeyResult::Cancelled => S::Cancelled,
        KeyResult::Failed(_) => S::Failed,
    }
}

/// Cancels a job when the request is dropped before it finished (the client went away or
/// cancelled the call).
struct CancelOnDrop(Option<umbp_copy::JobHandle>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(j) = self.0.take() {
            if !j.is_done() {
                j.cancel();
            }
        }
    }
}

/// Counts a transfer in flight while alive.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Forgets a named transfer when its request ends.
struct Named<'a>(&'a ClientSession, u64);

impl Drop for Named<'_> {
    fn drop(&mut self) {
        self.0.transfers.lock().remove(&self.1);
    }
}

/// Extra time a timed-out transfer gets to stop (keys being copied finish) before the reply.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);

impl Service {
    fn refuse(&self, s: Status) -> Status {
        self.state.metrics.refused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(code = ?s.code(), message = s.message(), "request refused");
        s
    }

    /// The caller, if its uid is allowed.
    fn peer<T>(&self, req: &Request<T>) -> Result<PeerInfo, Status> {
        let Some(p) = req.extensions().get::<PeerInfo>().copied() else {
            return Err(self.refuse(status(
                ErrorKind::Internal,
                "the connection's peer is unknown",
            )));
        };
        self.state
            .access
            .check(&p)
            .map_err(|m| self.refuse(status(ErrorKind::Denied, m)))?;
        Ok(p)
    }

    /// The caller's session `id`, attached on this very connection.
    fn session(&self, peer: &PeerInfo, id: u64) -> Result<Arc<ClientSession>, Status> {
        self.state.sessions.get(id, peer.conn).ok_or_else(|| {
            self.refuse(status(
                ErrorKind::SessionLost,
                format!(
                "session {id} is not attached on this connection (server boot {}); attach again",
                self.state.boot_id
            ),
            ))
        })
    }

    fn store_err(&self, e: StoreError) -> Status {
        self.refuse(status_of(&e))
    }

    /// The descriptor session `cs` sent over the side channel under `ticket` (used once).
    fn ticket(&self, cs: &ClientSession, ticket: u64) -> Result<std::os::fd::OwnedFd, Status> {
        cs.take_ticket(ticket).ok_or_else(|| {
            self.refuse(status(ErrorKind::NotFound, format!(
                "descriptor ticket {ticket} is unknown to session {} (send the memfd over the side channel first; each ticket is used once)",
                cs.id
            )))
        })
    }

    /// Unavailable once the server is shutting down.
    fn refuse_if_draining(&self) -> Result<(), Status> {
        if self.state.draining.load(Ordering::Acquire) {
            return Err(status(
                ErrorKind::Unavailable,
                "the server is shutting down; transfer refused",
            ));
        }
        Ok(())
    }

    /// Checks transfer request `r` of session `cs` (received at `t`) and submits its copy
    /// job, with the session's completion page hooked to it when the request names a slot.
    pub(crate) fn start_transfer(
        &self,
        cs: &ClientSession,
        r: &v1::TransferRequest,
        t: Instant,
    ) -> Result<Started, Status> {
        self.refuse_if_draining()?;
        let keys = unpack_keys(&r.keys, "keys").map_err(|s| self.refuse(s))?;
        if keys.len() != r.block_ids.len() {
            return Err(self.refuse(invalid(format!(
                "{} keys for {} block ids; give one key per block",
                keys.len(),
                r.block_ids.len()
            ))));
        }
        let dir = match v1::Direction::try_from(r.direction) {
            Ok(v1::Direction::Store) => umbp_copy::Direction::Store,
            Ok(v1::Direction::Load) => umbp_copy::Direction::Load,
            _ => {
                return Err(self.refuse(invalid(format!(
                    "direction {} is neither store nor load",
                    r.direction
                ))))
            }
        };
        let completion = match r.completion_slot {
            0 => None,
            k => {
                let page = cs.res.lock().completions.clone().ok_or_else(|| {
                    self.refuse(invalid(format!(
                        "completion slot {k} named, but session {} has no completion page; register one or send 0",
                        cs.id
                    )))
                })?;
                let slot = k - 1;
                if slot >= page.page.slots() {
                    return Err(self.refuse(invalid(format!(
                        "completion slot {k} is outside the session's page of {} slots; name 1 to {0}, or 0 for none",
                        page.page.slots()
                    ))));
                }
                if r.completion_seq >= completion::SEQ_LIMIT {
                    return Err(self.refuse(invalid(format!(
                        "completion sequence {} is too large; send one below 2^30",
                        r.completion_seq
                    ))));
                }
                Some((page, slot, r.completion_seq))
            }
        };
        let object_bytes = cs
            .session
            .layout(r.layout_id)
            .and_then(|l| Ok(l.group(r.group).map_err(StoreError::from)?.object_bytes()))
            .map_err(|e| self.store_err(e))?;
        let submitted = Instant::now();
        let job = match dir {
            umbp_copy::Direction::Store => {
                cs.session.store(r.layout_id, r.group, &r.block_ids, keys)
            }
            umbp_copy::Direction::Load => cs.session.load(r.layout_id, r.group, &r.block_ids, keys),
        }
        .map_err(|e| self.store_err(e))?;
        if let Some((page, slot, seq)) = completion {
            // Runs on the copy worker that finishes the job: the client wakes from here,
            // without waiting for the reply, its encoding or the client's runtime.
            job.on_done(move |results| {
                let all_done = results.iter().all(|r| *r == KeyResult::Done);
                // Not published when the client already settled the slot (nothing to tell).
                let in_server = t.elapsed();
                let now = completion::monotonic_ns();
                let times = completion::SlotTimes {
                    server_us: in_server.as_micros() as u64,
                    copy_us: submitted.elapsed().as_micros() as u64,
                    received_ns: now.saturating_sub(in_server.as_nanos() as u64),
                    published_ns: now,
                };
                let _ = page.page.publish(slot, seq, all_done, &times);
            });
        }
        Ok(Started {
            job,
            dir,
            object_bytes,
            received: t,
            submitted,
        })
    }
}

/// A transfer whose copy job is running.
pub(crate) struct Started {
    pub(crate) job: umbp_copy::JobHandle,
    dir: umbp_copy::Direction,
    object_bytes: u64,
    received: Instant,
    submitted: Instant,
}

impl State {
    /// The reply to transfer `s` that ended with `results` (cancelled by its deadline when
    /// `timed_out`), counted in the metrics.
    pub(crate) fn reply_of(
        &self,
        s: &Started,
        results: &[KeyResult],
        timed_out: bool,
    ) -> v1::TransferReply {
        let copy_micros = s.submitted.elapsed().as_micros() as u64;
        let mut statuses = Vec::with_capacity(results.len());
        let mut errors = Vec::new();
        let mut ok = 0u64;
        for (i, res) in results.iter().enumerate() {
            statuses.push(key_status(res, timed_out) as u8);
            if res.is_ok() {
                ok += 1;
            }
            if let KeyResult::Failed(f) = res {
                errors.push(v1::KeyError {
                    index: i as u32,
                    kind: f.kind().name().into(),
                    message: f.to_string(),
                });
            }
        }
        let done = results.iter().filter(|r| **r == KeyResult::Done).count() as u64;
        let bytes = done * s.object_bytes;
        let m = match s.dir {
            umbp_copy::Direction::Store => &self.metrics.store,
            umbp_copy::Direction::Load => &self.metrics.load,
        };
        m.transfers.fetch_add(1, Ordering::Relaxed);
        m.keys_ok.fetch_add(ok, Ordering::Relaxed);
        m.keys_failed
            .fetch_add(results.len() as u64 - ok, Ordering::Relaxed);
        m.bytes.fetch_add(bytes, Ordering::Relaxed);
        let elapsed = s.received.elapsed();
        m.latency.observe(elapsed);
        v1::TransferReply {
            statuses,
            errors,
            bytes,
            server_micros: elapsed.as_micros() as u64,
            copy_micros,
        }
    }
}

#[tonic::async_trait]
impl Store for Service {
    async fn ping(&self, req: Request<v1::PingRequest>) -> Result<Response<v1::PingReply>, Status> {
        self.peer(&req)?;
        Ok(Response::new(v1::PingReply {
            boot_id: self.state.boot_id.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_ms: self.state.started.elapsed().as_millis() as u64,
        }))
    }

    async fn stats(
        &self,
        req: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsReply>, Status> {
        self.peer(&req)?;
        let s = &self.state;
        let p = s.store.stats().map_err(|e| self.store_err(e))?;
        let t = s.sessions.totals();
        let m = &s.metrics;
        Ok(Response::new(v1::StatsReply {
            boot_id: s.boot_id.clone(),
            capacity_bytes: p.capacity_bytes,
            used_bytes: p.used_bytes,
            objects: p.objects,
            hits: p.hits,
            misses: p.misses,
            evictions: p.evictions,
            puts: p.puts,
            duplicate_puts: p.duplicate_puts,
            gets: p.gets,
            bytes_in: p.bytes_in,
            bytes_out: p.bytes_out,
            reservations: p.reservations,
            pinned: p.pinned,
            sessions: s.sessions.len() as u64 + m.releasing.load(Ordering::Relaxed),
            registrations: t.registrations,
            layouts: t.layouts,
            transfers_in_flight: s.in_flight.load(Ordering::Relaxed),
            pending_descriptors: t.descriptors,
            stores: m.store.transfers.load(Ordering::Relaxed),
            loads: m.load.transfers.load(Ordering::Relaxed),
            store_bytes: m.store.bytes.load(Ordering::Relaxed),
            load_bytes: m.load.bytes.load(Ordering::Relaxed),
            metadata_bytes: p.metadata_bytes,
            placement: format!("{:?}", p.placement),
            cuda_imports: t.cuda_imports,
            channel_transfers: m.channel_transfers.load(Ordering::Relaxed),
            transfer_channels: m.channels_open.load(Ordering::Relaxed),
            remote: s.store.remote_stats().map(|r| v1::RemoteStats {
                lookup_keys: r.lookup_keys,
                hits: r.hits,
                misses: r.misses,
                corrupt: r.corrupt,
                timeouts: r.timeouts,
                skipped_lookups: r.skipped_lookups,
                bytes_fetched: r.bytes_fetched,
                writes: r.writes,
                bytes_written: r.bytes_written,
                writes_dropped: r.writes_dropped,
                writes_evicted: r.writes_evicted,
                errors: r.errors,
                connected: r.connected,
                backlog_bytes: r.backlog_bytes,
            }),
        }))
    }

    async fn clear(
        &self,
        req: Request<v1::ClearRequest>,
    ) -> Result<Response<v1::ClearReply>, Status> {
        let peer = self.peer(&req)?;
        let ns = req.into_inner().namespace;
        let store = Arc::clone(&self.state.store);
        let name = ns.clone();
        let clear = move || {
            if name.is_empty() {
                store.clear()
            } else {
                store.clear_namespace(&name)
            }
        };
        // With a remote tier a namespace's clear scans the remote store: off the runtime.
        let removed = if self.state.store.has_remote() {
            tokio::task::spawn_blocking(clear)
                .await
                .map_err(|e| status(ErrorKind::Internal, format!("the clear failed: {e}")))?
        } else {
            clear()
        }
        .map_err(|e| self.store_err(e))?;
        tracing::info!(pid = peer.pid, namespace = %ns, removed, "pool cleared");
        Ok(Response::new(v1::ClearReply { removed }))
    }

    async fn exists(
        &self,
        req: Request<v1::ExistsRequest>,
    ) -> Result<Response<v1::ExistsReply>, Status> {
        self.peer(&req)?;
        let t = Instant::now();
        let mut r = req.into_inner();
        let keys = LookupKeys::parse(&mut r).map_err(|s| self.refuse(s))?;
        let prefix_only = r.prefix_only;
        let (n, n_ranks) = (keys.blocks(), keys.n_ranks());
        let n_keys = n * n_ranks;
        let store = Arc::clone(&self.state.store);
        let answer = move || -> Result<v1::ExistsReply, StoreError> {
            Ok(if prefix_only {
                let mut prefix = n;
                // Every rank's remote fetch shares one deadline.
                let deadline = store.remote_deadline();
                for i in 0..n_ranks {
                    if prefix == 0 {
                        break;
                    }
                    let rank = keys.rank(i)?;
                    let hits = store.prefix_hits_until(prefix, |b| rank[b], deadline)?;
                    prefix = prefix.min(hits);
                }
                v1::ExistsReply {
                    present: Vec::new(),
                    prefix: prefix as u64,
                }
            } else {
                let mut present = vec![1u8; n];
                for i in 0..n_ranks {
                    let found = store.exists(&keys.rank(i)?)?;
                    for (p, f) in present.iter_mut().zip(found) {
                        *p &= f as u8;
                    }
                }
                let prefix = present.iter().take_while(|p| **p == 1).count() as u64;
                v1::ExistsReply { present, prefix }
            })
        };
        // With a remote tier a lookup may wait on the network: off the runtime's threads,
        // which serve every client's transfers.
        let reply = if self.state.store.has_remote() {
            tokio::task::spawn_blocking(answer)
                .await
                .map_err(|e| status(ErrorKind::Internal, format!("the lookup failed: {e}")))?
        } else {
            answer()
        }
        .map_err(|e| self.store_err(e))?;
        let m = &self.state.metrics;
        m.lookups.fetch_add(1, Ordering::Relaxed);
        m.lookup_keys.fetch_add(n_keys as u64, Ordering::Relaxed);
        m.lookup_latency.observe(t.elapsed());
        Ok(Response::new(reply))
    }

    async fn attach(
        &self,
        req: Request<v1::AttachRequest>,
    ) -> Result<Response<v1::AttachReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        if r.protocol != PROTOCOL {
            return Err(self.refuse(status(ErrorKind::Denied, format!(
                "the client speaks protocol {} and this server {PROTOCOL}; install the same UMBP version on both sides",
                r.protocol
            ))));
        }
        if self.state.draining.load(Ordering::Acquire) {
            return Err(status(
                ErrorKind::Unavailable,
                "the server is shutting down",
            ));
        }
        let on_conn = self.state.sessions.count_on(peer.conn);
        if on_conn >= crate::sessions::MAX_SESSIONS_PER_CONNECTION {
            return Err(self.refuse(status(
                ErrorKind::Denied,
                format!(
                "this connection has {on_conn} sessions attached, the most one may have; detach \
                 one (or use a connection per client) before attaching another"
            ),
            )));
        }
        let name = printable_name(&r.client_name);
        let cs = self
            .state
            .sessions
            .attach(peer, name)
            .map_err(|e| self.store_err(e))?;
        crate::pidwatch::watch(peer.pid, cs.id, Arc::clone(&self.state.sessions));
        Ok(Response::new(v1::AttachReply {
            session_id: cs.id,
            boot_id: self.state.boot_id.clone(),
            secret: cs.secret.to_vec(),
            fd_socket: self.state.endpoint.fd_socket().display().to_string(),
            version: env!("CARGO_PKG_VERSION").into(),
            protocol: PROTOCOL,
            max_message_bytes: self.state.max_message_bytes as u64,
        }))
    }

    async fn detach(
        &self,
        req: Request<v1::DetachRequest>,
    ) -> Result<Response<v1::DetachReply>, Status> {
        let peer = self.peer(&req)?;
        let id = req.into_inner().session_id;
        self.session(&peer, id)?;
        let sessions = Arc::clone(&self.state.sessions);
        // Released before the reply, so a client that detached knows its memory is free.
        let report = tokio::task::spawn_blocking(move || {
            sessions
                .take(id)
                .map(|cs| sessions.release_logged(&cs, EndReason::Detached))
        })
        .await
        .map_err(|e| status(ErrorKind::Internal, e.to_string()))?
        .unwrap_or_default();
        Ok(Response::new(v1::DetachReply {
            jobs_cancelled: report.jobs_cancelled as u64,
            regions_deregistered: report.regions_deregistered as u64,
        }))
    }

    async fn register_host_memory(
        &self,
        req: Request<v1::RegisterHostMemoryRequest>,
    ) -> Result<Response<v1::RegisterMemoryReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let fd = self.ticket(&cs, r.ticket)?;
        let len = r.length;
        let cs2 = Arc::clone(&cs);
        let out = tokio::task::spawn_blocking(move || -> Result<u64, Status> {
            use std::os::fd::AsFd;
            // A memfd checked to be sealed against shrinking (so the mapping can never fault);
            // huge-page memfds are refused: a hole punched in one while the host has no free
            // huge pages would fault the server on access.
            let mapping = umbp_pool::ServerMapping::map(fd.as_fd(), len).map_err(|e| {
                status(ErrorKind::Registration, format!("cannot map the shared memory: {e}"))
            })?;
            if mapping.is_hugetlb() {
                return Err(status(ErrorKind::Registration,
                    "the shared memory is a huge-page (hugetlbfs) memfd, which the server does not map: a hole punched in it could fault the server; share memory on normal or transparent huge pages",
                ));
            }
            // Pages the client never allocated would be allocated by the server's copies, and
            // charged to the server's memory: refused.
            if let Some(missing @ 1..) = pages_missing(mapping.addr(), mapping.len()) {
                return Err(status(ErrorKind::Registration, format!(
                    "the shared memory is not populated: {missing} of its {} pages do not exist (never allocated, or swapped out); allocate every page before registering (UMBP clients do: upgrade the client)",
                    mapping.len().div_ceil(umbp_pool::shared_fd::page_size())
                )));
            }
            // SAFETY: the mapping stays in place until this registration is gone: it is kept
            // with the session's backings and dropped only after deregistration.
            let id = unsafe { cs2.session.register_memory(mapping.addr(), mapping.len()) }
                .map_err(|e| status_of(&e))?;
            cs2.res.lock().backings.insert(id, Backing::Host(mapping));
            Ok(id)
        })
        .await
        .map_err(|e| status(ErrorKind::Internal, e.to_string()))?
        .map_err(|s| self.refuse(s))?;
        tracing::debug!(
            session = cs.id,
            region = out,
            bytes = len,
            "host memory registered"
        );
        Ok(Response::new(v1::RegisterMemoryReply {
            region_id: out,
            length: len,
        }))
    }

    async fn register_completion_page(
        &self,
        req: Request<v1::RegisterCompletionPageRequest>,
    ) -> Result<Response<v1::RegisterCompletionPageReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let fd = self.ticket(&cs, r.ticket)?;
        use std::os::fd::AsFd;
        let page = CompletionMapping::map(fd.as_fd(), r.length)
            .map_err(|m| self.refuse(status(ErrorKind::InvalidArgument, m)))?;
        let slots = page.page.slots();
        cs.res.lock().completions = Some(Arc::new(page));
        tracing::debug!(session = cs.id, slots, "completion page registered");
        Ok(Response::new(v1::RegisterCompletionPageReply { slots }))
    }

    async fn register_cuda_ipc(
        &self,
        req: Request<v1::RegisterCudaIpcRequest>,
    ) -> Result<Response<v1::RegisterMemoryReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let st = Arc::clone(&self.state);
        tokio::task::spawn_blocking(move || crate::memory::register_ipc(&st, &cs, r))
            .await
            .map_err(|e| status(ErrorKind::Internal, e.to_string()))?
            .map(Response::new)
            .map_err(|s| self.refuse(s))
    }

    async fn register_cuda_vmm(
        &self,
        req: Request<v1::RegisterCudaVmmRequest>,
    ) -> Result<Response<v1::RegisterMemoryReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let st = Arc::clone(&self.state);
        tokio::task::spawn_blocking(move || crate::memory::register_vmm(&st, &cs, r))
            .await
            .map_err(|e| status(ErrorKind::Internal, e.to_string()))?
            .map(Response::new)
            .map_err(|s| self.refuse(s))
    }

    async fn deregister_memory(
        &self,
        req: Request<v1::DeregisterMemoryRequest>,
    ) -> Result<Response<v1::DeregisterMemoryReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let id = r.region_id;
        tokio::task::spawn_blocking(move || -> Result<(), Status> {
            cs.session
                .deregister_memory(id)
                .map_err(|e| status_of(&e))?;
            let backing = cs.res.lock().backings.remove(&id);
            drop(backing);
            Ok(())
        })
        .await
        .map_err(|e| status(ErrorKind::Internal, e.to_string()))?
        .map_err(|s| self.refuse(s))?;
        Ok(Response::new(v1::DeregisterMemoryReply {}))
    }

    async fn register_layout(
        &self,
        req: Request<v1::RegisterLayoutRequest>,
    ) -> Result<Response<v1::RegisterLayoutReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        if r.groups.is_empty() {
            return Err(self.refuse(invalid("a layout needs at least one group")));
        }
        let groups: Vec<Vec<RelativeLayer>> = r
            .groups
            .iter()
            .map(|g| {
                g.runs
                    .iter()
                    .map(|run| RelativeLayer {
                        base: RegionOffset {
                            region: run.region_id,
                            offset: run.offset,
                        },
                        num_blocks: run.num_blocks,
                        block_stride: run.block_stride,
                        block_bytes: run.block_bytes,
                    })
                    .collect()
            })
            .collect();
        if let Some(run) = r
            .groups
            .iter()
            .flat_map(|g| &g.runs)
            .find(|run| run.num_blocks > umbp_core::MAX_RUN_BLOCKS)
        {
            return Err(self.refuse(invalid(format!(
                "runs of {} blocks; a run may have at most {}",
                run.num_blocks,
                umbp_core::MAX_RUN_BLOCKS
            ))));
        }
        let runs: usize = groups.iter().map(Vec::len).sum();
        if runs > umbp_core::MAX_LAYOUT_RUNS {
            return Err(self.refuse(invalid(format!(
                "a layout of {runs} runs; a layout may have at most {}",
                umbp_core::MAX_LAYOUT_RUNS
            ))));
        }
        // Checking a layout of many runs takes milliseconds: off the runtime's threads, which
        // serve every client (and the shutdown signal).
        let session = Arc::clone(&cs);
        let checked = tokio::task::spawn_blocking(move || {
            let id = session.session.register_relative_layout(groups)?;
            let layout = session.session.layout(id)?;
            Ok::<_, StoreError>((
                id,
                layout.groups().iter().map(|g| g.object_bytes()).collect(),
            ))
        })
        .await
        .map_err(|e| status(ErrorKind::Internal, format!("the layout check failed: {e}")))?;
        let (id, object_bytes) = checked.map_err(|e| self.store_err(e))?;
        Ok(Response::new(v1::RegisterLayoutReply {
            layout_id: id,
            object_bytes,
        }))
    }

    async fn transfer(
        &self,
        req: Request<v1::TransferRequest>,
    ) -> Result<Response<v1::TransferReply>, Status> {
        let t = Instant::now();
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        self.refuse_if_draining()?;
        let cs = self.session(&peer, r.session_id)?;
        let started = self.start_transfer(&cs, &r, t)?;
        let st = &self.state;
        let job = started.job.clone();
        st.in_flight.fetch_add(1, Ordering::Relaxed);
        let _counted = InFlight(&st.in_flight);
        let _named = (r.transfer_id != 0).then(|| {
            cs.transfers.lock().insert(r.transfer_id, job.clone());
            Named(&cs, r.transfer_id)
        });
        let mut guard = CancelOnDrop(Some(job.clone()));
        let timeout = if r.timeout_ms == 0 {
            st.store.timeout()
        } else {
            Duration::from_millis(r.timeout_ms as u64)
        };
        let (results, timed_out) = match tokio::time::timeout(timeout, job.finished()).await {
            Ok(res) => (res, false),
            Err(_) => {
                job.cancel();
                match tokio::time::timeout(STOP_GRACE, job.finished()).await {
                    Ok(res) => (res, true),
                    Err(_) => {
                        guard.0 = None;
                        return Err(status(ErrorKind::TransferFailed, format!(
                            "the transfer did not finish within {} ms nor stop {} s after it was cancelled; its memory may still be written",
                            timeout.as_millis(),
                            STOP_GRACE.as_secs()
                        )));
                    }
                }
            }
        };
        guard.0 = None;
        Ok(Response::new(st.reply_of(&started, &results, timed_out)))
    }

    async fn cancel_transfer(
        &self,
        req: Request<v1::CancelTransferRequest>,
    ) -> Result<Response<v1::CancelTransferReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let cs = self.session(&peer, r.session_id)?;
        let job = cs.transfers.lock().get(&r.transfer_id).cloned();
        if let Some(j) = &job {
            j.cancel();
        }
        Ok(Response::new(v1::CancelTransferReply {
            found: job.is_some(),
        }))
    }
}

impl From<CoreError> for crate::ServerError {
    fn from(e: CoreError) -> Self {
        crate::ServerError::Config(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_their_text_and_lose_their_control_characters() {
        assert_eq!(printable_name("vllm-engine é"), "vllm-engine é");
        assert_eq!(
            printable_name("x\nINFO forged\r\u{1b}[31m"),
            "x\\nINFO forged\\r\\u{1b}[31m"
        );
        assert_eq!(printable_name(&"a".repeat(500)).len(), 128);
    }
}
