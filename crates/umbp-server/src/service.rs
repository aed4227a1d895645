//! The gRPC service: every request checked against its caller (uid, connection, session)
//! before anything is touched, then answered by the shared store.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use umbp_core::{ErrorKind, PinOutcome};
use umbp_proto::errors::status;
use umbp_proto::v1::{self, store_server::Store};
use umbp_proto::PROTOCOL;
use umbp_store::{RegionOffset, RelativeLayer, StoreError};

use crate::listen::PeerInfo;
use crate::lookup::LookupKeys;
use crate::refusal::{invalid, status_of};
use crate::sessions::{Backing, ClientSession, CompletionMapping, EndReason};
use crate::state::State;
use crate::transfer::{self, CancelOnDrop};

/// The longest one pin may last: 24 h (a holder renews it to keep it longer).
const MAX_PIN_MS: u64 = 24 * 3_600_000;

/// The `umbp.v1.Store` service.
#[derive(Debug, Clone)]
pub(crate) struct Service {
    pub(crate) state: Arc<State>,
}

/// How many pages of the server's mapping `[addr, addr + len)` of client memory are not in
/// memory (`mincore`): pages the client never allocated (or that were swapped out), which the
/// server's copies would allocate and have charged to the server. None when the kernel cannot
/// tell.
fn pages_missing(addr: u64, len: u64) -> Option<usize> {
    let page = umbp_unix::clock::page_size();
    let mut v = vec![0u8; len.div_ceil(page) as usize];
    // SAFETY: `[addr, addr + len)` is the server's live mapping of the memfd, page-aligned;
    // mincore writes one byte per page into `v`, which has one per page.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, v.as_mut_ptr()) };
    (rc == 0).then(|| v.iter().filter(|b| **b & 1 == 0).count())
}

/// A client's name as the logs and `stats` show it: control characters escaped (a newline
/// in a name must not forge a log line), and so are the invisible characters that reorder or
/// hide text (bidirectional overrides such as U+202E, zero-width characters, line and
/// paragraph separators), at most 128 characters.
fn printable_name(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_control() || invisible(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.chars().take(128).collect()
}

/// Characters that change how the text around them shows without showing themselves.
fn invisible(c: char) -> bool {
    matches!(c,
        '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}' | '\u{2060}'..='\u{2069}'
        | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}')
}

impl Service {
    fn refuse(&self, s: Status) -> Status {
        self.state.refuse(s)
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
        if let Some(short) = p.refused {
            return Err(self.refuse(status(
                ErrorKind::Resource,
                format!("this connection got no descriptor budget and is closed: {short}"),
            )));
        }
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
    fn ticket(
        &self,
        cs: &ClientSession,
        ticket: u64,
    ) -> Result<(std::os::fd::OwnedFd, crate::budget::Charge), Status> {
        cs.take_ticket(ticket).ok_or_else(|| {
            self.refuse(status(ErrorKind::NotFound, format!(
                "descriptor ticket {ticket} is unknown to session {} (send the memfd over the side channel first; each ticket is used once)",
                cs.id
            )))
        })
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
        let mut reply = v1::StatsReply {
            boot_id: s.boot_id.clone(),
            sessions: s.sessions.len() as u64 + m.releasing.load(Ordering::Relaxed),
            registrations: t.registrations,
            layouts: t.layouts,
            transfers_in_flight: s.in_flight.load(Ordering::Relaxed),
            pending_descriptors: t.descriptors,
            stores: m.store.transfers.load(Ordering::Relaxed),
            loads: m.load.transfers.load(Ordering::Relaxed),
            store_bytes: m.store.bytes.load(Ordering::Relaxed),
            load_bytes: m.load.bytes.load(Ordering::Relaxed),
            placement: format!("{:?}", p.placement),
            integrity: p.integrity.as_str().to_owned(),
            integrity_sample_every: u64::from(p.integrity.verify_every()),
            cuda_imports: t.cuda_imports,
            channel_transfers: m.channel_transfers.load(Ordering::Relaxed),
            transfer_channels: m.channels_open.load(Ordering::Relaxed),
            disk: s.store.disk_stats().map(|d| v1::DiskStats {
                counters: umbp_proto::counters::to_wire(&d),
            }),
            remote: s.store.remote_stats().map(|r| v1::RemoteStats {
                counters: umbp_proto::counters::to_wire(&r),
            }),
            pins: Some(v1::PinStats {
                counters: umbp_proto::counters::to_wire(&s.store.pin_stats()),
            }),
            ..Default::default()
        };
        umbp_proto::counters::set_pool_counters(&mut reply, &p.counters);
        Ok(Response::new(reply))
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
        let peer = self.peer(&req)?;
        let t = Instant::now();
        let mut r = req.into_inner();
        let keys = LookupKeys::parse(&mut r).map_err(|s| self.refuse(s))?;
        let (prefix_only, peek) = (r.prefix_only, r.peek);
        let (n, n_ranks) = (keys.blocks(), keys.n_ranks());
        let n_keys = n * n_ranks;
        let store = Arc::clone(&self.state.store);
        let answer = move || -> Result<v1::ExistsReply, StoreError> {
            Ok(if peek {
                let mut present = vec![1u8; n];
                for i in 0..n_ranks {
                    for (p, f) in present.iter_mut().zip(store.holds(&keys.rank(i)?)?) {
                        *p &= f as u8;
                    }
                }
                let prefix = present.iter().take_while(|p| **p == 1).count() as u64;
                if prefix_only {
                    present.clear();
                }
                v1::ExistsReply { present, prefix }
            } else if prefix_only {
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
        // On the lookup threads, in this connection's turn (`lookup_pool`): never on the
        // runtime's threads, which answer every client's pings and transfers.
        let reply = self
            .state
            .lookups
            .run(peer.conn, answer)
            .await?
            .map_err(|e| self.store_err(e))?;
        let m = &self.state.metrics;
        m.lookups.fetch_add(1, Ordering::Relaxed);
        m.lookup_keys.fetch_add(n_keys as u64, Ordering::Relaxed);
        m.lookup_latency.observe(t.elapsed());
        Ok(Response::new(reply))
    }

    async fn pins(&self, req: Request<v1::PinsRequest>) -> Result<Response<v1::PinsReply>, Status> {
        self.peer(&req)?;
        let namespaces = self
            .state
            .store
            .pins_by_namespace()
            .into_iter()
            .map(|p| v1::NamespacePins {
                namespace_id: p.namespace_id.to_vec(),
                objects: p.objects,
                bytes: p.bytes,
                soonest_ms: p.soonest_ms,
                latest_ms: p.latest_ms,
            })
            .collect();
        Ok(Response::new(v1::PinsReply { namespaces }))
    }

    async fn pin(&self, req: Request<v1::PinRequest>) -> Result<Response<v1::PinReply>, Status> {
        let peer = self.peer(&req)?;
        let r = req.into_inner();
        let mut blocks = r
            .blocks
            .ok_or_else(|| self.refuse(status(ErrorKind::InvalidArgument, "blocks are missing")))?;
        let keys = LookupKeys::parse(&mut blocks).map_err(|s| self.refuse(s))?;
        if !r.unpin && !(1..=MAX_PIN_MS).contains(&r.ttl_ms) {
            return Err(self.refuse(status(
                ErrorKind::InvalidArgument,
                format!(
                    "ttl_ms {} is out of range: a pin lasts 1 ms to {} h; renew it to keep it longer",
                    r.ttl_ms,
                    MAX_PIN_MS / 3_600_000
                ),
            )));
        }
        let (n_ranks, unpin, ttl) = (keys.n_ranks(), r.unpin, Duration::from_millis(r.ttl_ms));
        let store = Arc::clone(&self.state.store);
        let answer = move || -> Result<v1::PinReply, StoreError> {
            let mut reply = v1::PinReply::default();
            for i in 0..n_ranks {
                let rank = keys.rank(i)?;
                if unpin {
                    reply.released += store.unpin(&rank)?;
                } else {
                    let got = store.pin(&rank, ttl)?;
                    reply.outcomes.extend(got.into_iter().map(PinOutcome::code));
                }
            }
            Ok(reply)
        };
        // On the lookup threads, as lookups are: it takes the index shards' locks.
        let reply = self
            .state
            .lookups
            .run(peer.conn, answer)
            .await?
            .map_err(|e| self.store_err(e))?;
        tracing::debug!(pid = peer.pid, unpin, released = reply.released, "pin");
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
        // The session's pidfd: waits while the server's descriptors are spent by others.
        let fds = self.state.budget.take(peer.uid, 1).await.map_err(|short| {
            self.refuse(status(
                ErrorKind::Resource,
                format!("cannot attach: {short}"),
            ))
        })?;
        let name = printable_name(&r.client_name);
        let cs = self
            .state
            .sessions
            .attach(peer, name, fds)
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
        // The charge outlives the descriptor (closed at the end of the blocking job).
        let (fd, _fd_charge) = self.ticket(&cs, r.ticket)?;
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
                    mapping.len().div_ceil(umbp_unix::clock::page_size())
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
        let (fd, _fd_charge) = self.ticket(&cs, r.ticket)?;
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
        let cs = self.session(&peer, r.session_id)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = transfer::run(
            &self.state,
            &cs,
            &r,
            t,
            &tokio::runtime::Handle::current(),
            move |outcome| {
                let _ = tx.send(outcome);
            },
        )?;
        // The call dropped before the answer (the client went away or cancelled it): the
        // transfer stops.
        let mut guard = CancelOnDrop(Some(job));
        let outcome = rx.await.unwrap_or_else(|_| {
            Err(status(
                ErrorKind::Internal,
                "the transfer ended without an answer",
            ))
        });
        guard.0 = None;
        outcome.map(Response::new)
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
        // A right-to-left override would show "vllm-\u{202e}gnp.exe" as "vllm-exe.png".
        assert_eq!(
            printable_name("vllm-\u{202e}gnp.exe\u{200b}\u{2066}"),
            "vllm-\\u{202e}gnp.exe\\u{200b}\\u{2066}"
        );
    }
}
