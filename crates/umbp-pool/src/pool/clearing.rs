//! Clears that nothing brings back: while a clear runs no evicted object is on its way to the
//! spill hook (a disk tier), and a promotion that read its object before the clear cannot
//! commit it after.
//!
//! Without this, a clear raced the tiers under it: an object the evictor took just before the
//! clear reached the disk tier just after, and a lookup promoted it back; or a promotion that
//! read the disk before the clear committed into the pool after it. The owner of the tiers
//! (the store) runs its whole clear, pool and disk, inside one [`Clearing`].

use std::sync::atomic::Ordering;

use parking_lot::RwLockWriteGuard;
use umbp_core::BlockKey;

use super::inner::Reservation;
use super::types::CommitOutcome;
use super::Pool;

/// A clear in progress ([`Pool::begin_clear`]): evictions wait until it ends, and
/// promotions that began before it end commit nothing ([`Pool::commit_unless_cleared`]).
/// Clear the lower tiers while it is held, then drop it.
#[must_use = "a clear ends when its guard is dropped"]
pub struct Clearing<'a> {
    pool: &'a Pool,
    _gate: RwLockWriteGuard<'a, ()>,
}

impl std::fmt::Debug for Clearing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clearing").finish_non_exhaustive()
    }
}

impl Clearing<'_> {
    /// Removes every object (pinned ones are freed when unpinned). Returns how many.
    pub fn all(&self) -> u64 {
        self.pool.clear_where(|_| true)
    }

    /// Removes `key` ([`Pool::remove`]); whether it was there.
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.pool.remove(key)
    }

    /// Removes the objects of one key namespace (`namespace_id`: the first 16 bytes of its
    /// keys, [`BlockKey::namespace_id`]); other namespaces are untouched. Returns how many.
    pub fn namespace(&self, namespace_id: &[u8; 16]) -> u64 {
        self.pool
            .clear_where(|k: &BlockKey| k.namespace_id() == *namespace_id)
    }
}

impl Drop for Clearing<'_> {
    fn drop(&mut self) {
        // Still under the gate: a promotion that read its epoch at any time before this
        // point finds it changed at its commit.
        self.pool.inner.spill.clears.fetch_add(1, Ordering::AcqRel);
    }
}

impl Pool {
    /// Starts a clear: waits for evictions in progress to have handed their objects to the
    /// spill hook, and holds new ones back until the returned guard is dropped. Remove the
    /// pool's objects with the guard's [`Clearing::all`] or [`Clearing::namespace`], then a
    /// lower tier's, then drop it. Never call it from a spill hook or while holding one.
    pub fn begin_clear(&self) -> Clearing<'_> {
        Clearing {
            pool: self,
            _gate: self.inner.spill.gate.write(),
        }
    }

    /// Clears that ended so far: a promotion reads this before it reads a lower tier and
    /// hands it to [`Pool::commit_unless_cleared`].
    pub fn clear_epoch(&self) -> u64 {
        self.inner.spill.clears.load(Ordering::Acquire)
    }

    /// [`Pool::commit`] for an object read from a lower tier, unless a clear ended (or is
    /// running) since `epoch` ([`Pool::clear_epoch`], read before the lower tier was): then
    /// the reservation is dropped and `None` returned, as what was read may be what the clear
    /// removed.
    pub fn commit_unless_cleared(
        &self,
        res: Reservation,
        key: BlockKey,
        epoch: u64,
    ) -> Option<CommitOutcome> {
        let _gate = self.inner.spill.gate.read_recursive();
        if self.clear_epoch() != epoch {
            return None;
        }
        Some(self.commit(res, key))
    }
}
