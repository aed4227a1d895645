//! Who is at the other end of a Unix socket (`SO_PEERCRED`): the server checks its clients
//! with it, and each client its server.

use std::os::fd::{AsRawFd, BorrowedFd};

/// The credentials of a Unix socket's peer, as the kernel recorded them when it connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id; 0 when the kernel cannot tell (another pid namespace).
    pub pid: u32,
}

/// The credentials of the peer of connected Unix socket `fd`.
pub fn peer_credentials(fd: BorrowedFd<'_>) -> std::io::Result<PeerCredentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes one `ucred` into `cred`, whose size we pass in `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCredentials {
        uid: cred.uid,
        gid: cred.gid,
        pid: cred.pid.max(0) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_socket_pair_of_this_process_names_it() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = peer_credentials(a.as_fd()).unwrap();
        assert_eq!(c.pid, std::process::id());
        // SAFETY: geteuid has no preconditions.
        assert_eq!(c.uid, unsafe { libc::geteuid() });
    }
}
