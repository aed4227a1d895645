//! The remote tier in the chain: a store other nodes share, written through on commit by its
//! own threads, read back into the pool by a lookup.
//!
//! The tier imports no pool; this file glues it to one: the pool is its [`Source`] (the
//! pool's commits and removals, and its objects pinned while the writer reads them), and a
//! lookup's [`PoolFill`] is the [`FetchSink`] its fetches go into (checked while copied in
//! with the copy engine's copy, and committed only if no clear ran since the lookup began).

use std::sync::Arc;
use std::time::Instant;

use umbp_core::BlockKey;
use umbp_pool::{CommitOutcome, PinnedObject, Pool, PoolEvent};
use umbp_remote::object::Reject;
use umbp_remote::{
    FetchSink, ObjectBytes, ObjectEvent, Placed, RemoteConfig, RemoteError, RemoteTier, Source,
    WriteObject,
};

use crate::tier::{Filled, PoolFill, Tier};

/// Starts a remote tier behind `pool`: it writes the pool's commits through (as its policy
/// says) and its fetches go into the [`PoolFill`] each lookup hands it
/// ([`RemoteTier::fetch_prefix`]`(keys, Arc::new(PoolFill::new(&pool)))`).
pub fn start_remote_tier(cfg: RemoteConfig, pool: &Arc<Pool>) -> Result<RemoteTier, RemoteError> {
    RemoteTier::start(cfg, Arc::new(PoolSource(Arc::clone(pool))))
}

/// The pool, as the remote tier's writer sees it.
#[derive(Debug)]
struct PoolSource(Arc<Pool>);

/// A pool object the writer reads, pinned until dropped.
struct Pinned(PinnedObject);

impl ObjectBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    fn checksum(&self) -> Option<u64> {
        self.0.checksum()
    }

    /// A damaged object is counted and removed by the pool.
    fn intact(&self) -> bool {
        self.0.verify()
    }
}

impl Source for PoolSource {
    fn subscribe(&self, capacity: usize) -> Box<dyn Iterator<Item = ObjectEvent> + Send> {
        Box::new(self.0.subscribe(capacity).into_iter().map(|ev| match ev {
            PoolEvent::Stored { key, bytes } => ObjectEvent::Stored { key, bytes },
            PoolEvent::Removed { key, .. } => ObjectEvent::Removed { key },
        }))
    }

    fn commits(&self) -> u64 {
        self.0.stats().puts
    }

    fn object(&self, key: &BlockKey) -> Option<Box<dyn ObjectBytes>> {
        let obj = self.0.peek(key)?;
        Some(Box::new(Pinned(obj)))
    }
}

impl FetchSink for PoolFill {
    /// The copy engine's bulk copy (streaming stores on most hosts), ordered by
    /// [`FetchSink::put_with`] before the commit.
    fn copy(&self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "a piece of another length");
        // SAFETY: `dst` and `src` are equal-length slices, and distinct: `dst` is borrowed
        // mutably, so it cannot alias `src`.
        unsafe { umbp_copy::memcpy::copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    }

    fn put_with(
        &self,
        key: &BlockKey,
        len: u64,
        write: &mut WriteObject<'_>,
    ) -> Result<Placed, Reject> {
        let filled = self.place_with(key, len, |dst| {
            let res = write(dst);
            // The copy's streaming stores reach memory before the commit publishes them.
            umbp_copy::memcpy::fence();
            res
        })?;
        Ok(match filled {
            Filled::Held => Placed::Held,
            Filled::NoRoom(e) => {
                log::debug!("remote tier: a fetched object did not fit in the pool: {e}");
                Placed::NoRoom
            }
            Filled::Cleared => Placed::Cleared,
            Filled::Committed(CommitOutcome::Stored) => Placed::Stored,
            Filled::Committed(CommitOutcome::AlreadyPresent | CommitOutcome::Skipped) => {
                Placed::Discarded
            }
        })
    }
}

impl Tier for RemoteTier {
    fn name(&self) -> &'static str {
        "remote"
    }

    /// Other nodes read what it holds: this store's evictions and full clears leave it.
    fn shared(&self) -> bool {
        true
    }

    fn deadline(&self) -> Instant {
        RemoteTier::deadline(self)
    }

    // The fill goes with the lookup to the tier's fetch threads: what they fetch is checked
    // while copied into the pool, and committed unless a clear ran since the lookup began.
    fn fill_prefix(&self, fill: &PoolFill, keys: &[BlockKey], deadline: Instant) -> usize {
        self.fetch_prefix_by(keys, deadline, Arc::new(fill.clone()))
    }

    fn fill_present(&self, fill: &PoolFill, keys: &[BlockKey], _deadline: Instant) -> Vec<bool> {
        self.fetch_present(keys, Arc::new(fill.clone()))
    }

    fn note_hits(&self, keys: &mut dyn Iterator<Item = BlockKey>) {
        RemoteTier::note_hits(self, keys);
    }

    fn allow_object_bytes(&self, bytes: u64) {
        RemoteTier::allow_object_bytes(self, bytes);
    }

    fn clear_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        RemoteTier::clear_namespace(self, namespace_id)
    }

    fn corrupt(&self) -> u64 {
        self.stats().corrupt
    }

    fn close(&self) {
        RemoteTier::close(self);
    }
}
