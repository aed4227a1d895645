//! Who is at the other end of a Unix socket (`SO_PEERCRED`): the server checks its clients
//! with it, and each client its server. The call itself lives in `umbp_unix::peer`.

use std::os::fd::BorrowedFd;

pub use umbp_unix::peer::PeerCredentials;

/// The credentials of the peer of connected Unix socket `fd`.
pub fn peer_credentials(fd: BorrowedFd<'_>) -> std::io::Result<PeerCredentials> {
    Ok(umbp_unix::peer::peer_credentials(fd)?)
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
        assert_eq!(c.uid, umbp_unix::peer::effective_uid());
    }
}
