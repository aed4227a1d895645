//! The pool's memory: one mapping of the configured capacity.
//!
//! Huge pages are asked for explicitly (`MAP_HUGETLB` / `MFD_HUGETLB`) without `MAP_NORESERVE`,
//! so a machine without enough of them refuses at map time (never with a `SIGBUS` later); the
//! region then falls back to normal pages with transparent huge pages advised, logs a warning,
//! and records what was asked and what was got in its [`Placement`].

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use umbp_core::{CoreError, HugepageSize, MemoryBacking, PoolConfig};
use umbp_unix::arena::Arena;
use umbp_unix::{memfd, Op, UnixError};

use crate::PoolError;

const PAGE: u64 = 4096;
const THP_ALIGN: usize = 2 << 20;
/// Bytes one prefault step covers.
const PREFAULT_CHUNK: usize = 64 << 20;

/// Where and how the pool's memory was placed: what was asked and what was got.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Bytes mapped.
    pub bytes: u64,
    /// Anonymous or memfd.
    pub backing: MemoryBacking,
    /// Huge page size asked for, if any.
    pub hugepages_requested: Option<HugepageSize>,
    /// Huge page size in use, if any (None after a fallback).
    pub hugepages_used: Option<HugepageSize>,
    /// Why huge pages were not used, when they were asked for and refused.
    pub hugepage_fallback: Option<String>,
    /// NUMA node the memory is bound to.
    pub numa_node: Option<u32>,
    /// Whether every page was touched up front.
    pub prefaulted: bool,
    /// Seconds the prefault took.
    pub prefault_seconds: f64,
}

impl Placement {
    /// Memory just mapped: `bytes` of `backing` with huge pages `huge`, not yet bound to a
    /// node or prefaulted.
    fn mapped(bytes: u64, backing: MemoryBacking, huge: Option<HugepageSize>) -> Placement {
        Placement {
            bytes,
            backing,
            hugepages_requested: huge,
            hugepages_used: huge,
            hugepage_fallback: None,
            numa_node: None,
            prefaulted: false,
            prefault_seconds: 0.0,
        }
    }
}

/// One mapping of pool memory (a [`umbp_unix::arena::Arena`]). Unmapped on drop.
#[derive(Debug)]
pub struct Region {
    arena: Arena,
    fd: Option<OwnedFd>,
    placement: Placement,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Checks that NUMA node `node` exists on this machine.
pub fn check_numa_node(node: u32) -> Result<(), CoreError> {
    let root = Path::new("/sys/devices/system/node");
    if root.join(format!("node{node}")).exists() {
        return Ok(());
    }
    let online = std::fs::read_to_string(root.join("online"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned());
    Err(CoreError::option(
        "dram_numa_node",
        format!("NUMA node {node} does not exist on this machine (online nodes: {online}); pick one of those or leave it unset"),
    ))
}

/// Bytes of memory the kernel says are available on the host (`MemAvailable`), if it says.
fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Memory this process may still use, and what limits it.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryAvailable {
    /// Bytes: the smallest of the host's `MemAvailable` and, for the process's memory cgroup
    /// and each cgroup above it, its limit minus its usage (reclaimable file pages counted as
    /// free).
    pub bytes: u64,
    /// What sets `bytes`: "this host" or "the memory cgroup <dir> (limit N bytes)".
    pub source: String,
}

/// Memory this process may still use: the host's `MemAvailable`, or less where a memory
/// cgroup (v2 or v1) of this process, or one above it, has less room. None when neither can
/// be read.
pub fn memory_available() -> Option<MemoryAvailable> {
    let host = host_available().map(|bytes| MemoryAvailable {
        bytes,
        source: "this host".into(),
    });
    let cg = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .zip(std::fs::read_to_string("/proc/self/mountinfo").ok())
        .and_then(|(c, m)| cgroup_available(&c, &m));
    match (host, cg) {
        (Some(h), Some(c)) if c.bytes < h.bytes => Some(c),
        (Some(h), _) => Some(h),
        (None, c) => c,
    }
}

/// Limits above this are "unlimited" (cgroup v1 writes 2^63 rounded down to a page).
const NO_LIMIT: u64 = 1 << 62;

fn read_u64(p: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(p).ok()?;
    let s = s.trim();
    if s == "max" {
        return Some(u64::MAX);
    }
    s.parse().ok()
}

fn stat_field(p: &Path, name: &str) -> u64 {
    std::fs::read_to_string(p)
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == name).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or(0)
}

/// The tightest memory cgroup of this process (from `/proc/self/cgroup` and
/// `/proc/self/mountinfo` texts), walking from its own cgroup up to the mount's root.
pub(crate) fn cgroup_available(proc_cgroup: &str, mountinfo: &str) -> Option<MemoryAvailable> {
    let mut best: Option<MemoryAvailable> = None;
    for line in mountinfo.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(dash) = f.iter().position(|x| *x == "-") else {
            continue;
        };
        let (Some(root), Some(mnt), Some(fstype)) = (f.get(3), f.get(4), f.get(dash + 1)) else {
            continue;
        };
        let v2 = *fstype == "cgroup2";
        let v1 = *fstype == "cgroup"
            && f.get(dash + 3)
                .is_some_and(|o| o.split(',').any(|x| x == "memory"));
        if !v1 && !v2 {
            continue;
        }
        // This process's path in that hierarchy.
        let Some(path) = proc_cgroup.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrl, path) = (p.next()?, p.next()?, p.next()?);
            let mine = if v2 {
                ctrl.is_empty()
            } else {
                ctrl.split(',').any(|x| x == "memory")
            };
            mine.then_some(path)
        }) else {
            continue;
        };
        let rel = if *root == "/" {
            path
        } else {
            path.strip_prefix(root).unwrap_or("/")
        };
        let top = Path::new(mnt);
        let mut dir = top.join(rel.trim_start_matches('/'));
        let (limit_f, usage_f, stat_f, inactive) = if v2 {
            (
                "memory.max",
                "memory.current",
                "memory.stat",
                "inactive_file",
            )
        } else {
            (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "memory.stat",
                "total_inactive_file",
            )
        };
        loop {
            if let (Some(limit), Some(usage)) =
                (read_u64(&dir.join(limit_f)), read_u64(&dir.join(usage_f)))
            {
                if limit < NO_LIMIT {
                    let free = limit
                        .saturating_sub(usage)
                        .saturating_add(stat_field(&dir.join(stat_f), inactive))
                        .min(limit);
                    if best.as_ref().is_none_or(|b| free < b.bytes) {
                        best = Some(MemoryAvailable {
                            bytes: free,
                            source: format!(
                                "the memory cgroup {} (limit {limit} bytes)",
                                dir.display()
                            ),
                        });
                    }
                }
            }
            if dir == top || !dir.pop() || !dir.starts_with(top) {
                break;
            }
        }
    }
    best
}

impl Region {
    /// Maps, binds and (optionally) prefaults the pool's memory as `cfg` says.
    pub fn map(cfg: &PoolConfig) -> Result<Region, PoolError> {
        cfg.validate()?;
        if cfg.prefault && !cfg.use_hugepages {
            if let Some(avail) = memory_available() {
                if cfg.capacity_bytes > avail.bytes {
                    return Err(CoreError::option(
                        "capacity_bytes",
                        format!(
                            "{} bytes cannot be prefaulted: only {} bytes of memory are available to this process ({}); \
                             lower capacity_bytes/total_capacity_bytes, or set dram_prefault false to populate on demand",
                            cfg.capacity_bytes, avail.bytes, avail.source
                        ),
                    )
                    .into());
                }
            }
        }
        if let Some(node) = cfg.numa_node {
            check_numa_node(node)?;
        }
        let requested = cfg.use_hugepages.then_some(cfg.hugepage_size);
        let (mut region, fallback) = match requested {
            Some(size) => match Self::map_raw(cfg, Some(size)) {
                Ok(r) => (r, None),
                Err(e) => {
                    let why = e.to_string();
                    log::warn!(
                        "umbp: huge pages of {size} were asked for ({} bytes) but the kernel refused them ({why}); \
                         falling back to normal pages with transparent huge pages advised. Reserve them with \
                         `echo N > /sys/kernel/mm/hugepages/hugepages-{}kB/nr_hugepages` to get them",
                        cfg.capacity_bytes,
                        size.bytes() / 1024
                    );
                    (Self::map_raw(cfg, None)?, Some(why))
                }
            },
            None => (Self::map_raw(cfg, None)?, None),
        };
        region.placement.hugepages_requested = requested;
        region.placement.hugepage_fallback = fallback;
        if let Some(node) = cfg.numa_node {
            region.bind(node)?;
        }
        if cfg.prefault {
            let threads = if cfg.prefault_threads == 0 {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
                    .min(8)
            } else {
                cfg.prefault_threads
            };
            region.prefault(threads);
        }
        Ok(region)
    }

    /// Maps pool memory another process filled and handed over (its memfd, `fd`): it must be
    /// a memfd of exactly the bytes a pool of `cfg` maps, with `cfg`'s huge pages. Nothing is
    /// prefaulted (the pages are there); NUMA binding is not applied again.
    pub fn adopt(cfg: &PoolConfig, fd: OwnedFd) -> Result<Region, PoolError> {
        let huge = cfg.use_hugepages.then_some(cfg.hugepage_size);
        let page = huge.map_or(PAGE, HugepageSize::bytes);
        let bytes = round_up(cfg.capacity_bytes, page);
        let refuse = |why: String| PoolError::Image { reason: why };
        let info = memfd::file_info(&fd)
            .map_err(|e| refuse(format!("cannot fstat the pool's memfd: {}", e.to_io())))?;
        if info.size != bytes {
            return Err(refuse(format!(
                "the pool's memory is {} bytes, this server's pool would be {bytes}: start it \
                 with the old --capacity",
                info.size
            )));
        }
        let fd_huge = memfd::hugetlb_page_size(&fd);
        if fd_huge != huge.map(HugepageSize::bytes) {
            return Err(refuse(format!(
                "the pool's memory has {} pages, this server asks for {}: start it with the \
                 old huge page settings",
                fd_huge.map_or("normal".into(), |p| format!("{p}-byte")),
                huge.map_or("normal".into(), |h| format!("{}-byte", h.bytes()))
            )));
        }
        let len = mappable_len(bytes)?;
        let arena = Arena::shared(&fd, len).map_err(|e| map_error(bytes, e))?;
        if huge.is_none() {
            arena.advise_hugepage();
        }
        Ok(Region {
            arena,
            fd: Some(fd),
            placement: Placement::mapped(bytes, MemoryBacking::Memfd, huge),
        })
    }

    fn map_raw(cfg: &PoolConfig, huge: Option<HugepageSize>) -> Result<Region, PoolError> {
        let page = huge.map_or(PAGE, HugepageSize::bytes);
        let bytes = round_up(cfg.capacity_bytes, page);
        let len = mappable_len(bytes)?;
        let failed = |e: UnixError| map_error(bytes, e);
        let huge_page = huge.map(HugepageSize::bytes);
        let (arena, fd) = match cfg.backing {
            // Normal pages are over-mapped by 2 MiB and trimmed to a 2 MiB boundary, so
            // transparent huge pages can back all of them.
            MemoryBacking::Anonymous => {
                let arena = match huge_page {
                    Some(p) => Arena::anonymous_huge(len, p),
                    None => Arena::anonymous_aligned(len, THP_ALIGN),
                };
                (arena.map_err(failed)?, None)
            }
            MemoryBacking::Memfd => {
                let fd =
                    memfd::create_unsealable(c"umbp-pool", bytes, huge_page).map_err(failed)?;
                (Arena::shared(&fd, len).map_err(failed)?, Some(fd))
            }
        };
        if huge.is_none() {
            arena.advise_hugepage();
        }
        Ok(Region {
            arena,
            fd,
            placement: Placement::mapped(bytes, cfg.backing, huge),
        })
    }

    fn bind(&mut self, node: u32) -> Result<(), PoolError> {
        if node >= 1024 {
            return Err(
                CoreError::option("dram_numa_node", format!("node {node} is beyond 1023")).into(),
            );
        }
        self.arena
            .bind_to_node(node)
            .map_err(|e| map_error(self.arena.len() as u64, e))?;
        self.placement.numa_node = Some(node);
        Ok(())
    }

    /// Populates every page with `threads` threads, 64 MiB at a time, logging progress every
    /// two seconds for regions of 1 GiB or more. Uses `MADV_POPULATE_WRITE`, which allocates
    /// pages without writing them; kernels older than 5.14 get one byte per page touched.
    fn prefault(&mut self, threads: usize) {
        let start = Instant::now();
        let page = self
            .placement
            .hugepages_used
            .map_or(PAGE, HugepageSize::bytes) as usize;
        let chunks = self.arena.len().div_ceil(PREFAULT_CHUNK);
        let threads = threads.clamp(1, chunks.max(1));
        let next = AtomicU64::new(0);
        let done = AtomicU64::new(0);
        let arena = &self.arena;
        let len = arena.len();
        let total = len as u64;
        let loud = total >= (1 << 30);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        if loud {
            log::info!(
                "umbp: prefaulting {:.1} GiB with {threads} threads",
                gib(total)
            );
        }
        std::thread::scope(|s| {
            let (next, done) = (&next, &done);
            let mut workers = Vec::new();
            for _ in 0..threads {
                workers.push(s.spawn(move || loop {
                    let c = next.fetch_add(1, Ordering::Relaxed) as usize;
                    if c >= chunks {
                        return;
                    }
                    let at = c * PREFAULT_CHUNK;
                    let n = PREFAULT_CHUNK.min(len - at);
                    if arena.populate_write(at, n).is_err() {
                        arena.touch_pages(at, n, page);
                    }
                    done.fetch_add(n as u64, Ordering::Relaxed);
                }));
            }
            if loud {
                let mut last_log = Instant::now();
                while workers.iter().any(|w| !w.is_finished()) {
                    std::thread::sleep(Duration::from_millis(20));
                    if last_log.elapsed() >= Duration::from_secs(2) {
                        last_log = Instant::now();
                        let d = done.load(Ordering::Relaxed);
                        log::info!(
                            "umbp: prefault {:.0}% ({:.1} of {:.1} GiB)",
                            100.0 * d as f64 / total as f64,
                            gib(d),
                            gib(total)
                        );
                    }
                }
            }
        });
        let secs = start.elapsed().as_secs_f64();
        if loud {
            log::info!(
                "umbp: prefault done in {secs:.2}s ({:.3} s/GiB)",
                secs / gib(total)
            );
        }
        self.placement.prefaulted = true;
        self.placement.prefault_seconds = secs;
    }

    /// Address of the first byte.
    pub fn base(&self) -> *mut u8 {
        self.arena.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.arena.len()
    }

    /// Whether the region is empty (never, once mapped).
    pub fn is_empty(&self) -> bool {
        self.arena.is_empty()
    }

    /// The memfd behind the region, for sharing with other processes.
    pub fn fd(&self) -> Option<&OwnedFd> {
        self.fd.as_ref()
    }

    /// What was asked for and what was got.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
}

/// `bytes` as a mapping's length, refused where the address space is smaller.
fn mappable_len(bytes: u64) -> Result<usize, PoolError> {
    usize::try_from(bytes).map_err(|_| PoolError::Map {
        bytes,
        what: "size",
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "larger than this machine's address space",
        ),
    })
}

/// A failed mapping call as the pool reports it: the call (named as before the calls moved to
/// umbp-unix) and its errno.
fn map_error(bytes: u64, e: UnixError) -> PoolError {
    PoolError::Map {
        bytes,
        what: match e.op() {
            Op::Ftruncate => "ftruncate",
            Op::Mbind => "mbind (dram_numa_node)",
            op => op.name(),
        },
        source: e.to_io(),
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;

    fn cfg(bytes: u64) -> PoolConfig {
        PoolConfig {
            prefault_threads: 2,
            ..PoolConfig::with_capacity(bytes)
        }
    }

    #[test]
    fn maps_and_prefaults() {
        let r = Region::map(&cfg(8 << 20)).unwrap();
        assert_eq!(r.len(), 8 << 20);
        assert!(r.placement().prefaulted);
        // SAFETY: the region is 8 MiB and owned by this test.
        unsafe {
            r.base().add(r.len() - 1).write(7);
            assert_eq!(*r.base().add(r.len() - 1), 7);
        }
    }

    #[test]
    fn memfd_backing_has_a_descriptor() {
        let r = Region::map(&PoolConfig {
            backing: MemoryBacking::Memfd,
            ..cfg(2 << 20)
        })
        .unwrap();
        assert!(r.fd().is_some());
        assert_eq!(r.placement().backing, MemoryBacking::Memfd);
    }

    #[test]
    fn hugepage_request_falls_back_when_refused() {
        // 1 GiB pages are never reserved on CI machines, so this exercises the fallback; where
        // they are, the mapping must report them as used.
        let r = Region::map(&PoolConfig {
            use_hugepages: true,
            hugepage_size: HugepageSize::Size1GiB,
            prefault: false,
            ..cfg(1 << 30)
        })
        .unwrap();
        let p = r.placement();
        assert_eq!(p.hugepages_requested, Some(HugepageSize::Size1GiB));
        assert!(
            p.hugepages_used.is_some() != p.hugepage_fallback.is_some(),
            "either used or fell back with a reason: {p:?}"
        );
    }

    #[test]
    fn prefaulting_more_than_the_host_has_is_refused() {
        let e = Region::map(&PoolConfig::with_capacity(1 << 50))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("capacity_bytes") && e.contains("dram_prefault"),
            "{e}"
        );
    }

    #[test]
    fn cgroup_limits_are_read_for_v2_and_v1_up_the_hierarchy() {
        let d = std::env::temp_dir().join(format!("umbp-cg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let w = |p: &str, v: &str| {
            let p = d.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, v).unwrap();
        };
        // v2: the parent's limit is tighter than the process's own (which has none).
        w("v2/a/memory.max", "1073741824\n");
        w("v2/a/memory.current", "100\n");
        w("v2/a/memory.stat", "anon 100\ninactive_file 50\n");
        w("v2/a/b/memory.max", "max\n");
        w("v2/a/b/memory.current", "100\n");
        // v1, mounted with its root at /outer (a namespaced container view).
        w("v1/c/memory.limit_in_bytes", "2147483648\n");
        w("v1/c/memory.usage_in_bytes", "1000\n");
        w("v1/memory.limit_in_bytes", "9223372036854771712\n");
        w("v1/memory.usage_in_bytes", "5\n");
        let mi = |v2: bool| {
            if v2 {
                format!(
                    "41 31 0:38 / {} rw - cgroup2 cgroup2 rw\n",
                    d.join("v2").display()
                )
            } else {
                format!(
                    "35 31 0:32 /outer {} rw - cgroup cgroup rw,memory\n",
                    d.join("v1").display()
                )
            }
        };
        let a = cgroup_available("0::/a/b\n", &mi(true)).unwrap();
        assert_eq!(a.bytes, (1 << 30) - 100 + 50);
        assert!(
            a.source.contains("v2/a ") && a.source.contains("1073741824"),
            "{a:?}"
        );
        let a = cgroup_available("4:memory:/outer/c\n0::/\n", &mi(false)).unwrap();
        assert_eq!(a.bytes, (2 << 30) - 1000);
        assert!(
            cgroup_available("4:memory:/outer\n", &mi(false)).is_none(),
            "no limit"
        );
        assert!(cgroup_available("4:cpu:/x\n", &mi(false)).is_none());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_numa_node_names_the_option() {
        let e = Region::map(&PoolConfig {
            numa_node: Some(4000),
            ..cfg(2 << 20)
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("dram_numa_node") && e.contains("4000"), "{e}");
    }

    #[test]
    fn existing_numa_node_binds() {
        if check_numa_node(0).is_err() {
            return; // no sysfs NUMA information in this sandbox
        }
        let r = Region::map(&PoolConfig {
            numa_node: Some(0),
            ..cfg(4 << 20)
        })
        .unwrap();
        assert_eq!(r.placement().numa_node, Some(0));
    }
}
