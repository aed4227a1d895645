//! `umbp stats --watch`: a live node on one refreshing screen, for an operator.
//!
//! The source is the standalone server (its stats RPC; no session), or the embedded engines of
//! a lookup directory (`--lookup-dir`: every worker's lookup socket, asked what its pool
//! holds). Each refresh prints occupancy, the hit rate over the last minute, GB/s into and out
//! of the pool since the last refresh, evictions over the last minute, sessions (server) or
//! workers (engines) and the remote tier's state; `--json` prints one JSON object per refresh.

use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::json;
use umbp_lookup::LookupClient;

use crate::common::human_bytes;
use crate::raw::Raw;

/// What one refresh reads, summed over the source's pools.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub objects: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Server sessions, or engine workers answering.
    pub clients: u64,
    /// Engine workers asked (their lookup sockets); 0 for a server.
    pub expected_clients: u64,
    /// "off", "up" or "down" (engines: "down" when any worker's remote is down).
    pub remote: String,
    pub remote_hits: u64,
}

/// Where the numbers come from.
pub enum Source {
    Server(Box<Raw>),
    Engines { dir: PathBuf, timeout: Duration },
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Server(raw) => format!("UMBP server at {}", raw.endpoint),
            Source::Engines { dir, .. } => format!("UMBP embedded engines in {}", dir.display()),
        }
    }

    pub fn read(&self) -> Result<Snapshot> {
        match self {
            Source::Server(raw) => {
                let s = raw.stats()?;
                let p: umbp_pool::PoolCounters = umbp_proto::counters::pool_counters(&s);
                let remote: Option<umbp_store::RemoteStats> = s
                    .remote
                    .as_ref()
                    .map(|r| umbp_proto::counters::from_wire(&r.counters));
                let (remote, remote_hits) = match &remote {
                    None => ("off".to_owned(), 0),
                    Some(r) if r.connected => ("up".to_owned(), r.hits),
                    Some(r) => ("down".to_owned(), r.hits),
                };
                Ok(Snapshot {
                    capacity_bytes: p.capacity_bytes,
                    used_bytes: p.used_bytes,
                    objects: p.objects,
                    hits: p.hits,
                    misses: p.misses,
                    evictions: p.evictions,
                    bytes_in: p.bytes_in,
                    bytes_out: p.bytes_out,
                    clients: s.sessions,
                    expected_clients: 0,
                    remote,
                    remote_hits,
                })
            }
            Source::Engines { dir, timeout } => {
                let (sockets, skipped) = lookup_sockets(dir)?;
                if skipped > 0 && !SKIP_NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    eprintln!(
                        "umbp stats: skipped {skipped} socket(s) in {} that another user owns",
                        dir.display()
                    );
                }
                if sockets.is_empty() {
                    bail!(
                        "no engine lookup sockets (umbp-*-dp*-w*.sock) of this user in {} or its \
                         umbp-<uid> folder{}; give the connector's lookup_dir",
                        dir.display(),
                        if skipped > 0 {
                            format!(" ({skipped} of other users skipped)")
                        } else {
                            String::new()
                        }
                    );
                }
                // Every socket at once, each given at most PER_SOCKET: a killed engine leaves
                // its socket behind, and one that never answers must neither hide the others
                // nor add its wait to theirs.
                let expected = sockets.len() as u64;
                let per = (*timeout).min(PER_SOCKET);
                let mut answers = Vec::new();
                let mut first_err = None;
                for chunk in sockets.chunks(64) {
                    let got: Vec<_> = std::thread::scope(|s| {
                        let asks: Vec<_> = chunk
                            .iter()
                            .map(|path| {
                                s.spawn(move || {
                                    LookupClient::new(vec![path.clone()], per).wait_ready(per)
                                })
                            })
                            .collect();
                        asks.into_iter().map(|a| a.join()).collect()
                    });
                    for r in got {
                        match r {
                            Ok(Ok(mut a)) => answers.append(&mut a),
                            Ok(Err(e)) => {
                                first_err.get_or_insert(e.to_string());
                            }
                            Err(_) => {
                                first_err.get_or_insert("a socket's reader panicked".into());
                            }
                        }
                    }
                }
                if answers.is_empty() {
                    let e = first_err.unwrap_or_default();
                    bail!(
                        "none of the {expected} engine workers in {} answered: {e}",
                        dir.display()
                    );
                }
                let mut s = sum_describes(&answers);
                s.expected_clients = expected;
                Ok(s)
            }
        }
    }
}

/// How long one engine worker's lookup socket gets to answer, at most: 1 s (a worker answers
/// in microseconds; the sockets are asked all at once).
const PER_SOCKET: Duration = Duration::from_secs(1);

/// Whether the note about other users' sockets was printed already.
static SKIP_NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The lookup sockets of this user in `dir` and in `dir/umbp-<uid>` (where the connector puts
/// them), and how many sockets of other users were skipped (never connected to: one planted by
/// another user could hold the command, or learn who asks).
fn lookup_sockets(dir: &Path) -> Result<(Vec<PathBuf>, usize)> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut out = Vec::new();
    let mut skipped = 0;
    for d in [dir.to_path_buf(), dir.join(format!("umbp-{uid}"))] {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !(name.starts_with("umbp-") && name.ends_with(".sock") && name.contains("-dp")) {
                continue;
            }
            match std::fs::symlink_metadata(e.path()) {
                Ok(m) if m.uid() == uid => out.push(e.path()),
                _ => skipped += 1,
            }
        }
    }
    out.sort();
    Ok((out, skipped))
}

/// Sums the workers' `key=value` answers (`umbp-store-lookup`'s describe).
pub fn sum_describes(answers: &[String]) -> Snapshot {
    let mut s = Snapshot {
        remote: "off".to_owned(),
        ..Snapshot::default()
    };
    for a in answers {
        s.clients += 1;
        for word in a.split_whitespace() {
            let Some((k, v)) = word.split_once('=') else {
                continue;
            };
            let n = v.parse::<u64>().unwrap_or(0);
            match k {
                "capacity_bytes" => s.capacity_bytes += n,
                "used_bytes" => s.used_bytes += n,
                "objects" => s.objects += n,
                "hits" => s.hits += n,
                "misses" => s.misses += n,
                "evictions" => s.evictions += n,
                "bytes_in" => s.bytes_in += n,
                "bytes_out" => s.bytes_out += n,
                "remote_hits" => s.remote_hits += n,
                "remote" if v == "down" || (v == "up" && s.remote == "off") => {
                    s.remote = v.to_owned()
                }
                _ => {}
            }
        }
    }
    s
}

/// The rates of one refresh, from the snapshots of the last minute.
#[derive(Debug, Clone, PartialEq)]
pub struct Rates {
    /// Hits / (hits + misses) over the window; None without lookups.
    pub hit_rate: Option<f64>,
    pub lookups: u64,
    /// Into and out of the pool since the previous refresh.
    pub gb_s_in: f64,
    pub gb_s_out: f64,
    pub evictions: u64,
    /// Seconds the window covers.
    pub window_s: f64,
}

/// The last minute of snapshots.
pub struct Window {
    span: Duration,
    samples: VecDeque<(Instant, Snapshot)>,
}

impl Window {
    pub fn new(span: Duration) -> Self {
        Window {
            span,
            samples: VecDeque::new(),
        }
    }

    /// Adds `now`'s snapshot; returns the rates against the window's oldest and the previous.
    pub fn push(&mut self, at: Instant, now: Snapshot) -> Rates {
        let prev = self.samples.back().cloned();
        self.samples.push_back((at, now.clone()));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| at.duration_since(*t) > self.span)
        {
            self.samples.pop_front();
        }
        let (t0, first) = self.samples.front().cloned().expect("just pushed");
        // Counters that went back (a restarted server or engine) start the window again.
        let went_back = now.hits < first.hits || now.bytes_in < first.bytes_in;
        if went_back {
            self.samples.clear();
            self.samples.push_back((at, now.clone()));
        }
        let (t0, first) = if went_back {
            (at, now.clone())
        } else {
            (t0, first)
        };
        let hits = now.hits - first.hits;
        let lookups = hits + now.misses.saturating_sub(first.misses);
        let (gb_s_in, gb_s_out) = match prev {
            Some((tp, p)) if at > tp && now.bytes_in >= p.bytes_in => {
                let dt = at.duration_since(tp).as_secs_f64();
                (
                    (now.bytes_in - p.bytes_in) as f64 / dt / 1e9,
                    now.bytes_out.saturating_sub(p.bytes_out) as f64 / dt / 1e9,
                )
            }
            _ => (0.0, 0.0),
        };
        Rates {
            hit_rate: (lookups > 0).then(|| hits as f64 / lookups as f64),
            lookups,
            gb_s_in,
            gb_s_out,
            evictions: now.evictions.saturating_sub(first.evictions),
            window_s: at.duration_since(t0).as_secs_f64(),
        }
    }
}

/// One screen.
pub fn render(title: &str, s: &Snapshot, r: &Rates) -> String {
    let pct = if s.capacity_bytes > 0 {
        100.0 * s.used_bytes as f64 / s.capacity_bytes as f64
    } else {
        0.0
    };
    let hit = r
        .hit_rate
        .map_or("-".to_owned(), |h| format!("{:.1} %", 100.0 * h));
    format!(
        "{title}\n\
         occupancy   {} of {} ({pct:.1} %), {} objects\n\
         hit rate    {hit} of {} lookups (last {:.0} s)\n\
         pool in     {:.2} GB/s   out {:.2} GB/s (since the last refresh)\n\
         evictions   {} (last {:.0} s), {} in all\n\
         clients     {}\n\
         remote tier {} ({} hits in all)\n",
        human_bytes(s.used_bytes),
        human_bytes(s.capacity_bytes),
        s.objects,
        r.lookups,
        r.window_s,
        r.gb_s_in,
        r.gb_s_out,
        r.evictions,
        r.window_s,
        s.evictions,
        if s.expected_clients > 0 {
            format!(
                "{} of {} engine workers answered",
                s.clients, s.expected_clients
            )
        } else {
            format!("{} sessions", s.clients)
        },
        s.remote,
        s.remote_hits,
    )
}

/// Refreshes every `every` until `count` screens (None: until interrupted). A failed read is
/// shown and the next refresh tried (a restarting server), unless `once`: then it is the
/// command's error.
pub fn run(
    source: &Source,
    every: Duration,
    count: Option<u64>,
    as_json: bool,
    once: bool,
) -> Result<()> {
    let mut window = Window::new(Duration::from_secs(60));
    let tty = std::io::stdout().is_terminal() && !as_json;
    let title = source.describe();
    let mut n = 0u64;
    loop {
        let at = Instant::now();
        match source.read() {
            Ok(s) => {
                let r = window.push(at, s.clone());
                let mut out = std::io::stdout().lock();
                if as_json {
                    let line = json!({
                        "capacity_bytes": s.capacity_bytes,
                        "used_bytes": s.used_bytes,
                        "objects": s.objects,
                        "hits": s.hits,
                        "misses": s.misses,
                        "evictions": s.evictions,
                        "bytes_in": s.bytes_in,
                        "bytes_out": s.bytes_out,
                        "clients": s.clients,
                        "expected_clients": s.expected_clients,
                        "remote": s.remote,
                        "remote_hits": s.remote_hits,
                        "hit_rate_last_minute": r.hit_rate,
                        "lookups_last_minute": r.lookups,
                        "evictions_last_minute": r.evictions,
                        "gb_s_in": r.gb_s_in,
                        "gb_s_out": r.gb_s_out,
                        "window_s": r.window_s,
                    });
                    writeln!(out, "{line}")?;
                } else {
                    if tty {
                        write!(out, "\x1b[2J\x1b[H")?; // clear the screen, cursor home
                    }
                    writeln!(out, "{}", render(&title, &s, &r))?;
                }
                out.flush()?;
            }
            Err(e) if once => return Err(e),
            // A source away for a moment (a restarting server) is shown, not fatal.
            Err(e) => eprintln!("umbp stats: {e:#}"),
        }
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        std::thread::sleep(every.saturating_sub(at.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(hits: u64, misses: u64, bytes_in: u64, evictions: u64) -> Snapshot {
        Snapshot {
            hits,
            misses,
            bytes_in,
            evictions,
            ..Snapshot::default()
        }
    }

    #[test]
    fn rates_cover_the_last_minute_and_the_last_refresh() {
        let t = Instant::now();
        let mut w = Window::new(Duration::from_secs(60));
        let r = w.push(t, snap(10, 10, 0, 0));
        assert_eq!(r.hit_rate, None);
        let r = w.push(t + Duration::from_secs(30), snap(40, 20, 3_000_000_000, 2));
        assert_eq!(r.lookups, 40);
        assert_eq!(r.hit_rate, Some(0.75));
        assert!((r.gb_s_in - 0.1).abs() < 1e-9);
        assert_eq!(r.evictions, 2);
        // 90 s: the first snapshot left the window; the second is its start.
        let r = w.push(t + Duration::from_secs(90), snap(50, 30, 3_000_000_000, 5));
        assert_eq!((r.lookups, r.evictions), (20, 3));
        assert_eq!(r.hit_rate, Some(0.5));
        assert_eq!(r.gb_s_in, 0.0);
        // A restarted source: counters back to small numbers start the window again, and the
        // next refresh counts from there.
        let r = w.push(t + Duration::from_secs(100), snap(1, 0, 0, 0));
        assert_eq!((r.lookups, r.window_s), (0, 0.0));
        let r = w.push(t + Duration::from_secs(110), snap(4, 1, 1_000_000_000, 1));
        assert_eq!((r.lookups, r.evictions, r.window_s), (4, 1, 10.0));
        assert_eq!(r.hit_rate, Some(0.75));
    }

    #[test]
    fn workers_answers_are_summed() {
        let s = sum_describes(&[
            "tp0 objects=2 used_bytes=100 capacity_bytes=1000 evictions=1 hits=5 misses=1 \
             bytes_in=10 bytes_out=20 remote=off"
                .to_owned(),
            "tp1 objects=3 used_bytes=200 capacity_bytes=1000 evictions=0 hits=4 misses=2 \
             bytes_in=30 bytes_out=40 remote=down remote_hits=7"
                .to_owned(),
        ]);
        assert_eq!(
            s,
            Snapshot {
                capacity_bytes: 2000,
                used_bytes: 300,
                objects: 5,
                hits: 9,
                misses: 3,
                evictions: 1,
                bytes_in: 40,
                bytes_out: 60,
                clients: 2,
                expected_clients: 0,
                remote: "down".to_owned(),
                remote_hits: 7,
            }
        );
    }
}
