//! The UMBP standalone server: one DRAM pool per node, shared by every engine and worker on
//! the host, served over gRPC on a Unix-domain socket.
//!
//! - **Sessions** (`sessions`): each client attaches and owns its registrations, layouts
//!   and transfers; they are released the moment its connection closes or its process exits
//!   (`pidwatch`).
//! - **No KV bytes on the socket**: clients register memory the server can reach itself (a
//!   sealed memfd for host memory, CUDA IPC handles or exported VMM descriptors for GPU
//!   memory, `memory`), passing descriptors over a side channel (`side`); the server's
//!   copy engine moves the bytes, the same code path embedded mode uses (`umbp_store`).
//! - **One transfer lifecycle** (`transfer`): gRPC `Transfer` (`service`) and the
//!   transfer channel (`side`'s `channel`) are adapters over it; a job's end can also
//!   publish a slot of the session's completion page.
//! - **One error vocabulary**: every refusal carries its `umbp_core::ErrorKind`
//!   (`refusal`, `umbp_proto::errors`).
//! - **Restarts**: every start has a new boot id; clients that see one re-attach and
//!   re-register by themselves.
//! - **Parallel clients**: no global lock; each session's transfers run on the shared copy
//!   workers and the GPU's copy engines.
//!
//! The modules depend one way: `run` → `service` / `side` → `transfer` / `memory`
//! / `lookup` → `state` → `sessions` → `listen`, `metrics`; no two files use each
//! other.

mod budget;
mod config;
mod error;
mod handover;
mod listen;
mod lookup;
mod lookup_pool;
mod memory;
mod metrics;
mod metrics_port;
mod peer;
mod pidwatch;
mod ratelog;
mod refusal;
mod run;
mod service;
mod sessions;
mod side;
mod state;
mod transfer;

pub use config::{
    Access, ServerConfig, DEFAULT_BUSY_POLL, DEFAULT_COPY_WORKERS, DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_SOCKET_MODE,
};
pub use error::ServerError;
pub use listen::PeerInfo;
pub use run::serve;
