//! Hostile peers against a live worker process: a child process (this test binary again, running
//! the ignored test `worker_process`) serves lookups, the test attacks it and then checks that
//! it is still alive and answering.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_lookup::{LookupClient, LookupServer};

mod common;
use common::AllHeld;

/// The worker process: serves `UMBP_HOSTILE_SOCKET` until its stdin closes.
#[test]
#[ignore = "run as a child process by the other tests of this file"]
fn worker_process() {
    let Some(path) = std::env::var_os("UMBP_HOSTILE_SOCKET") else {
        return;
    };
    let server = LookupServer::bind(
        Path::new(&path),
        std::sync::Arc::new(AllHeld("hostile-test worker")),
    )
    .unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    server.shutdown();
}

struct Worker {
    child: Child,
    path: PathBuf,
    _dir: PathBuf,
}

impl Worker {
    fn start(name: &str) -> Worker {
        let dir = std::env::temp_dir().join(format!("umbp-hostile-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.sock");
        let _ = std::fs::remove_file(&path);
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "worker_process", "--test-threads=1"])
            .env("UMBP_HOSTILE_SOCKET", &path)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let w = Worker {
            child,
            path,
            _dir: dir,
        };
        w.client().wait_ready(Duration::from_secs(20)).unwrap();
        w
    }

    fn client(&self) -> LookupClient {
        LookupClient::new(vec![self.path.clone()], Duration::from_secs(5))
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Still running, and answers a lookup through a fresh client.
    fn assert_alive_and_answering(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("the worker process died: {status:?}");
        }
        let c = self.client();
        c.wait_ready(Duration::from_secs(5))
            .expect("the worker answers a ping");
        assert_eq!(c.prefix_hits(0, &[7u8; 32 * 5], 32), 5);
        // And a large request, through the (sealed) shared buffer.
        assert_eq!(c.prefix_hits(0, &vec![7u8; 32 * 1000], 32), 1000);
    }

    fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    fn threads(&self) -> usize {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// utime + stime in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let rest = &s[s.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        // Fields after the command: state is index 0, utime index 11, stime index 12.
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn frame(op: u8, body: &[u8]) -> Vec<u8> {
    let mut f = b"UMBL".to_vec();
    f.extend_from_slice(&[op, 0, 0, 0]);
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn shm_request(op: u8, offset: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&32u32.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    frame(op, &b)
}

/// Reads one reply; `None` when the worker closed the connection.
fn reply(s: &mut UnixStream) -> Option<(u8, Vec<u8>)> {
    let mut h = [0u8; 12];
    s.read_exact(&mut h).ok()?;
    assert_eq!(&h[..4], b"UMBR");
    let mut body = vec![0u8; u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize];
    s.read_exact(&mut body).ok()?;
    Some((h[4], body))
}

fn memfd(size: usize, sealing: bool) -> OwnedFd {
    let flags = libc::MFD_CLOEXEC | if sealing { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: a valid NUL-terminated name; plain flags.
    let raw = unsafe { libc::memfd_create(c"hostile".as_ptr(), flags) };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sizing our own memfd.
    assert_eq!(unsafe { libc::ftruncate(raw, size as libc::off_t) }, 0);
    let data = vec![7u8; size];
    // SAFETY: writing our own buffer into our own memfd.
    let n = unsafe { libc::pwrite(raw, data.as_ptr().cast(), size, 0) };
    assert_eq!(n as usize, size);
    fd
}

/// `fd` with its size sealed (`F_SEAL_SHRINK | F_SEAL_GROW`), as the client seals its buffers.
fn sealed(fd: OwnedFd) -> OwnedFd {
    // SAFETY: sealing our own memfd.
    let rc = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    fd
}

/// Sends `data` with `fds` attached in one `SCM_RIGHTS` message.
fn send_fds(s: &UnixStream, data: &[u8], fds: &[RawFd]) {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; the pointers set below outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg with room for `fds`, as sized above.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
    }
    // SAFETY: `msg` describes valid buffers; the socket is ours.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    assert_eq!(
        n as usize,
        data.len(),
        "{}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn a_shrunk_shared_buffer_does_not_kill_the_worker() {
    let mut w = Worker::start("shrink");
    // An unsealed memfd, attached, then truncated: the attack of finding 1.
    let mut s = UnixStream::connect(&w.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let fd = memfd(1 << 20, false);
    send_fds(&s, &frame(5, &[]), &[fd.as_raw_fd()]);
    let attach = reply(&mut s);
    // SAFETY: shrinking our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    s.write_all(&shm_request(6, 0, 32 * 1000)).unwrap();
    let answer = reply(&mut s);
    w.assert_alive_and_answering();
    let (status, msg) = attach.expect("the attach is answered");
    assert_eq!(status, 1, "an unsealed buffer is refused");
    let msg = String::from_utf8_lossy(&msg).into_owned();
    assert!(msg.contains("F_SEAL_SHRINK"), "{msg}");
    assert_eq!(answer.expect("the lookup is answered").0, 1);

    // A sealed buffer is accepted, and every range is checked against its sealed size.
    let mut s = UnixStream::connect(&w.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let fd = sealed(memfd(64 << 10, true));
    send_fds(&s, &frame(5, &[]), &[fd.as_raw_fd()]);
    assert_eq!(reply(&mut s).unwrap().0, 0);
    // SAFETY: trying to shrink our own sealed memfd (the kernel refuses).
    assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    s.write_all(&shm_request(6, 0, 32 * 100)).unwrap();
    let (st, body) = reply(&mut s).unwrap();
    assert_eq!((st, body), (0, 100u32.to_le_bytes().to_vec()));
    for (off, len) in [
        (0u64, (64 << 10) + 32),
        (64 << 10, 32),
        (u64::MAX - 8, 32),
        (32, u64::MAX),
    ] {
        s.write_all(&shm_request(6, off, len)).unwrap();
        assert_eq!(reply(&mut s).unwrap().0, 1, "range {off}+{len} is refused");
    }
    w.assert_alive_and_answering();
}

#[test]
fn descriptors_beyond_the_expected_one_are_closed() {
    let mut w = Worker::start("fds");
    let before = w.fd_count();
    let mut s = UnixStream::connect(&w.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let a = sealed(memfd(4096, true));
    let b = sealed(memfd(4096, true));
    let attach = frame(5, &[]);
    for i in 0..20_000 {
        send_fds(&s, &attach, &[a.as_raw_fd(), b.as_raw_fd()]);
        if reply(&mut s).is_none() {
            // A worker may close a connection that breaks the protocol: open another.
            s = UnixStream::connect(&w.path)
                .unwrap_or_else(|e| panic!("frame {i}: the worker accepts no connection: {e}"));
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
    }
    // Descriptors on frames that take none are closed too.
    let ping = frame(1, &[]);
    for _ in 0..1000 {
        send_fds(&s, &ping, &[a.as_raw_fd()]);
        if reply(&mut s).is_none() {
            s = UnixStream::connect(&w.path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
    }
    drop(s);
    std::thread::sleep(Duration::from_millis(200));
    let after = w.fd_count();
    println!("worker descriptors: {before} before, {after} after 20,000 two-descriptor frames");
    assert!(
        after <= before + 2,
        "the worker's descriptor count grew from {before} to {after}"
    );
    w.assert_alive_and_answering();
}

#[test]
fn idle_connections_cost_no_threads_and_lookups_stay_fast() {
    let mut w = Worker::start("idle");
    let threads_before = w.threads();
    let conns: Vec<UnixStream> = (0..3000)
        .map(|i| UnixStream::connect(&w.path).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    // Let the worker accept them all.
    let c = w.client();
    c.wait_ready(Duration::from_secs(10)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let threads = w.threads();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let t0 = Instant::now();
    let ticks0 = w.cpu_ticks();
    std::thread::sleep(Duration::from_secs(3));
    let cpu = (w.cpu_ticks() - ticks0) as f64 / hz / t0.elapsed().as_secs_f64();
    let hashes = vec![7u8; 32 * 64];
    let mut lat: Vec<Duration> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            assert_eq!(c.prefix_hits(0, &hashes, 32), 64);
            t.elapsed()
        })
        .collect();
    lat.sort();
    println!(
        "3000 idle connections: worker threads {threads_before} -> {threads}, idle CPU {:.2} % of a core, \
         64-hash lookup p50 {:?} p99 {:?} max {:?}",
        cpu * 100.0,
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        lat[lat.len() - 1]
    );
    assert!(
        threads <= threads_before + 1,
        "3000 idle connections took {} threads",
        threads - threads_before
    );
    drop(conns);
    w.assert_alive_and_answering();
}
