//! A private `umbp_standalone_server` for the benchmarks and the soak: started on a socket in
//! a fresh temporary directory, waited for, restarted at the same socket (SIGTERM or SIGKILL,
//! for `umbp soak`), and stopped with SIGTERM.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use umbp_proto::Endpoint;

use crate::common::progress;
use crate::raw::Raw;

/// The server binary's file name.
pub const SERVER_BIN: &str = "umbp_standalone_server";

/// Settings of a private server.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    /// `--server-bin`, when given.
    pub bin: Option<PathBuf>,
    /// Pool bytes.
    pub capacity: u64,
    /// Copy workers.
    pub workers: usize,
    /// `--busy-poll-us` (None: the server's default).
    pub busy_poll_us: Option<u64>,
    /// More flags, passed as they are (e.g. `--disk-dir DIR`).
    pub extra_args: Vec<String>,
}

/// A running private server; stopped (SIGTERM) by [`PrivateServer::stop`] or when dropped.
#[derive(Debug)]
pub struct PrivateServer {
    child: Option<Child>,
    /// Where it listens.
    pub endpoint: Endpoint,
    dir: PathBuf,
    log: PathBuf,
    bin: PathBuf,
    spec: ServerSpec,
}

/// How a private server is stopped before it is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM: a clean stop (in-flight transfers get their grace, a disk tier keeps the pool).
    Term,
    /// SIGKILL: a crash.
    Kill,
}

/// `umbp_standalone_server` next to the running `umbp` executable, else the first in PATH.
pub fn find_server_bin(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!(
            "--server-bin {}: no such file; give the path of an {SERVER_BIN} executable",
            p.display()
        );
    }
    let exe = std::env::current_exe().ok();
    if let Some(dir) = exe.as_deref().and_then(Path::parent) {
        let p = dir.join(SERVER_BIN);
        if p.is_file() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(SERVER_BIN);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "cannot find {SERVER_BIN} next to {} nor in PATH; build it (cargo build --release -p umbp-server), pass --server-bin PATH, or give --endpoint of a running server",
        exe.map_or_else(|| "this executable".into(), |e| e.display().to_string())
    )
}

/// A fresh private directory for the socket and the server's log.
fn temp_dir() -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("umbp-bench-{}-{nanos:08x}", std::process::id());
    let mut base = std::env::temp_dir();
    // The socket path must fit a Unix socket address.
    if base.as_os_str().len() + name.len() + 20 > 100 {
        base = PathBuf::from("/tmp");
    }
    let dir = base.join(name);
    std::fs::create_dir(&dir).with_context(|| {
        format!(
            "cannot create {} for the private server's socket; set TMPDIR to a writable directory",
            dir.display()
        )
    })?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// CPU seconds (user + system, every thread) process `pid` has used, from /proc.
pub fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".into(),
    };
    let s = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3; utime and
    // stime are fields 14 and 15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

fn log_tail(log: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(log) {
        let _ = f.read_to_string(&mut s);
    }
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl PrivateServer {
    /// Starts the server and waits until it answers a ping.
    pub fn start(spec: &ServerSpec) -> Result<Self> {
        let bin = find_server_bin(spec.bin.as_deref())?;
        let dir = temp_dir()?;
        let sock = dir.join("umbp.sock");
        let endpoint = Endpoint::parse(&sock.display().to_string())?;
        let log = dir.join("server.log");
        progress!(
            "starting a private server: {} --address {} --capacity {} --workers {}{}{} (log {})",
            bin.display(),
            sock.display(),
            spec.capacity,
            spec.workers,
            spec.busy_poll_us
                .map_or(String::new(), |us| format!(" --busy-poll-us {us}")),
            spec.extra_args
                .iter()
                .fold(String::new(), |s, a| s + " " + a),
            log.display()
        );
        let mut s = PrivateServer {
            child: None,
            endpoint,
            dir,
            log,
            bin,
            spec: spec.clone(),
        };
        let t0 = Instant::now();
        s.spawn()?;
        progress!(
            "private server ready in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
        Ok(s)
    }

    /// Starts the server process (its log appended to) and waits until it answers a ping.
    fn spawn(&mut self) -> Result<()> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("cannot create {}", self.log.display()))?;
        let spec = &self.spec;
        let mut cmd = Command::new(&self.bin);
        // SAFETY: the hook runs in the forked child before exec and calls only prctl, which is
        // async-signal-safe; it asks for SIGTERM when this process dies (Ctrl-C, a crash), so a
        // private server never outlives its benchmark.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd
            .arg("--address")
            .arg(self.endpoint.path())
            .arg("--capacity")
            .arg(spec.capacity.to_string())
            .arg("--workers")
            .arg(spec.workers.to_string())
            .arg("--prefault")
            .arg("true")
            .arg("--shutdown-grace-ms")
            .arg("2000")
            .args(
                spec.busy_poll_us
                    .map(|us| ["--busy-poll-us".to_string(), us.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(&spec.extra_args)
            .env_remove("UMBP_STANDALONE_ADDRESS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot start {}", self.bin.display()))?;
        self.child = Some(child);
        let raw = Raw::new(self.endpoint.clone(), Duration::from_millis(500))?;
        let t0 = Instant::now();
        loop {
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                bail!(
                    "the private server exited at start ({st}); its log:\n{}",
                    log_tail(&self.log)
                );
            }
            if raw.ping().is_ok() {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(120) {
                bail!(
                    "the private server did not answer within 120 s; its log:\n{}",
                    log_tail(&self.log)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server as `how` says and starts it again at the same socket with the same
    /// flags; waits until it answers. A clean stop must exit 0.
    pub fn restart(&mut self, how: Stop) -> Result<()> {
        match how {
            Stop::Term => self.terminate_keep_dir()?,
            Stop::Kill => {
                if let Some(mut child) = self.child.take() {
                    let _ = child.kill();
                    child.wait()?;
                }
            }
        }
        self.spawn()
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the server with SIGTERM and waits for it (SIGKILL after 20 s).
    pub fn stop(mut self) -> Result<()> {
        self.terminate()
    }

    fn terminate(&mut self) -> Result<()> {
        if self.child.is_none() {
            return Ok(());
        }
        self.terminate_keep_dir()?;
        let _ = std::fs::remove_dir_all(&self.dir);
        progress!("private server stopped");
        Ok(())
    }

    /// SIGTERM, then waits for the exit (SIGKILL after 20 s); the directory stays.
    fn terminate_keep_dir(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id() as libc::pid_t;
        // SAFETY: signalling our own child, which has not been reaped yet (so the pid is
        // still its own).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the private server did not stop within 20 s of SIGTERM and was killed; its log:\n{}",
                    log_tail(&self.log)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !status.success() {
            bail!(
                "the private server exited with {status} after SIGTERM; its log:\n{}",
                log_tail(&self.log)
            );
        }
        Ok(())
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        if let Err(e) = self.terminate() {
            eprintln!("umbp: {e:#}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
