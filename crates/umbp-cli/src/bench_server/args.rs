//! The flags of `umbp bench server` and of its client processes.

use std::path::PathBuf;

use anyhow::{anyhow, ensure, Result};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Client process counts to run, comma-separated.
    #[arg(long, default_value = "1,2,4")]
    pub(super) clients: String,
    /// Piece sizes (bytes of one layer of one block) in KiB, comma-separated (default: 64;
    /// with --cuda 64,8).
    #[arg(long)]
    pub(super) block_kib: Option<String>,
    /// Layers per block (one piece each).
    #[arg(long, default_value_t = 8)]
    pub(super) layers: u64,
    /// Blocks each client stores and loads per round.
    #[arg(long, default_value_t = 256)]
    pub(super) blocks: u64,
    /// Timed rounds (after one untimed warm-up round); the median and the best are shown.
    #[arg(long, default_value_t = 20)]
    pub(super) rounds: u32,
    /// Transfers each client has in flight per direction and round: that many key sets of
    /// its blocks, every transfer submitted at once and then waited for, as an engine does
    /// with several requests in one step. 1 measures one transfer's latency; more measure
    /// what one client sustains. Server and embedded mode alike.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(super) in_flight: u32,
    /// Copy workers of the server and of embedded mode (default: every core).
    #[arg(long)]
    pub(super) workers: Option<usize>,
    /// KV caches in CUDA memory (client: registered by IPC; embedded: registered directly).
    #[arg(long)]
    pub(super) cuda: bool,
    /// CUDA device ordinal (with --cuda).
    #[arg(long, default_value_t = 0)]
    pub(super) device: i32,
    /// The server's executable (default: next to this `umbp`, then PATH).
    #[arg(long)]
    pub(super) server_bin: Option<PathBuf>,
    /// Clients as before the direct paths: transfers over gRPC, answered by their replies
    /// only (no transfer channel, no completion page), to measure what those save.
    #[arg(long)]
    pub(super) replies_only: bool,
    /// Clients that send transfers over gRPC (no transfer channel) but are answered through
    /// the completion page.
    #[arg(long, conflicts_with = "replies_only")]
    pub(super) no_channel: bool,
    /// The private server's --busy-poll-us (default: the server's own default).
    #[arg(long)]
    pub(super) server_busy_poll_us: Option<u64>,
    /// Print a JSON object as the last line.
    #[arg(long)]
    pub(super) json: bool,
}

/// The client process of `umbp bench server` (not for direct use).
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    #[arg(long)]
    pub(super) endpoint: String,
    #[arg(long)]
    pub(super) id: u32,
    #[arg(long)]
    pub(super) blocks: u64,
    #[arg(long)]
    pub(super) layers: u64,
    #[arg(long)]
    pub(super) piece_bytes: u64,
    #[arg(long)]
    pub(super) namespace: String,
    #[arg(long)]
    pub(super) cuda: bool,
    #[arg(long, default_value_t = 0)]
    pub(super) device: i32,
    #[arg(long, default_value_t = 1)]
    pub(super) in_flight: u32,
    #[arg(long)]
    pub(super) replies_only: bool,
    #[arg(long)]
    pub(super) no_channel: bool,
}

pub(super) fn parse_list(s: &str, flag: &str) -> Result<Vec<u64>> {
    let v: Vec<u64> = s
        .split(',')
        .map(|x| x.trim())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| anyhow!("{flag}: {x:?} is not a positive whole number"))
        })
        .collect::<Result<_>>()?;
    ensure!(!v.is_empty(), "{flag}: give at least one value, e.g. 1,2,4");
    Ok(v)
}
