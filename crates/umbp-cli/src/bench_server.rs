//! `umbp bench server`: KV blocks through the standalone server from several client
//! processes at once, beside embedded mode and a plain-copy ceiling measured in the same run.
//!
//! A private server is started; for each client count that many client processes are
//! spawned (this executable again, `umbp bench server-client`), each with its own KV cache
//! (host memory shared through a memfd, or CUDA memory registered by IPC) and its own keys.
//! The parent drives them through their stdin (one command per phase, so every client starts
//! a phase together) and reads when each began and finished from their stdout; a direction's
//! figure is every client's bytes over the wall time from the first start to the last finish.
//!
//! The flags are in `args`, the caches in `cache`, the client process in `client`, the
//! parent's side of the clients in `server_run`, the embedded baseline and the ceiling in
//! `embedded` and the report in `report`; this file runs the sweep.

mod args;
mod cache;
mod client;
mod embedded;
mod report;
mod server_run;

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use serde_json::json;
use umbp_core::PoolConfig;
use umbp_cuda::Device;
use umbp_store::{EmbeddedStore, StoreConfig};

use crate::common::human_bytes;
use crate::common::progress;
use crate::raw::Raw;
use crate::server_proc::{PrivateServer, ServerSpec};

pub use args::{Args, ClientArgs};
/// What `umbp soak` shares with this benchmark: client memory and client processes.
pub(crate) use cache::HostBuf;
pub use client::run_client;
pub(crate) use server_run::{spawn_kid, Kid};

use args::parse_list;
use cache::{Run, Shape};
use embedded::{ceiling_round, EmbeddedRun};
use report::{print_header, print_table, row, Samples, Stat, GB};
use server_run::{breakdown_json, median_breakdown, Breakdown, ServerRun};

pub fn run(a: &Args) -> Result<()> {
    let clients = parse_list(&a.clients, "--clients")?;
    let block_kib = a
        .block_kib
        .as_deref()
        .unwrap_or(if a.cuda { "64,8" } else { "64" });
    let pieces: Vec<u64> = parse_list(block_kib, "--block-kib")?
        .into_iter()
        .map(|k| k << 10)
        .collect();
    ensure!(
        a.layers > 0 && a.blocks > 0 && a.rounds > 0,
        "--layers, --blocks and --rounds must be > 0"
    );
    ensure!(
        clients.iter().all(|c| *c <= 64),
        "--clients: at most 64 client processes"
    );
    let workers = a
        .workers
        .unwrap_or_else(crate::common::default_threads)
        .max(1);
    let dev = if a.cuda {
        match Device::open(a.device).and_then(|d| d.bind_thread().map(|()| d)) {
            Ok(d) => Some(d),
            Err(e) => {
                println!(
                    "SKIP: umbp bench server --cuda needs a CUDA GPU (device {}): {e}",
                    a.device
                );
                if a.json {
                    println!(
                        "{}",
                        json!({"bench": "server", "mode": "cuda", "skipped": true, "reason": e.to_string()})
                    );
                }
                return Ok(());
            }
        }
    } else {
        None
    };
    let max_total = clients.iter().max().copied().unwrap_or(1)
        * pieces.iter().max().copied().unwrap_or(0)
        * a.blocks
        * a.layers
        * u64::from(a.in_flight);
    let capacity = (max_total as f64 * 1.3) as u64 + (64 << 20);
    let capacity = capacity.next_multiple_of(64 << 20);
    let mode = if a.cuda { "cuda" } else { "host" };
    progress!(
        "{mode} memory: {} layers × {} blocks per client, pieces of {:?} KiB, clients {:?}, pool {}, {workers} copy workers",
        a.layers,
        a.blocks,
        pieces.iter().map(|p| p >> 10).collect::<Vec<_>>(),
        clients,
        human_bytes(capacity)
    );
    let server = PrivateServer::start(&ServerSpec {
        bin: a.server_bin.clone(),
        capacity,
        workers,
        busy_poll_us: a.server_busy_poll_us,
        extra_args: Vec::new(),
    })?;
    let raw = Raw::new(server.endpoint.clone(), Duration::from_secs(30))?;
    let t = Instant::now();
    let store = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: true,
            ..PoolConfig::with_capacity(capacity)
        },
        num_workers: workers,
        ..StoreConfig::default()
    })?;
    progress!("embedded store ready in {:.2} s", t.elapsed().as_secs_f64());
    let (mut rows, mut medians) = (Vec::new(), Vec::new());
    for &piece in &pieces {
        for &c in &clients {
            let r = Run {
                a,
                shape: Shape {
                    blocks: a.blocks,
                    layers: a.layers,
                    piece,
                },
                clients: c as usize,
                workers,
            };
            progress!(
                "{c} client process(es), {} KiB pieces: server, embedded{} interleaved, {} rounds after a warm-up round",
                piece >> 10,
                if a.cuda { "" } else { " and ceiling" },
                a.rounds
            );
            let mut srv_run = ServerRun::start(&r, &server.endpoint)?;
            let emb_run = EmbeddedRun::new(&r, &store, dev.as_ref())?;
            let (mut srv, mut emb, mut ceil) =
                (Samples::default(), Samples::default(), Samples::default());
            let mut parts: [Vec<Breakdown>; 2] = Default::default();
            let gbps = |s: f64| r.bytes() as f64 / s / GB;
            for round in 0..=a.rounds {
                let verify = round == a.rounds;
                let (sv, bd) = srv_run.round(&raw, verify)?;
                let em = emb_run.round(verify)?;
                let ce = (!a.cuda).then(|| ceiling_round(&emb_run, a.in_flight));
                progress!(
                    "  round {round}{}: server store {:.2} load {:.2}, embedded store {:.2} load {:.2}{} GB/s",
                    if round == 0 { " (warm-up)" } else { "" },
                    gbps(sv.0),
                    gbps(sv.1),
                    gbps(em.0),
                    gbps(em.1),
                    ce.map_or(String::new(), |(m, s)| format!(
                        ", memcpy {:.2} streaming {:.2}",
                        gbps(m),
                        gbps(s)
                    ))
                );
                if round > 0 {
                    parts[0].push(bd[0]);
                    parts[1].push(bd[1]);
                    srv.add(sv);
                    emb.add(em);
                    if let Some(c) = ce {
                        ceil.add(c);
                    }
                }
            }
            srv_run.finish()?;
            drop(emb_run);
            let ceil = (!a.cuda).then_some(ceil);
            let (bs, bl) = (median_breakdown(&parts[0]), median_breakdown(&parts[1]));
            let (es, el) = (
                Stat::Median.of(&emb.store) * 1e6,
                Stat::Median.of(&emb.load) * 1e6,
            );
            if c == 1 && a.in_flight == 1 {
                for (dir, b, e) in [("store", bs, es), ("load", bl, el)] {
                    let legs = if b.to_server >= 0 && b.to_caller >= 0 {
                        format!(
                            "; call to server {} µs, published to seen {} µs",
                            b.to_server, b.to_caller
                        )
                    } else {
                        String::new()
                    };
                    progress!(
                        "  one {dir} transfer, median µs: client call {} = {} {} (server {} (copy job {})) + the rest; embedded job {e:.0}{legs}",
                        b.call,
                        if b.by_page > 0 { "to the completion page's wake-up" } else { "gRPC round trip" },
                        b.round_trip,
                        b.server,
                        b.copy
                    );
                }
            }
            let mut best = row(&r, Stat::Best, &srv, &emb, ceil.as_ref());
            let mut med = row(&r, Stat::Median, &srv, &emb, ceil.as_ref());
            if c == 1 && a.in_flight == 1 {
                let parts =
                    json!({"store": breakdown_json(&bs, es), "load": breakdown_json(&bl, el)});
                best["median_breakdown"] = parts.clone();
                med["median_breakdown"] = parts;
            }
            rows.push(best);
            medians.push(med);
        }
    }
    store.close();
    drop(store);
    server.stop()?;
    print_header(a, mode, workers);
    print_table(a, Stat::Median, &medians);
    print_table(a, Stat::Best, &rows);
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "server",
                "mode": mode,
                "layers": a.layers,
                "blocks_per_client": a.blocks,
                "in_flight": a.in_flight,
                "completion_page": !a.replies_only,
                "transfer_channel": !a.replies_only && !a.no_channel,
                "server_busy_poll_us": a.server_busy_poll_us,
                "rounds": a.rounds,
                "workers": workers,
                "results": rows,
                "median_results": medians,
            })
        );
    }
    Ok(())
}
