//! The system calls the server makes: checked results, the eventfd wake-up and epoll
//! registration, with the epoll tokens of the listener and the wake-up.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

pub(super) const LISTENER: u64 = 0;
pub(super) const WAKE: u64 = 1;
pub(super) const FIRST_CONN: u64 = 2;

pub(super) fn os_err(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

pub(super) fn signal(wake: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local u64 to our eventfd.
    unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

pub(super) const IN: u32 = libc::EPOLLIN as u32;
pub(super) const OUT: u32 = libc::EPOLLOUT as u32;

pub(super) fn epoll_ctl(
    ep: &OwnedFd,
    op: libc::c_int,
    fd: RawFd,
    token: u64,
    events: u32,
) -> std::io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid epoll_event for the duration of the call; both fds are open.
    os_err(unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, &mut ev) }).map(|_| ())
}
