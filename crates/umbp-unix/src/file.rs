//! Files for the disk tier: opened for direct I/O (`O_DIRECT`: reads and writes go between
//! the caller's buffer and the device, past the page cache), positioned reads and writes that
//! finish or fail, space reserved up front, an advisory lock, and the file system's free space.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FallocateFlags, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use crate::safedir::{Access, Create, SafeDir};
use crate::{Op, UnixError};

/// A file opened for reading and writing, with direct I/O when the file system has it.
#[derive(Debug)]
pub struct IoFile {
    fd: OwnedFd,
    direct: bool,
}

impl IoFile {
    /// Opens `path` for reading and writing (creating it, mode 0600, with `create`), with
    /// `O_DIRECT` when `direct` is asked and the file system takes it (tmpfs does not:
    /// `EINVAL`, and the file is then opened without it; [`IoFile::is_direct`] tells).
    pub fn open(path: &Path, create: bool, direct: bool) -> Result<IoFile, UnixError> {
        let mut flags = OFlags::RDWR | OFlags::CLOEXEC;
        if create {
            flags |= OFlags::CREATE;
        }
        let mode = Mode::from_bits_retain(0o600);
        if direct {
            match rustix::fs::open(path, flags | OFlags::DIRECT, mode) {
                Ok(fd) => return Ok(IoFile { fd, direct: true }),
                Err(Errno::INVAL) => {}
                Err(e) => return Err(UnixError::os(Op::Open, e)),
            }
        }
        let fd = rustix::fs::open(path, flags, mode).map_err(|e| UnixError::os(Op::Open, e))?;
        Ok(IoFile { fd, direct: false })
    }

    /// Opens the file `name` of the trusted directory `dir` for reading and writing, never
    /// through a link ([`SafeDir::open_file`]): `Create::New` makes it (mode 0600, refused
    /// when the name exists), `Create::No` needs it to exist. `O_DIRECT` as [`IoFile::open`].
    pub fn open_in(
        dir: &SafeDir,
        name: &str,
        create: Create,
        direct: bool,
    ) -> Result<IoFile, UnixError> {
        let (fd, direct) = dir.open_file(name, Access::ReadWrite, create, direct)?;
        Ok(IoFile { fd, direct })
    }

    /// Whether reads and writes bypass the page cache (then every buffer, offset and length
    /// must be aligned to the device's logical block; 4 KiB always is).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reads into `buf` from `offset` until it is full or the file ends; the bytes read.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize, UnixError> {
        let mut got = 0;
        while got < buf.len() {
            match rustix::io::pread(&self.fd, &mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(UnixError::os(Op::Pread, e)),
            }
        }
        Ok(got)
    }

    /// Writes all of `buf` at `offset` (a device that takes nothing is `EIO`).
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> Result<(), UnixError> {
        let mut put = 0;
        while put < buf.len() {
            match rustix::io::pwrite(&self.fd, &buf[put..], offset + put as u64) {
                Ok(0) => {
                    return Err(UnixError::Os {
                        op: Op::Pwrite,
                        errno: libc::EIO,
                    })
                }
                Ok(n) => put += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(UnixError::os(Op::Pwrite, e)),
            }
        }
        Ok(())
    }

    /// Reserves `len` bytes of the device for the file from its start (the file grows to at
    /// least `len`), so that a full disk fails here rather than in a later write. A file
    /// system without `fallocate` (`EOPNOTSUPP`) is left as it is.
    pub fn reserve(&self, len: u64) -> Result<(), UnixError> {
        match rustix::fs::fallocate(&self.fd, FallocateFlags::empty(), 0, len) {
            Ok(()) | Err(Errno::OPNOTSUPP) => Ok(()),
            Err(e) => Err(UnixError::os(Op::Fallocate, e)),
        }
    }

    /// The file's length in bytes.
    pub fn len(&self) -> Result<u64, UnixError> {
        let st = rustix::fs::fstat(&self.fd).map_err(|e| UnixError::os(Op::Fstat, e))?;
        Ok(st.st_size as u64)
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool, UnixError> {
        Ok(self.len()? == 0)
    }

    /// Flushes the file's data to the device (`fdatasync`).
    pub fn sync_data(&self) -> Result<(), UnixError> {
        rustix::fs::fdatasync(&self.fd).map_err(|e| UnixError::os(Op::Fdatasync, e))
    }
}

impl AsFd for IoFile {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Takes an exclusive advisory lock (`flock`) on `fd` without waiting: `false` when another
/// open file description holds it. The lock lasts while the descriptor stays open.
pub fn try_lock_exclusive(fd: impl AsFd) -> Result<bool, UnixError> {
    match rustix::fs::flock(fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(UnixError::os(Op::Flock, e)),
    }
}

/// Releases a lock [`try_lock_exclusive`] took (closing the descriptor releases it too).
pub fn unlock(fd: impl AsFd) -> Result<(), UnixError> {
    rustix::fs::flock(fd, FlockOperation::Unlock).map_err(|e| UnixError::os(Op::Flock, e))
}

/// Space of the file system a descriptor lies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    /// Bytes an unprivileged user may still allocate.
    pub available: u64,
    /// Bytes the file system holds in all.
    pub total: u64,
    /// Whether it is mounted read-only.
    pub read_only: bool,
}

/// [`FsSpace`] of the file system `fd` lies on (`fstatvfs`).
pub fn fs_space(fd: impl AsFd) -> Result<FsSpace, UnixError> {
    let st = rustix::fs::fstatvfs(fd).map_err(|e| UnixError::os(Op::Statvfs, e))?;
    Ok(FsSpace {
        available: st.f_bavail.saturating_mul(st.f_frsize),
        total: st.f_blocks.saturating_mul(st.f_frsize),
        read_only: st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("umbp-unix-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn writes_and_reads_back_at_offsets() {
        let d = tmpdir("rw");
        let f = IoFile::open(&d.join("a"), true, false).unwrap();
        assert!(!f.is_direct());
        f.reserve(8192).unwrap();
        assert_eq!(f.len().unwrap(), 8192);
        f.write_all_at(b"hello", 4096).unwrap();
        let mut buf = [0u8; 5];
        assert_eq!(f.read_at(&mut buf, 4096).unwrap(), 5);
        assert_eq!(&buf, b"hello");
        // Past the end: a short read, not an error.
        let mut tail = [0u8; 16];
        assert_eq!(f.read_at(&mut tail, 8190).unwrap(), 2);
        f.sync_data().unwrap();
        assert!(!f.is_empty().unwrap());
        let space = fs_space(&f).unwrap();
        assert!(space.total >= space.available && !space.read_only);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_second_exclusive_lock_is_refused() {
        let d = tmpdir("lock");
        let a = IoFile::open(&d.join("lock"), true, false).unwrap();
        let b = IoFile::open(&d.join("lock"), false, false).unwrap();
        assert!(try_lock_exclusive(&a).unwrap());
        assert!(!try_lock_exclusive(&b).unwrap());
        drop(a);
        assert!(try_lock_exclusive(&b).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_open_error() {
        let d = tmpdir("missing");
        let e = IoFile::open(&d.join("nope"), false, true).unwrap_err();
        assert_eq!((e.op(), e.errno()), (Op::Open, Some(libc::ENOENT)));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
