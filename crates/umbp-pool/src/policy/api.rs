//! The trait every eviction policy implements, and what policies share.

pub(crate) use crate::image::Place;

/// Queues a policy may have (LRU uses one, S3-FIFO two).
pub(crate) const QUEUES: usize = 2;

/// What one shard's policy counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PolicyCounters {
    /// Evictions out of each queue.
    pub evicted: [u64; QUEUES],
    /// Entries moved to a later place by the policy instead of being evicted (S3-FIFO: out
    /// of the small queue into main, or back to main's tail).
    pub promotions: u64,
    /// Inserts whose fingerprint was in the ghost set.
    pub ghost_hits: u64,
}

impl PolicyCounters {
    pub fn add(&mut self, o: &PolicyCounters) {
        for q in 0..QUEUES {
            self.evicted[q] += o.evicted[q];
        }
        self.promotions += o.promotions;
        self.ghost_hits += o.ghost_hits;
    }
}

/// One shard's eviction state. Ids are the shard's entry ids; the caller holds the shard's
/// lock and tells the policy about every live entry's insert, use and removal.
pub(crate) trait ShardPolicy: std::fmt::Debug + Send + Sync {
    /// A new live entry: `fp` is its key's fingerprint, `len` its bytes, `tick` the pool's
    /// clock now.
    fn insert(&mut self, idx: u32, fp: u64, len: u64, tick: u64);
    /// A live entry taken over from another pool (a hand-over): as [`insert`](Self::insert),
    /// but at `place` (its queue and use count there; a queue this policy lacks or a count
    /// past its bound is clamped), entering its queue at `tick`.
    fn insert_at(&mut self, idx: u32, fp: u64, len: u64, tick: u64, place: Place);
    /// Where `idx` sits: its queue, its use count and the tick it entered its queue.
    fn place(&self, idx: u32) -> Place;
    /// The entry was read.
    fn access(&mut self, idx: u32, tick: u64);
    /// The entry left the index: evicted (`evicted`) or removed by its owner.
    fn remove(&mut self, idx: u32, fp: u64, len: u64, evicted: bool);
    /// Adds the bytes in each queue to `out`.
    fn queue_bytes(&self, out: &mut [u64; QUEUES]);
    /// Appends up to `limit` unpinned entries of `queue`, in the order this policy would evict
    /// them, as `(rank, idx)` with ranks ascending. May reorder entries on the way (a policy's
    /// lazy promotions), using `now` as their new rank.
    fn candidates(
        &mut self,
        queue: usize,
        limit: usize,
        now: u64,
        pinned: &dyn Fn(u32) -> bool,
        out: &mut Vec<(u64, u32)>,
    );
    /// Whether `idx` is still the candidate `candidates` returned as `(rank, idx)` of `queue`
    /// (not used, moved or replaced since).
    fn still_candidate(&self, idx: u32, queue: usize, rank: u64) -> bool;
    /// Every entry in eviction order (queue by queue) as `(rank, idx)`, without reordering.
    fn order(&self, out: &mut Vec<(u64, u32)>);
    fn counters(&self) -> PolicyCounters;
    fn metadata_bytes(&self) -> usize;
}

/// Grows a per-entry vector so `idx` is in it.
pub(crate) fn slot_for<T: Default + Clone>(v: &mut Vec<T>, idx: u32) -> &mut T {
    let i = idx as usize;
    if i >= v.len() {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}
