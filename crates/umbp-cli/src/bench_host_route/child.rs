//! The client processes: a forked child holding the client's buffer (shared in place and
//! sent as a memfd for route (a), private for route (b)), the socket messages with a
//! descriptor, and the huge-page share of a mapping read from smaps.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use anyhow::{ensure, Context, Result};

use super::buf::{Buf, PageMode};

/// A forked child that holds a client buffer until it is dropped.
pub(super) struct Child {
    pub(super) pid: libc::pid_t,
    pub(super) sock: Option<OwnedFd>,
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

pub(super) fn child_main(sock: RawFd, shared: bool, len: usize, mode: PageMode) -> Result<()> {
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
pub(super) fn send_with_fd(sock: RawFd, msg: [u64; 2], fd: Option<RawFd>) -> Result<()> {
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
pub(super) fn recv_with_fd(sock: RawFd) -> Result<([u64; 2], Option<OwnedFd>)> {
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
