//! Client sessions: what each attached client owns in the server, bound to its connection and
//! its process.
//!
//! A session is opened by `Attach` on one connection and is usable only from that connection.
//! It ends when the client detaches, when its connection closes (a killed process's sockets
//! are closed by the kernel), or when its process exits (watched through a pidfd, which also
//! catches a process whose connection lives on in a forked child). Nothing depends on pings.
//! Ending a session releases, at once and off the request threads: its transfers (cancelled
//! and waited for), its layouts, its registrations, the server's mappings of its memory (memfd
//! mappings unmapped, CUDA IPC handles closed) and descriptors it sent but never used.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use umbp_copy::RegionId;
use umbp_cuda::{ImportedIpc, ImportedVmm};
use umbp_pool::ServerMapping;
use umbp_proto::completion::{CompletionPage, MAX_PAGE_BYTES, SLOT_BYTES};
use umbp_proto::SECRET_BYTES;
use umbp_store::{EmbeddedStore, Session, SessionRelease};

use crate::budget::Charge;
use crate::listen::PeerInfo;
use crate::metrics::Metrics;

/// A client's CUDA allocation opened here by its legacy IPC handle.
#[derive(Debug)]
pub(crate) struct IpcImport(pub(crate) ImportedIpc);

/// CUDA memory of a client mapped into the server (held for its `Drop`, which unmaps it).
#[derive(Debug)]
#[allow(dead_code)]
pub(crate) enum CudaBacking {
    /// Part of an allocation opened by IPC handle (shared by the session's registrations in
    /// it: the allocation is opened once per session).
    Ipc(Arc<IpcImport>),
    /// Physical allocations of the client mapped here.
    Vmm(ImportedVmm),
}

/// Descriptors one session may have sent over the side channel and not yet named in a
/// registration: 1,024 (a client sends one per registration, right before it).
pub(crate) const MAX_PENDING_DESCRIPTORS: usize = 1024;
/// Sessions one connection may have attached at once: 64 (a client attaches one; each holds a
/// pidfd and a pool session).
pub(crate) const MAX_SESSIONS_PER_CONNECTION: usize = 64;

/// What a registration of a session is backed by in the server (held for its `Drop`, which
/// unmaps it once the registration is gone).
#[derive(Debug)]
#[allow(dead_code)]
pub(crate) enum Backing {
    /// A client's memfd mapped here.
    Host(ServerMapping),
    /// CUDA memory of the client opened here.
    Cuda(CudaBacking),
}

/// What a session holds besides the store's session.
#[derive(Debug, Default)]
pub(crate) struct Resources {
    /// The server-side memory behind each registration.
    pub(crate) backings: HashMap<RegionId, Backing>,
    /// Descriptors received on the side channel and not yet used, by ticket, each with its
    /// charge to the client's descriptor budget.
    pub(crate) tickets: HashMap<u64, (OwnedFd, Charge)>,
    /// CUDA IPC imports of this session by handle: one allocation is opened once per session.
    pub(crate) ipc: HashMap<[u8; 64], std::sync::Weak<IpcImport>>,
    /// The client's completion page, when it registered one (transfers still running hold it
    /// too, so it stays mapped until their last write).
    pub(crate) completions: Option<Arc<CompletionMapping>>,
    /// The session's live transfer channels (a token and a duplicate of the socket, shut
    /// down at release; removed when the channel ends).
    pub(crate) channels: Vec<(u64, OwnedFd)>,
}

/// A client's completion page mapped in the server (see [`umbp_proto::completion`]).
#[derive(Debug)]
pub(crate) struct CompletionMapping {
    /// The page, owning its mapping.
    pub(crate) page: CompletionPage,
}

impl CompletionMapping {
    /// Maps `len` bytes of the client's sealed memfd `fd` as a completion page.
    pub(crate) fn map(fd: std::os::fd::BorrowedFd<'_>, len: u64) -> Result<Self, String> {
        let page = umbp_unix::clock::page_size().max(SLOT_BYTES);
        if len == 0 || len > MAX_PAGE_BYTES || !len.is_multiple_of(page) {
            return Err(format!(
                "a completion page of {len} bytes; give a multiple of the page size ({page} bytes), at most {MAX_PAGE_BYTES}"
            ));
        }
        let mapping = ServerMapping::map(fd, len)
            .map_err(|e| format!("cannot map the completion page: {e}"))?;
        if mapping.is_hugetlb() {
            return Err(
                "the completion page is a huge-page (hugetlbfs) memfd; use a normal memfd".into(),
            );
        }
        // The memfd was checked to be sealed against shrinking: no access to the page faults.
        let page = CompletionPage::new(mapping.into_mapping()).map_err(|e| e.to_string())?;
        Ok(CompletionMapping { page })
    }
}

/// One attached client.
#[derive(Debug)]
pub(crate) struct ClientSession {
    pub(crate) id: u64,
    pub(crate) peer: PeerInfo,
    pub(crate) name: String,
    pub(crate) secret: [u8; SECRET_BYTES],
    pub(crate) session: Session,
    pub(crate) res: Mutex<Resources>,
    pub(crate) attached: Instant,
    /// Transfers in flight that the client named, by its transfer id.
    pub(crate) transfers: Mutex<HashMap<u64, umbp_copy::JobHandle>>,
    /// Notified once when the session is released (stops its process watcher).
    pub(crate) ended: tokio::sync::Notify,
    /// Set when its release begins (a transfer channel opened after that ends at once).
    pub(crate) released: std::sync::atomic::AtomicBool,
    next_ticket: AtomicU64,
    /// The session's pidfd, charged to the client's descriptor budget.
    _fds: Charge,
}

impl ClientSession {
    /// Keeps descriptors from the side channel and returns their tickets; refuses (and closes
    /// them) when the session would hold more than [`MAX_PENDING_DESCRIPTORS`] unused.
    pub(crate) fn add_tickets(
        &self,
        fds: Vec<OwnedFd>,
        mut charge: Charge,
    ) -> Result<Vec<u64>, String> {
        let mut res = self.res.lock();
        if res.tickets.len() + fds.len() > MAX_PENDING_DESCRIPTORS {
            return Err(format!(
                "session {} holds {} descriptors not yet named in a registration; at most \
                 {MAX_PENDING_DESCRIPTORS} may wait: register the ones sent before sending more",
                self.id,
                res.tickets.len()
            ));
        }
        Ok(fds
            .into_iter()
            .map(|fd| {
                let t = self.next_ticket.fetch_add(1, Ordering::Relaxed);
                res.tickets.insert(t, (fd, charge.split(1)));
                t
            })
            .collect())
    }

    /// A new token naming one of the session's transfer channels.
    pub(crate) fn next_channel_token(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the descriptor of `ticket` (each ticket is used once), with its charge (release
    /// it when the descriptor is closed).
    pub(crate) fn take_ticket(&self, ticket: u64) -> Option<(OwnedFd, Charge)> {
        self.res.lock().tickets.remove(&ticket)
    }

    /// Releases everything (see the module docs) and reports it. Blocks up to the store's
    /// timeout for transfers still copying; call it off the async threads.
    fn release(&self) -> SessionRelease {
        self.ended.notify_one();
        self.released.store(true, Ordering::Release);
        // Its transfer channels end now: no new transfer can arrive on them.
        for (_, fd) in std::mem::take(&mut self.res.lock().channels) {
            let _ = umbp_unix::socket::shutdown(&fd);
        }
        let report = self.session.release_now();
        let mut res = std::mem::take(&mut *self.res.lock());
        for id in &report.regions_kept {
            // Still used by a transfer that did not stop in time: its memory must stay
            // mapped (a copy may still write it), so the mapping is left in place.
            if let Some(b) = res.backings.remove(id) {
                tracing::error!(
                    session = self.id,
                    region = id,
                    "a registration stayed in use past the timeout; its mapping is kept"
                );
                std::mem::forget(b);
            }
        }
        drop(res);
        report
    }
}

/// Every session of the server.
#[derive(Debug)]
pub(crate) struct Sessions {
    store: Arc<EmbeddedStore>,
    metrics: Arc<Metrics>,
    by_id: Mutex<HashMap<u64, Arc<ClientSession>>>,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum EndReason {
    Detached,
    ConnectionClosed,
    ProcessExited,
    ServerStopping,
}

impl Sessions {
    pub(crate) fn new(store: Arc<EmbeddedStore>, metrics: Arc<Metrics>) -> Self {
        Sessions {
            store,
            metrics,
            by_id: Mutex::new(HashMap::new()),
        }
    }

    /// Sessions attached on connection `conn`.
    pub(crate) fn count_on(&self, conn: u64) -> usize {
        self.by_id
            .lock()
            .values()
            .filter(|s| s.peer.conn == conn)
            .count()
    }

    /// Opens a session for the client at `peer`.
    pub(crate) fn attach(
        &self,
        peer: PeerInfo,
        name: String,
        fds: Charge,
    ) -> Result<Arc<ClientSession>, umbp_store::StoreError> {
        let session = self.store.open_session()?;
        let cs = Arc::new(ClientSession {
            id: session.id(),
            peer,
            name,
            secret: random_bytes(),
            session,
            res: Mutex::new(Resources::default()),
            attached: Instant::now(),
            ended: tokio::sync::Notify::new(),
            released: std::sync::atomic::AtomicBool::new(false),
            transfers: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
            _fds: fds,
        });
        self.by_id.lock().insert(cs.id, Arc::clone(&cs));
        self.metrics
            .sessions_attached
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = cs.id,
            pid = peer.pid,
            uid = peer.uid,
            conn = peer.conn,
            client = %cs.name,
            "session attached"
        );
        Ok(cs)
    }

    /// The session `id` if it is attached on connection `conn`.
    pub(crate) fn get(&self, id: u64, conn: u64) -> Option<Arc<ClientSession>> {
        self.by_id
            .lock()
            .get(&id)
            .filter(|s| s.peer.conn == conn)
            .cloned()
    }

    /// The session `id`, from any connection (the side channel checks the secret instead).
    pub(crate) fn get_any(&self, id: u64) -> Option<Arc<ClientSession>> {
        self.by_id.lock().get(&id).cloned()
    }

    /// Removes session `id` from the table (its caller releases it).
    pub(crate) fn take(&self, id: u64) -> Option<Arc<ClientSession>> {
        self.by_id.lock().remove(&id)
    }

    /// Ends session `id` now: it disappears from the table at once and is released on a
    /// blocking thread. Returns whether it was attached.
    pub(crate) fn end(self: &Arc<Self>, id: u64, why: EndReason) -> Option<Arc<ClientSession>> {
        let cs = self.by_id.lock().remove(&id)?;
        self.release_in_background(Arc::clone(&cs), why);
        Some(cs)
    }

    /// Ends every session of connection `conn`.
    pub(crate) fn end_connection(self: &Arc<Self>, conn: u64) {
        let ended: Vec<Arc<ClientSession>> = {
            let mut m = self.by_id.lock();
            let ids: Vec<u64> = m
                .values()
                .filter(|s| s.peer.conn == conn)
                .map(|s| s.id)
                .collect();
            ids.iter().filter_map(|id| m.remove(id)).collect()
        };
        for cs in ended {
            self.release_in_background(cs, EndReason::ConnectionClosed);
        }
    }

    /// Ends every session and waits for the releases (the server is stopping).
    pub(crate) fn end_all(&self) {
        let all: Vec<Arc<ClientSession>> = self.by_id.lock().drain().map(|(_, s)| s).collect();
        for cs in all {
            self.release_logged(&cs, EndReason::ServerStopping);
        }
    }

    fn release_in_background(self: &Arc<Self>, cs: Arc<ClientSession>, why: EndReason) {
        self.metrics.releasing.fetch_add(1, Ordering::Relaxed);
        let me = Arc::clone(self);
        let run = move || {
            me.release_logged(&cs, why);
            me.metrics.releasing.fetch_sub(1, Ordering::Relaxed);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(run);
            }
            Err(_) => {
                if let Err(e) = std::thread::Builder::new()
                    .name("umbp-release".into())
                    .spawn(run)
                {
                    tracing::error!("cannot start a thread to release a session: {e}");
                }
            }
        }
    }

    /// Releases `cs` on this thread (blocking up to the store's timeout) and logs it.
    pub(crate) fn release_logged(&self, cs: &ClientSession, why: EndReason) -> SessionRelease {
        let t = Instant::now();
        let r = cs.release();
        self.metrics
            .sessions_released
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = cs.id,
            pid = cs.peer.pid,
            client = %cs.name,
            reason = ?why,
            attached_s = cs.attached.elapsed().as_secs(),
            jobs_cancelled = r.jobs_cancelled,
            jobs_unfinished = r.jobs_unfinished,
            layouts = r.layouts_dropped,
            regions = r.regions_deregistered,
            regions_kept = r.regions_kept.len(),
            took_ms = t.elapsed().as_millis() as u64,
            "session released"
        );
        r
    }

    /// Attached sessions.
    pub(crate) fn len(&self) -> usize {
        self.by_id.lock().len()
    }

    /// Registrations, layouts, in-flight transfers and unused descriptors over every session.
    pub(crate) fn totals(&self) -> Totals {
        let m = self.by_id.lock();
        let mut t = Totals::default();
        for s in m.values() {
            t.registrations += s.session.regions().len() as u64;
            t.layouts += s.session.layouts().len() as u64;
            t.jobs += s.session.jobs_in_flight() as u64;
            let r = s.res.lock();
            t.descriptors += r.tickets.len() as u64;
            t.cuda_imports += r
                .backings
                .values()
                .filter(|b| matches!(b, Backing::Cuda(_)))
                .count() as u64;
        }
        t
    }
}

/// Sums over the attached sessions.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub(crate) registrations: u64,
    pub(crate) layouts: u64,
    pub(crate) jobs: u64,
    pub(crate) descriptors: u64,
    pub(crate) cuda_imports: u64,
}

/// 16 random bytes from the kernel.
pub(crate) fn random_bytes() -> [u8; 16] {
    let mut b = [0u8; 16];
    // getrandom only fails for bad arguments (or a kernel before 3.17, which nothing of this
    // server runs on).
    umbp_unix::process::fill_random(&mut b).expect("getrandom");
    b
}
