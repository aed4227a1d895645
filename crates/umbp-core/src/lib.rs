//! Shared, dependency-light types for UMBP.
//!
//! * [`key`]: the compact binary [`BlockKey`] and its readable string form, built in bulk.
//! * [`layout`]: the description of an engine's KV cache ([`KvLayout`]) and the planner that turns
//!   block ids into scatter/gather [`CopyRange`]s.
//! * [`strided`]: the runs of one block of a strided tensor view ([`TensorView`]), so a layout
//!   can be built from what the engine's tensors really look like.
//! * [`integrity`]: whether objects are checksummed and how many loads verify them
//!   ([`Integrity`]).
//! * [`counters`]: the one model of a group of counters ([`counter_set!`]), from which every
//!   surface (wire, Python, Prometheus, CLI) is rendered.
//! * [`config`]: pool configuration ([`PoolConfig`]) with up-front validation.
//! * [`outcome`]: the one vocabulary of failures ([`ErrorKind`]) and per-key outcomes
//!   ([`KeyOutcome`], [`FailureKind`]) every crate and both modes use.
//! * [`options`]: the vLLM connector's options: one schema ([`options::SCHEMA`]) owning every
//!   default, range and message, and the validated [`ConnectorOptions`].
//!
//! * [`address`]: the one parser of the standalone server's endpoint and the one redaction of
//!   a URL's password.
//!
//! Nothing here allocates threads, maps memory or knows about Python or CUDA.

#![deny(unsafe_code)]

pub mod address;
pub mod caching;
pub mod config;
pub mod counters;
pub mod error;
pub mod integrity;
pub mod key;
pub mod kv_store;
pub mod layout;
pub mod options;
pub mod outcome;
mod sizes;
pub mod strided;

pub use caching::{Admit, EvictionPolicy, StoreAdmission};
pub use config::{HugepageSize, MemoryBacking, PoolConfig, DEFAULT_LOOKUP_LEASE_MS};
pub use counters::{CounterSet, Field as CounterField, Kind as CounterKind};
pub use error::CoreError;
pub use integrity::Integrity;
pub use key::{BlockKey, KeyBuilder, RankTopology};
pub use kv_store::{KvError, KvStore, KvTransfer};
pub use layout::{
    CopyRange, GroupLayout, KvLayout, LayerSpec, LayoutSummary, RangePlan, MAX_GROUP_STRIDES,
    MAX_LAYOUT_RUNS, MAX_RUN_BLOCKS,
};
pub use options::ConnectorOptions;
pub use outcome::{ErrorKind, FailureKind, KeyFailure, KeyOutcome, PinOutcome};
pub use strided::TensorView;
