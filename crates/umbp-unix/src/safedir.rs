//! A directory only this process's user can change, opened once and used through its
//! descriptor, for files a privileged process writes on behalf of others (the disk tier's).
//!
//! [`SafeDir::open`] resolves the path one component at a time from `/`, the way sshd's
//! `StrictModes` and PostgreSQL judge a data directory: every directory on the way (symbolic
//! links followed, each checked too) must be owned by root or by the effective uid, and
//! writable by nobody else unless it has the sticky bit (`/tmp`); a symbolic link on the way
//! must be owned by root or by the effective uid; the directory itself must be owned by the
//! effective uid and writable by nobody else. What fails is refused with
//! [`UnixError::Untrusted`], naming the path and what to change.
//!
//! Files are then opened relative to the directory's descriptor, never by path, and never
//! through a symbolic link: `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS` where the kernel has it; where it answers `ENOSYS` (before Linux 5.6,
//! gVisor, some seccomp filters) `openat` with `O_NOFOLLOW`, which is as strict here because
//! every name is a single component without `/` (checked). New files are made with `O_EXCL`
//! and mode 0600; an existing file must be a regular file owned by the effective uid.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat, CWD};
use rustix::io::Errno;

use crate::{Op, UnixError};

/// Symbolic links followed while resolving one path, at most (as the kernel's `ELOOP`).
const MAX_LINKS: usize = 40;

/// Whether `openat2` works here: 0 not tried yet, 1 yes, 2 no (`ENOSYS`).
static OPENAT2: AtomicU8 = AtomicU8::new(0);

/// How [`SafeDir::open_file`] opens a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// The file must exist.
    No,
    /// The file must not exist (`O_EXCL`); it is made with mode 0600.
    New,
    /// Made (mode 0600) when missing, opened otherwise.
    IfMissing,
}

/// What [`SafeDir::open_file`] opens a file for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reading.
    Read,
    /// Reading and writing.
    ReadWrite,
    /// Appending.
    Append,
}

/// A trusted directory, open (see the module docs).
#[derive(Debug)]
pub struct SafeDir {
    fd: OwnedFd,
    path: PathBuf,
    uid: u32,
}

impl SafeDir {
    /// Opens the directory at `path` (absolute), creating it (mode 0700) and missing parents
    /// with `create`, after checking every directory and link on the way (module docs).
    pub fn open(path: &Path, create: bool) -> Result<SafeDir, UnixError> {
        let uid = crate::peer::effective_uid();
        let untrusted = |p: &Path, why: String| UnixError::Untrusted {
            path: p.to_path_buf(),
            why,
        };
        if !path.is_absolute() {
            return Err(untrusted(path, "must be an absolute path".into()));
        }
        let root = rustix::fs::openat(CWD, "/", dir_flags(), Mode::empty())
            .map_err(|e| UnixError::os(Op::Openat, e))?;
        // Each directory is judged as a parent when a name is looked up in it, and the last
        // one as the directory itself.
        let mut stack = vec![root];
        let mut here = PathBuf::from("/");
        let mut todo: VecDeque<OsString> = components(path);
        let mut links = 0;
        while let Some(name) = todo.pop_front() {
            if name == "." {
                continue;
            }
            if name == ".." {
                if stack.len() > 1 {
                    stack.pop();
                    here.pop();
                }
                continue;
            }
            let cur = stack.last().expect("the root stays").as_fd();
            check_parent(&fstat(cur)?, &here, uid)?;
            let next = here.join(&name);
            let st = match statat(cur, &name) {
                Err(Errno::NOENT) if create => {
                    match rustix::fs::mkdirat(cur, name.as_os_str(), Mode::from_bits_retain(0o700))
                    {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => {
                            return Err(untrusted(
                                &next,
                                format!(
                                    "cannot be created ({}); create it or choose another directory",
                                    std::io::Error::from(e)
                                ),
                            ))
                        }
                    }
                    statat(cur, &name).map_err(|e| UnixError::os(Op::Fstat, e))?
                }
                Err(Errno::NOENT) => {
                    return Err(untrusted(
                        &next,
                        "does not exist; create it or choose another directory".into(),
                    ))
                }
                Err(e) => return Err(UnixError::os(Op::Fstat, e)),
                Ok(st) => st,
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(untrusted(path, "has too many symbolic links".into()));
                    }
                    if st.st_uid != 0 && st.st_uid != uid {
                        return Err(untrusted(
                            &next,
                            format!(
                                "is a symbolic link owned by uid {}, who could point it anywhere; \
                                 give the directory it leads to instead, or have root or uid \
                                 {uid} own the link",
                                st.st_uid
                            ),
                        ));
                    }
                    let target = rustix::fs::readlinkat(cur, name.as_os_str(), Vec::new())
                        .map_err(|e| UnixError::os(Op::Readlink, e))?;
                    let target = PathBuf::from(std::ffi::OsStr::from_bytes(target.as_bytes()));
                    if target.is_absolute() {
                        stack.truncate(1);
                        here = PathBuf::from("/");
                    }
                    for c in components(&target).into_iter().rev() {
                        todo.push_front(c);
                    }
                }
                FileType::Directory => {
                    let fd = rustix::fs::openat(
                        cur,
                        name.as_os_str(),
                        dir_flags() | OFlags::NOFOLLOW,
                        Mode::empty(),
                    )
                    .map_err(|e| UnixError::os(Op::Openat, e))?;
                    // Judged (by what was opened, not by the name's earlier stat) when a name
                    // is looked up in it, or at the end.
                    stack.push(fd);
                    here = next;
                }
                _ => return Err(untrusted(&next, "is not a directory".into())),
            }
        }
        let last = stack.pop().expect("the root stays");
        let st = fstat(&last)?;
        check_own(&st, &here, uid)?;
        let fd = rustix::fs::openat(
            &last,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| UnixError::os(Op::Openat, e))?;
        let again = fstat(&fd)?;
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
            return Err(untrusted(&here, "changed while it was opened".into()));
        }
        Ok(SafeDir {
            fd,
            path: path.to_path_buf(),
            uid,
        })
    }

    /// The path the directory was opened by (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in the directory (for messages only: files are opened by
    /// descriptor).
    pub fn show(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Opens the file `name` of the directory (a single component) for `access`, never
    /// following a symbolic link; with `direct`, `O_DIRECT` when the file system takes it.
    /// Returns the descriptor and whether it is direct. An existing file must be a regular
    /// file of the effective uid.
    pub fn open_file(
        &self,
        name: &str,
        access: Access,
        create: Create,
        direct: bool,
    ) -> Result<(OwnedFd, bool), UnixError> {
        self.check_name(name)?;
        let mut flags = OFlags::CLOEXEC | OFlags::NOFOLLOW;
        flags |= match access {
            Access::Read => OFlags::RDONLY,
            Access::ReadWrite => OFlags::RDWR,
            Access::Append => OFlags::WRONLY | OFlags::APPEND,
        };
        flags |= match create {
            Create::No => OFlags::empty(),
            Create::New => OFlags::CREATE | OFlags::EXCL,
            Create::IfMissing => OFlags::CREATE,
        };
        // openat2 refuses a mode without O_CREAT.
        let mode = if create == Create::No {
            Mode::empty()
        } else {
            Mode::from_bits_retain(0o600)
        };
        let (fd, direct) = if direct {
            match self.openat(name, flags | OFlags::DIRECT, mode) {
                Ok(fd) => (fd, true),
                Err(Errno::INVAL) => (self.openat(name, flags, mode).map_err(open_err)?, false),
                Err(e) => return Err(open_err(e)),
            }
        } else {
            (self.openat(name, flags, mode).map_err(open_err)?, false)
        };
        let st = fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(UnixError::Untrusted {
                path: self.show(name),
                why: "is not a regular file; remove it".into(),
            });
        }
        if st.st_uid != self.uid {
            return Err(UnixError::Untrusted {
                path: self.show(name),
                why: format!(
                    "is owned by uid {}, not by uid {} that uses the directory; remove it",
                    st.st_uid, self.uid
                ),
            });
        }
        Ok((fd, direct))
    }

    /// Opens (creating when missing) the lock file `name`, mode 0600 (a lock file of wider
    /// mode is narrowed: a user who can open it could hold its lock).
    pub fn open_lock(&self, name: &str) -> Result<OwnedFd, UnixError> {
        let (fd, _) = self.open_file(name, Access::ReadWrite, Create::IfMissing, false)?;
        if fstat(&fd)?.st_mode & 0o077 != 0 {
            rustix::fs::fchmod(&fd, Mode::from_bits_retain(0o600))
                .map_err(|e| UnixError::os(Op::Fchmod, e))?;
        }
        Ok(fd)
    }

    /// Removes the name `name` from the directory (a link is removed, never followed).
    pub fn remove(&self, name: &str) -> Result<(), UnixError> {
        self.check_name(name)?;
        rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())
            .map_err(|e| UnixError::os(Op::Unlink, e))
    }

    /// The names in the directory (without `.` and `..`; names that are not UTF-8 skipped).
    pub fn names(&self) -> Result<Vec<String>, UnixError> {
        let dir =
            rustix::fs::Dir::read_from(&self.fd).map_err(|e| UnixError::os(Op::ReadDir, e))?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| UnixError::os(Op::ReadDir, e))?;
            if let Ok(n) = entry.file_name().to_str() {
                if n != "." && n != ".." {
                    out.push(n.to_owned());
                }
            }
        }
        Ok(out)
    }

    /// Whether `openat2` serves [`SafeDir::open_file`] here (`None` before the first file was
    /// opened); without it `openat` with `O_NOFOLLOW` does.
    pub fn has_openat2() -> Option<bool> {
        match OPENAT2.load(Ordering::Relaxed) {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        }
    }

    fn check_name(&self, name: &str) -> Result<(), UnixError> {
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
            return Err(UnixError::Untrusted {
                path: self.show(name),
                why: "is not a plain file name".into(),
            });
        }
        Ok(())
    }

    fn openat(&self, name: &str, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
        if OPENAT2.load(Ordering::Relaxed) != 2 {
            let how =
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
            match rustix::fs::openat2(&self.fd, name, flags, mode, how) {
                Err(Errno::NOSYS) => OPENAT2.store(2, Ordering::Relaxed),
                r => {
                    OPENAT2.store(1, Ordering::Relaxed);
                    return r;
                }
            }
        }
        // A single component and O_NOFOLLOW: nothing but this directory's own entry is
        // reached, and a link there is refused (ELOOP).
        rustix::fs::openat(&self.fd, name, flags, mode)
    }
}

impl AsFd for SafeDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn dir_flags() -> OFlags {
    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC
}

fn open_err(e: Errno) -> UnixError {
    UnixError::os(Op::Openat, e)
}

fn fstat(fd: impl AsFd) -> Result<Stat, UnixError> {
    rustix::fs::fstat(fd).map_err(|e| UnixError::os(Op::Fstat, e))
}

fn statat(dir: BorrowedFd<'_>, name: &OsString) -> Result<Stat, Errno> {
    rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
}

/// The path's components as names (`..` and `.` kept, the root dropped).
fn components(p: &Path) -> VecDeque<OsString> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            Component::CurDir => Some(".".into()),
            Component::RootDir | Component::Prefix(_) => None,
        })
        .collect()
}

/// A directory on the way: owned by root or `uid`, writable by nobody else unless sticky.
fn check_parent(st: &Stat, path: &Path, uid: u32) -> Result<(), UnixError> {
    let why = if st.st_uid != 0 && st.st_uid != uid {
        format!(
            "is owned by uid {}, who could replace what lies below it; choose a directory whose \
             every parent is owned by root or by uid {uid}",
            st.st_uid
        )
    } else if st.st_mode & 0o022 != 0 && st.st_mode & 0o1000 == 0 {
        format!(
            "is writable by its group or by others (mode {:04o}) without the sticky bit, so \
             another user could replace what lies below it; chmod go-w it or choose another \
             directory",
            st.st_mode & 0o7777
        )
    } else {
        return Ok(());
    };
    Err(UnixError::Untrusted {
        path: path.to_path_buf(),
        why,
    })
}

/// The directory itself: owned by `uid` and writable by nobody else.
fn check_own(st: &Stat, path: &Path, uid: u32) -> Result<(), UnixError> {
    let why = if st.st_uid != uid {
        format!(
            "is owned by uid {}, not by uid {uid} that runs this process, so that user could \
             plant or replace its files; chown it to uid {uid} or choose a directory of your own",
            st.st_uid
        )
    } else if st.st_mode & 0o022 != 0 {
        format!(
            "is writable by its group or by others (mode {:04o}), who could plant or replace its \
             files; chmod go-w it (0700 is best) or choose another directory",
            st.st_mode & 0o7777
        )
    } else {
        return Ok(());
    };
    Err(UnixError::Untrusted {
        path: path.to_path_buf(),
        why,
    })
}

#[cfg(test)]
#[path = "safedir_tests.rs"]
mod tests;
