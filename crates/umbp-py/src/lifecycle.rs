//! What native objects need from the interpreter and the process: the GIL released around
//! native work, no use in a forked child, drops that cannot deadlock, and closing at exit.

use std::sync::{Arc, Mutex, Weak};

use pyo3::marker::Ungil;
use pyo3::prelude::*;
use umbp_client::StandaloneClient as CoreClient;
use umbp_lookup::LookupServer as CoreLookupServer;
use umbp_store::EmbeddedStore as CoreStore;

use crate::errors::{Error, Result};

/// Runs native work with the GIL released. Every call into the store, the lookup service or
/// the key builder that can block, take a lock or scale with its input goes through here (or
/// [`bulk`]): the GIL is released nowhere else. Besides letting other Python threads run, it
/// keeps the GIL free for the store's background threads, whose `log` records go to Python's
/// `logging` and so may need it while they hold a lock the caller waits for.
pub(crate) fn without_gil<T, F>(py: Python<'_>, work: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    py.detach(work)
}

/// From this many keys up, a key batch is handled without the GIL. Releasing and retaking it
/// costs about as much as looking up a few dozen keys, and once released another thread may
/// hold it for a whole switch interval (5 ms), so small lookups keep it.
pub(crate) const BULK_KEYS: usize = 1024;

/// Runs work over `keys` keys: through [`without_gil`] from [`BULK_KEYS`] keys up, with the
/// GIL held below.
pub(crate) fn bulk<T, F>(py: Python<'_>, keys: usize, work: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    if keys >= BULK_KEYS {
        without_gil(py, work)
    } else {
        work()
    }
}

/// The process that made a native object. In a forked child its background threads, and any
/// lock they held at the fork, exist only in the parent, so using it could hang or panic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin {
    pid: u32,
}

impl Origin {
    /// This process.
    pub(crate) fn here() -> Self {
        Origin {
            pid: std::process::id(),
        }
    }

    /// Whether this is a forked child of the process that made the object.
    pub(crate) fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// `StoreClosedError` (naming `what` and the parent) in a forked child.
    pub(crate) fn check(&self, what: &'static str) -> Result<()> {
        if self.forked() {
            return Err(Error::Forked {
                what,
                parent: self.pid,
            });
        }
        Ok(())
    }
}

/// A value whose drop can wait for background threads, which may need the GIL to log: it is
/// dropped with the GIL released, so that a `del store` or a garbage collection never
/// deadlocks against them. In a forked child it is leaked instead: the threads it would join
/// exist only in the parent.
pub(crate) struct ReleaseGilOnDrop<T: Send> {
    value: Option<T>,
    origin: Origin,
}

impl<T: Send> ReleaseGilOnDrop<T> {
    pub(crate) fn new(v: T) -> Self {
        ReleaseGilOnDrop {
            value: Some(v),
            origin: Origin::here(),
        }
    }

    /// Whether this is a forked child of the process that made the value.
    pub(crate) fn forked(&self) -> bool {
        self.origin.forked()
    }

    /// The value, or `StoreClosedError` in a forked child (see [`Origin`]).
    pub(crate) fn live(&self, what: &'static str) -> Result<&T> {
        self.origin.check(what)?;
        Ok(self)
    }
}

impl<T: Send> std::ops::Deref for ReleaseGilOnDrop<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("present until dropped")
    }
}

impl<T: Send> Drop for ReleaseGilOnDrop<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            if self.origin.forked() {
                std::mem::forget(v);
                return;
            }
            Python::attach(|py| without_gil(py, move || drop(v)));
        }
    }
}

/// Weakly held objects and the processes that made them.
type Live<T> = Mutex<Vec<(u32, Weak<T>)>>;

/// Stores and lookup servers not yet dropped, closed by an `atexit` handler: at interpreter
/// exit their background threads must finish while they can still take the GIL (during
/// finalization they cannot, and joining them would hang).
static LIVE_STORES: Live<CoreStore> = Mutex::new(Vec::new());
static LIVE_SERVERS: Live<CoreLookupServer> = Mutex::new(Vec::new());
/// Standalone clients not yet dropped, detached at exit: their runtime's threads log through
/// Python too, and the server learns at once that the session is over.
static LIVE_CLIENTS: Live<CoreClient> = Mutex::new(Vec::new());

fn track<T>(live: &Live<T>, v: &Arc<T>) {
    if let Ok(mut l) = live.lock() {
        l.retain(|(_, w)| w.strong_count() > 0);
        l.push((std::process::id(), Arc::downgrade(v)));
    }
}

/// Closes `store` at exit unless it is dropped first.
pub(crate) fn track_store(store: &Arc<CoreStore>) {
    track(&LIVE_STORES, store);
}

/// Stops `server` at exit unless it is dropped first.
pub(crate) fn track_server(server: &Arc<CoreLookupServer>) {
    track(&LIVE_SERVERS, server);
}

/// Detaches `client` at exit unless it is dropped first.
pub(crate) fn track_client(client: &Arc<CoreClient>) {
    track(&LIVE_CLIENTS, client);
}

/// This process's live objects of `live` (a forked child skips its parent's).
fn take_live<T>(live: &Live<T>) -> Vec<Arc<T>> {
    let me = std::process::id();
    live.lock()
        .map(|mut l| {
            l.drain(..)
                .filter(|(pid, _)| *pid == me)
                .filter_map(|(_, w)| w.upgrade())
                .collect()
        })
        .unwrap_or_default()
}

/// Closes every live store and standalone client and stops every lookup server of this
/// process (registered with
/// `atexit` when `umbp._native` is imported, so it runs after every exit handler registered
/// later, e.g. a serving framework's shutdown).
#[pyfunction]
pub(crate) fn _close_all(py: Python<'_>) {
    let servers = take_live(&LIVE_SERVERS);
    let stores = take_live(&LIVE_STORES);
    let clients = take_live(&LIVE_CLIENTS);
    without_gil(py, move || {
        for c in clients {
            c.close();
        }
        for s in servers {
            s.shutdown();
        }
        for s in stores {
            s.close();
        }
    });
}
