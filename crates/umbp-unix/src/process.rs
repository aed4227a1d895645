//! Process-wide calls: a descriptor that tells when another process exits, the file-creation
//! mask, the kernel's random bytes, and descriptors handed across an `exec`.

use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};

use rustix::fs::Mode;
use rustix::process::{Pid, PidfdFlags};
use rustix::rand::GetRandomFlags;

use crate::{Op, UnixError};

/// `pidfd_open`: a close-on-exec descriptor that becomes readable when process `pid` exits
/// (Linux 5.3).
pub fn pidfd_open(pid: u32) -> Result<OwnedFd, UnixError> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or(UnixError::Os {
            op: Op::PidfdOpen,
            errno: libc::EINVAL,
        })?;
    rustix::process::pidfd_open(pid, PidfdFlags::empty())
        .map_err(|e| UnixError::os(Op::PidfdOpen, e))
}

/// Runs `f` with the process's file-creation mask set to `mask`, then restores the mask it
/// had. The mask is the process's: files another thread creates meanwhile get it too.
pub fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    let old = rustix::process::umask(Mode::from_bits_retain(mask));
    let out = f();
    rustix::process::umask(old);
    out
}

/// Fills `buf` with random bytes from the kernel (`getrandom`, waiting for its pool at boot).
pub fn fill_random(buf: &mut [u8]) -> Result<(), UnixError> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::rand::getrandom(&mut buf[got..], GetRandomFlags::empty()) {
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(UnixError::os(Op::GetRandom, e)),
        }
    }
    Ok(())
}

/// Lets descriptor `fd` survive this process's next `exec` (clears close-on-exec), for a
/// process that re-executes itself with something to hand its new image.
pub fn keep_across_exec(fd: impl AsFd) -> Result<(), UnixError> {
    rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())
        .map_err(|e| UnixError::os(Op::FdFlags, e))
}

/// Takes descriptor `fd`, which this process inherited through an `exec` (from its own
/// earlier image, or from systemd's `LISTEN_FDS`), and marks it close-on-exec. Fails, taking
/// nothing, when no descriptor `fd` is open.
///
/// # Safety
/// Nothing else in the process may own `fd`: the caller got its number from whoever passed
/// it (an environment variable it owns), and takes it once.
pub unsafe fn adopt_inherited_fd(fd: RawFd) -> Result<OwnedFd, UnixError> {
    if fd < 0 {
        return Err(UnixError::Os {
            op: Op::FdFlags,
            errno: libc::EBADF,
        });
    }
    // SAFETY: `F_GETFD` on a raw number reads flags only; a closed number fails with EBADF.
    let open = unsafe { rustix::io::fcntl_getfd(rustix::fd::BorrowedFd::borrow_raw(fd)) };
    open.map_err(|e| UnixError::os(Op::FdFlags, e))?;
    // SAFETY: the descriptor is open (above) and, by the caller's contract, owned by nobody
    // else in this process.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| UnixError::os(Op::FdFlags, e))?;
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_of_this_process_and_none_of_pid_zero() {
        let fd = pidfd_open(std::process::id()).unwrap();
        assert!(
            crate::socket::wait_readable(
                &[std::os::fd::AsFd::as_fd(&fd)],
                Some(std::time::Duration::ZERO)
            )
            .unwrap()
            .iter()
            .all(|r| !r),
            "we have not exited"
        );
        assert_eq!(pidfd_open(0).unwrap_err().errno(), Some(libc::EINVAL));
    }

    #[test]
    fn the_mask_is_restored_and_random_bytes_differ() {
        let before = with_umask(0o077, || with_umask(0o177, || 1));
        assert_eq!(before, 1);
        let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
        fill_random(&mut a).unwrap();
        fill_random(&mut b).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn an_inherited_descriptor_is_taken_once_it_is_open() {
        let fd = crate::memfd::create(c"inherit-test", 4096, None).unwrap();
        keep_across_exec(&fd).unwrap();
        let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
        // SAFETY: `raw` was given up by its OwnedFd above and is taken once here.
        let back = unsafe { adopt_inherited_fd(raw) }.unwrap();
        let flags = rustix::io::fcntl_getfd(&back).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        drop(back);
        // SAFETY: a negative number is never a descriptor.
        assert!(unsafe { adopt_inherited_fd(-1) }.is_err());
    }
}
