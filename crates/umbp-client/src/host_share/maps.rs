//! This process's mappings, read from `/proc/self/smaps`: which overlap a range, what kind
//! of memory each is (and whether it can be shared), and finding an open descriptor of the
//! memfd a mapping shows.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use umbp_unix::clock::page_size;

use crate::error::ClientError;

/// One mapping of this process, from `/proc/self/smaps`.
#[derive(Debug, Clone, Default)]
pub(super) struct Vma {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) perms: String,
    pub(super) offset: u64,
    pub(super) dev: (u32, u32),
    pub(super) inode: u64,
    pub(super) path: String,
    /// `KernelPageSize`, bytes.
    pub(super) page: u64,
    /// `VmFlags`, two-letter codes.
    pub(super) flags: Vec<String>,
    /// `AnonHugePages`, bytes: transparent huge pages backing it.
    pub(super) anon_huge: u64,
}

impl Vma {
    pub(super) fn flag(&self, f: &str) -> bool {
        self.flags.iter().any(|x| x == f)
    }
}

/// Parses an smaps header line (`start-end perms offset major:minor inode   path`).
fn parse_header(line: &str) -> Option<Vma> {
    let mut it = line.splitn(6, ' ');
    let (range, perms, offset, dev, inode) =
        (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
    let (s, e) = range.split_once('-')?;
    let (ma, mi) = dev.split_once(':')?;
    Some(Vma {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms: perms.to_owned(),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: (
            u32::from_str_radix(ma, 16).ok()?,
            u32::from_str_radix(mi, 16).ok()?,
        ),
        inode: inode.parse().ok()?,
        path: it.next().unwrap_or("").trim().to_owned(),
        page: 0,
        flags: Vec::new(),
        anon_huge: 0,
    })
}

/// The mappings of this process that overlap `[lo, hi)`, in address order. Reads
/// `/proc/self/smaps` only as far as `hi` (the kernel builds it as it is read).
pub(super) fn vmas_overlapping(lo: u64, hi: u64) -> Result<Vec<Vma>, ClientError> {
    let f = std::fs::File::open("/proc/self/smaps").map_err(ClientError::ShareProc)?;
    let mut out: Vec<Vma> = Vec::new();
    let mut cur: Option<Vma> = None;
    let finish = |v: Vma, out: &mut Vec<Vma>| {
        if v.end > lo && v.start < hi {
            out.push(v);
        }
    };
    for line in BufReader::new(f).lines() {
        let line = line.map_err(ClientError::ShareProc)?;
        if let Some(v) = parse_header(&line) {
            if let Some(done) = cur.take() {
                finish(done, &mut out);
            }
            if v.start >= hi {
                return Ok(out);
            }
            cur = Some(v);
        } else if let Some(v) = cur.as_mut() {
            if let Some(rest) = line.strip_prefix("KernelPageSize:") {
                let kib: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(4);
                v.page = kib * 1024;
            } else if let Some(rest) = line.strip_prefix("AnonHugePages:") {
                let kib: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(0);
                v.anon_huge = kib * 1024;
            } else if let Some(rest) = line.strip_prefix("VmFlags:") {
                v.flags = rest.split_whitespace().map(str::to_owned).collect();
            }
        }
    }
    if let Some(done) = cur.take() {
        finish(done, &mut out);
    }
    Ok(out)
}

/// What kind of memory a mapping is, for sharing.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Kind {
    /// Private anonymous memory of normal pages (malloc, mmap MAP_ANONYMOUS, THP included).
    Anon,
    /// Private anonymous huge pages (MAP_HUGETLB) of this size.
    Hugetlb(u64),
    /// A shared mapping of a memfd: its device and inode, the address of its offset 0, its
    /// page size and whether they are huge pages.
    Memfd {
        dev: (u32, u32),
        inode: u64,
        base: u64,
        page: u64,
        hugetlb: bool,
    },
}

/// The kind of `v`, or what it is and what to do instead.
pub(super) fn classify(v: &Vma) -> Result<Kind, (String, String)> {
    let anon_fix = || {
        "share private anonymous memory (malloc, mmap MAP_PRIVATE | MAP_ANONYMOUS, a torch CPU \
         tensor) or allocate the cache with alloc_shared_host"
            .to_owned()
    };
    if !v.perms.starts_with("rw") {
        return Err((
            format!("not readable and writable (permissions {})", v.perms),
            "share memory the process reads and writes; the server writes it too".into(),
        ));
    }
    for (flag, what) in [
        ("io", "device I/O memory"),
        ("pf", "a raw page-frame mapping"),
    ] {
        if v.flag(flag) {
            return Err((what.into(), anon_fix()));
        }
    }
    if v.flag("dc") {
        return Err((
            "marked MADV_DONTFORK, as memory pinned for a device (RDMA, a GPU) usually is".into(),
            "share memory no device has registered: a device keeps using the old pages after the \
             move; if nothing pins it, clear the mark with madvise(MADV_DOFORK)"
                .into(),
        ));
    }
    let private = v.perms.as_bytes().get(3) == Some(&b'p');
    if private {
        if v.flag("ht") {
            if v.path.starts_with("/anon_hugepage") {
                return Ok(Kind::Hugetlb(v.page));
            }
            return Err((
                format!("a private mapping of the hugetlbfs file {}", v.path),
                anon_fix(),
            ));
        }
        let anonymous = v.path.is_empty() || v.path == "[heap]" || v.path.starts_with("[anon:");
        if v.inode == 0 && anonymous {
            return Ok(Kind::Anon);
        }
        let what = if v.path.starts_with('[') {
            format!("the {} mapping", v.path)
        } else {
            format!("a private mapping of the file {}", v.path)
        };
        return Err((what, anon_fix()));
    }
    if v.path.starts_with("/memfd:") {
        return Ok(Kind::Memfd {
            dev: v.dev,
            inode: v.inode,
            base: v.start.wrapping_sub(v.offset),
            page: v.page.max(page_size()),
            hugetlb: v.flag("ht"),
        });
    }
    let what = if v.path.is_empty() || v.path.starts_with("/dev/zero") {
        "shared anonymous memory (MAP_SHARED | MAP_ANONYMOUS), which has no descriptor".to_owned()
    } else {
        format!("a shared mapping of {}", v.path)
    };
    Err((what, anon_fix()))
}

/// A descriptor open in this process for the file `(dev, inode)`, duplicated.
pub(super) fn find_open_fd(dev: (u32, u32), inode: u64) -> Option<OwnedFd> {
    let same = |raw: libc::c_int| {
        // SAFETY: `stat` is plain data filled by fstat; a stale number only fails.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let ok = unsafe { libc::fstat(raw, &mut st) } == 0;
        ok && libc::major(st.st_dev) == dev.0
            && libc::minor(st.st_dev) == dev.1
            && st.st_ino == inode
    };
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(raw) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        if !same(raw) {
            continue;
        }
        // SAFETY: duplicating a descriptor number of this process; a number closed meanwhile
        // fails or names another file, which the check after it catches.
        let dup = unsafe { libc::fcntl(raw, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            continue;
        }
        // SAFETY: `dup` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(dup) };
        if same(fd.as_raw_fd()) {
            return Some(fd);
        }
    }
    None
}
