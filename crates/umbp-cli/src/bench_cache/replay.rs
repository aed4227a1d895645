//! Replays a trace against a real [`Pool`] the way the connector drives it: a prefix lookup,
//! a pinned read of every hit block, and a store of every block after the first miss.

use std::time::Instant;

use anyhow::{Context, Result};
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::{EvictionPolicy, Pool, PoolStats, StoreAdmission};

use super::workload::{Phase, Request};

/// The pool and block shape of one replay.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub capacity_bytes: u64,
    pub block_bytes: u64,
    pub block_tokens: u64,
    pub prefix_blocks: u32,
    pub admission_window: usize,
}

/// What one replay measured, in tokens.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub tokens: u64,
    pub tokens_hit: u64,
    /// Tokens of the shared prefixes asked for, and found.
    pub shared: u64,
    pub shared_hit: u64,
    /// The same during the burst and its recovery.
    pub shared_burst: u64,
    pub shared_burst_hit: u64,
    /// Tokens of conversations' earlier turns asked for, and found.
    pub chat: u64,
    pub chat_hit: u64,
    pub stats: PoolStats,
    pub seconds: f64,
}

impl Outcome {
    pub fn hit_rate(&self) -> f64 {
        ratio(self.tokens_hit, self.tokens)
    }
    pub fn shared_rate(&self) -> f64 {
        ratio(self.shared_hit, self.shared)
    }
    pub fn shared_burst_rate(&self) -> f64 {
        ratio(self.shared_burst_hit, self.shared_burst)
    }
    pub fn chat_rate(&self) -> f64 {
        ratio(self.chat_hit, self.chat)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Keys: shared prefix `p`'s block `b`, or unique block `u` (suffixes and one-off prompts).
struct Keys(KeyBuilder);

impl Keys {
    fn prefix(&self, p: u32, b: u32) -> BlockKey {
        self.hashed(1, u64::from(p) << 32 | u64::from(b))
    }
    fn unique(&self, u: u64) -> BlockKey {
        self.hashed(2, u)
    }
    fn conversation(&self, c: u32, b: u32) -> BlockKey {
        self.hashed(3, u64::from(c) << 32 | u64::from(b))
    }
    fn hashed(&self, tag: u8, v: u64) -> BlockKey {
        let mut h = [0u8; 32];
        h[0] = tag;
        h[8..16].copy_from_slice(&v.to_le_bytes());
        h[16..24].copy_from_slice(&v.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
        self.0.key(0, &h).expect("a 32-byte hash is a valid key")
    }
}

/// Replays `trace` against a new pool of `shape` with `policy` and `admission`.
pub fn replay(
    trace: &[Request],
    shape: Shape,
    policy: EvictionPolicy,
    admission: StoreAdmission,
) -> Result<Outcome> {
    let pool = Pool::new(PoolConfig {
        capacity_bytes: shape.capacity_bytes,
        // Only synchronous eviction: the replay is deterministic.
        high_watermark: 1.0,
        low_watermark: 0.9,
        use_hugepages: false,
        prefault: false,
        eviction_policy: policy,
        store_admission: admission,
        admission_window: shape.admission_window,
        ..PoolConfig::default()
    })
    .context("creating the pool")?;
    let keys = Keys(KeyBuilder::new("bench-cache", RankTopology::default())?);
    let data = vec![0x5Au8; shape.block_bytes as usize];
    let t0 = Instant::now();
    let mut o = Outcome {
        tokens: 0,
        tokens_hit: 0,
        shared: 0,
        shared_hit: 0,
        shared_burst: 0,
        shared_burst_hit: 0,
        chat: 0,
        chat_hit: 0,
        stats: pool.stats(),
        seconds: 0.0,
    };
    let mut next_unique = 0u64;
    for r in trace {
        let pb = if r.prefix.is_some() {
            shape.prefix_blocks
        } else {
            0
        };
        let context = r.turn.map_or(0, |t| t.context);
        let n = (pb + context + r.unique) as usize;
        let base = next_unique;
        if r.turn.is_none() {
            next_unique += u64::from(r.unique);
        }
        let key = |i: usize| match (r.prefix, r.turn) {
            (Some(p), _) if i < pb as usize => keys.prefix(p, i as u32),
            (_, Some(t)) => keys.conversation(t.conversation, i as u32),
            _ => keys.unique(base + (i - pb as usize) as u64),
        };
        let hits = pool.prefix_hits_with(n, key);
        for i in 0..hits {
            drop(pool.get(&key(i)));
        }
        for i in hits..n {
            pool.put(key(i), &data)
                .with_context(|| format!("storing block {i} of a request"))?;
        }
        let t = shape.block_tokens;
        o.tokens += n as u64 * t;
        o.tokens_hit += hits as u64 * t;
        if r.turn.is_some() {
            o.chat += u64::from(context) * t;
            o.chat_hit += hits.min(context as usize) as u64 * t;
        }
        if r.prefix.is_some() {
            let shared = u64::from(pb) * t;
            let shared_hit = hits.min(pb as usize) as u64 * t;
            o.shared += shared;
            o.shared_hit += shared_hit;
            if matches!(r.phase, Phase::Burst | Phase::Recovery) {
                o.shared_burst += shared;
                o.shared_burst_hit += shared_hit;
            }
        }
    }
    o.seconds = t0.elapsed().as_secs_f64();
    o.stats = pool.stats();
    pool.check_invariants();
    Ok(o)
}
