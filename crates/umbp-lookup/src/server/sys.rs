//! The epoll tokens of the listener and the wake-up, the events the loop watches for, and the
//! wake-up itself.

pub(super) const LISTENER: u64 = 0;
pub(super) const WAKE: u64 = 1;
pub(super) const FIRST_CONN: u64 = 2;

pub(super) use umbp_unix::epoll::{ERROR, HANGUP, READABLE as IN, WRITABLE as OUT};

pub(super) fn signal(wake: &umbp_unix::eventfd::EventFd) {
    // A failure only loses this wake-up; the loop looks at its stop flag every second.
    let _ = wake.signal();
}
