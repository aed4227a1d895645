//! The embedded-mode lookup service.
//!
//! vLLM runs a connector's scheduler side and worker side in different processes. In embedded
//! mode every worker owns its pool, so each worker serves the scheduler's lookups (and clears)
//! on a Unix socket: [`LookupServer`]. The scheduler's [`LookupClient`] sends one request to
//! every worker of its engine at once and takes the smallest answer, since a block hits only
//! when every rank holds it. A dead worker, a missing socket or a late answer is a miss, never
//! a hang: after a lookup times out, that worker's lookups miss at once until its late answer
//! has arrived.
//!
//! The worker builds the keys itself from the block hashes (it knows its ranks), so the
//! scheduler sends each block hash once per worker and never builds per-rank keys.

#![forbid(unsafe_code)]

mod client;
mod protocol;
mod server;
mod shm;

pub use client::LookupClient;
pub use protocol::{LookupError, Op};
pub use server::{LookupServer, LookupTarget, ServerLimits};

/// The socket path of one worker's lookup service: `<dir>/umbp-<tag>-dp<dp>-w<worker>.sock`.
///
/// `tag` identifies the engine (derived by the caller from the key namespace and
/// `lookup_instance`, short enough for the 107-byte socket path limit).
pub fn socket_path(
    dir: &std::path::Path,
    tag: &str,
    dp_rank: u32,
    worker: u32,
) -> std::path::PathBuf {
    dir.join(format!("umbp-{tag}-dp{dp_rank}-w{worker}.sock"))
}
