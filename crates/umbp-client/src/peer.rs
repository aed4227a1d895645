//! Whom the client sends its memory to: the process at the other end of each socket it opens
//! must run as this user, as root, or as a uid listed in `UMBP_SERVER_UIDS`, checked with
//! `SO_PEERCRED` before anything is written. A socket path in a shared directory can be bound by
//! any local user while no server runs; without this check that user would receive the
//! client's KV memory descriptors.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::OnceLock;

use crate::ClientError;

/// The variable naming other uids the server may run as (comma-separated).
pub const SERVER_UIDS_ENV: &str = "UMBP_SERVER_UIDS";

/// The uids of `UMBP_SERVER_UIDS`, read once per process.
fn listed_uids() -> Result<&'static [u32], ClientError> {
    static LISTED: OnceLock<Result<Vec<u32>, String>> = OnceLock::new();
    LISTED
        .get_or_init(|| parse_uids(&std::env::var(SERVER_UIDS_ENV).unwrap_or_default()))
        .as_deref()
        .map_err(|bad| {
            ClientError::Invalid(format!(
                "{SERVER_UIDS_ENV}={bad:?} is not a comma-separated list of numeric uids"
            ))
        })
}

fn parse_uids(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().map_err(|_| s.to_string()))
        .collect()
}

/// Fails unless the process serving the connected Unix socket `fd` (at `path`) runs as this
/// user, root or a uid of `UMBP_SERVER_UIDS`.
pub(crate) fn check_server(fd: BorrowedFd<'_>, path: &Path) -> Result<(), ClientError> {
    let umbp_proto::peer::PeerCredentials { uid, pid, .. } = umbp_proto::peer::peer_credentials(fd)
        .map_err(|source| ClientError::Io {
            what: "reading the server socket's peer credentials",
            source,
        })?;
    let me = umbp_unix::peer::effective_uid();
    if uid == me || uid == 0 || listed_uids()?.contains(&uid) {
        return Ok(());
    }
    Err(ClientError::UntrustedServer {
        path: path.display().to_string(),
        uid,
        pid,
        me,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_lists_parse_or_name_the_mistake() {
        assert_eq!(parse_uids("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_uids("1000, 1001,").unwrap(), vec![1000, 1001]);
        assert!(parse_uids("vllm").is_err());
    }

    #[test]
    fn a_socket_of_this_process_is_trusted() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        check_server(a.as_fd(), Path::new("pair")).unwrap();
    }
}
