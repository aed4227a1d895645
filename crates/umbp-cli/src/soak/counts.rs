//! The soak's figures: what clients count ([`Counts`]), what the pool and its disk tier count
//! ([`Snapshot`], from a server's stats or an embedded store's), and the identities those
//! counters must satisfy ([`identities`]).

use serde_json::{json, Map, Value};
use umbp_client::ServerStats;

/// A struct of named `u64` counters with JSON both ways and a sum.
macro_rules! counters {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub(crate) struct $name {
            $($(#[$fm])* pub(crate) $f: u64,)*
        }

        impl $name {
            pub(crate) fn json(self) -> Value {
                let mut m = Map::new();
                $(m.insert(stringify!($f).into(), json!(self.$f));)*
                Value::Object(m)
            }

            pub(crate) fn from_json(v: &Value) -> Self {
                $name { $($f: v[stringify!($f)].as_u64().unwrap_or(0),)* }
            }

            pub(crate) fn add(&mut self, o: &Self) {
                $(self.$f += o.$f;)*
            }
        }
    };
}

counters! {
    /// What the clients of an arm did and saw (totals since they started).
    Counts {
        /// Operations: a store of a run of keys, a load of keys, a lookup followed by a load
        /// of its hits.
        store_ops,
        load_ops,
        lookup_ops,
        /// Keys a store wrote (done), found there already, or could not place (pool full).
        keys_stored,
        keys_already,
        keys_pool_full,
        /// Keys loaded and checked byte for byte.
        keys_loaded,
        /// Keys a load found missing (evicted, cleared, lost, never stored).
        load_misses,
        /// Of those, keys this client had seen present (the rest it loaded blindly).
        expected_misses,
        /// Keys asked by lookups, and how many were there.
        lookup_keys,
        lookup_hits,
        /// Keys a lookup reported present that the load right after missed.
        lost_after_hit,
        /// Keys whose loaded bytes differed from the key's block, and how many bytes did.
        wrong_keys,
        wrong_bytes,
        /// Operations that failed because the server was restarting (or gone), and those that
        /// failed otherwise.
        failed_restart,
        failed_other,
        /// Bytes stored and loaded.
        bytes_stored,
        bytes_loaded,
        /// Hits (lookup, load or store finding it present) on a key of the client's own
        /// namespace after a clear removed it, before it stored it again.
        clear_hits,
        /// The final audit: keys expected present, found loadable, not found.
        audit_keys,
        audit_present,
        audit_missing,
    }
}

counters! {
    /// A pool's counters and its disk tier's (zero without one), one instant of one server
    /// process (or embedded store): they start at zero with each.
    Snapshot {
        capacity_bytes,
        used_bytes,
        objects,
        puts,
        duplicate_puts,
        evictions,
        hits,
        misses,
        sessions,
        disk_capacity_bytes,
        disk_used_bytes,
        disk_objects,
        disk_writes,
        disk_writes_dropped,
        disk_write_errors,
        disk_backlog_bytes,
        disk_hits,
        disk_corrupt,
        disk_read_errors,
        disk_objects_evicted,
        disk_already_present,
        disk_evicted_queued,
        disk_evicted_dropped,
        disk_rebuilt_objects,
        disk_removed,
    }
}

impl Snapshot {
    pub(crate) fn from_server(s: &ServerStats) -> Self {
        let d: umbp_disk::DiskStats = s
            .disk
            .as_ref()
            .map(|d| umbp_proto::counters::from_wire(&d.counters))
            .unwrap_or_default();
        Self::of(&umbp_proto::counters::pool_counters(s), &d, s.sessions)
    }

    pub(crate) fn from_store(p: &umbp_pool::PoolStats, d: Option<&umbp_disk::DiskStats>) -> Self {
        Self::of(p, &d.copied().unwrap_or_default(), 0)
    }

    /// From a pool's counters and its disk tier's, either mode's.
    fn of(p: &umbp_pool::PoolCounters, d: &umbp_disk::DiskStats, sessions: u64) -> Self {
        Snapshot {
            capacity_bytes: p.capacity_bytes,
            used_bytes: p.used_bytes,
            objects: p.objects,
            puts: p.puts,
            duplicate_puts: p.duplicate_puts,
            evictions: p.evictions,
            hits: p.hits,
            misses: p.misses,
            sessions,
            disk_capacity_bytes: d.capacity_bytes,
            disk_used_bytes: d.used_bytes,
            disk_objects: d.objects,
            disk_writes: d.writes,
            disk_writes_dropped: d.writes_dropped,
            disk_write_errors: d.write_errors,
            disk_backlog_bytes: d.backlog_bytes,
            disk_hits: d.hits,
            disk_corrupt: d.corrupt,
            disk_read_errors: d.read_errors,
            disk_objects_evicted: d.objects_evicted,
            disk_already_present: d.already_present,
            disk_evicted_queued: d.evicted_queued,
            disk_evicted_dropped: d.evicted_dropped,
            disk_rebuilt_objects: d.rebuilt_objects,
            disk_removed: d.removed,
        }
    }

    /// Objects the counters say were lost on the way (counted, so explained): dropped from
    /// the write-behind backlog, failed writes, dropped with disk segments, unreadable.
    pub(crate) fn counted_losses(&self) -> u64 {
        self.disk_writes_dropped
            + self.disk_write_errors
            + self.disk_objects_evicted
            + self.disk_corrupt
            + self.disk_read_errors
    }
}

/// One identity between counters, at one quiet instant (no client transfers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The identity in words, e.g. `objects = puts - evictions - removed`.
    pub(crate) name: &'static str,
    pub(crate) left: i128,
    pub(crate) right: i128,
    /// Whether a difference counts as unaccounted (and fails the soak); the others are
    /// reported only.
    pub(crate) gating: bool,
}

impl Identity {
    pub(crate) fn diff(&self) -> u64 {
        (self.left - self.right).unsigned_abs() as u64
    }
}

/// The identities the counters of one server process (or embedded store) must satisfy at a
/// quiet instant, `removed` being the objects the soak's clears removed from that pool.
///
/// * `objects = puts - evictions - removed` (gating): every object committed is still there,
///   or was evicted, or was cleared; anything else left uncounted.
/// * With a disk tier, `evictions = queued for disk + dropped + already on disk` (gating):
///   every object the pool evicted, whatever evicted it (the background evictor, or a store
///   that found the pool full), was handed to the disk tier, which queued it, dropped it
///   (counted) or held it already (issue 45 §2). What became of a queued one afterwards
///   (written, failed, cancelled by a clear) is the disk's own business, so the identity is
///   exact at any quiet instant. (With `integrity` on, an evicted object that fails its
///   checksum is counted in `corrupt_detected` instead; the soak runs without it.)
pub(crate) fn identities(s: &Snapshot, removed: u64) -> Vec<Identity> {
    let i = |v: u64| i128::from(v);
    let mut v = vec![Identity {
        name: "objects = puts - evictions - removed",
        left: i(s.objects),
        right: i(s.puts) - i(s.evictions) - i(removed),
        gating: true,
    }];
    if s.disk_capacity_bytes > 0 {
        v.push(Identity {
            name: "evictions = queued for disk + dropped + already on disk",
            left: i(s.evictions),
            right: i(s.disk_evicted_queued) + i(s.disk_evicted_dropped) + i(s.disk_already_present),
            gating: true,
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_through_json_and_add() {
        let mut a = Counts {
            store_ops: 3,
            wrong_bytes: 1,
            ..Counts::default()
        };
        let b = Counts::from_json(&a.json());
        assert_eq!(a, b);
        a.add(&b);
        assert_eq!((a.store_ops, a.wrong_bytes, a.load_ops), (6, 2, 0));
        // Missing fields read as zero (an older client, a partial line).
        assert_eq!(Counts::from_json(&json!({"load_ops": 4})).load_ops, 4);
    }

    #[test]
    fn the_pool_identity_finds_an_object_that_left_uncounted() {
        let s = Snapshot {
            objects: 70,
            puts: 100,
            evictions: 20,
            ..Snapshot::default()
        };
        let ids = identities(&s, 10);
        assert_eq!(ids.len(), 1, "no disk tier, no disk identity");
        assert_eq!(ids[0].diff(), 0);
        let ids = identities(&Snapshot { objects: 69, ..s }, 10);
        assert_eq!((ids[0].diff(), ids[0].gating), (1, true));
    }

    #[test]
    fn the_disk_identity_finds_an_eviction_the_disk_never_saw() {
        let s = Snapshot {
            objects: 0,
            puts: 10,
            evictions: 10,
            disk_capacity_bytes: 1 << 30,
            disk_writes: 6,
            disk_writes_dropped: 1,
            disk_evicted_queued: 7,
            disk_evicted_dropped: 1,
            disk_already_present: 2,
            ..Snapshot::default()
        };
        let ids = identities(&s, 0);
        assert_eq!(ids.len(), 2);
        assert_eq!((ids[1].diff(), ids[1].gating), (0, true));
        assert_eq!(s.counted_losses(), 1);
        let ids = identities(&Snapshot { evictions: 11, ..s }, 0);
        assert_eq!((ids[1].diff(), ids[1].gating), (1, true));
    }
}
