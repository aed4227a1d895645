//! Client of the UMBP standalone server.
//!
//! [`StandaloneClient`] is synchronous (for the Python bindings and engine threads): it makes
//! its own small async runtime when it connects (never at import) and refuses to be used in a
//! forked child. It registers memory without sending KV bytes: host memory is shared with the
//! server through a sealed memfd ([`host_share`]), CUDA memory by IPC handle or exported VMM
//! descriptors; descriptors travel over the server's side channel.
//!
//! **Restarts.** The client remembers what it registered. When a call finds its session gone
//! (the server restarted, or the connection broke) that call fails, and the next one attaches
//! again and replays every registration and layout by itself; ids handed out by the client
//! stay valid across it. Objects stored before a restart are gone with the old server.
//!
//! **Stalls.** A lookup past its deadline fails, and later lookups fail at once until the
//! stalled one is answered; the same for transfers (a transfer past its deadline stays
//! pending until the server answers; its memory may be written until then).
//!
//! **Where the code is.** [`StandaloneClient`] and its shared state are in `client`; its
//! methods are spread over the modules by job: `attach` (the session, re-attaching and
//! replaying; its rules in `attach::state`), `register` (memory and layouts, with the
//! records kept to replay them), `transfer` (stores, loads and their answers), `lookup`
//! (exists and prefix hits) and `rpc` (the runtime, the gRPC channel and one call with a
//! deadline). Below them: `channel` (the transfer channel), `completions` (the completion
//! page), `eta`, `fdsend`, `peer`, `error`, and [`host_share`] (host memory shared through
//! memfds). `kv_store` makes the client a [`umbp_core::KvStore`], as the embedded store's
//! session is.

mod attach;
mod channel;
mod client;
mod completions;
mod error;
mod eta;
mod fdsend;
pub mod host_share;
mod kv_store;
mod lookup;
mod options;
mod peer;
mod register;
mod rpc;
mod transfer;

pub use client::StandaloneClient;
pub use error::{ClientError, Result};
pub use host_share::SharedHostMemory;
pub use options::ClientOptions;
pub use peer::SERVER_UIDS_ENV;
pub use register::LayoutInfo;
pub use rpc::unix_channel;
pub use transfer::{Transfer, TransferTiming};
pub use umbp_proto::v1::StatsReply as ServerStats;
