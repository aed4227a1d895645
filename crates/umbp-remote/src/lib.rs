//! The remote tier: a node pool's objects shared with other nodes through an existing Redis or
//! Valkey deployment (one server or a cluster).
//!
//! UMBP does not build a distributed store; it puts one behind the node pool. The tier imports
//! no pool: the store that runs it hands it a [`Source`] to write behind (its commits and
//! removals, and its objects' bytes, pinned), and with each lookup a [`FetchSink`] to put what
//! it fetched in (in `umbp-store`, the lookup's `PoolFill`, which commits nothing that a clear
//! since the lookup began may have removed).
//!
//! - **Writes are behind the store.** A writer thread follows the source's commits and copies
//!   objects to the remote store from it (pinned only while it sends them), in pipelined
//!   batches, bounded by a backlog in bytes and optionally a rate. When the remote is slow or
//!   down, objects past the backlog are dropped and counted; the engine never waits for it.
//!   With [`WritePolicy::OnReuse`] an object is written only when lookups hit it a second time,
//!   sparing the network for one-off prefixes.
//! - **Lookups consult it for what the pool misses.** [`RemoteTier::fetch_prefix`] and
//!   [`RemoteTier::fetch_present`] get the missing objects (pipelined per node, in chunks),
//!   check them ([`object`]: key, length and checksum; any mismatch is a miss) and put them in
//!   the lookup's sink, so the copy path still reads local DRAM. The caller waits at most the
//!   tier's timeout; whatever has not arrived by then is a miss.
//! - **Failures are misses.** A connection error marks the remote down for a back-off period
//!   during which lookups miss at once and writes are dropped; the next attempt after it
//!   reconnects. Every such event is counted in [`RemoteStats`].
//!
//! Remote eviction is the remote store's own: set `maxmemory` and `maxmemory-policy
//! allkeys-lru` there, and/or give objects a TTL ([`RemoteConfig::ttl`]).
//!
//! The crate's files, by job: [`config`](RemoteConfig) (settings, URL, secret file),
//! `host` (what the store hands it: [`FetchSink`], [`Source`]), `tier` (the running
//! [`RemoteTier`]), `fetch` (reads into a sink), `write` (stores behind the source), `state`
//! (what the tier's threads share), `stats` ([`RemoteStats`]),
//! `conn` (connections to one server or a cluster), `link` (a one-server connection whose
//! replies `resp` reads within bounds, whatever the peer claims), [`object`] (the value format) and
//! `error` ([`RemoteError`]).

#![forbid(unsafe_code)]

mod cluster;
mod config;
mod conn;
mod error;
mod fetch;
mod host;
mod link;
pub mod object;
mod resp;
mod state;
mod stats;
mod tier;
mod write;

pub use config::{secret_file_from_env, RemoteConfig, WritePolicy, SECRET_FILE_ENV};
pub use conn::Target;
pub use error::RemoteError;
pub use host::{FetchSink, ObjectBytes, ObjectEvent, Placed, Source, WriteObject};
pub use stats::RemoteStats;
pub use tier::RemoteTier;
