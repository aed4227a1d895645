//! Memfds: anonymous files in memory that processes share by passing the descriptor, and the
//! seals that stop a holder from resizing one under another's mapping.

use std::ffi::CStr;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FileType as RawType, MemfdFlags};

pub use rustix::fs::SealFlags as Seals;

use crate::{Op, UnixError};

/// `MFD_HUGE_SHIFT`: where `memfd_create` takes the log2 of a huge page size.
const HUGE_SHIFT: u32 = 26;
/// `HUGETLBFS_MAGIC`, the `f_type` of a file of huge pages.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// A new close-on-exec memfd named `name` (shown as `/memfd:<name>` in `/proc/<pid>/maps`)
/// that takes seals, sized `len` bytes; of huge pages of `huge_page` bytes (a power of two)
/// when given.
pub fn create(name: &CStr, len: u64, huge_page: Option<u64>) -> Result<OwnedFd, UnixError> {
    create_with(
        name,
        len,
        huge_page,
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
}

/// [`create`] without `MFD_ALLOW_SEALING`: a memfd no holder can ever seal (the pool's own
/// memory, which clients map but must not be able to freeze or fix in size).
pub fn create_unsealable(
    name: &CStr,
    len: u64,
    huge_page: Option<u64>,
) -> Result<OwnedFd, UnixError> {
    create_with(name, len, huge_page, MemfdFlags::CLOEXEC)
}

fn create_with(
    name: &CStr,
    len: u64,
    huge_page: Option<u64>,
    mut flags: MemfdFlags,
) -> Result<OwnedFd, UnixError> {
    if let Some(h) = huge_page {
        flags |=
            MemfdFlags::HUGETLB | MemfdFlags::from_bits_retain(h.trailing_zeros() << HUGE_SHIFT);
    }
    let fd =
        rustix::fs::memfd_create(name, flags).map_err(|e| UnixError::os(Op::MemfdCreate, e))?;
    rustix::fs::ftruncate(&fd, len).map_err(|e| UnixError::os(Op::Ftruncate, e))?;
    Ok(fd)
}

/// [`create`], then sealed with `seals`.
pub fn create_sealed(
    name: &CStr,
    len: u64,
    huge_page: Option<u64>,
    seals: Seals,
) -> Result<OwnedFd, UnixError> {
    let fd = create(name, len, huge_page)?;
    add_seals(fd.as_fd(), seals)?;
    Ok(fd)
}

/// Adds `seals` to the memfd `fd`.
pub fn add_seals(fd: impl AsFd, seals: Seals) -> Result<(), UnixError> {
    rustix::fs::fcntl_add_seals(fd, seals).map_err(|e| UnixError::os(Op::AddSeals, e))
}

/// The seals of `fd`; fails (`EINVAL`) for a file that cannot carry seals (anything but a
/// memfd made with `MFD_ALLOW_SEALING`).
pub fn seals(fd: impl AsFd) -> Result<Seals, UnixError> {
    rustix::fs::fcntl_get_seals(fd).map_err(|e| UnixError::os(Op::GetSeals, e))
}

/// What kind of file a descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    /// A regular file (a memfd is one).
    Regular,
    /// A pipe.
    Fifo,
    /// A socket.
    Socket,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A directory.
    Directory,
    /// A symbolic link or anything else.
    Other,
}

/// What `fstat` tells of a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    /// What it is.
    pub file_type: FileType,
    /// Its size in bytes.
    pub size: u64,
}

/// What `fstat` tells of `fd`.
pub fn file_info(fd: impl AsFd) -> Result<FileInfo, UnixError> {
    let st = rustix::fs::fstat(fd).map_err(|e| UnixError::os(Op::Fstat, e))?;
    let file_type = match RawType::from_raw_mode(st.st_mode) {
        RawType::RegularFile => FileType::Regular,
        RawType::Fifo => FileType::Fifo,
        RawType::Socket => FileType::Socket,
        RawType::CharacterDevice => FileType::CharDevice,
        RawType::BlockDevice => FileType::BlockDevice,
        RawType::Directory => FileType::Directory,
        _ => FileType::Other,
    };
    Ok(FileInfo {
        file_type,
        size: st.st_size.max(0) as u64,
    })
}

/// The huge page size of `fd` when it is a file of huge pages (hugetlbfs, or a memfd made with
/// `MFD_HUGETLB`); `None` for anything else, or when `fstatfs` fails.
pub fn hugetlb_page_size(fd: impl AsFd) -> Option<u64> {
    let fs = rustix::fs::fstatfs(fd).ok()?;
    (fs.f_type as i64 == HUGETLBFS_MAGIC).then_some(fs.f_bsize as u64)
}

/// Reads into `buf` from `offset` of `fd` (`pread`, again when a signal interrupts it): the
/// bytes read, 0 at the end of the file.
pub fn read_at(fd: impl AsFd, buf: &mut [u8], offset: u64) -> Result<usize, UnixError> {
    loop {
        match rustix::io::pread(fd.as_fd(), &mut *buf, offset) {
            Ok(n) => return Ok(n),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(UnixError::os(Op::Pread, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn a_sealed_memfd_cannot_grow_or_shrink() {
        let fd = create_sealed(c"umbp-test", 8192, None, Seals::SHRINK | Seals::GROW).unwrap();
        let s = seals(&fd).unwrap();
        assert!(s.contains(Seals::SHRINK | Seals::GROW) && !s.contains(Seals::SEAL));
        let info = file_info(&fd).unwrap();
        assert_eq!(
            info,
            FileInfo {
                file_type: FileType::Regular,
                size: 8192
            }
        );
        assert_eq!(hugetlb_page_size(&fd), None);
        let mut f = File::from(fd);
        assert!(f.set_len(4096).is_err(), "shrinking a sealed memfd");
        assert!(f.set_len(16384).is_err(), "growing a sealed memfd");
        // Writes inside the file are allowed, past its end they would grow it.
        f.write_all(b"kv").unwrap();
        f.seek(SeekFrom::Start(8191)).unwrap();
        assert!(f.write_all(b"xy").is_err(), "a write that grows it");
        let mut back = [0u8; 2];
        assert_eq!(read_at(&f, &mut back, 0).unwrap(), 2);
        assert_eq!(&back, b"kv");
        assert_eq!(read_at(&f, &mut back, 8192).unwrap(), 0);
    }

    #[test]
    fn seal_seal_forbids_more_seals_and_plain_files_have_none() {
        let fd = create_sealed(c"umbp-test", 4096, None, Seals::SEAL).unwrap();
        assert!(add_seals(&fd, Seals::SHRINK).is_err());
        let unsealed = create(c"umbp-test", 4096, None).unwrap();
        assert!(seals(&unsealed).unwrap().is_empty());
        add_seals(&unsealed, Seals::SHRINK).unwrap();
        assert!(seals(&unsealed).unwrap().contains(Seals::SHRINK));
        // Without MFD_ALLOW_SEALING the kernel reports F_SEAL_SEAL and refuses any seal.
        let never = create_unsealable(c"umbp-test", 4096, None).unwrap();
        assert_eq!(seals(&never).unwrap(), Seals::SEAL);
        assert!(add_seals(&never, Seals::SHRINK).is_err());
        assert_eq!(file_info(&never).unwrap().size, 4096);

        let (r, _w) = std::io::pipe().unwrap();
        let e = seals(&r).unwrap_err();
        assert_eq!(e.op(), Op::GetSeals);
        assert_eq!(file_info(&r).unwrap().file_type, FileType::Fifo);
    }
}
