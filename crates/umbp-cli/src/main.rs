//! The `umbp` command: benchmarks of the pool, the copy engine, the GPU path and the
//! standalone server, operations on a running server (ping, stats, clear), and the soak.
//!
//! A binary of its own (built and installed with cargo): no library links it, so neither clap
//! nor the benchmarks are part of the Python extension.

// `umbp stats --json` builds one flat object of ~50 fields with serde_json's `json!`, whose
// expansion nests deeper than the default limit of 128.
#![recursion_limit = "256"]

use clap::{Parser, Subcommand};

mod bench_cache;
mod bench_copy;
mod bench_disk;
mod bench_gpu;
mod bench_host_route;
mod bench_lookup;
mod bench_pool;
mod bench_remote;
mod bench_server;
mod common;
mod cublas;
mod ops;
mod raw;
mod server_proc;
mod soak;
mod watch;

/// UMBP: a host-DRAM KV-cache offload store.
#[derive(Debug, Parser)]
#[command(name = "umbp", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks; with --json the last line printed is one JSON object.
    #[command(subcommand)]
    Bench(Bench),
    /// Asks a standalone server for its boot id, version and uptime (exit 1 when unreachable).
    Ping(ops::PingArgs),
    /// Every statistic of a standalone server's pool, sessions and transfers; --watch: a
    /// refreshing one-screen summary of the server or (--lookup-dir) of embedded engines.
    Stats(ops::StatsArgs),
    /// Removes the objects of a standalone server's pool (all, or one namespace's).
    Clear(ops::ClearArgs),
    /// A standalone server's live pins by key namespace: objects, bytes, when they run out.
    Pins(ops::PinsArgs),
    /// Client processes storing, loading and looking up KV blocks for a given time while the
    /// server (or an embedded store) is restarted and cleared; every loaded byte is checked
    /// and every object accounted for (exit 1 on a wrong byte or an unaccounted object).
    Soak(soak::Args),
    /// One client process of `umbp soak` (started by it; driven through stdin).
    #[command(hide = true)]
    SoakClient(soak::ClientArgs),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Pool operations: reserve/commit, batch lookups, pinned reads, eviction; metadata size.
    Pool(bench_pool::Args),
    /// Hit rates of the eviction policies and store admissions on a replayed prefix workload
    /// (Zipf shared prefixes plus a one-off burst twice the pool) at several capacities.
    Cache(bench_cache::Args),
    /// Host copy engine moving KV-shaped batches both ways, beside a plain memcpy ceiling.
    Copy(bench_copy::Args),
    /// CUDA KV cache ↔ pool (needs an NVIDIA GPU), beside the pinned-copy ceiling and a naive
    /// one-copy-per-piece baseline.
    Gpu(Box<bench_gpu::Args>),
    /// How the standalone server best reaches a client process's host memory: shared memory
    /// (memfd) against process_vm_readv/writev, beside an in-process memcpy ceiling.
    HostRoute(bench_host_route::Args),
    /// Standalone server lookups (exists, prefix_hits, exists_across_ranks): client-side
    /// latency percentiles of batches of keys.
    Lookup(bench_lookup::Args),
    /// KV blocks through the standalone server from several client processes at once, beside
    /// embedded mode and a memcpy ceiling (host memory, or CUDA memory with --cuda).
    Server(bench_server::Args),
    /// The remote tier (Redis / Valkey): put and get rates of 0.5-2 MiB objects next to raw
    /// pipelined SET / GET of the same sizes, in the same run.
    Remote(bench_remote::Args),
    /// The disk tier: write-behind and promote rates of 0.5-8 MiB objects next to raw
    /// O_DIRECT writes and reads of the same sizes, in the same run; restart time of 100k
    /// objects.
    Disk(bench_disk::Args),
    /// One client process of `umbp bench server` (started by it; driven through stdin).
    #[command(hide = true)]
    ServerClient(bench_server::ClientArgs),
}

fn main() {
    std::process::exit(run());
}

/// Parses the command line and runs the command. Returns the exit code.
fn run() -> i32 {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .try_init();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let result = match cli.command {
        Command::Bench(Bench::Pool(a)) => bench_pool::run(&a),
        Command::Bench(Bench::Cache(a)) => bench_cache::run(&a),
        Command::Bench(Bench::Copy(a)) => bench_copy::run(&a),
        Command::Bench(Bench::Gpu(a)) => bench_gpu::run(&a),
        Command::Bench(Bench::HostRoute(a)) => bench_host_route::run(&a),
        Command::Bench(Bench::Lookup(a)) => bench_lookup::run(&a),
        Command::Bench(Bench::Server(a)) => bench_server::run(&a),
        Command::Bench(Bench::Remote(a)) => bench_remote::run(&a),
        Command::Bench(Bench::Disk(a)) => bench_disk::run(&a),
        Command::Bench(Bench::ServerClient(a)) => bench_server::run_client(&a),
        Command::Ping(a) => ops::ping(&a),
        Command::Stats(a) => ops::stats(&a),
        Command::Clear(a) => ops::clear(&a),
        Command::Pins(a) => ops::pins(&a),
        Command::Soak(a) => soak::run(&a),
        Command::SoakClient(a) => soak::run_client(&a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("umbp: error: {e:#}");
            1
        }
    }
}
