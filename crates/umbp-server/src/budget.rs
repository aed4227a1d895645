//! Descriptor budgets: every descriptor the server holds for a client (its connections, a
//! session's pidfd, descriptors sent and not yet registered, transfer channels) is charged to
//! the client's uid and to the server's total at once, so that no uid can take what the others
//! need, and the server never runs out of descriptors of its own (`EMFILE` would stop it
//! accepting anyone).
//!
//! - **Total**: the process's descriptor limit (`RLIMIT_NOFILE`, raised to its hard limit at
//!   start) less a reserve for the server's own files (listeners, disk segments, the metrics
//!   port, the remote tier). While it is spent, the listeners stop accepting (connections
//!   queue in the kernel's backlog) and requests that need a descriptor wait, up to
//!   [`QUEUE_WAIT`], for one to be released.
//! - **Per uid**: at most `--max-fds-per-uid` (half the total by default). A uid at its limit
//!   is refused at once, with a message that names the limit: it is the one holding them.
//!
//! Connections that have sent nothing yet are registered in [`Handshakes`]: each loses its
//! slot after [`HANDSHAKE_DEADLINE`], and sooner, after [`EVICT_GRACE`], when its uid (or the
//! total) needs the slot for a connection that did send.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a connection may take to send its first bytes (gRPC's preface, the side
/// channel's header) before it is closed: 2 s. Clients send at once after connecting.
pub(crate) const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(2);
/// A connection silent this long loses its slot at once when its uid, or the server, needs
/// a descriptor for a connection that did send: 250 ms.
pub(crate) const EVICT_GRACE: Duration = Duration::from_millis(250);
/// How long a request that needs descriptors waits for the total budget to have room before
/// it is refused: 10 s.
pub(crate) const QUEUE_WAIT: Duration = Duration::from_secs(10);
/// Descriptors kept out of the client budget for the server's own use, besides its disk
/// segments: 512 (connections waiting for their budget and refused ones come out of it).
pub(crate) const RESERVE: usize = 512;

/// Which budget a request found short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Short {
    /// The caller's uid holds `held` of its `max`.
    Uid { uid: u32, held: usize, max: usize },
    /// All clients together hold `held` of `max`.
    Total { held: usize, max: usize },
}

impl std::fmt::Display for Short {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Short::Uid { uid, held, max } => write!(
                f,
                "uid {uid} holds {held} of the {max} descriptors one uid may hold in the server \
                 (--max-fds-per-uid): its connections, sessions, descriptors sent and not yet \
                 registered, and transfer channels; close some, or raise the limit"
            ),
            Short::Total { held, max } => write!(
                f,
                "the server's clients hold {held} of the {max} descriptors it has for them \
                 (RLIMIT_NOFILE less a reserve); waited {} s for one to be released; raise the \
                 server's descriptor limit (LimitNOFILE) or --max-fds-per-uid lower",
                QUEUE_WAIT.as_secs()
            ),
        }
    }
}

/// Connections accepted and waiting for their uid's budget (one that finds room at once does
/// not wait), at most: 128; past it new ones are refused at once. They come out of
/// [`RESERVE`].
pub(crate) const MAX_PARKED: usize = 128;
/// Connections without a budget kept open to be told why, at most: 64 (past it they are
/// closed at once).
pub(crate) const MAX_REFUSED: usize = 64;

/// One of a bounded number of places (see [`Budget::park`]); given back when dropped.
#[derive(Debug)]
pub(crate) struct Counted(Arc<std::sync::atomic::AtomicUsize>);

impl Counted {
    fn take(c: &Arc<std::sync::atomic::AtomicUsize>, max: usize) -> Option<Counted> {
        c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Counted(Arc::clone(c)))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Default)]
struct Used {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// The descriptor budgets of one server.
#[derive(Debug)]
pub(crate) struct Budget {
    total: usize,
    per_uid: usize,
    used: Mutex<Used>,
    freed: tokio::sync::Notify,
    parked: Arc<std::sync::atomic::AtomicUsize>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections not yet heard from.
    pub(crate) handshakes: Arc<Handshakes>,
}

/// Descriptors charged to a uid; released when dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    budget: Arc<Budget>,
    uid: u32,
    n: usize,
}

impl Budget {
    /// A budget of `total` client descriptors, at most `per_uid` of them per uid.
    pub(crate) fn new(total: usize, per_uid: usize) -> Arc<Budget> {
        Arc::new(Budget {
            total,
            per_uid: per_uid.min(total),
            used: Mutex::new(Used::default()),
            freed: tokio::sync::Notify::new(),
            parked: Arc::default(),
            refused: Arc::default(),
            handshakes: Arc::new(Handshakes::default()),
        })
    }

    /// A place for an accepted connection to wait for its budget (`None` past
    /// [`MAX_PARKED`]).
    pub(crate) fn park(&self) -> Option<Counted> {
        Counted::take(&self.parked, MAX_PARKED)
    }

    /// A place for a connection without a budget to stay open until told why (`None` past
    /// [`MAX_REFUSED`]).
    pub(crate) fn linger(&self) -> Option<Counted> {
        Counted::take(&self.refused, MAX_REFUSED)
    }

    /// The total and the per-uid limit.
    pub(crate) fn limits(&self) -> (usize, usize) {
        (self.total, self.per_uid)
    }

    /// Descriptors charged now: in all, and to `uid`.
    #[cfg(test)]
    fn held(&self, uid: u32) -> (usize, usize) {
        let u = self.used.lock();
        (u.total, u.by_uid.get(&uid).copied().unwrap_or(0))
    }

    /// `n` descriptors for `uid` if both budgets have room now (nothing is evicted, nothing
    /// waited for).
    pub(crate) fn try_now(self: &Arc<Self>, uid: u32, n: usize) -> Result<Charge, Short> {
        self.try_once(uid, n)
    }

    fn try_once(self: &Arc<Self>, uid: u32, n: usize) -> Result<Charge, Short> {
        let mut u = self.used.lock();
        let mine = u.by_uid.get(&uid).copied().unwrap_or(0);
        if mine + n > self.per_uid {
            return Err(Short::Uid {
                uid,
                held: mine,
                max: self.per_uid,
            });
        }
        if u.total + n > self.total {
            return Err(Short::Total {
                held: u.total,
                max: self.total,
            });
        }
        u.total += n;
        *u.by_uid.entry(uid).or_default() += n;
        Ok(Charge {
            budget: Arc::clone(self),
            uid,
            n,
        })
    }

    /// `n` descriptors for `uid`: at once, or once enough are released, at most
    /// [`QUEUE_WAIT`]. Silent connections past [`EVICT_GRACE`] (of `uid` when its own budget
    /// is short, of anyone when the total is) are closed to make room. A uid at its own limit
    /// with no silent connection left to close is refused at once: it holds them.
    pub(crate) async fn take(self: &Arc<Self>, uid: u32, n: usize) -> Result<Charge, Short> {
        let deadline = tokio::time::Instant::now() + QUEUE_WAIT;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let short = match self.try_once(uid, n) {
                Ok(c) => return Ok(c),
                Err(short) => short,
            };
            let only = matches!(short, Short::Uid { .. }).then_some(uid);
            let evicted = self.handshakes.evict(only, EVICT_GRACE);
            let silent = self.handshakes.count(only);
            let now = tokio::time::Instant::now();
            if (only.is_some() && evicted == 0 && silent == 0) || now >= deadline {
                return Err(short);
            }
            // Woken by a release (an evicted connection's, say), or looked at again when the
            // silent ones left are old enough to close.
            let _ = tokio::time::timeout(EVICT_GRACE.min(deadline - now), freed).await;
        }
    }

    /// Waits until the total has room for one more descriptor (listeners call it before
    /// accepting, so connections queue in the kernel while it is spent).
    pub(crate) async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.used.lock().total < self.total {
                return;
            }
            self.handshakes.evict(None, EVICT_GRACE);
            // Woken by a release, or looked at again (a silent one may have been evicted).
            let _ = tokio::time::timeout(EVICT_GRACE, freed).await;
        }
    }

    fn release(&self, uid: u32, n: usize) {
        if n == 0 {
            return;
        }
        {
            let mut u = self.used.lock();
            u.total -= n;
            if let Some(m) = u.by_uid.get_mut(&uid) {
                *m -= n;
                if *m == 0 {
                    u.by_uid.remove(&uid);
                }
            }
        }
        self.freed.notify_waiters();
    }
}

impl Charge {
    /// Splits `n` descriptors off into a charge of their own.
    pub(crate) fn split(&mut self, n: usize) -> Charge {
        let n = n.min(self.n);
        self.n -= n;
        Charge {
            budget: Arc::clone(&self.budget),
            uid: self.uid,
            n,
        }
    }

    /// Adds `other` (of the same uid) to this charge.
    pub(crate) fn merge(&mut self, mut other: Charge) {
        debug_assert_eq!(self.uid, other.uid);
        self.n += other.n;
        other.n = 0;
    }

    /// Releases all but `n` descriptors.
    pub(crate) fn shrink_to(&mut self, n: usize) {
        if n < self.n {
            let extra = self.n - n;
            self.n = n;
            self.budget.release(self.uid, extra);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.release(self.uid, self.n);
    }
}

/// What kind of silent connection an entry is, and so what it is told when it is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Silent {
    /// A gRPC connection before its first byte (closed without a word: no HTTP/2 yet).
    Grpc,
    /// A side-channel connection before its header (told why).
    Side,
    /// A gRPC connection refused every request (past a budget, or not allowed): closed after
    /// [`REFUSED_LINGER`], which lets its first request be answered with the reason.
    Refused,
}

/// How long a connection whose requests are all refused stays open: 1 s.
pub(crate) const REFUSED_LINGER: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Entry {
    uid: u32,
    fd: RawFd,
    since: Instant,
    kind: Silent,
}

/// Connections not yet heard from (and refused ones waiting to be closed), by token.
#[derive(Debug, Default)]
pub(crate) struct Handshakes {
    m: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

/// A connection's entry in [`Handshakes`]; removed when dropped, which must happen before
/// its descriptor is closed.
#[derive(Debug)]
pub(crate) struct Pending {
    hs: Arc<Handshakes>,
    token: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.hs.m.lock().remove(&self.token);
    }
}

impl Handshakes {
    /// Registers the connection of `uid` on descriptor `fd` as silent.
    pub(crate) fn enter(self: &Arc<Self>, uid: u32, fd: RawFd, kind: Silent) -> Pending {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        self.m.lock().insert(
            token,
            Entry {
                uid,
                fd,
                since: Instant::now(),
                kind,
            },
        );
        Pending {
            hs: Arc::clone(self),
            token,
        }
    }

    /// Silent connections (of `uid`, or of anyone).
    pub(crate) fn count(&self, uid: Option<u32>) -> usize {
        self.m
            .lock()
            .values()
            .filter(|e| uid.is_none_or(|u| e.uid == u))
            .count()
    }

    /// Closes (shuts down) the silent connections of `uid` (or of anyone) older than `age`,
    /// telling side-channel ones why; how many. Their tasks then see the end of the stream
    /// and release their descriptors.
    pub(crate) fn evict(&self, uid: Option<u32>, age: Duration) -> usize {
        self.close_where(
            |e| uid.is_none_or(|u| e.uid == u) && e.since.elapsed() >= age,
            "and the server needed its descriptor (its uid's or the server's budget is spent)",
        )
    }

    /// Closes the connections past their deadline: silent ones after [`HANDSHAKE_DEADLINE`],
    /// refused ones after [`REFUSED_LINGER`].
    pub(crate) fn expire(&self) -> usize {
        self.close_where(
            |e| {
                e.since.elapsed()
                    >= match e.kind {
                        Silent::Refused => REFUSED_LINGER,
                        _ => HANDSHAKE_DEADLINE,
                    }
            },
            "the most a connection may wait",
        )
    }

    fn close_where(&self, pick: impl Fn(&Entry) -> bool, why: &str) -> usize {
        let mut m = self.m.lock();
        let picked: Vec<u64> = m.iter().filter(|(_, e)| pick(e)).map(|(t, _)| *t).collect();
        for t in &picked {
            let e = m.remove(t).expect("picked from the map");
            // SAFETY: the entry's descriptor is open: its owner removes the entry (under this
            // lock) before closing it, and it was still here.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(e.fd) };
            if e.kind == Silent::Side {
                let why = format!(
                    "no header within {} ms of connecting, {why}; send it at once after \
                     connecting",
                    e.since.elapsed().as_millis()
                );
                let msg = umbp_proto::errors::encode_refusal(umbp_core::ErrorKind::Timeout, &why);
                let _ = umbp_unix::socket::send_nosignal(fd, &msg, true);
            }
            let _ = umbp_unix::socket::shutdown(fd);
        }
        picked.len()
    }
}

/// Raises the soft descriptor limit to the hard one; returns the soft limit in force.
pub(crate) fn raise_nofile() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed, nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    usize::try_from(r.rlim_cur)
        .unwrap_or(usize::MAX)
        .min(1 << 24)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_is_held_to_its_share_and_the_total_to_its_own() {
        let b = Budget::new(10, 6);
        let a = b.try_once(1, 6).unwrap();
        assert_eq!(
            b.try_once(1, 1).unwrap_err(),
            Short::Uid {
                uid: 1,
                held: 6,
                max: 6
            }
        );
        let mut c = b.try_once(2, 4).unwrap();
        let e = b.try_once(3, 1).unwrap_err();
        assert_eq!(e, Short::Total { held: 10, max: 10 });
        assert!(e.to_string().contains("LimitNOFILE"), "{e}");
        let one = c.split(1);
        c.shrink_to(1);
        assert_eq!(b.held(2), (8, 2));
        drop((one, c));
        assert_eq!(b.held(2), (6, 0));
        drop(a);
        assert_eq!(b.held(1), (0, 0));
        assert!(b.used.lock().by_uid.is_empty());
    }

    #[test]
    fn a_short_total_waits_for_a_release_and_a_short_uid_does_not() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let b = Budget::new(4, 3);
            let held = b.try_once(1, 3).unwrap();
            let other = b.try_once(2, 1).unwrap();
            let t = tokio::time::Instant::now();
            let e = b.take(1, 1).await.unwrap_err();
            assert!(matches!(e, Short::Uid { .. }) && t.elapsed() < QUEUE_WAIT / 2);
            let waiter = {
                let b = Arc::clone(&b);
                tokio::spawn(async move { b.take(3, 1).await.map(|c| c.n) })
            };
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished(), "the total is spent: it waits");
            drop(other);
            assert_eq!(waiter.await.unwrap(), Ok(1));
            drop(held);
        });
    }

    #[test]
    fn silent_connections_are_closed_for_room_and_at_their_deadline() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let hs = Arc::new(Handshakes::default());
        let p = hs.enter(7, std::os::fd::AsRawFd::as_raw_fd(&a), Silent::Side);
        assert_eq!(hs.evict(Some(8), Duration::ZERO), 0, "another uid's");
        assert_eq!(hs.expire(), 0, "not past its deadline");
        assert_eq!(hs.evict(Some(7), Duration::ZERO), 1);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut b, &mut got).unwrap();
        assert!(String::from_utf8_lossy(&got).contains("no header within"));
        assert_eq!(hs.count(None), 0);
        drop(p);
    }
}
