//! The report: the samples of each run, the figure a table shows, the JSON rows and the
//! printed tables with the targets.

use serde_json::{json, Value};

use super::args::Args;
use super::cache::Run;
use crate::common::human_bytes;

pub(super) const GB: f64 = 1e9;
/// Targets of the issue: host, 2 and 4 clients, against the ceiling; CUDA, one client,
/// against embedded mode.
pub(super) const TARGET_HOST_VS_CEILING: f64 = 0.8;
pub(super) const TARGET_CUDA_VS_EMBEDDED: f64 = 0.95;
/// Seconds of each direction, one per timed round.
#[derive(Debug, Clone, Default)]
pub(super) struct Samples {
    pub(super) store: Vec<f64>,
    pub(super) load: Vec<f64>,
}

impl Samples {
    pub(super) fn add(&mut self, (store, load): (f64, f64)) {
        self.store.push(store);
        self.load.push(load);
    }
}

/// Which figure of the rounds a table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stat {
    /// The fastest round.
    Best,
    /// The median round.
    Median,
}

impl Stat {
    pub(super) fn of(self, v: &[f64]) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        match self {
            Stat::Best => v[0],
            Stat::Median => v[v.len() / 2],
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Stat::Best => "best",
            Stat::Median => "median",
        }
    }
}
pub(super) fn row(
    r: &Run<'_>,
    stat: Stat,
    srv: &Samples,
    emb: &Samples,
    ceil: Option<&Samples>,
) -> Value {
    let bytes = r.bytes() as f64;
    let g = |s: f64| bytes / s / GB;
    let (ss, sl) = (stat.of(&srv.store), stat.of(&srv.load));
    let (es, el) = (stat.of(&emb.store), stat.of(&emb.load));
    let mut v = json!({
        "clients": r.clients,
        "piece_bytes": r.shape.piece,
        "bytes_each_way": bytes as u64,
        "workers": r.workers,
        "stat": stat.name(),
        "server_store_gbps": g(ss),
        "server_load_gbps": g(sl),
        "embedded_store_gbps": g(es),
        "embedded_load_gbps": g(el),
        "store_vs_embedded": es / ss,
        "load_vs_embedded": el / sl,
    });
    if let (Some(c), Value::Object(o)) = (ceil, &mut v) {
        // `store` holds the memcpy rounds, `load` the streaming ones.
        let (m, st) = (stat.of(&c.store), stat.of(&c.load));
        let c = m.min(st);
        o.insert("memcpy_gbps".into(), json!(g(m)));
        o.insert("stream_gbps".into(), json!(g(st)));
        o.insert("ceiling_gbps".into(), json!(g(c)));
        o.insert("store_vs_ceiling".into(), json!(c / ss));
        o.insert("load_vs_ceiling".into(), json!(c / sl));
    }
    v
}

/// How the clients send and are answered.
pub(super) fn paths(a: &Args) -> &'static str {
    if a.replies_only {
        "over gRPC, answered by the replies"
    } else if a.no_channel {
        "over gRPC, answered through the completion page"
    } else {
        "on the transfer channel, answered through the completion page"
    }
}

pub(super) fn print_header(a: &Args, mode: &str, workers: usize) {
    println!(
        "server benchmark ({mode} memory): {} layers × {} blocks per client process and transfer, {} transfer(s) in flight per client, each way; {} timed rounds after a warm-up; {workers} copy workers in the server and in embedded mode; transfers {}",
        a.layers,
        a.blocks,
        a.in_flight,
        a.rounds,
        paths(a)
    );
    if let Some(us) = a.server_busy_poll_us {
        println!("  the server's transfer channels busy-poll {us} µs after each request and reply (--busy-poll-us)");
    }
    if !a.cuda {
        println!(
            "  ceiling: the faster of libc memcpy and UMBP's streaming copy, one thread per client, the same bytes in the same pieces"
        );
    }
}

pub(super) fn print_table(a: &Args, stat: Stat, rows: &[Value]) {
    let f = |v: &Value, k: &str| v[k].as_f64();
    let num = |x: Option<f64>| match x {
        Some(x) => format!("{x:>7.2}"),
        None => format!("{:>7}", "-"),
    };
    println!("  {} of the rounds:", stat.name());
    println!(
        "  {:>7} {:>7} {:>10} | {:^15} | {:^15} | {:>7} | {:^15} | {:^15}",
        "", "", "", "server GB/s", "embedded GB/s", "ceiling", "server/ceiling", "server/embedded"
    );
    println!(
        "  {:>7} {:>7} {:>10} | {:>7} {:>7} | {:>7} {:>7} | {:>7} | {:>7} {:>7} | {:>7} {:>7}",
        "clients",
        "piece",
        "each way",
        "store",
        "load",
        "store",
        "load",
        "GB/s",
        "store",
        "load",
        "store",
        "load"
    );
    let mut misses = Vec::new();
    for v in rows {
        let c = v["clients"].as_u64().unwrap_or(0);
        let p = v["piece_bytes"].as_u64().unwrap_or(0);
        println!(
            "  {c:>7} {:>7} {:>10} | {} {} | {} {} | {} | {} {} | {} {}",
            format!("{} KiB", p >> 10),
            human_bytes(v["bytes_each_way"].as_u64().unwrap_or(0)),
            num(f(v, "server_store_gbps")),
            num(f(v, "server_load_gbps")),
            num(f(v, "embedded_store_gbps")),
            num(f(v, "embedded_load_gbps")),
            num(f(v, "ceiling_gbps")),
            num(f(v, "store_vs_ceiling")),
            num(f(v, "load_vs_ceiling")),
            num(f(v, "store_vs_embedded")),
            num(f(v, "load_vs_embedded")),
        );
        let (key, target, applies) = if a.cuda {
            ("embedded", TARGET_CUDA_VS_EMBEDDED, c == 1)
        } else {
            ("ceiling", TARGET_HOST_VS_CEILING, c == 2 || c == 4)
        };
        if applies {
            for dir in ["store", "load"] {
                let x = f(v, &format!("{dir}_vs_{key}")).unwrap_or(0.0);
                if x < target {
                    misses.push(format!("{c} clients, {} KiB, {dir} {x:.2}", p >> 10));
                }
            }
        }
    }
    let target = if a.cuda {
        format!("CUDA, 1 client ≥ {TARGET_CUDA_VS_EMBEDDED} of embedded")
    } else {
        format!("host, 2 and 4 clients ≥ {TARGET_HOST_VS_CEILING} of the ceiling")
    };
    if misses.is_empty() {
        println!("  target ({target}): met");
    } else {
        println!("  target ({target}): MISSED by {}", misses.join(", "));
    }
}
