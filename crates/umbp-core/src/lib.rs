//! Shared, dependency-light types for UMBP.
//!
//! * [`key`]: the compact binary [`BlockKey`] and its readable string form, built in bulk.
//! * [`layout`]: the description of an engine's KV cache ([`KvLayout`]) and the planner that turns
//!   block ids into scatter/gather [`CopyRange`]s.
//! * [`config`]: pool configuration ([`PoolConfig`]) with up-front validation.
//!
//! Nothing here allocates threads, maps memory or knows about Python or CUDA.

pub mod config;
pub mod error;
pub mod key;
pub mod layout;

pub use config::{HugepageSize, MemoryBacking, PoolConfig};
pub use error::CoreError;
pub use key::{BlockKey, KeyBuilder, RankTopology};
pub use layout::{CopyRange, GroupLayout, KvLayout, LayerSpec, RangePlan};
