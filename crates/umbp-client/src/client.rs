//! The client itself: [`StandaloneClient`] and its shared state, connecting, the checks
//! before every call, the calls that need no session (ping, stats, clear) and closing.

use std::mem::ManuallyDrop;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tonic::transport::Channel;
use tonic::Status;
use umbp_proto::v1::{self, store_client::StoreClient, StatsReply as ServerStats};

use crate::attach::state::AttachState;
use crate::completions::Completions;
use crate::error::{ClientError, Result};
use crate::eta::TransferEta;
use crate::options::ClientOptions;
use crate::peer;
use crate::register::records::Records;
use crate::rpc::{self, CurrentSocket};
use crate::transfer::FailureLog;

/// What every handle of a client shares.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) opts: ClientOptions,
    /// Shut down by [`Inner`]'s drop (see there).
    rt: ManuallyDrop<Runtime>,
    pub(crate) grpc: StoreClient<Channel>,
    pub(crate) pid: u32,
    /// The session, and attaching again when it is gone.
    pub(crate) attach: AttachState,
    pub(crate) records: Mutex<Records>,
    pub(crate) next_transfer: AtomicU64,
    pub(crate) closed: AtomicBool,
    /// Lookups / transfers past their deadline and still unanswered.
    pub(crate) stalled_lookups: Arc<AtomicU64>,
    pub(crate) stalled_transfers: Arc<AtomicU64>,
    socket: CurrentSocket,
    /// The completion page (None where it could not be made: replies only).
    pub(crate) completions: Option<Arc<Completions>>,
    /// How long transfers take, so that callers are awake when their answer comes.
    pub(crate) eta: TransferEta,
    /// Transfers that failed as a whole, logged at most once in a while.
    pub(crate) transfer_failures: FailureLog,
}

impl Inner {
    pub(crate) fn rt(&self) -> &Runtime {
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
            if let Some(ch) = self.attach.take_mut().and_then(|a| a.channel) {
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
    pub(crate) inner: Arc<Inner>,
}

impl StandaloneClient {
    /// Connects to the server at `opts.endpoint`, waiting up to `opts.startup_timeout` for
    /// it to answer, and attaches.
    pub fn connect(opts: ClientOptions) -> Result<Self> {
        let rt = rpc::runtime()?;
        let socket = CurrentSocket::default();
        let grpc = rpc::store_client(&rt, &opts, &socket);
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
                attach: AttachState::default(),
                records: Mutex::new(Records::default()),
                next_transfer: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                stalled_lookups: Arc::new(AtomicU64::new(0)),
                stalled_transfers: Arc::new(AtomicU64::new(0)),
                socket,
                completions,
                eta: TransferEta::default(),
                transfer_failures: FailureLog::default(),
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

    pub(crate) fn check(&self) -> Result<()> {
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

    /// Runs one RPC with a deadline; a failure that means the session is gone forgets it.
    pub(crate) fn call<T, F, Fut>(&self, name: &'static str, timeout: Duration, f: F) -> Result<T>
    where
        F: FnOnce(StoreClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, Status>>,
    {
        self.check()?;
        rpc::call(
            self.inner.rt(),
            &self.inner.grpc,
            &self.inner.opts.endpoint,
            name,
            timeout,
            f,
            || self.lost(),
        )
    }

    fn ping_once(&self, timeout: Duration) -> Result<v1::PingReply> {
        self.call("ping", timeout, |mut g| async move {
            g.ping(v1::PingRequest {}).await
        })
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
        let attachment = self.inner.attach.take();
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
        rpc::shut_down(&self.inner.socket);
    }
}
