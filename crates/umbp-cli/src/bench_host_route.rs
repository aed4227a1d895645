//! `umbp bench host-route`: how the standalone server can best reach a client process's host
//! memory (a CPU engine's KV cache), measured side by side in one run.
//!
//! For each page kind and piece size, `--total-mib` bytes move each way between a pool-like
//! buffer of this process (pieces in order) and a client's memory (pieces in a random order,
//! as the blocks of a KV cache are):
//! * **memcpy**: between two buffers of this process, the ceiling;
//! * **(a) shm**: between the pool buffer and this process's `MAP_SHARED` mapping
//!   (`umbp_pool::ServerMapping`) of a forked child's memory, made shareable in place by
//!   `umbp_client::host_share::share_host_range` and sent over a socket (`SCM_RIGHTS`);
//! * **(b) pvm**: `process_vm_readv`/`process_vm_writev` against a forked child's private
//!   anonymous memory, one iovec pair per piece, up to `IOV_MAX` pieces per call.
//!
//! memcpy and (a) copy with the copy engine's own function (`umbp_copy::memcpy::copy`), so the
//! two differ only in where the client's bytes are.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde_json::json;
use umbp_pool::ServerMapping;

use crate::common::progress;

/// The most iovecs one `process_vm_readv`/`writev` call takes (`UIO_MAXIOV`).
const IOV_MAX: usize = 1024;
/// Buffers start on this boundary, so transparent huge pages can back them whole.
const ALIGN: usize = 2 << 20;
/// Pieces whose bytes are checked in each warm-up round.
const SAMPLES: usize = 64;

/// Which pages back the buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PageMode {
    /// 4 KiB pages (transparent huge pages refused with MADV_NOHUGEPAGE).
    #[value(name = "4k")]
    Small,
    /// Transparent huge pages asked for with MADV_HUGEPAGE, where the host grants them.
    Thp,
}

impl PageMode {
    fn name(self) -> &'static str {
        match self {
            PageMode::Small => "4k",
            PageMode::Thp => "thp",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// MiB moved per case and direction (also the size of every buffer).
    #[arg(long, default_value_t = 1024)]
    total_mib: u64,
    /// Piece sizes, comma-separated; k and m mean KiB and MiB.
    #[arg(long, value_delimiter = ',', default_value = "4k,16k,64k,256k,1m", value_parser = parse_size)]
    pieces: Vec<u64>,
    /// Page kinds, comma-separated: 4k, thp.
    #[arg(long, value_delimiter = ',', default_value = "4k,thp")]
    pages: Vec<PageMode>,
    /// Copy threads per transfer (each takes an equal share of the pieces).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Measured rounds (the best is reported), after one warm-up round whose bytes are checked.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = t.strip_suffix('k') {
        (n, 1u64 << 10)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 1 << 20)
    } else {
        (t.as_str(), 1)
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (examples: 4096, 16k, 1m)"))
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// An anonymous private buffer of this process, 2 MiB-aligned. Unmapped on drop.
struct Buf {
    addr: usize,
    len: usize,
}

impl Buf {
    fn map(len: usize, mode: PageMode) -> Result<Buf> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing; checked below.
        let r = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + ALIGN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        ensure!(
            r != libc::MAP_FAILED,
            "cannot map {len} bytes: {}; lower --total-mib",
            std::io::Error::last_os_error()
        );
        let head = r.cast::<u8>().align_offset(ALIGN);
        let addr = r as usize + head;
        // SAFETY: trimming the unused ends (`head < ALIGN`) of the mapping just made.
        unsafe {
            if head > 0 {
                libc::munmap(r, head);
            }
            if ALIGN - head > 0 {
                libc::munmap((addr + len) as *mut libc::c_void, ALIGN - head);
            }
        }
        let advice = match mode {
            PageMode::Small => libc::MADV_NOHUGEPAGE,
            PageMode::Thp => libc::MADV_HUGEPAGE,
        };
        // SAFETY: advising our own mapping; a refusal only leaves the default pages.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, advice) };
        Ok(Buf { addr, len })
    }

    /// Writes every byte (allocating every page).
    fn fill(&self, byte: u8) {
        // SAFETY: the whole mapping is ours and nothing else uses it yet.
        unsafe { std::ptr::write_bytes(self.addr as *mut u8, byte, self.len) };
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our own mapping; no copies run after the benchmark.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// Where the client's bytes are reached.
#[derive(Debug, Clone, Copy)]
enum Client {
    /// Memory mapped in this process at this address (the ceiling's buffer, or route (a)).
    Local(usize),
    /// Another process's memory (route (b)).
    Remote { pid: libc::pid_t, base: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Dir {
    /// Pool → client.
    In,
    /// Client → pool.
    Out,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::In => "into client",
            Dir::Out => "out of client",
        }
    }
}

/// Moves piece `i` of the pool to slot `perm[i]` of the client (or back) for every piece, over
/// `threads` threads; seconds taken.
fn pass(
    client: Client,
    dir: Dir,
    pool: usize,
    perm: &[u32],
    piece: usize,
    threads: usize,
) -> Result<f64> {
    let per = perm.len().div_ceil(threads);
    let t0 = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..perm.len())
            .step_by(per)
            .map(|first| {
                let part = &perm[first..(first + per).min(perm.len())];
                s.spawn(move || move_pieces(client, dir, pool, first, part, piece))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a copy thread panicked"))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<()>>()?;
    Ok(secs)
}

/// Pieces `first..first + part.len()` of the pool, to or from client slots `part`.
fn move_pieces(
    client: Client,
    dir: Dir,
    pool: usize,
    first: usize,
    part: &[u32],
    piece: usize,
) -> Result<()> {
    match client {
        Client::Local(base) => {
            for (k, &slot) in part.iter().enumerate() {
                let p = pool + (first + k) * piece;
                let c = base + slot as usize * piece;
                let (dst, src) = match dir {
                    Dir::In => (c, p),
                    Dir::Out => (p, c),
                };
                // SAFETY: `p` and `c` are whole pieces inside the pool buffer and the client
                // mapping (slots and indices are below total / piece); the two never overlap
                // and no other thread copies the same pieces.
                unsafe { umbp_copy::memcpy::copy(dst as *mut u8, src as *const u8, piece) };
            }
            umbp_copy::memcpy::fence();
            Ok(())
        }
        Client::Remote { pid, base } => {
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            let mut local = vec![empty; IOV_MAX];
            let mut remote = vec![empty; IOV_MAX];
            for (b, batch) in part.chunks(IOV_MAX).enumerate() {
                for (k, &slot) in batch.iter().enumerate() {
                    local[k] = libc::iovec {
                        iov_base: (pool + (first + b * IOV_MAX + k) * piece) as *mut libc::c_void,
                        iov_len: piece,
                    };
                    remote[k] = libc::iovec {
                        iov_base: (base as usize + slot as usize * piece) as *mut libc::c_void,
                        iov_len: piece,
                    };
                }
                let n = batch.len();
                // SAFETY: the local iovecs name whole pieces of our pool buffer, the remote
                // ones whole pieces of the child's buffer; the kernel checks the remote side.
                let got = unsafe {
                    match dir {
                        Dir::In => libc::process_vm_writev(
                            pid,
                            local.as_ptr(),
                            n as libc::c_ulong,
                            remote.as_ptr(),
                            n as libc::c_ulong,
                            0,
                        ),
                        Dir::Out => libc::process_vm_readv(
                            pid,
                            local.as_ptr(),
                            n as libc::c_ulong,
                            remote.as_ptr(),
                            n as libc::c_ulong,
                            0,
                        ),
                    }
                };
                if got != (n * piece) as isize {
                    bail!(
                        "process_vm_{}v moved {got} of {} bytes: {}",
                        if dir == Dir::In { "write" } else { "read" },
                        n * piece,
                        std::io::Error::last_os_error()
                    );
                }
            }
            Ok(())
        }
    }
}

/// Reads the u64 at `off` of the client's memory.
fn peek(c: Client, off: usize) -> Result<u64> {
    match c {
        // SAFETY: `off + 8` lies inside the client mapping; 8-aligned (pieces are multiples of
        // 64 bytes).
        Client::Local(base) => Ok(unsafe { ((base + off) as *const u64).read_volatile() }),
        Client::Remote { pid, base } => {
            let mut v = 0u64;
            let l = libc::iovec {
                iov_base: (&mut v as *mut u64).cast(),
                iov_len: 8,
            };
            let r = libc::iovec {
                iov_base: (base as usize + off) as *mut libc::c_void,
                iov_len: 8,
            };
            // SAFETY: the local iovec is `v`; the kernel checks the remote one.
            let n = unsafe { libc::process_vm_readv(pid, &l, 1, &r, 1, 0) };
            ensure!(
                n == 8,
                "process_vm_readv: {}",
                std::io::Error::last_os_error()
            );
            Ok(v)
        }
    }
}

/// Writes the u64 at `off` of the client's memory.
fn poke(c: Client, off: usize, v: u64) -> Result<()> {
    match c {
        Client::Local(base) => {
            // SAFETY: as in `peek`.
            unsafe { ((base + off) as *mut u64).write_volatile(v) };
            Ok(())
        }
        Client::Remote { pid, base } => {
            let l = libc::iovec {
                iov_base: (&v as *const u64).cast_mut().cast(),
                iov_len: 8,
            };
            let r = libc::iovec {
                iov_base: (base as usize + off) as *mut libc::c_void,
                iov_len: 8,
            };
            // SAFETY: the local iovec is `v` (only read); the kernel checks the remote one.
            let n = unsafe { libc::process_vm_writev(pid, &l, 1, &r, 1, 0) };
            ensure!(
                n == 8,
                "process_vm_writev: {}",
                std::io::Error::last_os_error()
            );
            Ok(())
        }
    }
}

/// One pass with its bytes checked: marks are planted at both ends of sampled pieces on the
/// source side and must arrive at the other. Seconds the pass took.
fn checked_pass(
    client: Client,
    dir: Dir,
    pool: usize,
    perm: &[u32],
    piece: usize,
    threads: usize,
    salt: u64,
) -> Result<f64> {
    let n = perm.len();
    let samples: Vec<usize> = (0..SAMPLES.min(n))
        .map(|k| k * n / SAMPLES.min(n))
        .collect();
    let mark = |i: usize, end: usize| {
        (salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((i as u64) << 1) ^ end as u64) | 1
    };
    let ends = |i: usize| [(0, i * piece), (1, i * piece + piece - 8)];
    let slot_ends = |i: usize| {
        let s = perm[i] as usize * piece;
        [(0, s), (1, s + piece - 8)]
    };
    let pool_word = |off: usize| (pool + off) as *mut u64;
    for &i in &samples {
        for ((e, p), (_, c)) in ends(i).into_iter().zip(slot_ends(i)) {
            match dir {
                // SAFETY: `p + 8` lies inside the pool buffer, 8-aligned.
                Dir::In => unsafe { pool_word(p).write_volatile(mark(i, e)) },
                Dir::Out => poke(client, c, mark(i, e))?,
            }
        }
    }
    let secs = pass(client, dir, pool, perm, piece, threads)?;
    for &i in &samples {
        for ((e, p), (_, c)) in ends(i).into_iter().zip(slot_ends(i)) {
            let got = match dir {
                Dir::In => peek(client, c)?,
                // SAFETY: as above.
                Dir::Out => unsafe { pool_word(p).read_volatile() },
            };
            ensure!(
                got == mark(i, e),
                "{} of {piece}-byte pieces: piece {i} (client slot {}) arrived wrong: {got:#x}, expected {:#x}",
                dir.name(),
                perm[i],
                mark(i, e)
            );
        }
    }
    Ok(secs)
}

/// A forked child that holds a client buffer until it is dropped.
struct Child {
    pid: libc::pid_t,
    sock: Option<OwnedFd>,
    addr: u64,
    len: u64,
    fd: Option<OwnedFd>,
}

impl Drop for Child {
    fn drop(&mut self) {
        // Closing the socket tells the child to leave.
        self.sock.take();
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

/// Forks a child that maps `len` bytes of private anonymous memory (pages as `mode` says),
/// writes all of it, and, when `shared`, makes it shareable with `share_host_range` and sends
/// the memfd; it then waits until its socket closes. Call only while this process has one
/// thread.
fn spawn_child(shared: bool, len: usize, mode: PageMode) -> Result<Child> {
    let mut sv = [0; 2];
    // SAFETY: socketpair fills two descriptors into `sv`.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    };
    ensure!(rc == 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are fresh and owned here.
    let (mine, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    // SAFETY: the benchmark forks only between transfers, when no other thread runs, so the
    // child may use the allocator and the rest of the library.
    let pid = unsafe { libc::fork() };
    ensure!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(mine);
        let code = match child_main(theirs.as_raw_fd(), shared, len, mode) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("umbp bench host-route: child: {e:#}");
                1
            }
        };
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    drop(theirs);
    let mut child = Child {
        pid,
        sock: Some(mine),
        addr: 0,
        len: 0,
        fd: None,
    };
    let sock = child.sock.as_ref().expect("set above").as_raw_fd();
    let (msg, fd) = recv_with_fd(sock).context("the child did not report its buffer")?;
    child.addr = msg[0];
    child.len = msg[1];
    child.fd = fd;
    ensure!(
        child.len == len as u64 && (child.fd.is_some() || !shared),
        "the child reported {} bytes at {:#x}",
        child.len,
        child.addr
    );
    Ok(child)
}

fn child_main(sock: RawFd, shared: bool, len: usize, mode: PageMode) -> Result<()> {
    let buf = Buf::map(len, mode)?;
    buf.fill(0x5A);
    let addr = buf.addr as u64;
    std::mem::forget(buf); // the child's memory lives until it exits
    let mut share = None;
    if shared {
        // SAFETY: the child's own buffer, used by nothing else; its one thread is here.
        share = Some(unsafe { umbp_client::host_share::share_host_range(addr, len as u64) }?);
    } else {
        // What a client does under Yama's ptrace_scope 1; refused (harmlessly) without Yama.
        // SAFETY: prctl with plain integer arguments.
        unsafe {
            libc::prctl(
                libc::PR_SET_PTRACER,
                libc::getppid() as libc::c_ulong,
                0,
                0,
                0,
            )
        };
    }
    let fd = share.as_ref().map(|s| s.fd().as_raw_fd());
    let span = share.as_ref().map_or(addr, |s| s.span_addr());
    send_with_fd(sock, [span, len as u64], fd)?;
    let mut b = 0u8;
    // Wait for the parent to close the socket (read returns 0, or an error).
    // SAFETY: reads at most one byte into `b`.
    while unsafe { libc::read(sock, (&mut b as *mut u8).cast(), 1) } > 0 {}
    Ok(())
}

/// Sends two u64 words over `sock`, with `fd` attached when given (`SCM_RIGHTS`).
fn send_with_fd(sock: RawFd, msg: [u64; 2], fd: Option<RawFd>) -> Result<()> {
    let bytes: Vec<u8> = msg.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the pointers set below outlive the sendmsg call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    if let Some(fd) = fd {
        m.msg_control = cbuf.as_mut_ptr().cast();
        m.msg_controllen = space as _;
        // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(sizeof fd) bytes.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    // SAFETY: `m` describes valid buffers; the socket is ours.
    let n = unsafe { libc::sendmsg(sock, &m, libc::MSG_NOSIGNAL) };
    ensure!(
        n == bytes.len() as isize,
        "sendmsg: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// Receives the two u64 words of [`send_with_fd`] and the descriptor, if one came.
fn recv_with_fd(sock: RawFd) -> Result<([u64; 2], Option<OwnedFd>)> {
    let mut bytes = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: bytes.as_mut_ptr().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the pointers set below outlive the recvmsg call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.as_mut_ptr().cast();
    m.msg_controllen = space as _;
    // SAFETY: `m` describes valid buffers; received descriptors are close-on-exec.
    let n = unsafe { libc::recvmsg(sock, &mut m, libc::MSG_CMSG_CLOEXEC | libc::MSG_WAITALL) };
    ensure!(
        n == 16,
        "recvmsg got {n} bytes ({})",
        std::io::Error::last_os_error()
    );
    let mut fd = None;
    // SAFETY: reading the control message the kernel wrote into `cbuf`; a descriptor it
    // carries is now ours to own.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&m);
        if !c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
        {
            let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
            fd = Some(OwnedFd::from_raw_fd(raw));
        }
    }
    let w = |k: usize| u64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
    Ok(([w(0), w(1)], fd))
}

/// Share of `[addr, addr + len)` of process `pid` (this one when None) that huge pages back,
/// from its smaps (anonymous, shmem or file huge pages over resident bytes).
fn huge_share(pid: Option<libc::pid_t>, addr: u64, len: u64) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/smaps"),
        None => "/proc/self/smaps".to_owned(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    let (mut inside, mut rss, mut huge) = (false, 0u64, 0u64);
    for line in text.lines() {
        let first = line.split(' ').next().unwrap_or("");
        if let Some((s, e)) = first.split_once('-') {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                inside = e > addr && s < addr + len;
                continue;
            }
        }
        if !inside {
            continue;
        }
        let kb = |l: &str| -> u64 {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        if line.starts_with("Rss:") {
            rss += kb(line);
        } else if line.starts_with("AnonHugePages:")
            || line.starts_with("ShmemPmdMapped:")
            || line.starts_with("FilePmdMapped:")
        {
            huge += kb(line);
        }
    }
    (rss > 0).then(|| huge as f64 / rss as f64)
}

/// One measured case.
struct Case {
    pages: PageMode,
    piece: u64,
    dir: Dir,
    memcpy: f64,
    shm: f64,
    pvm: f64,
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(a.total_mib > 0, "--total-mib must be > 0");
    ensure!(a.rounds > 0, "--rounds must be > 0");
    ensure!(
        !a.pieces.is_empty() && !a.pages.is_empty(),
        "--pieces and --pages must not be empty"
    );
    let threads = a.threads.max(1);
    let total = a.total_mib << 20;
    for &p in &a.pieces {
        ensure!(
            p >= 64
                && p.is_multiple_of(64)
                && total.is_multiple_of(p)
                && total / p <= u32::MAX as u64,
            "piece size {p}: must be a multiple of 64 bytes that divides --total-mib"
        );
    }
    let len = total as usize;
    let gbps = |secs: f64| total as f64 / secs / 1e9;
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let shmem = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    progress!(
        "{} MiB per case and direction, {threads} thread(s), best of {} rounds; THP enabled: {}, shmem_enabled: {}",
        a.total_mib,
        a.rounds,
        thp.trim(),
        shmem.trim()
    );
    let mut cases: Vec<Case> = Vec::new();
    let mut modes_json = Vec::new();
    let mut notes = Vec::new();
    let mut salt = 0u64;
    for &mode in &a.pages {
        // Children first, while this process has one thread and no large buffers to share
        // copy-on-write with them.
        let shm_child = spawn_child(true, len, mode)?;
        let pvm_child = spawn_child(false, len, mode)?;
        let server = ServerMapping::map(
            shm_child
                .fd
                .as_ref()
                .expect("checked in spawn_child")
                .as_fd(),
            shm_child.len,
        )?;
        let pool = Buf::map(len, mode)?;
        pool.fill(1);
        let local = Buf::map(len, mode)?;
        local.fill(2);
        let routes = [
            Client::Local(local.addr),
            Client::Local(server.addr() as usize),
            Client::Remote {
                pid: pvm_child.pid,
                base: pvm_child.addr,
            },
        ];
        let mut first_touch = None;
        for &piece in &a.pieces {
            let n = (total / piece) as usize;
            let mut perm: Vec<u32> = (0..n as u32).collect();
            perm.shuffle(&mut StdRng::seed_from_u64(42 + piece));
            for dir in [Dir::Out, Dir::In] {
                let mut best = [f64::MAX; 3];
                for (r, &client) in routes.iter().enumerate() {
                    salt += 1;
                    let warm =
                        checked_pass(client, dir, pool.addr, &perm, piece as usize, threads, salt)?;
                    if r == 1 && first_touch.is_none() {
                        first_touch = Some(warm);
                    }
                }
                // Rounds take the routes in turn, so a noisy moment is shared out.
                for _ in 0..a.rounds {
                    for (r, &client) in routes.iter().enumerate() {
                        let s = pass(client, dir, pool.addr, &perm, piece as usize, threads)?;
                        best[r] = best[r].min(s);
                    }
                }
                let c = Case {
                    pages: mode,
                    piece,
                    dir,
                    memcpy: gbps(best[0]),
                    shm: gbps(best[1]),
                    pvm: gbps(best[2]),
                };
                progress!(
                    "{} pages, {} pieces, {}: memcpy {:.2} GB/s, shm {:.2} ({:.2}), pvm {:.2} ({:.2})",
                    mode.name(),
                    human(piece),
                    dir.name(),
                    c.memcpy,
                    c.shm,
                    c.shm / c.memcpy,
                    c.pvm,
                    c.pvm / c.memcpy
                );
                cases.push(c);
            }
        }
        let share = |pid, addr: u64| huge_share(pid, addr, total).unwrap_or(0.0);
        let huge = [
            ("pool", share(None, pool.addr as u64)),
            ("memcpy client", share(None, local.addr as u64)),
            ("shm: server's mapping", share(None, server.addr())),
            (
                "shm: client's mapping",
                share(Some(shm_child.pid), shm_child.addr),
            ),
            ("pvm: client", share(Some(pvm_child.pid), pvm_child.addr)),
        ];
        let ft = first_touch.map(gbps).unwrap_or(0.0);
        notes.push(format!(
            "  {} pages: huge pages back {}; first pass over a new server mapping (page faults, shm, {} pieces, out): {:.2} GB/s",
            mode.name(),
            huge.iter()
                .map(|(k, v)| format!("{k} {:.0}%", v * 100.0))
                .collect::<Vec<_>>()
                .join(", "),
            human(a.pieces[0]),
            ft
        ));
        modes_json.push(json!({
            "pages": mode.name(),
            "huge_share": huge.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "first_touch_gbps": ft,
        }));
        drop(server);
        // The second child holds a copy of the first one's socket (forked after it): it has to
        // go first, or the first would never see its socket close.
        drop(pvm_child);
        drop(shm_child);
    }
    println!(
        "host-route benchmark: {} MiB each way per case, {threads} thread(s), client pieces in random order, best of {} rounds",
        a.total_mib, a.rounds
    );
    println!(
        "  {:<5} {:>8}  {:<13} {:>12} {:>14} {:>6} {:>14} {:>6}",
        "pages",
        "piece",
        "direction",
        "memcpy GB/s",
        "(a) shm GB/s",
        "ratio",
        "(b) pvm GB/s",
        "ratio"
    );
    for c in &cases {
        println!(
            "  {:<5} {:>8}  {:<13} {:>12.2} {:>14.2} {:>6.2} {:>14.2} {:>6.2}",
            c.pages.name(),
            human(c.piece),
            c.dir.name(),
            c.memcpy,
            c.shm,
            c.shm / c.memcpy,
            c.pvm,
            c.pvm / c.memcpy
        );
    }
    for n in &notes {
        println!("{n}");
    }
    println!(
        "  THP enabled: {}; shmem_enabled: {}",
        thp.trim(),
        shmem.trim()
    );
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "host-route",
                "total_bytes": total,
                "threads": threads,
                "rounds": a.rounds,
                "thp_enabled": thp.trim(),
                "shmem_enabled": shmem.trim(),
                "modes": modes_json,
                "cases": cases.iter().map(|c| json!({
                    "pages": c.pages.name(),
                    "piece_bytes": c.piece,
                    "direction": if c.dir == Dir::In { "in" } else { "out" },
                    "memcpy_gbps": c.memcpy,
                    "shm_gbps": c.shm,
                    "shm_ratio": c.shm / c.memcpy,
                    "pvm_gbps": c.pvm,
                    "pvm_ratio": c.pvm / c.memcpy,
                })).collect::<Vec<_>>(),
            })
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert!(parse_size("x").is_err());
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(1 << 20), "1 MiB");
    }
}
