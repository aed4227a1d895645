//! `umbp bench host-route`: how the standalone server can best reach a client process's host
//! memory (a CPU engine's KV cache), measured side by side in one run.
//!
//! For each page kind and piece size, `--total-mib` bytes move each way between a pool-like
//! buffer of this process (pieces in order) and a client's memory (pieces in a random order,
//! as the blocks of a KV cache are):
//! * **memcpy**: between two buffers of this process, the ceiling;
//! * **(a) shm**: between the pool buffer and this process's `MAP_SHARED` mapping
//!   (`umbp_pool::ServerMapping`) of a forked child's memory, made shareable in place by
//!   `umbp_client::host_share::share_host_range` and sent over a socket (`SCM_RIGHTS`);
//! * **(b) pvm**: `process_vm_readv`/`process_vm_writev` against a forked child's private
//!   anonymous memory, one iovec pair per piece, up to `IOV_MAX` pieces per call.
//!
//! memcpy and (a) copy with the copy engine's own function (`umbp_copy::memcpy::copy`), so the
//! two differ only in where the client's bytes are.
//!
//! The buffers are in `buf`, the timed moves in `moves` and the client processes in `child`;
//! this file runs the cases and reports them.

mod buf;
mod child;
mod moves;

use std::os::fd::AsFd;

use anyhow::{ensure, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde_json::json;
use umbp_pool::ServerMapping;

use crate::common::progress;
use buf::{Buf, PageMode};
use child::{huge_share, spawn_child};
use moves::{checked_pass, pass, Client, Dir};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// MiB moved per case and direction (also the size of every buffer).
    #[arg(long, default_value_t = 1024)]
    total_mib: u64,
    /// Piece sizes, comma-separated; k and m mean KiB and MiB.
    #[arg(long, value_delimiter = ',', default_value = "4k,16k,64k,256k,1m", value_parser = parse_size)]
    pieces: Vec<u64>,
    /// Page kinds, comma-separated: 4k, thp.
    #[arg(long, value_delimiter = ',', default_value = "4k,thp")]
    pages: Vec<PageMode>,
    /// Copy threads per transfer (each takes an equal share of the pieces).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Measured rounds (the best is reported), after one warm-up round whose bytes are checked.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = t.strip_suffix('k') {
        (n, 1u64 << 10)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 1 << 20)
    } else {
        (t.as_str(), 1)
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (examples: 4096, 16k, 1m)"))
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// One measured case.
struct Case {
    pages: PageMode,
    piece: u64,
    dir: Dir,
    memcpy: f64,
    shm: f64,
    pvm: f64,
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(a.total_mib > 0, "--total-mib must be > 0");
    ensure!(a.rounds > 0, "--rounds must be > 0");
    ensure!(
        !a.pieces.is_empty() && !a.pages.is_empty(),
        "--pieces and --pages must not be empty"
    );
    let threads = a.threads.max(1);
    let total = a.total_mib << 20;
    for &p in &a.pieces {
        ensure!(
            p >= 64
                && p.is_multiple_of(64)
                && total.is_multiple_of(p)
                && total / p <= u32::MAX as u64,
            "piece size {p}: must be a multiple of 64 bytes that divides --total-mib"
        );
    }
    let len = total as usize;
    let gbps = |secs: f64| total as f64 / secs / 1e9;
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let shmem = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    progress!(
        "{} MiB per case and direction, {threads} thread(s), best of {} rounds; THP enabled: {}, shmem_enabled: {}",
        a.total_mib,
        a.rounds,
        thp.trim(),
        shmem.trim()
    );
    let mut cases: Vec<Case> = Vec::new();
    let mut modes_json = Vec::new();
    let mut notes = Vec::new();
    let mut salt = 0u64;
    for &mode in &a.pages {
        // Children first, while this process has one thread and no large buffers to share
        // copy-on-write with them.
        let shm_child = spawn_child(true, len, mode)?;
        let pvm_child = spawn_child(false, len, mode)?;
        let server = ServerMapping::map(
            shm_child
                .fd
                .as_ref()
                .expect("checked in spawn_child")
                .as_fd(),
            shm_child.len,
        )?;
        let pool = Buf::map(len, mode)?;
        pool.fill(1);
        let local = Buf::map(len, mode)?;
        local.fill(2);
        let routes = [
            Client::Local(local.addr),
            Client::Local(server.addr() as usize),
            Client::Remote {
                pid: pvm_child.pid,
                base: pvm_child.addr,
            },
        ];
        let mut first_touch = None;
        for &piece in &a.pieces {
            let n = (total / piece) as usize;
            let mut perm: Vec<u32> = (0..n as u32).collect();
            perm.shuffle(&mut StdRng::seed_from_u64(42 + piece));
            for dir in [Dir::Out, Dir::In] {
                let mut best = [f64::MAX; 3];
                for (r, &client) in routes.iter().enumerate() {
                    salt += 1;
                    let warm =
                        checked_pass(client, dir, pool.addr, &perm, piece as usize, threads, salt)?;
                    if r == 1 && first_touch.is_none() {
                        first_touch = Some(warm);
                    }
                }
                // Rounds take the routes in turn, so a noisy moment is shared out.
                for _ in 0..a.rounds {
                    for (r, &client) in routes.iter().enumerate() {
                        let s = pass(client, dir, pool.addr, &perm, piece as usize, threads)?;
                        best[r] = best[r].min(s);
                    }
                }
                let c = Case {
                    pages: mode,
                    piece,
                    dir,
                    memcpy: gbps(best[0]),
                    shm: gbps(best[1]),
                    pvm: gbps(best[2]),
                };
                progress!(
                    "{} pages, {} pieces, {}: memcpy {:.2} GB/s, shm {:.2} ({:.2}), pvm {:.2} ({:.2})",
                    mode.name(),
                    human(piece),
                    dir.name(),
                    c.memcpy,
                    c.shm,
                    c.shm / c.memcpy,
                    c.pvm,
                    c.pvm / c.memcpy
                );
                cases.push(c);
            }
        }
        let share = |pid, addr: u64| huge_share(pid, addr, total).unwrap_or(0.0);
        let huge = [
            ("pool", share(None, pool.addr as u64)),
            ("memcpy client", share(None, local.addr as u64)),
            ("shm: server's mapping", share(None, server.addr())),
            (
                "shm: client's mapping",
                share(Some(shm_child.pid), shm_child.addr),
            ),
            ("pvm: client", share(Some(pvm_child.pid), pvm_child.addr)),
        ];
        let ft = first_touch.map(gbps).unwrap_or(0.0);
        notes.push(format!(
            "  {} pages: huge pages back {}; first pass over a new server mapping (page faults, shm, {} pieces, out): {:.2} GB/s",
            mode.name(),
            huge.iter()
                .map(|(k, v)| format!("{k} {:.0}%", v * 100.0))
                .collect::<Vec<_>>()
                .join(", "),
            human(a.pieces[0]),
            ft
        ));
        modes_json.push(json!({
            "pages": mode.name(),
            "huge_share": huge.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "first_touch_gbps": ft,
        }));
        drop(server);
        // The second child holds a copy of the first one's socket (forked after it): it has to
        // go first, or the first would never see its socket close.
        drop(pvm_child);
        drop(shm_child);
    }
    println!(
        "host-route benchmark: {} MiB each way per case, {threads} thread(s), client pieces in random order, best of {} rounds",
        a.total_mib, a.rounds
    );
    println!(
        "  {:<5} {:>8}  {:<13} {:>12} {:>14} {:>6} {:>14} {:>6}",
        "pages",
        "piece",
        "direction",
        "memcpy GB/s",
        "(a) shm GB/s",
        "ratio",
        "(b) pvm GB/s",
        "ratio"
    );
    for c in &cases {
        println!(
            "  {:<5} {:>8}  {:<13} {:>12.2} {:>14.2} {:>6.2} {:>14.2} {:>6.2}",
            c.pages.name(),
            human(c.piece),
            c.dir.name(),
            c.memcpy,
            c.shm,
            c.shm / c.memcpy,
            c.pvm,
            c.pvm / c.memcpy
        );
    }
    for n in &notes {
        println!("{n}");
    }
    println!(
        "  THP enabled: {}; shmem_enabled: {}",
        thp.trim(),
        shmem.trim()
    );
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "host-route",
                "total_bytes": total,
                "threads": threads,
                "rounds": a.rounds,
                "thp_enabled": thp.trim(),
                "shmem_enabled": shmem.trim(),
                "modes": modes_json,
                "cases": cases.iter().map(|c| json!({
                    "pages": c.pages.name(),
                    "piece_bytes": c.piece,
                    "direction": if c.dir == Dir::In { "in" } else { "out" },
                    "memcpy_gbps": c.memcpy,
                    "shm_gbps": c.shm,
                    "shm_ratio": c.shm / c.memcpy,
                    "pvm_gbps": c.pvm,
                    "pvm_ratio": c.pvm / c.memcpy,
                })).collect::<Vec<_>>(),
            })
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert!(parse_size("x").is_err());
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(1 << 20), "1 MiB");
    }
}
