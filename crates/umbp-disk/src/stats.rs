//! The tier's counters.

use std::sync::atomic::{AtomicU64, Ordering};

umbp_core::counter_set! {
    /// A snapshot of the disk tier's counters (totals since start-up unless said otherwise).
    pub struct DiskStats: "disk" {
        /// The configured size in bytes.
        gauge capacity_bytes: u64,
        /// Bytes the segment files take now.
        gauge used_bytes: u64 as "bytes",
        /// Objects the index holds now.
        gauge objects: u64,
        /// Objects written.
        counter writes: u64,
        /// Bytes of objects written (without headers and padding).
        counter bytes_written: u64 as "written_bytes",
        /// Objects not written because the backlog was full or the tier closing.
        counter writes_dropped: u64 as "drops",
        /// Objects not written because of an I/O error (disk full, directory gone, ...).
        counter write_errors: u64,
        /// Bytes of objects waiting to be written now.
        gauge backlog_bytes: u64,
        /// Keys asked of the disk by lookups.
        counter lookup_keys: u64,
        /// Objects read back and handed over (promoted).
        counter hits: u64 as "promotions",
        /// Keys the disk did not hold (or could not hand over).
        counter misses: u64,
        /// Objects whose header, key, length or checksum was wrong (misses, dropped from the
        /// index).
        counter corrupt: u64 as "misses_corrupt",
        /// Reads that failed with an I/O error (misses).
        counter read_errors: u64,
        /// Keys whose read had not finished by the lookup's deadline (misses).
        counter timeouts: u64,
        /// Bytes read back.
        counter bytes_read: u64 as "read_bytes",
        /// Segments dropped to make room (oldest first).
        counter segments_evicted: u64,
        /// Objects dropped with them.
        counter objects_evicted: u64,
        /// Objects found on disk at start-up.
        gauge rebuilt_objects: u64,
        /// Microseconds the start-up index rebuild took.
        gauge rebuild_us: u64,
        /// 1 when files are read and written with direct I/O (`O_DIRECT`).
        flag direct_io: u64,
        /// Objects queued for writing when committed (eager writes, `disk_write = "eager"`).
        counter eager_queued: u64,
        /// Eagerly queued objects that had left the pool before their write (evicted ones are
        /// queued again by the eviction; removed ones are not written).
        counter eager_gone: u64,
        /// Objects handed over (evicted) that the disk held or had queued already: released at
        /// once, not written again.
        counter already_present: u64,
        /// Objects handed over (evicted) that were queued to be written behind. Every object the
        /// pool evicts is handed over, so the pool's `evictions` equal `evicted_queued +
        /// evicted_dropped + already_present`.
        counter evicted_queued: u64,
        /// Of `evicted_queued`, those a store that found the pool full evicted: their bytes were
        /// copied out of the pool (which needed the memory at once) into the backlog.
        counter evicted_copied: u64,
        /// Objects handed over (evicted) that were not queued: the backlog had no room for them
        /// or the tier was closing (also in `writes_dropped`).
        counter evicted_dropped: u64,
        /// Objects removed from the disk tier by `evict`, `clear_namespace` or `clear`.
        counter removed: u64,
    }
}

/// The live counters behind [`DiskStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub writes: AtomicU64,
    pub bytes_written: AtomicU64,
    pub writes_dropped: AtomicU64,
    pub write_errors: AtomicU64,
    pub backlog_bytes: AtomicU64,
    pub lookup_keys: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub corrupt: AtomicU64,
    pub read_errors: AtomicU64,
    pub timeouts: AtomicU64,
    pub bytes_read: AtomicU64,
    pub segments_evicted: AtomicU64,
    pub objects_evicted: AtomicU64,
    pub rebuilt_objects: AtomicU64,
    pub rebuild_us: AtomicU64,
    pub eager_queued: AtomicU64,
    pub eager_gone: AtomicU64,
    pub already_present: AtomicU64,
    pub evicted_queued: AtomicU64,
    pub evicted_copied: AtomicU64,
    pub evicted_dropped: AtomicU64,
    pub removed: AtomicU64,
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn backlog_bytes_set(&self, bytes: u64) {
        self.backlog_bytes.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> DiskStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DiskStats {
            writes: g(&self.writes),
            bytes_written: g(&self.bytes_written),
            writes_dropped: g(&self.writes_dropped),
            write_errors: g(&self.write_errors),
            backlog_bytes: g(&self.backlog_bytes),
            lookup_keys: g(&self.lookup_keys),
            hits: g(&self.hits),
            misses: g(&self.misses),
            corrupt: g(&self.corrupt),
            read_errors: g(&self.read_errors),
            timeouts: g(&self.timeouts),
            bytes_read: g(&self.bytes_read),
            segments_evicted: g(&self.segments_evicted),
            objects_evicted: g(&self.objects_evicted),
            rebuilt_objects: g(&self.rebuilt_objects),
            rebuild_us: g(&self.rebuild_us),
            eager_queued: g(&self.eager_queued),
            eager_gone: g(&self.eager_gone),
            already_present: g(&self.already_present),
            evicted_queued: g(&self.evicted_queued),
            evicted_copied: g(&self.evicted_copied),
            evicted_dropped: g(&self.evicted_dropped),
            removed: g(&self.removed),
            ..DiskStats::default()
        }
    }
}
