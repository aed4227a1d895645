//! The crate's one error: which call failed and why.

use umbp_core::ErrorKind;

/// A system call of this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `memfd_create`.
    MemfdCreate,
    /// `ftruncate` of a new memfd.
    Ftruncate,
    /// `fcntl(F_ADD_SEALS)`.
    AddSeals,
    /// `fcntl(F_GET_SEALS)`.
    GetSeals,
    /// `fstat`.
    Fstat,
    /// `pread`.
    Pread,
    /// `sendmsg` with descriptors.
    SendFds,
    /// `recvmsg` with descriptors.
    RecvFds,
    /// `getsockopt(SO_PEERCRED)`.
    PeerCredentials,
    /// `eventfd`.
    EventfdCreate,
    /// `write` to an eventfd.
    EventfdSignal,
    /// `read` of an eventfd.
    EventfdRead,
    /// `futex(FUTEX_WAIT)`.
    FutexWait,
    /// `futex(FUTEX_WAKE)`.
    FutexWake,
    /// `mmap`.
    Mmap,
    /// `recv`.
    Recv,
    /// `send`.
    Send,
    /// `poll`.
    Poll,
    /// `setsockopt`.
    SetSockOpt,
    /// `epoll_create1` or `epoll_ctl`.
    EpollCtl,
    /// `epoll_wait`.
    EpollWait,
    /// `pidfd_open`.
    PidfdOpen,
    /// `getrandom`.
    GetRandom,
    /// `shutdown` of a socket.
    Shutdown,
    /// `open` of a file.
    Open,
    /// `pwrite`.
    Pwrite,
    /// `fallocate`.
    Fallocate,
    /// `fdatasync`.
    Fdatasync,
    /// `flock`.
    Flock,
    /// `fstatvfs`.
    Statvfs,
    /// `mbind`.
    Mbind,
    /// `madvise(MADV_POPULATE_WRITE)`.
    Populate,
    /// `openat2` / `openat` of a name in a directory.
    Openat,
    /// `mkdirat`.
    Mkdir,
    /// `readlinkat`.
    Readlink,
    /// `unlinkat`.
    Unlink,
    /// Reading a directory's entries (`getdents64`).
    ReadDir,
    /// `fchmod`.
    Fchmod,
    /// `fcntl(F_GETFD)` / `fcntl(F_SETFD)`.
    FdFlags,
}

impl Op {
    /// The call as a person reads it in a message.
    pub fn name(self) -> &'static str {
        match self {
            Op::MemfdCreate => "memfd_create",
            Op::FdFlags => "fcntl(F_GETFD/F_SETFD)",
            Op::Ftruncate => "ftruncate of the memfd",
            Op::AddSeals => "fcntl(F_ADD_SEALS)",
            Op::GetSeals => "fcntl(F_GET_SEALS)",
            Op::Fstat => "fstat",
            Op::Pread => "pread",
            Op::SendFds => "sendmsg(SCM_RIGHTS)",
            Op::RecvFds => "recvmsg(SCM_RIGHTS)",
            Op::PeerCredentials => "getsockopt(SO_PEERCRED)",
            Op::EventfdCreate => "eventfd",
            Op::EventfdSignal => "write to the eventfd",
            Op::EventfdRead => "read of the eventfd",
            Op::FutexWait => "futex(FUTEX_WAIT)",
            Op::FutexWake => "futex(FUTEX_WAKE)",
            Op::Mmap => "mmap",
            Op::Recv => "recv",
            Op::Send => "send",
            Op::Poll => "poll",
            Op::SetSockOpt => "setsockopt",
            Op::EpollCtl => "epoll_ctl",
            Op::EpollWait => "epoll_wait",
            Op::PidfdOpen => "pidfd_open",
            Op::GetRandom => "getrandom",
            Op::Shutdown => "shutdown",
            Op::Open => "open",
            Op::Pwrite => "pwrite",
            Op::Fallocate => "fallocate",
            Op::Fdatasync => "fdatasync",
            Op::Flock => "flock",
            Op::Statvfs => "fstatvfs",
            Op::Mbind => "mbind",
            Op::Populate => "madvise(MADV_POPULATE_WRITE)",
            Op::Openat => "openat",
            Op::Mkdir => "mkdirat",
            Op::Readlink => "readlinkat",
            Op::Unlink => "unlinkat",
            Op::ReadDir => "reading the directory",
            Op::Fchmod => "fchmod",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call of this crate.
#[derive(Debug, thiserror::Error)]
pub enum UnixError {
    /// The kernel refused the call.
    #[error("{op}: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The call.
        op: Op,
        /// Its errno.
        errno: i32,
    },
    /// A message came with more descriptors than the receiver takes; every one of them was
    /// closed.
    #[error("{op}: more than {max} descriptors in one message")]
    TooManyFds {
        /// The call.
        op: Op,
        /// The most the receiver takes.
        max: usize,
    },
    /// A directory or file another user could change (its owner or its mode), refused before
    /// anything is read or written there; `why` says what to change.
    #[error("{}: {why}", path.display())]
    Untrusted {
        /// The path refused (a directory on the way, a link, or a file).
        path: std::path::PathBuf,
        /// What is wrong and what to change.
        why: String,
    },
}

impl UnixError {
    pub(crate) fn os(op: Op, e: rustix::io::Errno) -> Self {
        UnixError::Os {
            op,
            errno: e.raw_os_error(),
        }
    }

    /// The call that failed.
    pub fn op(&self) -> Op {
        match self {
            UnixError::Os { op, .. } | UnixError::TooManyFds { op, .. } => *op,
            UnixError::Untrusted { .. } => Op::Open,
        }
    }

    /// The errno, when the kernel refused the call.
    pub fn errno(&self) -> Option<i32> {
        match self {
            UnixError::Os { errno, .. } => Some(*errno),
            UnixError::TooManyFds { .. } | UnixError::Untrusted { .. } => None,
        }
    }

    /// Whether the call would have blocked (`EAGAIN` on a non-blocking descriptor).
    pub fn would_block(&self) -> bool {
        self.errno() == Some(libc::EAGAIN)
    }

    /// The failure as an `io::Error`, as `last_os_error` would have read it: callers that
    /// carry `io::Error` keep their messages.
    pub fn to_io(&self) -> std::io::Error {
        match self {
            UnixError::Os { errno, .. } => std::io::Error::from_raw_os_error(*errno),
            UnixError::TooManyFds { .. } => {
                std::io::Error::new(std::io::ErrorKind::InvalidData, self.to_string())
            }
            UnixError::Untrusted { .. } => {
                std::io::Error::new(std::io::ErrorKind::PermissionDenied, self.to_string())
            }
        }
    }

    /// What kind of failure this is, for callers that report `umbp_core` kinds.
    pub fn kind(&self) -> ErrorKind {
        if matches!(self, UnixError::Untrusted { .. }) {
            return ErrorKind::Denied;
        }
        let Some(errno) = self.errno() else {
            return ErrorKind::InvalidArgument;
        };
        match errno {
            libc::ENOMEM
            | libc::EMFILE
            | libc::ENFILE
            | libc::ENOSPC
            | libc::EFBIG
            | libc::EDQUOT => ErrorKind::Resource,
            libc::ETIMEDOUT => ErrorKind::Timeout,
            libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN | libc::ECONNREFUSED | libc::EAGAIN => {
                ErrorKind::Unavailable
            }
            libc::EPERM | libc::EACCES | libc::EROFS => ErrorKind::Denied,
            libc::EINVAL | libc::EBADF | libc::ENOTSOCK | libc::ENOSYS => {
                ErrorKind::InvalidArgument
            }
            _ => ErrorKind::Internal,
        }
    }
}

impl From<UnixError> for std::io::Error {
    fn from(e: UnixError) -> Self {
        e.to_io()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_call_and_the_errno() {
        let e = UnixError::Os {
            op: Op::MemfdCreate,
            errno: libc::EMFILE,
        };
        let s = e.to_string();
        assert!(
            s.starts_with("memfd_create: ") && s.contains("os error 24"),
            "{s}"
        );
        assert_eq!(e.kind(), ErrorKind::Resource);
        assert_eq!(e.to_io().raw_os_error(), Some(libc::EMFILE));
        let t = UnixError::TooManyFds {
            op: Op::RecvFds,
            max: 4,
        };
        assert_eq!(
            t.to_string(),
            "recvmsg(SCM_RIGHTS): more than 4 descriptors in one message"
        );
        assert_eq!(t.kind(), ErrorKind::InvalidArgument);
    }
}
