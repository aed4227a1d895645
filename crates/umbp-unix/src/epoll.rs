//! An epoll set: one thread waiting on many descriptors, each registered with a token that
//! comes back with its events.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll::{self, CreateFlags, Event, EventData, EventFlags};

use crate::{Op, UnixError};

/// The descriptor can be read (or its peer closed).
pub const READABLE: u32 = EventFlags::IN.bits();
/// The descriptor can be written.
pub const WRITABLE: u32 = EventFlags::OUT.bits();
/// The peer hung up.
pub const HANGUP: u32 = EventFlags::HUP.bits();
/// The descriptor failed.
pub const ERROR: u32 = EventFlags::ERR.bits();

/// A close-on-exec epoll set.
#[derive(Debug)]
pub struct Epoll(OwnedFd);

impl Epoll {
    /// A new, empty set.
    pub fn new() -> Result<Self, UnixError> {
        epoll::create(CreateFlags::CLOEXEC)
            .map(Epoll)
            .map_err(|e| UnixError::os(Op::EpollCtl, e))
    }

    /// Watches `fd` for `events` (of [`READABLE`], [`WRITABLE`]; 0 to pause), reported with
    /// `token`.
    pub fn add(&self, fd: impl AsFd, token: u64, events: u32) -> Result<(), UnixError> {
        epoll::add(&self.0, fd, EventData::new_u64(token), flags(events))
            .map_err(|e| UnixError::os(Op::EpollCtl, e))
    }

    /// Changes what `fd` (added before) is watched for, and its token.
    pub fn modify(&self, fd: impl AsFd, token: u64, events: u32) -> Result<(), UnixError> {
        epoll::modify(&self.0, fd, EventData::new_u64(token), flags(events))
            .map_err(|e| UnixError::os(Op::EpollCtl, e))
    }

    /// Waits at most `timeout` (forever when `None`) for events, then puts up to `max` of
    /// them in `out` (cleared first) as `(token, events)`; none after the timeout or a
    /// signal.
    pub fn wait(
        &self,
        out: &mut Vec<(u64, u32)>,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<(), UnixError> {
        out.clear();
        let ts = timeout.map(|t| rustix::time::Timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: t.subsec_nanos() as _,
        });
        let mut events: Vec<Event> = Vec::with_capacity(max.max(1));
        match epoll::wait(
            &self.0,
            rustix::buffer::spare_capacity(&mut events),
            ts.as_ref(),
        ) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return Ok(()),
            Err(e) => return Err(UnixError::os(Op::EpollWait, e)),
        }
        out.extend(events.iter().map(|e| {
            let Event { flags, data, .. } = *e;
            (data.u64(), flags.bits())
        }));
        Ok(())
    }
}

fn flags(events: u32) -> EventFlags {
    EventFlags::from_bits_retain(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eventfd::EventFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn events_come_back_with_their_tokens() {
        let ep = Epoll::new().unwrap();
        let wake = EventFd::new(true).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        ep.add(&wake, 1, READABLE).unwrap();
        ep.add(&a, 2, READABLE).unwrap();
        let mut out = Vec::new();
        ep.wait(&mut out, 8, Some(Duration::from_millis(5)))
            .unwrap();
        assert!(out.is_empty());
        wake.signal().unwrap();
        ep.wait(&mut out, 8, None).unwrap();
        assert_eq!(out, [(1, READABLE)]);
        wake.drain().unwrap();
        ep.modify(&a, 3, READABLE | WRITABLE).unwrap();
        drop(b);
        ep.wait(&mut out, 8, None).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 3);
        assert_ne!(out[0].1 & (READABLE | HANGUP), 0);
    }
}
