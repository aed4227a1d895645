//! The disk tier's one error type: what stops it from starting, and what a direct call
//! ([`crate::DiskTier::write_now`]) reports. Once running, lookups and write-behind never fail
//! their caller: they miss or drop, and count it.

use std::path::PathBuf;

use thiserror::Error;
use umbp_core::ErrorKind;
use umbp_unix::UnixError;

/// Errors of the disk tier.
#[derive(Debug, Error)]
pub enum DiskError {
    /// A setting is out of range.
    #[error("{name}: {why}")]
    Setting {
        /// The option's name.
        name: &'static str,
        /// What to change.
        why: String,
    },
    /// The directory cannot be used.
    #[error("disk tier directory {dir}: {why}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
    /// Another process (or another store of this one) uses the directory.
    #[error(
        "disk tier directory {dir} is in use by another process (its lock file is held); give each worker or server a directory of its own"
    )]
    InUse {
        /// The directory.
        dir: PathBuf,
    },
    /// The file system cannot hold the configured size.
    #[error(
        "disk tier directory {dir}: {capacity} bytes configured, but its file system has only {available} bytes free (plus {used} already used by the tier); lower disk_capacity_bytes or free space"
    )]
    NoSpace {
        /// The directory.
        dir: PathBuf,
        /// The configured size.
        capacity: u64,
        /// Free bytes of its file system.
        available: u64,
        /// Bytes the tier's own files already take.
        used: u64,
    },
    /// A file operation failed.
    #[error("disk tier: {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The failed call.
        source: UnixError,
    },
    /// A directory or file operation of the standard library failed.
    #[error("disk tier: {what} {path}: {source}")]
    Fs {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An object larger than a segment cannot be written.
    #[error("an object of {len} bytes does not fit in a disk segment of {segment} bytes")]
    TooLarge {
        /// The object's length.
        len: u64,
        /// The segment size.
        segment: u64,
    },
    /// The tier is closed.
    #[error("the disk tier is closed")]
    Closed,
    /// A thread could not be started.
    #[error("cannot start the disk tier's {what} thread: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

impl DiskError {
    /// The error's kind, for callers that decide on kinds.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DiskError::Setting { .. } | DiskError::Dir { .. } | DiskError::TooLarge { .. } => {
                ErrorKind::InvalidArgument
            }
            DiskError::InUse { .. } => ErrorKind::Unavailable,
            DiskError::NoSpace { .. } => ErrorKind::Resource,
            DiskError::Io { source, .. } => source.kind(),
            DiskError::Fs { source, .. } => match source.kind() {
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
                    ErrorKind::Denied
                }
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                _ => ErrorKind::Internal,
            },
            DiskError::Closed => ErrorKind::Closed,
            DiskError::Thread { .. } => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_to_change() {
        let e = DiskError::NoSpace {
            dir: "/d".into(),
            capacity: 10,
            available: 3,
            used: 1,
        };
        assert!(e.to_string().contains("lower disk_capacity_bytes"), "{e}");
        assert_eq!(e.kind(), ErrorKind::Resource);
        let e = DiskError::InUse { dir: "/d".into() };
        assert!(e.to_string().contains("a directory of its own"), "{e}");
    }
}
