//! Counters and latency histograms, rendered for the opt-in Prometheus endpoint
//! (`metrics_port`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use umbp_core::{CounterKind, CounterSet};

/// Upper bounds of the transfer latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// A latency histogram (Prometheus' cumulative buckets are computed when rendered).
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cum = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        cum += self.counts[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cum}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cum}");
    }
}

/// Per direction: transfers, keys, bytes and latency.
#[derive(Debug, Default)]
pub(crate) struct DirectionMetrics {
    pub(crate) transfers: AtomicU64,
    pub(crate) keys_ok: AtomicU64,
    pub(crate) keys_failed: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) latency: Histogram,
}

/// What the server counts.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) store: DirectionMetrics,
    pub(crate) load: DirectionMetrics,
    pub(crate) lookups: AtomicU64,
    pub(crate) lookup_keys: AtomicU64,
    pub(crate) lookup_latency: Histogram,
    pub(crate) sessions_attached: AtomicU64,
    pub(crate) sessions_released: AtomicU64,
    /// Sessions ended whose release has not finished.
    pub(crate) releasing: AtomicU64,
    pub(crate) refused: AtomicU64,
    /// Transfers that came on transfer channels.
    pub(crate) channel_transfers: AtomicU64,
    /// Transfer channels open now.
    pub(crate) channels_open: AtomicU64,
}

/// Gauges read when rendering.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Gauges {
    pub(crate) sessions: u64,
    pub(crate) registrations: u64,
    pub(crate) layouts: u64,
    pub(crate) transfers_in_flight: u64,
    pub(crate) capacity_bytes: u64,
    pub(crate) used_bytes: u64,
    pub(crate) objects: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) evictions: u64,
    pub(crate) reservations: u64,
    pub(crate) pinned: u64,
    pub(crate) ghost_hits: u64,
    pub(crate) promotions: u64,
    pub(crate) admissions_skipped: u64,
    pub(crate) admissions_forced: u64,
    pub(crate) leases: u64,
    pub(crate) leases_released: u64,
    pub(crate) leases_expired: u64,
    pub(crate) leases_refused: u64,
    pub(crate) leases_ended: u64,
    pub(crate) leased_bytes: u64,
    pub(crate) verified: u64,
    pub(crate) corrupt_detected: u64,
    pub(crate) remote: Option<umbp_store::RemoteStats>,
    pub(crate) disk: Option<umbp_store::DiskStats>,
    pub(crate) pins: Option<umbp_pool::KeepStats>,
}

/// Every field of a group of counters (the disk tier's, the remote tier's, pins') as its series,
/// named, typed and described by the group's model (`umbp_core::counters`).
fn group_series<S: CounterSet>(o: &mut String, s: &S) {
    for (f, v) in s.pairs() {
        let name = f.series(S::GROUP);
        let kind = match f.kind {
            CounterKind::Counter => "counter",
            CounterKind::Gauge | CounterKind::Flag => "gauge",
        };
        let help = f.help().replace('\\', "\\\\");
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
}

impl Metrics {
    /// The Prometheus text exposition of everything.
    pub(crate) fn render(&self, g: &Gauges) -> String {
        let mut o = String::with_capacity(8192);
        let gauge = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                o,
                "# HELP umbp_{name} {help}\n# TYPE umbp_{name} gauge\numbp_{name} {v}"
            );
        };
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                o,
                "# HELP umbp_{name} {help}\n# TYPE umbp_{name} counter\numbp_{name} {v}"
            );
        };
        gauge(
            &mut o,
            "pool_capacity_bytes",
            "Usable bytes of the pool.",
            g.capacity_bytes,
        );
        gauge(
            &mut o,
            "pool_used_bytes",
            "Bytes held by objects and open reservations.",
            g.used_bytes,
        );
        gauge(&mut o, "pool_objects", "Objects in the pool.", g.objects);
        gauge(
            &mut o,
            "pool_reservations",
            "Reservations open now.",
            g.reservations,
        );
        gauge(
            &mut o,
            "pool_pinned_objects",
            "Objects pinned by loads now.",
            g.pinned,
        );
        counter(
            &mut o,
            "pool_hits_total",
            "Keys found by lookups and loads.",
            g.hits,
        );
        counter(
            &mut o,
            "pool_misses_total",
            "Keys not found by lookups and loads.",
            g.misses,
        );
        counter(
            &mut o,
            "pool_evictions_total",
            "Objects evicted.",
            g.evictions,
        );
        counter(
            &mut o,
            "pool_promotions_total",
            "Objects S3-FIFO moved from its small queue to its main queue (used again).",
            g.promotions,
        );
        counter(
            &mut o,
            "pool_ghost_hits_total",
            "Objects stored again soon after S3-FIFO evicted them (they enter the main queue).",
            g.ghost_hits,
        );
        counter(
            &mut o,
            "pool_admissions_skipped_total",
            "Stores not kept by store_admission=on_reuse (the key's first sighting).",
            g.admissions_skipped,
        );
        counter(
            &mut o,
            "pool_admissions_forced_total",
            "Stores kept on the key's first sighting because the client asked (admit_now: a \
             request's priority or umbp_store=now) where store_admission=on_reuse would not.",
            g.admissions_forced,
        );
        for (name, help, v) in [
            (
                "pool_leases_total",
                "Leases lookups took on the hits they reported (kept from eviction until loaded).",
                g.leases,
            ),
            (
                "pool_leases_released_total",
                "Lookup leases given back by the loads that used them.",
                g.leases_released,
            ),
            (
                "pool_leases_expired_total",
                "Lookup leases that ran out before a load used them.",
                g.leases_expired,
            ),
            (
                "pool_leases_refused_total",
                "Lookup leases refused because leased objects held half the pool (reported as misses).",
                g.leases_refused,
            ),
            (
                "pool_leases_ended_total",
                "Lookup leases that ended with their object (removed or cleared).",
                g.leases_ended,
            ),
        ] {
            counter(&mut o, name, help, v);
        }
        gauge(
            &mut o,
            "pool_leased_bytes",
            "Bytes of the objects that hold lookup leases now.",
            g.leased_bytes,
        );
        counter(
            &mut o,
            "pool_verified_total",
            "Objects whose bytes a load checked against their checksum (--integrity).",
            g.verified,
        );
        counter(
            &mut o,
            "corrupt_detected_total",
            "Objects whose bytes failed their checksum on the way to a client, in any tier \
             (pool, disk, remote): each removed and its load failed, never copied out.",
            g.corrupt_detected,
        );
        if let Some(r) = &g.remote {
            group_series(&mut o, r);
        }
        if let Some(p) = &g.pins {
            group_series(&mut o, p);
        }
        if let Some(d) = &g.disk {
            group_series(&mut o, d);
            counter(
                &mut o,
                "disk_errors_total",
                "Disk reads and writes that failed with an I/O error (read_errors + write_errors).",
                d.read_errors + d.write_errors,
            );
        }
        gauge(&mut o, "sessions", "Attached client sessions.", g.sessions);
        gauge(
            &mut o,
            "registrations",
            "Memory registrations of attached sessions.",
            g.registrations,
        );
        gauge(
            &mut o,
            "layouts",
            "KV layouts of attached sessions.",
            g.layouts,
        );
        gauge(
            &mut o,
            "transfers_in_flight",
            "Transfers being copied.",
            g.transfers_in_flight,
        );
        counter(
            &mut o,
            "sessions_attached_total",
            "Sessions attached since start.",
            self.sessions_attached.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "sessions_released_total",
            "Sessions released since start.",
            self.sessions_released.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "requests_refused_total",
            "Requests refused (bad input, unknown ids, other uids).",
            self.refused.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "channel_transfers_total",
            "Transfers that came on transfer channels (the rest over gRPC).",
            self.channel_transfers.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "lookups_total",
            "Lookup requests.",
            self.lookups.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "lookup_keys_total",
            "Keys looked up.",
            self.lookup_keys.load(Ordering::Relaxed),
        );
        let _ = writeln!(o, "# HELP umbp_lookup_seconds Lookup latency in the server.\n# TYPE umbp_lookup_seconds histogram");
        self.lookup_latency
            .render(&mut o, "umbp_lookup_seconds", "service=\"exists\"");
        for (name, help) in [
            ("transfers_total", "Transfers finished."),
            (
                "transfer_keys_ok_total",
                "Keys transferred (or already present).",
            ),
            (
                "transfer_keys_failed_total",
                "Keys that failed, were missing or cancelled.",
            ),
            ("transfer_bytes_total", "Bytes copied."),
        ] {
            let _ = writeln!(o, "# HELP umbp_{name} {help}\n# TYPE umbp_{name} counter");
            for (dir, m) in [("store", &self.store), ("load", &self.load)] {
                let v = match name {
                    "transfers_total" => &m.transfers,
                    "transfer_keys_ok_total" => &m.keys_ok,
                    "transfer_keys_failed_total" => &m.keys_failed,
                    _ => &m.bytes,
                };
                let _ = writeln!(
                    o,
                    "umbp_{name}{{direction=\"{dir}\"}} {}",
                    v.load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(o, "# HELP umbp_transfer_seconds Transfer latency in the server, from request to reply.\n# TYPE umbp_transfer_seconds histogram");
        self.store
            .latency
            .render(&mut o, "umbp_transfer_seconds", "direction=\"store\"");
        self.load
            .latency
            .render(&mut o, "umbp_transfer_seconds", "direction=\"load\"");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every counter of every tier group reaches Prometheus, typed as its model says: a field
    /// added to a group without a series, or a series that lost its type line, fails here.
    #[test]
    fn every_counter_of_the_tier_groups_is_a_series() {
        let g = Gauges {
            remote: Some(umbp_store::RemoteStats::default()),
            disk: Some(umbp_store::DiskStats::default()),
            pins: Some(umbp_pool::KeepStats::default()),
            ..Gauges::default()
        };
        let text = Metrics::default().render(&g);
        fn check<S: CounterSet>(text: &str) {
            for f in S::FIELDS {
                let name = f.series(S::GROUP);
                let kind = match f.kind {
                    CounterKind::Counter => "counter",
                    CounterKind::Gauge | CounterKind::Flag => "gauge",
                };
                assert!(
                    text.contains(&format!("# TYPE {name} {kind}\n{name} 0\n")),
                    "{} {} has no series {name} in:\n{text}",
                    S::GROUP,
                    f.name
                );
                assert!(text.contains(&format!("# HELP {name} ")), "{name}: no help");
            }
        }
        check::<umbp_store::RemoteStats>(&text);
        check::<umbp_store::DiskStats>(&text);
        check::<umbp_pool::KeepStats>(&text);
        // The names dashboards know, from before the model.
        for old in [
            "umbp_disk_bytes ",
            "umbp_disk_promotions_total ",
            "umbp_disk_drops_total ",
            "umbp_disk_errors_total ",
            "umbp_remote_fetched_bytes_total ",
            "umbp_remote_connected ",
            "umbp_remote_writes_evicted_total ",
        ] {
            assert!(text.contains(old), "{old} is gone");
        }
    }
}
