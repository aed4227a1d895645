//! The flags of `umbp soak` and of its client processes.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Result};

/// Which arms run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// Client processes attached to a private standalone server (restarted by SIGTERM and
    /// SIGKILL).
    Server,
    /// Threads of one process with an embedded store (closed and reopened).
    Embedded,
    /// Both at once.
    Both,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long to run: 90s, 30m, 1h (plain numbers are seconds).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// server, embedded or both (at once).
    #[arg(long, value_enum, default_value_t = ModeArg::Server)]
    pub(crate) mode: ModeArg,
    /// Client processes of the server arm; worker threads of the embedded arm.
    #[arg(long, default_value_t = 4)]
    pub(crate) clients: u32,
    /// Seed of every client's random mix.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Layers per block (one piece each).
    #[arg(long, default_value_t = 4)]
    pub(crate) layers: u64,
    /// Bytes of one layer of one block, in KiB (a multiple of 4).
    #[arg(long, default_value_t = 16)]
    pub(crate) piece_kib: u64,
    /// Blocks of each client's KV region (the most one transfer moves).
    #[arg(long, default_value_t = 32)]
    pub(crate) slots: u64,
    /// Most keys in one store, load or lookup.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_batch: u32,
    /// Keys of each client's own namespace.
    #[arg(long, default_value_t = 512)]
    pub(crate) private_keys: u32,
    /// Keys of the namespace every client stores and loads.
    #[arg(long, default_value_t = 1024)]
    pub(crate) shared_keys: u32,
    /// Fraction of operations on the shared namespace.
    #[arg(long, default_value_t = 0.4)]
    pub(crate) shared_fraction: f64,
    /// Pool MiB (smaller than the keys' blocks, so the pool evicts).
    #[arg(long, default_value_t = 64)]
    pub(crate) pool_mib: u64,
    /// Disk tier MiB (in a temporary directory; segments are preallocated as they are made).
    #[arg(long, default_value_t = 8192)]
    pub(crate) disk_mib: u64,
    /// Copy workers of the server and of the embedded store.
    #[arg(long, default_value_t = 2)]
    pub(crate) copy_workers: usize,
    /// Time between restarts of the server (and of the embedded store); 0: none.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) restart_every: Duration,
    /// Every Nth restart of the server is a SIGKILL (a crash: the pool's content not on disk
    /// is lost) instead of a SIGTERM; 0: never.
    #[arg(long, default_value_t = 4)]
    pub(crate) kill_every: u32,
    /// Time between clears of a namespace (one client's or the shared one); 0: none.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) clear_every: Duration,
    /// Time between checks of the counters' identities (the clients pause for a moment).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) check_every: Duration,
    /// Time between samples of RSS and open descriptors.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) sample_every: Duration,
    /// Time between progress lines.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) progress_every: Duration,
    /// The server's executable (default: next to this `umbp`, then PATH).
    #[arg(long)]
    pub(crate) server_bin: Option<PathBuf>,
    /// Print a JSON object as the last line.
    #[arg(long)]
    pub(crate) json: bool,
    /// Test hook: the first client flips one byte of a block it loaded before checking it,
    /// so the soak must report wrong bytes and fail.
    #[arg(long, hide = true)]
    pub(crate) inject_wrong: bool,
    /// Test hook (server arm): before the final audit the parent clears the shared namespace
    /// without telling the clients or counting it, so the soak must report unaccounted keys
    /// and fail.
    #[arg(long, hide = true)]
    pub(crate) inject_loss: bool,
}

/// The client process of `umbp soak` (not for direct use).
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The server's socket (server arm).
    #[arg(long)]
    pub(crate) endpoint: Option<String>,
    /// The embedded store's disk tier directory (embedded arm).
    #[arg(long)]
    pub(crate) disk_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 64 << 20)]
    pub(crate) pool_bytes: u64,
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) disk_bytes: u64,
    #[arg(long, default_value_t = 2)]
    pub(crate) copy_workers: usize,
    /// The first worker's number (its namespace is that number + 1).
    #[arg(long)]
    pub(crate) first_id: u32,
    #[arg(long, default_value_t = 1)]
    pub(crate) workers: u32,
    #[arg(long)]
    pub(crate) seed: u64,
    #[arg(long)]
    pub(crate) layers: u64,
    #[arg(long)]
    pub(crate) piece_bytes: u64,
    #[arg(long)]
    pub(crate) slots: u64,
    #[arg(long)]
    pub(crate) max_batch: u32,
    #[arg(long)]
    pub(crate) private_keys: u32,
    #[arg(long)]
    pub(crate) shared_keys: u32,
    #[arg(long)]
    pub(crate) shared_fraction: f64,
    #[arg(long)]
    pub(crate) inject_wrong: bool,
}

/// `90s`, `30m`, `1h`, `500ms`, or a plain number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow!("{s:?} is not a duration; write e.g. 90s, 30m or 1h"))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1e3,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => return Err(anyhow!("{s:?}: unknown unit {u:?}; use ms, s, m or h")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(anyhow!(
            "{s:?} is not a duration; write e.g. 90s, 30m or 1h"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `1m30s`-style display of a duration, to the second.
pub(crate) fn show_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_junk() {
        assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d")
            .unwrap_err()
            .to_string()
            .contains("unknown unit"));
        assert_eq!(show_duration(Duration::from_secs(3725)), "1h02m05s");
        assert_eq!(show_duration(Duration::from_secs(75)), "1m15s");
    }
}
