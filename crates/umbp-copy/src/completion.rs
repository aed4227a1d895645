//! Whether a copy job has finished, and everyone waiting for it: threads blocked on a
//! condition variable, futures' wakers and `on_done` callbacks. A [`Completion`] is owned by
//! a job's state ([`crate::engine`]) and observed through its handle ([`crate::jobs`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::task::Waker;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use umbp_core::KeyOutcome;

/// A callback to run once with a job's results.
pub(crate) type DoneCallback = Box<dyn FnOnce(Vec<KeyOutcome>) + Send + 'static>;

/// Whether a job has finished, and everyone waiting for it: threads (on the condition
/// variable), futures (their wakers) and callbacks.
pub(crate) struct Completion {
    inner: Mutex<Waiters>,
    cv: Condvar,
}

#[derive(Default)]
struct Waiters {
    done: bool,
    /// One waker per pending [`JobFinished`], under the slot number that future holds.
    wakers: Vec<(u64, Waker)>,
    next_slot: u64,
    callbacks: Vec<DoneCallback>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = self.inner.lock();
        f.debug_struct("Completion")
            .field("done", &w.done)
            .field("wakers", &w.wakers.len())
            .field("callbacks", &w.callbacks.len())
            .finish()
    }
}

impl Completion {
    /// A completion that starts finished (`done`, for a job without keys) or pending.
    pub(crate) fn new(done: bool) -> Self {
        Completion {
            inner: Mutex::new(Waiters {
                done,
                ..Waiters::default()
            }),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.inner.lock().done
    }

    /// Blocks until the job has finished or `deadline` has passed; whether it finished.
    pub(crate) fn wait_until(&self, deadline: Instant) -> bool {
        let mut w = self.inner.lock();
        while !w.done {
            if self.cv.wait_until(&mut w, deadline).timed_out() {
                return w.done;
            }
        }
        true
    }

    /// Runs the job's callbacks (each with `results()`), then marks it finished and wakes its
    /// waiting threads and futures, on this thread. Called once, by whoever finished the last
    /// key. Callbacks come first, and the job reads as finished only after them, so that what
    /// they signal (a standalone client's completion page) happens before anything a waiter
    /// does next (the server's reply); a callback added meanwhile runs in the same turn. A
    /// callback that panics is logged and does not take the caller down.
    pub(crate) fn finish(&self, results: impl Fn() -> Vec<KeyOutcome>) {
        let wakers = loop {
            let callbacks = {
                let mut w = self.inner.lock();
                if w.callbacks.is_empty() {
                    w.done = true;
                    break std::mem::take(&mut w.wakers);
                }
                std::mem::take(&mut w.callbacks)
            };
            let results = results();
            for cb in callbacks {
                let r = results.clone();
                if catch_unwind(AssertUnwindSafe(move || cb(r))).is_err() {
                    log::error!(
                        "umbp: a job's on_done callback panicked; the panic was caught and the copy worker goes on"
                    );
                }
            }
        };
        self.cv.notify_all();
        for (_, waker) in wakers {
            waker.wake();
        }
    }

    /// Whether the job has finished; if not, `waker` is kept (in the slot `slot` names, which
    /// is assigned on the first call) to be woken when it does.
    pub(crate) fn register(&self, slot: &mut Option<u64>, waker: &Waker) -> bool {
        let mut w = self.inner.lock();
        if w.done {
            *slot = None;
            return true;
        }
        if let Some(s) = *slot {
            if let Some((_, kept)) = w.wakers.iter_mut().find(|(k, _)| *k == s) {
                if !kept.will_wake(waker) {
                    kept.clone_from(waker);
                }
                return false;
            }
        }
        let s = w.next_slot;
        w.next_slot += 1;
        w.wakers.push((s, waker.clone()));
        *slot = Some(s);
        false
    }

    /// Forgets the waker in `slot` (its future was dropped before the job finished).
    pub(crate) fn unregister(&self, slot: u64) {
        self.inner.lock().wakers.retain(|(k, _)| *k != slot);
    }

    /// How many futures' wakers are kept.
    #[cfg(test)]
    pub(crate) fn waker_count(&self) -> usize {
        self.inner.lock().wakers.len()
    }

    /// Keeps `cb` to run when the job finishes; hands it back when the job already has.
    pub(crate) fn add_callback(&self, cb: DoneCallback) -> Option<DoneCallback> {
        let mut w = self.inner.lock();
        if w.done {
            Some(cb)
        } else {
            w.callbacks.push(cb);
            None
        }
    }
}
