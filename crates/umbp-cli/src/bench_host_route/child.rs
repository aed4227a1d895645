//! The client processes: a forked child holding the client's buffer (shared in place and
//! sent as a memfd for route (a), private for route (b)), the socket messages with a
//! descriptor, and the huge-page share of a mapping read from smaps.

use std::io::Read;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use anyhow::{ensure, Context, Result};

use super::buf::{Buf, PageMode};

/// A forked child that holds a client buffer until it is dropped.
pub(super) struct Child {
    pub(super) pid: libc::pid_t,
    pub(super) sock: Option<UnixStream>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) fd: Option<OwnedFd>,
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
pub(super) fn spawn_child(shared: bool, len: usize, mode: PageMode) -> Result<Child> {
    let (mine, theirs) = UnixStream::pair().context("socketpair")?;
    // SAFETY: the benchmark forks only between transfers, when no other thread runs, so the
    // child may use the allocator and the rest of the library.
    let pid = unsafe { libc::fork() };
    ensure!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(mine);
        let code = match child_main(&theirs, shared, len, mode) {
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
    let sock = child.sock.as_ref().expect("set above");
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

pub(super) fn child_main(
    sock: &UnixStream,
    shared: bool,
    len: usize,
    mode: PageMode,
) -> Result<()> {
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
    let fd = share.as_ref().map(|s| s.fd());
    let span = share.as_ref().map_or(addr, |s| s.span_addr());
    send_with_fd(sock, [span, len as u64], fd)?;
    let mut b = [0u8; 1];
    // Wait for the parent to close the socket (read returns 0, or an error).
    while (&mut &*sock).read(&mut b).is_ok_and(|n| n > 0) {}
    Ok(())
}

/// Sends two u64 words over `sock`, with `fd` attached when given (`SCM_RIGHTS`).
pub(super) fn send_with_fd(
    sock: &UnixStream,
    msg: [u64; 2],
    fd: Option<BorrowedFd<'_>>,
) -> Result<()> {
    let bytes: Vec<u8> = msg.iter().flat_map(|w| w.to_le_bytes()).collect();
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    let n = umbp_unix::fdpass::send_with_fds(sock, &bytes, &fds).context("sendmsg")?;
    ensure!(
        n == bytes.len(),
        "sendmsg sent {n} of {} bytes",
        bytes.len()
    );
    Ok(())
}

/// Receives the two u64 words of [`send_with_fd`] and the descriptor, if one came.
pub(super) fn recv_with_fd(sock: &UnixStream) -> Result<([u64; 2], Option<OwnedFd>)> {
    let mut bytes = [0u8; 16];
    let got = umbp_unix::fdpass::recv_with_fds(sock, &mut bytes, 1, false).context("recvmsg")?;
    ensure!(got.len > 0, "recvmsg: the child closed its socket");
    // The rest of the words, should they come apart from the first bytes.
    (&mut &*sock)
        .read_exact(&mut bytes[got.len..])
        .context("recvmsg")?;
    let fd = got.fds.into_iter().next();
    let w = |k: usize| u64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
    Ok(([w(0), w(1)], fd))
}

/// Share of `[addr, addr + len)` of process `pid` (this one when None) that huge pages back,
/// from its smaps (anonymous, shmem or file huge pages over resident bytes).
pub(super) fn huge_share(pid: Option<libc::pid_t>, addr: u64, len: u64) -> Option<f64> {
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
