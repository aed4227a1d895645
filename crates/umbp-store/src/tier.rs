//! The tiers under the pool as one ordered chain: the disk tier, then the remote tier, then any
//! tier a caller adds ([`EmbeddedStore::with_tiers`](crate::EmbeddedStore::with_tiers)).
//!
//! A tier is anything that implements [`Tier`]: it takes objects the pool evicts (or declines
//! them), fills the pool with the objects a lookup missed there, forgets keys and namespaces,
//! flushes and closes. The store asks the chain, never a tier by name, for all of that, so a
//! new tier is one file: its `impl Tier`.

use std::sync::{Arc, Weak};
use std::time::Instant;

use umbp_core::BlockKey;
use umbp_pool::{CommitOutcome, PinnedObject, Pool, PoolError, SpillKind};

/// A tier under the pool. Every method but [`Tier::name`] has the answer of a tier that
/// holds nothing, so a tier implements what it does.
pub trait Tier: Send + Sync + std::fmt::Debug {
    /// Its name in logs ("disk", "remote").
    fn name(&self) -> &'static str;

    /// Whether other stores share what it holds (a remote every node writes to): it then
    /// keeps its objects when this store evicts keys or clears everything, and a namespace
    /// reset clears it first, outside the pool's clear (it may take long).
    fn shared(&self) -> bool {
        false
    }

    /// When a lookup that starts now must have had this tier's answers.
    fn deadline(&self) -> Instant {
        Instant::now()
    }

    /// An object the pool evicts, offered in chain order: `None` when this tier took it
    /// (its memory is freed when the tier drops it), `Some(obj)` to offer it to the next one.
    /// Never waits. With [`SpillKind::Now`] the pool needs the memory back at once: copy the
    /// bytes and drop `obj` before returning.
    fn spill(&self, _key: BlockKey, obj: PinnedObject, _kind: SpillKind) -> Option<PinnedObject> {
        Some(obj)
    }

    /// Puts the leading `keys` it holds into the pool ([`PoolFill::put`]), waiting until
    /// `deadline` at most; how many from the first it put.
    fn fill_prefix(&self, _fill: &PoolFill, _keys: &[BlockKey], _deadline: Instant) -> usize {
        0
    }

    /// Puts every one of `keys` it holds into the pool, waiting until `deadline` at most;
    /// which it put.
    fn fill_present(&self, _fill: &PoolFill, keys: &[BlockKey], _deadline: Instant) -> Vec<bool> {
        vec![false; keys.len()]
    }

    /// The keys a lookup found in the tiers above this one (a tier that keeps what is used
    /// may note them); `keys` is lazy: unused, it costs nothing.
    fn note_hits(&self, _keys: &mut dyn Iterator<Item = BlockKey>) {}

    /// The largest object a registered layout makes grew to `bytes` (a tier that reads
    /// values of unknown size reads no further).
    fn allow_object_bytes(&self, _bytes: u64) {}

    /// Forgets `keys` (this store evicts them); a [`Tier::shared`] tier is not asked.
    fn forget(&self, _keys: &[BlockKey]) {}

    /// Forgets everything (this store's full clear); a [`Tier::shared`] tier is not asked.
    fn clear(&self) {}

    /// Forgets the objects of the namespace with id `namespace_id`; how many (`None` when it
    /// cannot say).
    fn clear_namespace(&self, _namespace_id: &[u8; 16]) -> Option<u64> {
        Some(0)
    }

    /// Objects it refused to hand over because their bytes were damaged.
    fn corrupt(&self) -> u64 {
        0
    }

    /// At close, before any tier closes: what it should keep of the pool for the next start
    /// (the disk tier writes the pool's objects it lacks).
    fn write_out(&self, _pool: &Pool) {}

    /// Stops its threads; later calls may do nothing.
    fn close(&self) {}
}

/// Where a tier puts what a lookup missed in the pool: made before the tier is read, it
/// commits nothing that a clear since may have removed ([`Pool::commit_unless_cleared`]), and
/// never evicts (what does not fit in the free room misses: evicting would push out what the
/// same lookup just counted).
#[derive(Debug, Clone)]
pub struct PoolFill {
    pool: Arc<Pool>,
    epoch: u64,
}

impl PoolFill {
    /// A fill of `pool` for a lookup that starts now.
    pub fn new(pool: &Arc<Pool>) -> PoolFill {
        PoolFill {
            pool: Arc::clone(pool),
            epoch: pool.clear_epoch(),
        }
    }

    /// Puts `bytes` in the pool under `key` (checksummed when the pool keeps checksums);
    /// whether the pool now holds the key. A key the pool holds already is not written again.
    pub fn put(&self, key: &BlockKey, bytes: &[u8]) -> bool {
        let sums = self.pool.integrity().sums();
        self.put_with(key, bytes.len() as u64, |dst| {
            // Summed from the source, before the copy reads it again from the cache.
            let sum = sums.then(|| umbp_pool::checksum(bytes));
            dst.copy_from_slice(bytes);
            Ok::<_, std::convert::Infallible>(sum)
        })
        .unwrap_or_else(|e| match e {})
    }

    /// [`PoolFill::put`] for an object of `len` bytes that `write` copies into the pool's
    /// room (checking it on the way, say): it returns the bytes' checksum when it has one
    /// (`None`: the pool sums them if it keeps checksums), or an error, which frees the room
    /// and is returned. `Ok(false)` when there was no room or a clear came between.
    pub fn put_with<E>(
        &self,
        key: &BlockKey,
        len: u64,
        write: impl FnOnce(&mut [u8]) -> Result<Option<u64>, E>,
    ) -> Result<bool, E> {
        Ok(matches!(
            self.place_with(key, len, write)?,
            Filled::Held
                | Filled::Committed(CommitOutcome::Stored)
                | Filled::Committed(CommitOutcome::AlreadyPresent)
        ))
    }

    /// [`PoolFill::put_with`], saying what became of the object.
    pub(crate) fn place_with<E>(
        &self,
        key: &BlockKey,
        len: u64,
        write: impl FnOnce(&mut [u8]) -> Result<Option<u64>, E>,
    ) -> Result<Filled, E> {
        if self.pool.contains(key) {
            return Ok(Filled::Held);
        }
        let mut r = match self.pool.try_reserve(len) {
            Ok(r) => r,
            Err(e) => return Ok(Filled::NoRoom(e)),
        };
        if let Some(sum) = write(r.as_mut_slice())? {
            if self.pool.integrity().sums() {
                r.set_checksum(sum);
            }
        }
        Ok(match self.pool.commit_unless_cleared(r, *key, self.epoch) {
            Some(o) => Filled::Committed(o),
            None => Filled::Cleared,
        })
    }

    /// The pool it fills.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
}

/// What [`PoolFill::place_with`] did with an object.
#[derive(Debug)]
pub(crate) enum Filled {
    /// The pool held the key already: nothing was written.
    Held,
    /// No room in the pool's free memory (a fill never evicts): nothing was written.
    NoRoom(PoolError),
    /// Written, but a clear ran since the fill was made: dropped.
    Cleared,
    /// Written and committed: how the commit went.
    Committed(CommitOutcome),
}

/// The tiers in order, and what the store asks of them.
#[derive(Debug, Default)]
pub(crate) struct TierChain {
    tiers: Vec<Arc<dyn Tier>>,
}

impl TierChain {
    pub(crate) fn new(tiers: Vec<Arc<dyn Tier>>) -> TierChain {
        TierChain { tiers }
    }

    /// Hands every object the pool evicts to the first tier that takes it (none takes it:
    /// freed). The hook holds the tiers weakly: a closed store's tiers go with it.
    pub(crate) fn install_spill(&self, pool: &Pool) {
        if self.tiers.is_empty() {
            return;
        }
        let tiers: Vec<Weak<dyn Tier>> = self.tiers.iter().map(Arc::downgrade).collect();
        pool.set_spill(Some(Arc::new(move |key, obj: PinnedObject, kind| {
            let mut obj = obj;
            for t in &tiers {
                let Some(t) = t.upgrade() else { return };
                match t.spill(key, obj, kind) {
                    None => return,
                    Some(o) => obj = o,
                }
            }
        })));
    }

    /// How many of `key(0)..key(n)` from the first are in the pool, filling it from the tiers
    /// in order with what it misses; every hit is leased before the next tier is asked, so a
    /// slow tier cannot let the evictor take what was counted already. `deadline`: when every
    /// tier must have answered (`None`: each tier's own timeout from when it is asked).
    pub(crate) fn prefix_hits(
        &self,
        pool: &Arc<Pool>,
        n: usize,
        key: impl Fn(usize) -> BlockKey,
        deadline: Option<Instant>,
    ) -> usize {
        let mut local = pool.prefix_hits_leased(n, &key);
        let mut broken = false;
        for t in &self.tiers {
            if broken {
                break;
            }
            t.note_hits(&mut (0..local).map(&key));
            if local == n {
                continue;
            }
            let fill = PoolFill::new(pool);
            let rest: Vec<BlockKey> = (local..n).map(&key).collect();
            let until = deadline.unwrap_or_else(|| t.deadline());
            let filled = t.fill_prefix(&fill, &rest, until);
            let leased = pool.lease_prefix_with(filled, |i| rest[i]);
            local += leased;
            // One taken between its fill and its lease ends the prefix there.
            broken = leased < filled;
        }
        local
    }

    /// Which of `keys` are in the pool, filling it from the tiers in order with what it
    /// misses; each one reported is leased.
    pub(crate) fn exists(&self, pool: &Arc<Pool>, keys: &[BlockKey]) -> Vec<bool> {
        let mut found = pool.exists_many_leased(keys);
        for t in &self.tiers {
            t.note_hits(
                &mut keys
                    .iter()
                    .zip(&found)
                    .filter(|(_, f)| **f)
                    .map(|(k, _)| *k),
            );
            let missing: Vec<usize> = (0..keys.len()).filter(|i| !found[*i]).collect();
            if missing.is_empty() {
                continue;
            }
            let fill = PoolFill::new(pool);
            let ks: Vec<BlockKey> = missing.iter().map(|i| keys[*i]).collect();
            let got = t.fill_present(&fill, &ks, t.deadline());
            let got = pool.lease_where(&ks, &got);
            for (i, got) in missing.into_iter().zip(got) {
                found[i] = got;
            }
        }
        found
    }

    /// Drops `keys` from the pool and from every tier this store owns alone, as one clear:
    /// nothing evicted or filled meanwhile brings them back. How many were in the pool.
    pub(crate) fn evict(&self, pool: &Pool, keys: &[BlockKey]) -> u64 {
        let clearing = pool.begin_clear();
        let n = keys.iter().filter(|k| clearing.remove(k)).count() as u64;
        for t in self.tiers.iter().filter(|t| !t.shared()) {
            t.forget(keys);
        }
        drop(clearing);
        n
    }

    /// Empties the pool and every tier this store owns alone, as one clear; how many left
    /// the pool.
    pub(crate) fn clear(&self, pool: &Pool) -> u64 {
        let clearing = pool.begin_clear();
        let n = clearing.all();
        for t in self.tiers.iter().filter(|t| !t.shared()) {
            t.clear();
        }
        drop(clearing);
        n
    }

    /// Removes a namespace's objects: from the shared tiers first (a lookup between would
    /// fetch back what the pool lost; they may take long, so outside the pool's clear), then
    /// from the pool and the other tiers as one clear. How many left the pool.
    pub(crate) fn clear_namespace(&self, pool: &Pool, namespace_id: &[u8; 16]) -> u64 {
        self.clear_shared_namespace(namespace_id);
        let clearing = pool.begin_clear();
        let n = clearing.namespace(namespace_id);
        for t in self.tiers.iter().filter(|t| !t.shared()) {
            t.clear_namespace(namespace_id);
        }
        drop(clearing);
        n
    }

    /// Removes a namespace's objects from the shared tiers only; how many (`None` without
    /// one, or when one could not say).
    pub(crate) fn clear_shared_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        let mut total = None;
        for t in self.tiers.iter().filter(|t| t.shared()) {
            let n = t.clear_namespace(namespace_id)?;
            total = Some(total.unwrap_or(0) + n);
        }
        total
    }

    pub(crate) fn allow_object_bytes(&self, bytes: u64) {
        for t in &self.tiers {
            t.allow_object_bytes(bytes);
        }
    }

    /// Damaged objects every tier refused to hand over.
    pub(crate) fn corrupt(&self) -> u64 {
        self.tiers.iter().map(|t| t.corrupt()).sum()
    }

    /// Each tier writes out what it keeps of the pool, then the pool stops spilling, then
    /// every tier closes (objects still queued are dropped, their pins released, before the
    /// pool goes).
    /// Stops every tier for a hand-over of the pool: nothing written out (the pool's
    /// objects go on living in its memory, in the taker), no eviction offered any more, every
    /// tier's threads stopped (so none fills the pool again).
    pub(crate) fn close_for_hand_over(&self, pool: &Pool) {
        pool.set_spill(None);
        for t in &self.tiers {
            t.close();
        }
    }

    pub(crate) fn close(&self, pool: &Pool) {
        for t in &self.tiers {
            t.write_out(pool);
        }
        pool.set_spill(None);
        for t in &self.tiers {
            t.close();
        }
    }
}
