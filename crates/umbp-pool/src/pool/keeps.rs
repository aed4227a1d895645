//! Keeping objects from eviction for a while ([`crate::keep`]): the pool's side of the pins
//! that agents' sessions hold on their context across a pause.

use std::time::Duration;

use umbp_core::{BlockKey, PinOutcome};

use super::inner::{shard_of, SHARDS};
use super::Pool;
use crate::keep::KeepStats;

impl Pool {
    /// Keeps each committed object of `keys` from eviction for `ttl` from now (a kept one:
    /// its expiry set anew), within the bounds on kept bytes per namespace and for the pool.
    /// An explicit [`Pool::evict`] or a clear still removes a kept object, and ends its keep.
    ///
    /// Keys are taken in their order (a shard's lock each), so that when a bound is reached
    /// the pinned part of a prefix is its beginning, the part a prefix lookup can use.
    pub fn keep(&self, keys: &[BlockKey], ttl: Duration) -> Vec<PinOutcome> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        keys.iter()
            .map(|k| {
                let fp = k.fingerprint();
                let mut shard = self.inner.shards[shard_of(fp)].write();
                match shard.find(k, fp) {
                    Some(idx) => shard.keep(idx, ttl_ms),
                    None => PinOutcome::Missing,
                }
            })
            .collect()
    }

    /// Releases the keeps of `keys`; how many were kept.
    pub fn release_kept(&self, keys: &[BlockKey]) -> u64 {
        let mut n = 0;
        self.each_in_shard(keys, |shard, _, idx| {
            n += u64::from(shard.release_kept(idx));
        });
        n
    }

    /// Counters of kept objects.
    pub fn keep_stats(&self) -> KeepStats {
        self.inner.keeps.stats()
    }

    /// The live pins by key namespace, most pinned bytes first.
    pub fn pins_by_namespace(&self) -> Vec<crate::keep::NamespacePins> {
        let mut by = std::collections::HashMap::new();
        for shard in &self.inner.shards {
            shard.read().summarize_keeps(&mut by);
        }
        let mut out: Vec<_> = by.into_values().collect();
        out.sort_by(|a, b| {
            b.bytes
                .cmp(&a.bytes)
                .then(a.namespace_id.cmp(&b.namespace_id))
        });
        out
    }

    /// Bytes that key namespace `namespace_id` keeps now.
    pub fn kept_bytes_of(&self, namespace_id: &[u8; 16]) -> u64 {
        self.inner.keeps.namespace_bytes(namespace_id)
    }

    /// Counts and drops the keeps that ran out (the background evictor does it every 100 ms
    /// at most; tests call it after moving the clock on with `advance_lease_clock`).
    pub fn sweep_keeps(&self) {
        self.inner.sweep_keeps();
    }

    /// `f(shard, i, entry id)` for every key of `keys` the index holds, shard by shard under
    /// its write lock.
    fn each_in_shard(
        &self,
        keys: &[BlockKey],
        mut f: impl FnMut(&mut crate::index::Shard, usize, u32),
    ) {
        let mut by_shard: Vec<Vec<(usize, u64)>> = vec![Vec::new(); SHARDS];
        for (i, k) in keys.iter().enumerate() {
            let fp = k.fingerprint();
            by_shard[shard_of(fp)].push((i, fp));
        }
        for (s, items) in by_shard.iter().enumerate() {
            if items.is_empty() {
                continue;
            }
            let mut shard = self.inner.shards[s].write();
            for &(i, fp) in items {
                if let Some(idx) = shard.find(&keys[i], fp) {
                    f(&mut shard, i, idx);
                }
            }
        }
    }
}

impl super::inner::Inner {
    pub(super) fn sweep_keeps(&self) {
        if !self.keeps.any() {
            return;
        }
        for shard in self.shards.iter() {
            shard.write().sweep_keeps();
        }
    }
}
