//! The remote tier in the chain: a store other nodes share, written through on commit by its
//! own threads, read back into the pool by a lookup.

use std::time::Instant;

use umbp_core::BlockKey;
use umbp_remote::RemoteTier;

use crate::tier::{PoolFill, Tier};

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

    // The remote tier commits what it fetches into the pool it was started with (checked
    // while copied in, against the clear epoch of when the lookup began), so the fill is not
    // used yet.
    fn fill_prefix(&self, _fill: &PoolFill, keys: &[BlockKey], deadline: Instant) -> usize {
        self.fetch_prefix_by(keys, deadline)
    }

    fn fill_present(&self, _fill: &PoolFill, keys: &[BlockKey], _deadline: Instant) -> Vec<bool> {
        self.fetch_present(keys)
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
