//! Who is at the other end of a Unix socket (`SO_PEERCRED`), and who this process is.

use std::os::fd::{AsFd, AsRawFd};

use crate::{Op, UnixError};

/// The credentials of a Unix socket's peer, as the kernel recorded them when it connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id; 0 when the kernel cannot tell (a peer in another pid namespace).
    pub pid: u32,
}

/// The credentials of the peer of the connected Unix socket `socket`.
pub fn peer_credentials(socket: impl AsFd) -> Result<PeerCredentials, UnixError> {
    // Not rustix's `socket_peercred`: it reads the pid as non-zero, and a peer in another pid
    // namespace has pid 0 here.
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes, one `ucred`, into `cred`, which lives
    // across the call; the descriptor is borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(UnixError::Os {
            op: Op::PeerCredentials,
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        });
    }
    Ok(PeerCredentials {
        uid: cred.uid,
        gid: cred.gid,
        pid: cred.pid.max(0) as u32,
    })
}

/// This process's effective user id (whose files it may open, whom a peer sees).
pub fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// This process's real user id.
pub fn real_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_socket_pair_of_this_process_names_it() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_credentials(&a).unwrap();
        assert_eq!(c.pid, std::process::id());
        assert_eq!(c.uid, effective_uid());
        assert_eq!(c.gid, rustix::process::getegid().as_raw());
    }

    #[test]
    fn a_file_is_not_a_socket() {
        let (r, _w) = std::io::pipe().unwrap();
        let e = peer_credentials(&r).unwrap_err();
        assert_eq!(e.op(), Op::PeerCredentials);
        assert_eq!(e.errno(), Some(libc::ENOTSOCK));
    }
}
