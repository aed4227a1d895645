//! An eventfd: a counter one thread adds to ([`EventFd::signal`]) and another waits on by
//! polling its descriptor, then reads back to zero ([`EventFd::drain`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use rustix::event::EventfdFlags;

use crate::{Op, UnixError};

/// A close-on-exec eventfd.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd at 0; `nonblocking`: [`drain`](Self::drain) returns 0 rather than wait
    /// while it is 0.
    pub fn new(nonblocking: bool) -> Result<Self, UnixError> {
        let mut flags = EventfdFlags::CLOEXEC;
        if nonblocking {
            flags |= EventfdFlags::NONBLOCK;
        }
        rustix::event::eventfd(0, flags)
            .map(EventFd)
            .map_err(|e| UnixError::os(Op::EventfdCreate, e))
    }

    /// Adds 1: the descriptor polls readable until drained.
    pub fn signal(&self) -> Result<(), UnixError> {
        match rustix::io::write(&self.0, &1u64.to_ne_bytes()) {
            // The counter is at its limit: it is readable already, which is all a signal does.
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(e) => Err(UnixError::os(Op::EventfdSignal, e)),
        }
    }

    /// Reads the counter back to 0: how many signals came since the last drain (0 when none
    /// did and the eventfd is non-blocking; a blocking one waits for one).
    pub fn drain(&self) -> Result<u64, UnixError> {
        let mut b = [0u8; 8];
        match rustix::io::read(&self.0, &mut b) {
            Ok(_) => Ok(u64::from_ne_bytes(b)),
            Err(rustix::io::Errno::AGAIN) => Ok(0),
            Err(e) => Err(UnixError::os(Op::EventfdRead, e)),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_add_up_and_a_drain_resets() {
        let e = EventFd::new(true).unwrap();
        assert_eq!(e.drain().unwrap(), 0);
        e.signal().unwrap();
        e.signal().unwrap();
        assert_eq!(e.drain().unwrap(), 2);
        assert_eq!(e.drain().unwrap(), 0);
    }

    #[test]
    fn a_blocking_drain_waits_for_a_signal_from_another_thread() {
        let e = std::sync::Arc::new(EventFd::new(false).unwrap());
        let e2 = std::sync::Arc::clone(&e);
        let t = std::thread::spawn(move || e2.drain().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(20));
        e.signal().unwrap();
        assert_eq!(t.join().unwrap(), 1);
    }
}
