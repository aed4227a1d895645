//! The soak's client process (`umbp soak-client`, started by `umbp soak`): one or more workers
//! (threads) attached to the server, or sessions of an embedded store this process owns,
//! running the mix while the parent says so; driven through stdin, answering on stdout.
//!
//! Commands (one a line): `run`, `pause` (answers `paused` once every worker is between
//! operations), `clear-notice NS T0 T1 sure|unsure` (the parent cleared namespace NS of the
//! server between T0 and T1), `audit` (paused: answers `audit {json}`), `quit`; for the
//! embedded store also `stats` (answers `stats {json}`), `clear NS` (answers
//! `cleared REMOVED T0 T1`) and `restart` (a clean close and reopen; answers `restarted`).
//! Every second it prints `stat {json}` with its workers' counts summed.

use std::io::{BufRead, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::json;
use umbp_proto::completion::monotonic_ns;
use umbp_store::EmbeddedStore;

use super::args::ClientArgs;
use super::backend::{open_store, Backend, EmbeddedSpec};
use super::content::{namespace, Region};
use super::counts::{Counts, Snapshot};
use super::worker::{clear_hits_json, missing_json, WorkSpec, Worker};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Paused,
    Running,
    Quit,
}

/// Whether the workers run, and how many wait between operations.
#[derive(Debug)]
struct Control {
    state: Mutex<(Mode, usize)>,
    cv: Condvar,
}

impl Control {
    /// Called by a worker between operations: waits while paused; false once told to quit.
    fn proceed(&self) -> bool {
        let mut g = self.state.lock().expect("control lock");
        if g.0 == Mode::Paused {
            g.1 += 1;
            self.cv.notify_all();
            while g.0 == Mode::Paused {
                g = self.cv.wait(g).expect("control lock");
            }
            g.1 -= 1;
        }
        g.0 == Mode::Running
    }

    fn set(&self, m: Mode) {
        self.state.lock().expect("control lock").0 = m;
        self.cv.notify_all();
    }

    fn mode(&self) -> Mode {
        self.state.lock().expect("control lock").0
    }

    /// Pauses, and waits until all `workers` wait between operations.
    fn pause(&self, workers: usize) {
        let mut g = self.state.lock().expect("control lock");
        g.0 = Mode::Paused;
        self.cv.notify_all();
        while g.1 < workers {
            g = self.cv.wait(g).expect("control lock");
        }
    }
}

fn lock(w: &Mutex<Worker>) -> MutexGuard<'_, Worker> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// `umbp soak-client`: see the module docs.
pub fn run_client(a: &ClientArgs) -> Result<()> {
    // Restarts make every client log its re-attach; warnings and errors are enough here.
    if std::env::var_os("RUST_LOG").is_none() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    let r = client_main(a);
    if let Err(e) = &r {
        println!("error soak client {}: {e:#}", a.first_id);
    }
    r
}

fn client_main(a: &ClientArgs) -> Result<()> {
    ensure!(a.workers > 0, "--workers must be > 0");
    ensure!(
        u64::from(a.max_batch) <= a.slots,
        "--max-batch must not exceed --slots"
    );
    let spec = WorkSpec {
        private_keys: a.private_keys,
        shared_keys: a.shared_keys,
        max_batch: a.max_batch,
        shared_fraction: a.shared_fraction,
    };
    let embedded = a.disk_dir.as_ref().map(|d| EmbeddedSpec {
        disk_dir: d.clone(),
        pool_bytes: a.pool_bytes,
        disk_bytes: a.disk_bytes,
        copy_workers: a.copy_workers,
    });
    let mut store = match &embedded {
        Some(e) => Some(open_store(e)?),
        None => None,
    };
    let mut workers = Vec::with_capacity(a.workers as usize);
    for i in 0..a.workers {
        let id = a.first_id + i;
        let mut region = Region::new(a.layers, a.slots, a.piece_bytes)?;
        let backend = match (&store, &a.endpoint) {
            (Some(s), _) => Backend::open(s, &region)?,
            (None, Some(ep)) => {
                Backend::connect(ep, format!("umbp soak worker {id}"), &mut region)?
            }
            (None, None) => bail!("give --endpoint or --disk-dir"),
        };
        let mut w = Worker::new(id, region, spec.clone(), a.seed, a.inject_wrong && i == 0);
        w.backend = Some(backend);
        workers.push(Arc::new(Mutex::new(w)));
    }
    let ctl = Arc::new(Control {
        state: Mutex::new((Mode::Paused, 0)),
        cv: Condvar::new(),
    });
    let published: Arc<Vec<Mutex<Counts>>> =
        Arc::new((0..workers.len()).map(|_| Mutex::default()).collect());
    let threads: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let (w, ctl, published) = (Arc::clone(w), Arc::clone(&ctl), Arc::clone(&published));
            std::thread::Builder::new()
                .name(format!("soak-worker-{i}"))
                .spawn(move || {
                    while ctl.proceed() {
                        let mut g = lock(&w);
                        if let Err(e) = g.step() {
                            // A worker that cannot go on ends the process: the parent sees
                            // the error and the exit.
                            println!("error soak worker {}: {e:#}", g.id);
                            std::process::exit(1);
                        }
                        *published[i].lock().expect("counts lock") = g.counts;
                    }
                })
                .context("cannot start a worker thread")
        })
        .collect::<Result<_>>()?;
    let sum = {
        let published = Arc::clone(&published);
        move || {
            let mut c = Counts::default();
            for p in published.iter() {
                c.add(&p.lock().expect("counts lock"));
            }
            c
        }
    };
    {
        let (sum, ctl) = (sum.clone(), Arc::clone(&ctl));
        std::thread::Builder::new()
            .name("soak-report".into())
            .spawn(move || {
                while ctl.mode() != Mode::Quit {
                    std::thread::sleep(Duration::from_secs(1));
                    println!("stat {}", sum().json());
                }
            })
            .context("cannot start the report thread")?;
    }
    println!("ready");
    let n = workers.len();
    let publish_all = |workers: &[Arc<Mutex<Worker>>]| {
        for (i, w) in workers.iter().enumerate() {
            *published[i].lock().expect("counts lock") = lock(w).counts;
        }
    };
    let mut line = String::new();
    let stdin = std::io::stdin();
    loop {
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        match f[..] {
            ["run"] => ctl.set(Mode::Running),
            ["pause"] => {
                ctl.pause(n);
                publish_all(&workers);
                println!("paused {}", sum().json());
            }
            ["clear-notice", ns, t0, t1, sure] => {
                let (ns, t0, t1) = (ns.parse()?, t0.parse()?, t1.parse()?);
                for w in &workers {
                    lock(w).apply_clear(ns, t0, t1, sure == "sure");
                }
            }
            ["audit"] => {
                ensure!(ctl.mode() == Mode::Paused, "audit while running");
                let results: Vec<_> = std::thread::scope(|s| {
                    let hs: Vec<_> = workers
                        .iter()
                        .map(|w| s.spawn(move || lock(w).audit()))
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().expect("an audit thread panicked"))
                        .collect()
                });
                let mut missing = Vec::new();
                for r in results {
                    missing.extend(r?.missing);
                }
                let hits: Vec<_> = workers
                    .iter()
                    .flat_map(|w| lock(w).clear_hits.clone())
                    .collect();
                publish_all(&workers);
                println!(
                    "audit {}",
                    json!({
                        "counts": sum().json(),
                        "missing": missing_json(&missing),
                        "clear_hits": clear_hits_json(&hits),
                    })
                );
            }
            ["stats"] => {
                let s = store.as_ref().context("stats: no embedded store")?;
                let snap = Snapshot::from_store(&s.stats()?, s.disk_stats().as_ref());
                println!("stats {}", snap.json());
            }
            ["clear", ns] => {
                let s = store.as_ref().context("clear: no embedded store")?;
                let ns: u32 = ns.parse()?;
                let t0 = monotonic_ns();
                let r = s.clear_namespace(&namespace(ns));
                let t1 = monotonic_ns();
                for w in &workers {
                    lock(w).apply_clear(ns, t0, t1, r.is_ok());
                }
                println!("cleared {} {t0} {t1}", r?);
            }
            ["restart"] => {
                let e = embedded.as_ref().context("restart: no embedded store")?;
                let was = ctl.mode();
                ctl.pause(n);
                restart(&mut store, e, &workers)?;
                ctl.set(was);
                println!("restarted");
            }
            ["quit"] => break,
            _ => bail!("unknown command {:?} from the parent", line.trim()),
        }
        std::io::stdout().flush()?;
    }
    ctl.set(Mode::Quit);
    for t in threads {
        t.join().expect("a worker thread panicked");
    }
    for w in &workers {
        if let Some(b) = lock(w).backend.take() {
            b.close();
        }
    }
    drop(store);
    println!("bye");
    Ok(())
}

/// Closes the embedded store cleanly (it writes its pool to disk) and opens it again on the
/// same directory; every worker gets a new session with its region and layout.
fn restart(
    store: &mut Option<Arc<EmbeddedStore>>,
    e: &EmbeddedSpec,
    workers: &[Arc<Mutex<Worker>>],
) -> Result<()> {
    let mut guards: Vec<_> = workers.iter().map(|w| lock(w)).collect();
    for g in guards.iter_mut() {
        if let Some(b) = g.backend.take() {
            b.close();
        }
    }
    if let Some(s) = store.take() {
        s.close();
        // The disk directory is locked until the last handle goes.
        ensure!(
            Arc::strong_count(&s) == 1,
            "the embedded store is still in use at restart"
        );
        drop(s);
    }
    let s = open_store(e)?;
    for g in guards.iter_mut() {
        g.backend = Some(Backend::open(&s, &g.region)?);
    }
    *store = Some(s);
    Ok(())
}
