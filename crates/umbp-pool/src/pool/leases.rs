//! The pool's lookups that lease what they report ([`crate::lease`]): a key a lookup reports
//! as a hit stays loadable until its load takes it, or its lease runs out.

use std::sync::atomic::Ordering;

use umbp_core::BlockKey;

use super::inner::{shard_of, SHARDS};
use super::Pool;
use crate::lease::Grant;

impl Pool {
    /// [`Pool::prefix_hits_with`] that leases the hits it reports: how many keys from the
    /// first are committed and now leased (a key whose lease the bound on leased bytes
    /// refuses ends the prefix). Without leases (`lookup_lease_ms` 0) it is
    /// [`Pool::prefix_hits_with`].
    pub fn prefix_hits_leased(&self, n: usize, key: impl Fn(usize) -> BlockKey) -> usize {
        let hits = self.prefix_hits_with(n, &key);
        self.lease_prefix_with(hits, key)
    }

    /// [`Pool::exists_many`] that leases the hits it reports (a key whose lease is refused
    /// is reported missing).
    pub fn exists_many_leased(&self, keys: &[BlockKey]) -> Vec<bool> {
        let found = self.exists_many(keys);
        self.lease_where(keys, &found)
    }

    /// Takes a lease on each of the keys `key(0)..key(n)`, in order, up to the first that is
    /// not committed or whose lease is refused; returns how many from the first are leased.
    /// For objects a lookup put in the pool itself (promoted from disk, fetched from the
    /// remote tier) before it reports them. Without leases: how many from the first are
    /// committed.
    pub fn lease_prefix_with(&self, n: usize, key: impl Fn(usize) -> BlockKey) -> usize {
        let got = self.lease_keys(n, &key, None);
        let leased = got.iter().take_while(|g| g.is_some()).count();
        // Leases past the first failure were taken for keys the lookup does not report:
        // undone, expiry included.
        for (i, g) in got.iter().enumerate().skip(leased) {
            if let Some((idx, Some(grant))) = *g {
                let fp = key(i).fingerprint();
                self.inner.shards[shard_of(fp)]
                    .write()
                    .take_back_lease(idx, grant);
            }
        }
        leased
    }

    /// Takes a lease on each key of `keys` that `want` marks; returns which are committed and
    /// leased. Without leases: which of the marked keys are committed.
    pub fn lease_where(&self, keys: &[BlockKey], want: &[bool]) -> Vec<bool> {
        self.lease_keys(keys.len(), |i| keys[i], Some(want))
            .into_iter()
            .map(|g| g.is_some())
            .collect()
    }

    /// Leases `key(i)` for every `i < n` (that `want` marks, when given), shard by shard; per
    /// key, the entry id and its lease (none when leases are off), or `None` (absent,
    /// refused, or not wanted).
    fn lease_keys(
        &self,
        n: usize,
        key: impl Fn(usize) -> BlockKey,
        want: Option<&[bool]>,
    ) -> Vec<Option<(u32, Option<Grant>)>> {
        let inner = &self.inner;
        let mut out = vec![None; n];
        let wanted = |i: usize| want.is_none_or(|w| w[i]);
        let on = inner.leases.on();
        let mut by_shard: Vec<Vec<(usize, BlockKey, u64)>> = vec![Vec::new(); SHARDS];
        for i in (0..n).filter(|i| wanted(*i)) {
            let k = key(i);
            let fp = k.fingerprint();
            by_shard[shard_of(fp)].push((i, k, fp));
        }
        for (s, items) in by_shard.iter().enumerate() {
            if items.is_empty() {
                continue;
            }
            if !on {
                let shard = inner.shards[s].read();
                for &(i, k, fp) in items {
                    out[i] = shard.find(&k, fp).map(|idx| (idx, None));
                }
                continue;
            }
            let mut shard = inner.shards[s].write();
            for &(i, k, fp) in items {
                if let Some(idx) = shard.find(&k, fp) {
                    if let Some(g) = shard.lease(idx) {
                        out[i] = Some((idx, Some(g)));
                    }
                }
            }
        }
        out
    }

    /// Counts and drops the leases that ran out (the background evictor does it every
    /// 100 ms at most; tests call it after moving the clock on).
    pub fn sweep_leases(&self) {
        self.inner.sweep_leases();
    }

    /// Moves the lease clock on by `ms` (tests: leases run out without waiting).
    #[doc(hidden)]
    pub fn advance_lease_clock(&self, ms: u64) {
        self.inner.leases.advance(ms);
    }
}

impl super::inner::Inner {
    pub(super) fn sweep_leases(&self) {
        if !self.leases.any() {
            return;
        }
        for shard in self.shards.iter() {
            shard.write().sweep_leases();
        }
    }

    /// The lease counters for [`super::PoolStats`]: granted, given back by loads, expired,
    /// refused, ended with their objects, outstanding, and the leased bytes.
    pub(super) fn lease_counts(&self) -> [u64; 7] {
        let b = &self.leases;
        let r = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        [
            r(&b.granted),
            r(&b.released),
            r(&b.expired),
            r(&b.refused),
            r(&b.ended),
            r(&b.active),
            r(&b.bytes),
        ]
    }
}
