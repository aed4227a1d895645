//! The UMBP copy engine.
//!
//! * [`MemoryRegistry`]: the engine memory (KV cache allocations) that copies may touch. Every
//!   range of every job is checked against it before any byte moves; a range outside it fails
//!   that key with an error, never a crash.
//! * [`CopyEngine`]: asynchronous store (engine memory → new pool object) and load (pool object →
//!   engine memory) jobs over planned scatter/gather ranges, run by `num_workers` threads, with
//!   poll / wait (with timeout) / cancel and one [`umbp_core::KeyOutcome`] per key. A job can
//!   also be awaited ([`JobHandle::finished`], a runtime-free [`std::future::Future`]) or given a
//!   callback ([`JobHandle::on_done`]); a [`JobSet`] cancels and waits for an owner's jobs.
//! * [`JobHandle`] is a [`umbp_core::KvTransfer`] and [`CopyError`] a [`umbp_core::KvError`]:
//!   the embedded store's side of the one surface both modes give ([`umbp_core::kv_store`]).
//!
//! The host backend moves bytes with the bulk copy [`memcpy`] measured fastest on this CPU at the
//! first engine's start. Device backends plug in behind [`Mover`].

mod completion;
mod engine;
mod error;
mod jobs;
mod kv_store;
pub mod memcpy;
mod mover;
mod registry;

pub use engine::{CopyEngine, Direction, JobHandle};
pub use error::CopyError;
pub use jobs::{JobFinished, JobSet};
pub use mover::{BlockCopy, HostMover, MoveError, MoveResult, Mover, OrderToken, TokenOwner};
pub use registry::{MemoryKind, MemoryRegistry, RegionId};
