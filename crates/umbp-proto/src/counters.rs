//! Groups of counters on the wire: a `map<string, uint64>` by field name, rendered from and
//! read into the group's struct by its model ([`umbp_core::counters`]), so no counter is
//! named in the protocol or its conversions.

use std::collections::HashMap;

use umbp_core::CounterSet;

use crate::v1;

/// `stats`' fields by name, for a `counters` map of the wire.
pub fn to_wire<S: CounterSet>(stats: &S) -> HashMap<String, u64> {
    stats.pairs().map(|(f, v)| (f.name.to_owned(), v)).collect()
}

/// The group a peer sent: names it does not know are skipped (a newer peer's counters),
/// fields it did not send read as 0 (an older peer's).
pub fn from_wire<S: CounterSet>(counters: &HashMap<String, u64>) -> S {
    S::from_pairs(counters.iter().map(|(k, v)| (k.as_str(), *v)))
}

/// The pool fields `StatsReply` carried before its `pool` group, by their group field names.
/// Frozen: a server fills them for clients older than the group, a client reads them from a
/// server older than it; a new pool counter goes only in the group.
fn legacy_pool_fields(r: &mut v1::StatsReply) -> [(&'static str, &mut u64); 22] {
    [
        ("capacity_bytes", &mut r.capacity_bytes),
        ("used_bytes", &mut r.used_bytes),
        ("objects", &mut r.objects),
        ("hits", &mut r.hits),
        ("misses", &mut r.misses),
        ("evictions", &mut r.evictions),
        ("puts", &mut r.puts),
        ("duplicate_puts", &mut r.duplicate_puts),
        ("gets", &mut r.gets),
        ("bytes_in", &mut r.bytes_in),
        ("bytes_out", &mut r.bytes_out),
        ("reservations", &mut r.reservations),
        ("pinned", &mut r.pinned),
        ("metadata_bytes", &mut r.metadata_bytes),
        ("leases", &mut r.leases),
        ("leases_released", &mut r.leases_released),
        ("leases_expired", &mut r.leases_expired),
        ("leases_refused", &mut r.leases_refused),
        ("leases_ended", &mut r.leases_ended),
        ("leases_active", &mut r.leases_active),
        ("leased_bytes", &mut r.leased_bytes),
        ("verified", &mut r.verified),
    ]
}

/// Puts the pool's counters in `reply`: its `pool` group, and the frozen fields older clients
/// read (`corrupt_detected` among them).
pub fn set_pool_counters<S: CounterSet>(reply: &mut v1::StatsReply, pool: &S) {
    for (name, field) in legacy_pool_fields(reply) {
        *field = pool.get(name).unwrap_or(0);
    }
    reply.corrupt_detected = pool.get("corrupt_detected").unwrap_or(0);
    reply.pool = Some(v1::PoolCounters {
        counters: to_wire(pool),
    });
}

/// The pool's counters a server sent: its `pool` group, or from a server older than the
/// group, the frozen fields (the group's other counters read 0).
pub fn pool_counters<S: CounterSet>(reply: &v1::StatsReply) -> S {
    if let Some(p) = &reply.pool {
        return from_wire(&p.counters);
    }
    let mut r = reply.clone();
    let corrupt = r.corrupt_detected;
    let mut pairs: Vec<(&str, u64)> = legacy_pool_fields(&mut r)
        .into_iter()
        .map(|(n, v)| (n, *v))
        .collect();
    pairs.push(("corrupt_detected", corrupt));
    S::from_pairs(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    umbp_core::counter_set! {
        /// A test group.
        pub struct T: "t" {
            /// One.
            counter a: u64,
            /// Two.
            flag b: bool,
        }
    }

    #[test]
    fn a_group_survives_the_wire() {
        let t = T { a: 5, b: true };
        let w = to_wire(&t);
        assert_eq!(w.len(), 2);
        assert_eq!(from_wire::<T>(&w), t);
    }

    umbp_core::counter_set! {
        /// A pool group: two frozen fields and a new one.
        pub struct P: "pool" {
            /// Hits.
            counter hits: u64,
            /// Objects.
            gauge objects: u64,
            /// A counter newer than the frozen fields.
            counter gets_new: u64,
            /// Damaged objects.
            counter corrupt_detected: u64,
        }
    }

    #[test]
    fn pool_counters_reach_new_and_old_clients_and_come_from_old_servers() {
        let p = P {
            hits: 3,
            objects: 4,
            gets_new: 5,
            corrupt_detected: 6,
        };
        let mut r = v1::StatsReply::default();
        set_pool_counters(&mut r, &p);
        // An old client reads the frozen fields.
        assert_eq!((r.hits, r.objects, r.corrupt_detected), (3, 4, 6));
        // A new client reads the group.
        assert_eq!(pool_counters::<P>(&r), p);
        // From an old server (no group): the frozen fields, the newer counter 0.
        r.pool = None;
        assert_eq!(pool_counters::<P>(&r), P { gets_new: 0, ..p });
    }
}
