//! What the tier is handed by the store that runs it, which owns the memory the tier reads
//! and fills (the tier imports no pool): where a lookup's fetched objects go
//! ([`FetchSink`]), and, for writing behind, the store's commits and removals and its objects'
//! bytes ([`Source`]).

use umbp_core::BlockKey;

use crate::object::Reject;

/// What became of an object a fetch offered its [`FetchSink`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The sink held the key already: nothing was written.
    Held,
    /// Written, and the sink's now (a hit).
    Stored,
    /// Written, but another writer committed the key first, or the sink's own admission
    /// declined it: this copy was dropped.
    Discarded,
    /// No room for it (a lookup's fill never evicts: it would push out what the same lookup
    /// just counted): nothing was written.
    NoRoom,
    /// Written, but a clear ran since the lookup began, so what was read may be what the
    /// clear removed: dropped.
    Cleared,
}

/// What copies a fetched object into the room a [`FetchSink`] gives it, checking it on the
/// way: its XXH3-64 when it has it, or why it is not the object.
pub type WriteObject<'a> = dyn FnMut(&mut [u8]) -> Result<Option<u64>, Reject> + 'a;

/// Where a lookup's fetched objects go (the store's pool, through the lookup's fill). It
/// travels to the fetch threads with the lookup.
pub trait FetchSink: Send + Sync + std::fmt::Debug {
    /// Copies `src` into `dst` (of equal lengths), one piece of an object that
    /// [`FetchSink::put_with`]'s `write` is copying in. A copy whose stores need ordering
    /// (non-temporal ones) is ordered by the sink before it commits the object.
    fn copy(&self, dst: &mut [u8], src: &[u8]) {
        dst.copy_from_slice(src);
    }

    /// Puts an object of `len` bytes under `key`: unless the sink holds the key already or
    /// has no room, it calls `write` once with room of `len` bytes, which copies the object
    /// in (with [`FetchSink::copy`], checking it on the way) and returns the bytes' XXH3-64
    /// when it has it (`None`: the sink sums them if it keeps sums), or a [`Reject`], which
    /// frees the room and is returned.
    fn put_with(
        &self,
        key: &BlockKey,
        len: u64,
        write: &mut WriteObject<'_>,
    ) -> Result<Placed, Reject>;
}

/// A change the writer follows (the store's commits and removals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectEvent {
    /// An object was committed.
    Stored {
        /// Its key.
        key: BlockKey,
        /// Its size.
        bytes: u64,
    },
    /// An object left the store.
    Removed {
        /// Its key.
        key: BlockKey,
    },
}

/// An object's bytes as the store holds them, kept there (pinned) while this lives.
pub trait ObjectBytes {
    /// The bytes.
    fn bytes(&self) -> &[u8];

    /// The XXH3-64 the store keeps with them, if it keeps one.
    fn checksum(&self) -> Option<u64>;

    /// Whether the bytes still match that checksum (true without one); a damaged object is
    /// counted by the store, and not written.
    fn intact(&self) -> bool;
}

/// The store whose objects the tier writes behind.
pub trait Source: Send + Sync + std::fmt::Debug {
    /// The store's commits and removals from now on; at most `capacity` wait for the writer
    /// (the store drops, and counts, those past it). It ends when the store goes.
    fn subscribe(&self, capacity: usize) -> Box<dyn Iterator<Item = ObjectEvent> + Send>;

    /// How many objects the store has committed so far.
    fn commits(&self) -> u64;

    /// The object of `key`, pinned, or `None` when the store does not hold it.
    fn object(&self, key: &BlockKey) -> Option<Box<dyn ObjectBytes>>;
}
