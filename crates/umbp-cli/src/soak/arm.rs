//! The parent's side of one arm of the soak: the pool (a private server, or the embedded
//! store inside the arm's one client process), the client processes and what they report,
//! the chaos (restarts, clears), the counters' checks, samples, and the final audit.

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use umbp_proto::completion::monotonic_ns;

use super::args::Args;
use super::content::{namespace, SHARED_NS};
use super::counts::{identities, Counts, Identity, Snapshot};
use super::findings::{AuditFindings, Chaos};
use super::sample::Series;
use crate::bench_server::{spawn_kid, Kid};
use crate::raw::Raw;
use crate::server_proc::{PrivateServer, ServerSpec, Stop};

/// How long a client process may take to answer a command (an audit reads every key).
const ANSWER_WAIT: Duration = Duration::from_secs(600);

/// Where an arm's pool lives.
enum Target {
    Server {
        server: Box<PrivateServer>,
        raw: Box<Raw>,
    },
    /// In the arm's one client process.
    Embedded,
}

struct KidIo {
    id: u32,
    child: Child,
    stdin: Option<ChildStdin>,
    series: Series,
    alive: bool,
}

/// One arm: see the module docs.
pub(crate) struct Arm {
    pub(crate) name: &'static str,
    /// The server arm (else the embedded one).
    is_server: bool,
    target: Target,
    kids: Vec<KidIo>,
    rx: Receiver<(usize, Option<String>)>,
    latest: Vec<Counts>,
    workers: u32,
    rng: StdRng,
    kill_every: u32,
    object_bytes: u64,
    pool_bytes: u64,
    /// The pool's process: the server (across restarts), or the embedded arm's process.
    pub(crate) pool_series: Series,
    pub(crate) chaos: Chaos,
    /// Objects the soak's clears removed from the current pool process.
    removed_life: u64,
    /// The latest counters of the current pool process, and the last of each earlier one.
    last: Snapshot,
    past: Vec<Snapshot>,
    /// Every identity checked, with the check's number.
    pub(crate) identities: Vec<(u32, Identity)>,
    pub(crate) checks: u32,
    /// What went wrong with client processes (an error line, an early exit).
    pub(crate) problems: Vec<String>,
    /// Answers that came while another was awaited: (client, line).
    early: Vec<(usize, String)>,
    /// Set once the clients are told to quit: their exits are expected.
    quitting: bool,
    /// `--inject-loss`.
    inject_loss: bool,
    pub(crate) audit: AuditFindings,
}

/// The flags every client process of an arm gets.
fn client_flags(a: &Args) -> Vec<String> {
    let mut v = Vec::new();
    for (f, x) in [
        ("--seed", a.seed.to_string()),
        ("--layers", a.layers.to_string()),
        ("--piece-bytes", (a.piece_kib << 10).to_string()),
        ("--slots", a.slots.to_string()),
        ("--max-batch", a.max_batch.to_string()),
        ("--private-keys", a.private_keys.to_string()),
        ("--shared-keys", a.shared_keys.to_string()),
        ("--shared-fraction", a.shared_fraction.to_string()),
    ] {
        v.push(f.to_string());
        v.push(x);
    }
    v
}

impl Arm {
    /// Starts the server arm: a private server with a disk tier in `dir`, and one client
    /// process per client.
    pub(crate) fn server(a: &Args, dir: &std::path::Path) -> Result<Self> {
        let disk = dir.join("server-disk");
        std::fs::create_dir_all(&disk)
            .with_context(|| format!("cannot create {}", disk.display()))?;
        let server = PrivateServer::start(&ServerSpec {
            bin: a.server_bin.clone(),
            capacity: a.pool_mib << 20,
            workers: a.copy_workers,
            busy_poll_us: None,
            extra_args: vec![
                "--disk-dir".into(),
                disk.display().to_string(),
                "--disk-capacity".into(),
                (a.disk_mib << 20).to_string(),
            ],
        })?;
        let raw = Raw::new(server.endpoint.clone(), Duration::from_secs(30))?;
        let mut kids = Vec::new();
        for c in 0..a.clients {
            let mut args: Vec<String> = vec![
                "soak-client".into(),
                "--endpoint".into(),
                server.endpoint.to_string(),
                "--first-id".into(),
                c.to_string(),
            ];
            args.extend(client_flags(a));
            if a.inject_wrong && c == 0 {
                args.push("--inject-wrong".into());
            }
            kids.push(spawn_kid(c, &args)?);
        }
        let target = Target::Server {
            server: Box::new(server),
            raw: Box::new(raw),
        };
        Self::new("server", a, target, kids)
    }

    /// Starts the embedded arm: one client process with a worker thread per client and an
    /// embedded store with a disk tier in `dir`.
    pub(crate) fn embedded(a: &Args, dir: &std::path::Path) -> Result<Self> {
        let disk = dir.join("embedded-disk");
        std::fs::create_dir_all(&disk)
            .with_context(|| format!("cannot create {}", disk.display()))?;
        let mut args: Vec<String> = vec![
            "soak-client".into(),
            "--disk-dir".into(),
            disk.display().to_string(),
            "--pool-bytes".into(),
            (a.pool_mib << 20).to_string(),
            "--disk-bytes".into(),
            (a.disk_mib << 20).to_string(),
            "--copy-workers".into(),
            a.copy_workers.to_string(),
            "--first-id".into(),
            "0".into(),
            "--workers".into(),
            a.clients.to_string(),
        ];
        args.extend(client_flags(a));
        if a.inject_wrong {
            args.push("--inject-wrong".into());
        }
        let kid = spawn_kid(0, &args)?;
        Self::new("embedded", a, Target::Embedded, vec![kid])
    }

    fn new(name: &'static str, a: &Args, target: Target, kids: Vec<Kid>) -> Result<Self> {
        let (tx, rx) = channel();
        let mut io = Vec::new();
        for (i, k) in kids.into_iter().enumerate() {
            let Kid {
                id,
                child,
                stdin,
                stdout,
            } = k;
            read_lines(i, stdout, tx.clone());
            io.push(KidIo {
                id,
                child,
                stdin: Some(stdin),
                series: Series::default(),
                alive: true,
            });
        }
        let mut arm = Arm {
            name,
            is_server: matches!(target, Target::Server { .. }),
            target,
            latest: vec![Counts::default(); io.len()],
            kids: io,
            rx,
            workers: a.clients,
            rng: StdRng::seed_from_u64(a.seed ^ 0x5EED_CAFE),
            kill_every: a.kill_every,
            object_bytes: a.layers * (a.piece_kib << 10),
            pool_bytes: a.pool_mib << 20,
            pool_series: Series::default(),
            chaos: Chaos::default(),
            removed_life: 0,
            last: Snapshot::default(),
            past: Vec::new(),
            identities: Vec::new(),
            checks: 0,
            problems: Vec::new(),
            early: Vec::new(),
            quitting: false,
            inject_loss: a.inject_loss,
            audit: AuditFindings::default(),
        };
        for i in 0..arm.kids.len() {
            arm.reply(i, "ready", Duration::from_secs(300))?;
        }
        arm.broadcast("run");
        Ok(arm)
    }

    /// The clients' counts summed.
    pub(crate) fn totals(&self) -> Counts {
        let mut c = Counts::default();
        for l in &self.latest {
            c.add(l);
        }
        c
    }

    /// The pool process's id (the server's, or the embedded arm's process).
    fn pool_pid(&self) -> Option<u32> {
        match &self.target {
            Target::Server { server, .. } => server.pid(),
            Target::Embedded => self.kids.first().map(|k| k.child.id()),
        }
    }

    /// Per client process: its number and its samples (none for the embedded arm, whose one
    /// process is the pool's).
    pub(crate) fn client_series(&self) -> Vec<(u32, &Series)> {
        if self.is_server {
            self.kids.iter().map(|k| (k.id, &k.series)).collect()
        } else {
            Vec::new()
        }
    }

    pub(crate) fn sample(&mut self) {
        let pid = self.pool_pid();
        self.pool_series.take(pid);
        if self.is_server {
            for k in &mut self.kids {
                k.series.take(Some(k.child.id()));
            }
        }
    }

    /// Handles one line of client `i` (None: its stdout ended); returns it when it is an
    /// answer to a command.
    fn handle(&mut self, i: usize, line: Option<String>) -> Option<String> {
        match line {
            None => {
                let k = &mut self.kids[i];
                if k.alive {
                    k.alive = false;
                    match k.child.wait() {
                        Ok(st) if st.success() && self.quitting => {}
                        Ok(st) if self.quitting => self.problems.push(format!(
                            "{} client process {} exited with {st}",
                            self.name, k.id
                        )),
                        st => self.problems.push(format!(
                            "{} client process {} exited early ({})",
                            self.name,
                            k.id,
                            st.map_or_else(|e| e.to_string(), |s| s.to_string())
                        )),
                    }
                }
                None
            }
            Some(l) => {
                if let Some(j) = l.strip_prefix("stat ") {
                    if let Ok(v) = serde_json::from_str::<Value>(j) {
                        self.latest[i] = Counts::from_json(&v);
                    }
                    None
                } else if let Some(e) = l.strip_prefix("error ") {
                    self.problems.push(format!("{}: {e}", self.name));
                    None
                } else {
                    Some(l)
                }
            }
        }
    }

    /// Takes every line that has come, without waiting.
    pub(crate) fn drain(&mut self) {
        while let Ok((i, l)) = self.rx.try_recv() {
            if let Some(l) = self.handle(i, l) {
                self.early.push((i, l));
            }
        }
        for (i, l) in std::mem::take(&mut self.early) {
            eprintln!(
                "[umbp soak] {}: unexpected line from client {i}: {l}",
                self.name
            );
        }
    }

    /// Waits for client `i`'s answer starting with `prefix`; returns the rest of the line.
    fn reply(&mut self, i: usize, prefix: &str, wait: Duration) -> Result<String> {
        if let Some(at) = self
            .early
            .iter()
            .position(|(j, l)| *j == i && l.starts_with(prefix))
        {
            let (_, l) = self.early.remove(at);
            return Ok(l[prefix.len()..].trim().to_string());
        }
        let until = Instant::now() + wait;
        loop {
            if !self.kids[i].alive {
                bail!(
                    "{} client process {} is gone: {}",
                    self.name,
                    self.kids[i].id,
                    self.problems.join("; ")
                );
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((j, l)) => {
                    if let Some(l) = self.handle(j, l) {
                        match l.strip_prefix(prefix) {
                            Some(rest) if j == i => return Ok(rest.trim().to_string()),
                            // Another client's answer to the same command: kept for later.
                            _ => self.early.push((j, l)),
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => bail!(
                    "{} client process {} did not answer {prefix:?} within {} s",
                    self.name,
                    self.kids[i].id,
                    wait.as_secs()
                ),
                Err(RecvTimeoutError::Disconnected) => bail!("every client process is gone"),
            }
        }
    }

    fn send(&mut self, i: usize, cmd: &str) {
        let k = &mut self.kids[i];
        if !k.alive {
            return;
        }
        let ok = k
            .stdin
            .as_mut()
            .is_some_and(|s| writeln!(s, "{cmd}").and_then(|_| s.flush()).is_ok());
        if !ok {
            k.alive = false;
            self.problems.push(format!(
                "{} client process {} took no command",
                self.name, k.id
            ));
        }
    }

    fn broadcast(&mut self, cmd: &str) {
        for i in 0..self.kids.len() {
            self.send(i, cmd);
        }
    }

    /// Sends `cmd` to every live client and waits for each one's answer.
    fn ask_all(&mut self, cmd: &str, prefix: &str) -> Result<Vec<(usize, String)>> {
        self.broadcast(cmd);
        let mut out = Vec::new();
        for i in 0..self.kids.len() {
            if self.kids[i].alive {
                out.push((i, self.reply(i, prefix, ANSWER_WAIT)?));
            }
        }
        Ok(out)
    }

    /// The pool's counters now.
    fn snapshot(&mut self) -> Result<Snapshot> {
        if let Target::Server { raw, .. } = &self.target {
            return Ok(Snapshot::from_server(&raw.stats()?));
        }
        self.send(0, "stats");
        let j = self.reply(0, "stats ", ANSWER_WAIT)?;
        Ok(Snapshot::from_json(&serde_json::from_str(&j)?))
    }

    /// With the clients paused: counters that stay the same over 100 ms with nothing
    /// waiting to be written to disk (the evictor and the disk writers settled), or after
    /// 10 s the last ones.
    fn settled_snapshot(&mut self) -> Result<Snapshot> {
        let mut prev = self.snapshot()?;
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(100));
            let s = self.snapshot()?;
            if s == prev && s.disk_backlog_bytes == 0 {
                return Ok(s);
            }
            prev = s;
        }
        Ok(prev)
    }

    /// Pauses the clients, checks the counters' identities, and lets them run again.
    pub(crate) fn check(&mut self) -> Result<()> {
        self.ask_all("pause", "paused")?;
        self.check_paused()?;
        self.broadcast("run");
        Ok(())
    }

    fn check_paused(&mut self) -> Result<()> {
        let s = self.settled_snapshot()?;
        self.checks += 1;
        for id in identities(&s, self.removed_life) {
            if id.diff() != 0 {
                eprintln!(
                    "[umbp soak] {}: check {}: {} does not hold: {} vs {}",
                    self.name, self.checks, id.name, id.left, id.right
                );
            }
            self.identities.push((self.checks, id));
        }
        self.last = s;
        Ok(())
    }

    /// Restarts the pool: the server by SIGTERM, or every `kill_every`th time SIGKILL; the
    /// embedded store by a clean close and reopen.
    pub(crate) fn restart(&mut self) -> Result<()> {
        if let Ok(s) = self.snapshot() {
            self.last = s;
        }
        let kill = self.is_server
            && self.kill_every > 0
            && (self.chaos.restarts + 1).is_multiple_of(u64::from(self.kill_every));
        let t = monotonic_ns();
        self.chaos.restart_times.push(t);
        if kill {
            self.chaos.kill_times.push(t);
        } else {
            self.close_allowance();
        }
        if let Target::Server { server, raw } = &mut self.target {
            server.restart(if kill { Stop::Kill } else { Stop::Term })?;
            // A new connection: the old one's channel broke with the old server.
            **raw = Raw::new(server.endpoint.clone(), Duration::from_secs(30))?;
        } else {
            self.send(0, "restart");
            self.reply(0, "restarted", ANSWER_WAIT)?;
        }
        self.chaos.restarts += 1;
        self.chaos.kills += u64::from(kill);
        self.past.push(std::mem::take(&mut self.last));
        self.removed_life = 0;
        Ok(())
    }

    /// A clean stop writes the pool's objects to disk; where the disk is nearly full that
    /// drops its oldest segments after the last counters were read. At most this many objects
    /// can go that way, so that many missing keys count as explained.
    fn close_allowance(&mut self) {
        let s = &self.last;
        if s.disk_capacity_bytes == 0 {
            return;
        }
        let seg = umbp_disk::DiskConfig::new("/", s.disk_capacity_bytes).effective_segment_bytes();
        if s.disk_used_bytes + self.pool_bytes + seg > s.disk_capacity_bytes {
            let segments = self.pool_bytes.div_ceil(seg) + 1;
            self.chaos.close_allowance += segments * (seg / self.object_bytes.max(1));
        }
    }

    /// Clears one namespace (a client's own, or a quarter of the time the shared one) and
    /// tells every client when.
    pub(crate) fn clear(&mut self) -> Result<()> {
        let ns = if self.rng.random_bool(0.25) {
            SHARED_NS
        } else {
            self.rng.random_range(1..=self.workers)
        };
        let on_server = match &self.target {
            Target::Server { raw, .. } => {
                let t0 = monotonic_ns();
                let r = raw.clear(Some(&namespace(ns)));
                Some((r, t0, monotonic_ns()))
            }
            Target::Embedded => None,
        };
        let removed = match on_server {
            Some((r, t0, t1)) => {
                let sure = if r.is_ok() { "sure" } else { "unsure" };
                self.broadcast(&format!("clear-notice {ns} {t0} {t1} {sure}"));
                r.unwrap_or(0)
            }
            None => {
                self.send(0, &format!("clear {ns}"));
                let l = self.reply(0, "cleared ", ANSWER_WAIT)?;
                l.split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0)
            }
        };
        self.removed_life += removed;
        self.chaos.clears += 1;
        self.chaos.cleared_objects += removed;
        Ok(())
    }

    /// The end: pauses the clients, checks the counters, audits every client's keys, stops
    /// the clients and the pool.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.drain();
        self.ask_all("pause", "paused")?;
        if let (true, Target::Server { raw, .. }) = (self.inject_loss, &self.target) {
            let n = raw.clear(Some(&namespace(SHARED_NS)))?;
            eprintln!(
                "[umbp soak] {}: removed {n} objects behind the clients' backs (--inject-loss)",
                self.name
            );
        }
        self.check_paused()?;
        for (i, j) in self.ask_all("audit", "audit ")? {
            let v: Value = serde_json::from_str(&j).context("an audit answer")?;
            self.latest[i] = Counts::from_json(&v["counts"]);
            self.audit.add(&v);
        }
        if let Ok(s) = self.snapshot() {
            self.last = s;
        }
        self.past.push(std::mem::take(&mut self.last));
        self.quitting = true;
        self.ask_all("quit", "bye")?;
        for i in 0..self.kids.len() {
            drop(self.kids[i].stdin.take());
            if self.kids[i].alive {
                // Its stdout ends as it exits; `handle` waits for it and checks its status.
                while self.kids[i].alive {
                    match self.rx.recv_timeout(ANSWER_WAIT) {
                        Ok((j, l)) => {
                            let _ = self.handle(j, l);
                        }
                        Err(_) => bail!(
                            "{} client process {} does not exit",
                            self.name,
                            self.kids[i].id
                        ),
                    }
                }
            }
        }
        if let Target::Server { server, .. } = std::mem::replace(&mut self.target, Target::Embedded)
        {
            server.stop()?;
        }
        Ok(())
    }

    /// The last counters of every pool process, in order (after `finish`).
    pub(crate) fn lives(&self) -> &[Snapshot] {
        &self.past
    }

    /// Every pool process's last counters summed, over the run (after `finish`): meaningful
    /// for the counters (puts, evictions, writes, ...), not for the gauges (objects, bytes).
    pub(crate) fn summed(&self) -> Snapshot {
        let mut t = Snapshot::default();
        for s in &self.past {
            t.add(s);
        }
        t
    }

    /// The latest pool counters (of the current pool process).
    pub(crate) fn current(&self) -> &Snapshot {
        &self.last
    }

    /// Samples the pool counters, for progress lines (errors ignored: a restart may be on).
    pub(crate) fn refresh(&mut self) {
        if let Ok(s) = self.snapshot() {
            self.last = s;
        }
    }
}

impl Drop for Arm {
    fn drop(&mut self) {
        // Only after an error: client processes may be stuck, so they are killed.
        for k in &mut self.kids {
            if k.alive {
                let _ = k.child.kill();
                let _ = k.child.wait();
            }
        }
    }
}

/// Forwards every line client `i` prints to `tx`, then None when its stdout ends.
fn read_lines(
    i: usize,
    mut stdout: std::io::BufReader<std::process::ChildStdout>,
    tx: Sender<(usize, Option<String>)>,
) {
    std::thread::spawn(move || {
        let mut l = String::new();
        loop {
            l.clear();
            match stdout.read_line(&mut l) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if tx.send((i, Some(l.trim_end().to_string()))).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = tx.send((i, None));
    });
}
