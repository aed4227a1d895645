//! Eviction policies behind one trait, one file each.
//!
//! Every index shard owns one [`ShardPolicy`] that keeps its entries' eviction state; the
//! pool merges the shards' candidates by a rank comparable across shards, so a policy's order
//! holds for the whole pool, not shard by shard:
//!
//! * [`lru`]: exact least-recently-used (rank: the tick of the last use).
//! * [`s3fifo`]: S3-FIFO, scan resistant: a small probation FIFO, a main FIFO with a 2-bit
//!   use count, and a ghost set of recently evicted fingerprints (rank: the tick an entry
//!   entered its queue).
//!
//! A policy may have several queues; [`plan`] says, from every queue's bytes summed over the
//! shards, which queue to evict from first and how many bytes it may give up.

mod api;
mod list;
pub(crate) mod lru;
pub(crate) mod s3fifo;

pub(crate) use api::{PolicyCounters, ShardPolicy, QUEUES};

use umbp_core::caching::EvictionPolicy;

/// A new shard's policy.
pub(crate) fn new_policy(kind: EvictionPolicy) -> Box<dyn ShardPolicy> {
    match kind {
        EvictionPolicy::Lru => Box::new(lru::Lru::default()),
        EvictionPolicy::S3Fifo => Box::new(s3fifo::S3Fifo::default()),
    }
}

/// Queues to evict from, in order, each with the bytes it may give up before the plan is
/// made again, from the bytes in each queue (summed over the shards).
pub(crate) fn plan(kind: EvictionPolicy, bytes: &[u64; QUEUES]) -> [(usize, u64); QUEUES] {
    match kind {
        EvictionPolicy::Lru => [(lru::QUEUE, u64::MAX), (lru::QUEUE, 0)],
        EvictionPolicy::S3Fifo => s3fifo::plan(bytes),
    }
}
