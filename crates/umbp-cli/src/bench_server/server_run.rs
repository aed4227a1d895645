//! The parent's side of the client processes: spawning them for one run, driving each phase
//! through their stdin and collecting their timings and the first client's breakdown.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use umbp_proto::Endpoint;

use super::cache::Run;
use crate::raw::Raw;

/// A client process driven through its stdin, answering on its stdout.
#[derive(Debug)]
pub(crate) struct Kid {
    pub(crate) id: u32,
    pub(crate) child: Child,
    pub(crate) stdin: ChildStdin,
    pub(crate) stdout: BufReader<ChildStdout>,
}

impl Kid {
    pub(crate) fn read_line(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.stdout.read_line(&mut l)? == 0 {
            let st = self.child.wait()?;
            bail!("client process {} exited ({st}) before answering", self.id);
        }
        let l = l.trim().to_string();
        if let Some(e) = l.strip_prefix("error ") {
            bail!("{e}");
        }
        Ok(l)
    }
}

/// Starts `umbp ARGS` (this executable again) as client process `id`, its stdin and stdout
/// piped, its stderr inherited.
pub(crate) fn spawn_kid(id: u32, args: &[String]) -> Result<Kid> {
    let exe = std::env::current_exe().context("cannot find this executable to re-run it")?;
    let mut child = Command::new(&exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {}", exe.display()))?;
    let stdin = child.stdin.take().expect("piped");
    let stdout = BufReader::new(child.stdout.take().expect("piped"));
    Ok(Kid {
        id,
        child,
        stdin,
        stdout,
    })
}

/// Where the first client's transfer of one phase spent its time, in µs: its whole call
/// (submit to `wait` returning), the gRPC round trip inside the client, the server's
/// handling, and the copy job inside that; with the completion page, from the call to the
/// server reading the request and from the server publishing the answer to the client
/// seeing it (-1: not recorded); and how many of every client's transfers the completion
/// page answered.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Breakdown {
    pub(super) call: u64,
    pub(super) round_trip: u64,
    pub(super) server: u64,
    pub(super) copy: u64,
    pub(super) to_server: i64,
    pub(super) to_caller: i64,
    pub(super) by_page: u64,
}

/// Sends `cmd` to every client, then collects their (start, end); returns the wall time
/// from the first start to the last end, and the first client's breakdown.
pub(super) fn phase(kids: &mut [Kid], cmd: &str) -> Result<(f64, Breakdown)> {
    for k in kids.iter_mut() {
        writeln!(k.stdin, "{cmd}")
            .and_then(|_| k.stdin.flush())
            .with_context(|| format!("client process {} is gone", k.id))?;
    }
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut breakdown: Option<Breakdown> = None;
    let mut by_page = 0;
    for k in kids.iter_mut() {
        let l = k.read_line()?;
        let f: Vec<&str> = l.split_whitespace().collect();
        let ["done", a, b, rtt, srv, copy, pages, to_server, to_caller] = f[..] else {
            bail!("client process {} answered {l:?}", k.id);
        };
        by_page += pages.parse::<u64>()?;
        let (a, b): (u64, u64) = (a.parse()?, b.parse()?);
        first = first.min(a);
        last = last.max(b);
        breakdown.get_or_insert(Breakdown {
            call: b.saturating_sub(a) / 1000,
            round_trip: rtt.parse()?,
            server: srv.parse()?,
            copy: copy.parse()?,
            to_server: to_server.parse()?,
            to_caller: to_caller.parse()?,
            by_page: 0,
        });
    }
    let mut b = breakdown.unwrap_or_default();
    b.by_page = by_page;
    Ok((last.saturating_sub(first) as f64 / 1e9, b))
}

/// Median of each field of `v` (non-empty).
pub(super) fn median_breakdown(v: &[Breakdown]) -> Breakdown {
    fn median<T: Ord + Copy>(v: &[Breakdown], f: fn(&Breakdown) -> T) -> T {
        let mut x: Vec<T> = v.iter().map(f).collect();
        x.sort_unstable();
        x[x.len() / 2]
    }
    Breakdown {
        call: median(v, |b| b.call),
        round_trip: median(v, |b| b.round_trip),
        server: median(v, |b| b.server),
        copy: median(v, |b| b.copy),
        to_server: median(v, |b| b.to_server),
        to_caller: median(v, |b| b.to_caller),
        by_page: median(v, |b| b.by_page),
    }
}

pub(super) fn breakdown_json(b: &Breakdown, embedded_us: f64) -> Value {
    json!({
        "client_call_us": b.call,
        "round_trip_us": b.round_trip,
        "server_us": b.server,
        "copy_job_us": b.copy,
        "embedded_job_us": embedded_us,
        "to_server_us": (b.to_server >= 0).then_some(b.to_server),
        "to_caller_us": (b.to_caller >= 0).then_some(b.to_caller),
        "answered_by_completion_page": b.by_page,
    })
}
/// The client processes of one run.
#[derive(Debug)]
pub(super) struct ServerRun {
    pub(super) kids: Vec<Kid>,
}

impl ServerRun {
    /// Starts `r.clients` client processes and waits until each has registered its cache.
    pub(super) fn start(r: &Run<'_>, endpoint: &Endpoint) -> Result<Self> {
        let mut run = ServerRun {
            kids: Vec::with_capacity(r.clients),
        };
        for id in 0..r.clients as u32 {
            let mut args: Vec<String> = ["bench", "server-client", "--endpoint"]
                .map(String::from)
                .into();
            args.push(endpoint.to_string());
            for (flag, v) in [
                ("--id", id.to_string()),
                ("--blocks", r.shape.blocks.to_string()),
                ("--layers", r.shape.layers.to_string()),
                ("--piece-bytes", r.shape.piece.to_string()),
                ("--namespace", "bench-server".into()),
                ("--device", r.a.device.to_string()),
                ("--in-flight", r.a.in_flight.to_string()),
            ] {
                args.push(flag.into());
                args.push(v);
            }
            for (on, flag) in [
                (r.a.cuda, "--cuda"),
                (r.a.replies_only, "--replies-only"),
                (r.a.no_channel, "--no-channel"),
            ] {
                if on {
                    args.push(flag.into());
                }
            }
            run.kids.push(spawn_kid(id, &args)?);
        }
        for k in run.kids.iter_mut() {
            let l = k.read_line()?;
            ensure!(l == "ready", "client process {} said {l:?}", k.id);
        }
        Ok(run)
    }

    /// Every client stores, then every client loads (checking the bytes when `verify`);
    /// then the pool is emptied. Seconds of each direction.
    pub(super) fn round(
        &mut self,
        raw: &Raw,
        verify: bool,
    ) -> Result<((f64, f64), [Breakdown; 2])> {
        let (s, bs) = phase(
            &mut self.kids,
            if verify { "verify-store" } else { "store" },
        )?;
        let (l, bl) = phase(&mut self.kids, if verify { "verify-load" } else { "load" })?;
        raw.clear(None)?;
        Ok(((s, l), [bs, bl]))
    }

    /// Tells every client to quit and checks that each exits 0.
    pub(super) fn finish(mut self) -> Result<()> {
        let kids = std::mem::take(&mut self.kids);
        for mut k in kids {
            let _ = writeln!(k.stdin, "quit").and_then(|_| k.stdin.flush());
            drop(k.stdin);
            let st = k.child.wait()?;
            ensure!(st.success(), "client process {} exited with {st}", k.id);
        }
        Ok(())
    }
}

impl Drop for ServerRun {
    fn drop(&mut self) {
        // Only after an error: the clients may be stuck, so they are killed.
        for k in &mut self.kids {
            let _ = k.child.kill();
            let _ = k.child.wait();
        }
    }
}
