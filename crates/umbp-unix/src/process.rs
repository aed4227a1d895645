//! Process-wide calls: a descriptor that tells when another process exits, the file-creation
//! mask, and the kernel's random bytes.

use std::os::fd::OwnedFd;

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
}
