//! Counters and latency histograms, rendered for the opt-in Prometheus endpoint
//! (`metrics_port`) by the `prometheus-client` crate (the Prometheus text format, 0.0.4).
//!
//! Hot paths bump plain atomics and observe the crate's histograms; a scrape builds a
//! registry of the moment: the histograms (shared, not copied) and one collector holding every
//! counter and gauge read then, the pool's, the tiers' and pins' groups rendered from their model
//! (`umbp_core::counters`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use umbp_core::{CounterKind, CounterSet};

/// The `Content-Type` of what [`Metrics::render`] returns.
pub(crate) use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// One label (`direction="store"`, `service="exists"`).
type Label = [(&'static str, &'static str); 1];
/// No label.
const NO_LABEL: [(&str, &str); 0] = [];
/// Histograms of one name, one per label value.
type Latencies = Family<Label, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

fn latencies() -> Latencies {
    Family::new_with_constructor(latency_histogram)
}

/// A latency histogram: one member of a [`Latencies`] family (its state is shared with it).
#[derive(Debug, Clone)]
pub(crate) struct Latency(Histogram);

impl Latency {
    fn of(family: &Latencies, label: Label) -> Self {
        Self(family.get_or_create(&label).clone())
    }

    pub(crate) fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Per direction: transfers, keys, bytes and latency.
#[derive(Debug)]
pub(crate) struct DirectionMetrics {
    pub(crate) transfers: AtomicU64,
    pub(crate) keys_ok: AtomicU64,
    pub(crate) keys_failed: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) latency: Latency,
}

/// What the server counts.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) store: DirectionMetrics,
    pub(crate) load: DirectionMetrics,
    pub(crate) lookups: AtomicU64,
    pub(crate) lookup_keys: AtomicU64,
    pub(crate) lookup_latency: Latency,
    pub(crate) sessions_attached: AtomicU64,
    pub(crate) sessions_released: AtomicU64,
    /// Sessions ended whose release has not finished.
    pub(crate) releasing: AtomicU64,
    pub(crate) refused: AtomicU64,
    /// Transfers that came on transfer channels.
    pub(crate) channel_transfers: AtomicU64,
    /// Transfer channels open now.
    pub(crate) channels_open: AtomicU64,
    /// `umbp_transfer_seconds{direction}` (the members are `store.latency`, `load.latency`).
    transfer_seconds: Latencies,
    /// `umbp_lookup_seconds{service}` (the member is `lookup_latency`).
    lookup_seconds: Latencies,
}

impl DirectionMetrics {
    fn new(latency: Latency) -> Self {
        Self {
            transfers: AtomicU64::new(0),
            keys_ok: AtomicU64::new(0),
            keys_failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            latency,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let transfer_seconds = latencies();
        let lookup_seconds = latencies();
        Self {
            store: DirectionMetrics::new(Latency::of(&transfer_seconds, [("direction", "store")])),
            load: DirectionMetrics::new(Latency::of(&transfer_seconds, [("direction", "load")])),
            lookups: AtomicU64::new(0),
            lookup_keys: AtomicU64::new(0),
            lookup_latency: Latency::of(&lookup_seconds, [("service", "exists")]),
            sessions_attached: AtomicU64::new(0),
            sessions_released: AtomicU64::new(0),
            releasing: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            channel_transfers: AtomicU64::new(0),
            channels_open: AtomicU64::new(0),
            transfer_seconds,
            lookup_seconds,
        }
    }
}

/// Gauges read when rendering.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Gauges {
    pub(crate) sessions: u64,
    pub(crate) registrations: u64,
    pub(crate) layouts: u64,
    pub(crate) transfers_in_flight: u64,
    /// The pool's counters (None when the store could not give them).
    pub(crate) pool: Option<umbp_pool::PoolCounters>,
    pub(crate) remote: Option<umbp_store::RemoteStats>,
    pub(crate) disk: Option<umbp_store::DiskStats>,
    pub(crate) pins: Option<umbp_pool::KeepStats>,
}

/// One series of a scrape: a counter or a gauge, with or without one label.
#[derive(Debug)]
struct Series {
    /// The name without `umbp_` and, for a counter, without `_total` (the encoder adds both).
    name: String,
    help: String,
    counter: bool,
    samples: Vec<(Option<Label>, u64)>,
}

/// Every counter and gauge of one scrape, read when it was built.
#[derive(Debug, Default)]
struct Snapshot(Vec<Series>);

impl Snapshot {
    fn push(
        &mut self,
        series: &str,
        help: &str,
        counter: bool,
        samples: Vec<(Option<Label>, u64)>,
    ) {
        let name = series.strip_prefix("umbp_").unwrap_or(series);
        let name = if counter {
            name.strip_suffix("_total").unwrap_or(name)
        } else {
            name
        };
        self.0.push(Series {
            name: name.to_string(),
            help: help.to_string(),
            counter,
            samples,
        });
    }

    fn counter(&mut self, series: &str, help: &str, v: u64) {
        self.push(series, help, true, vec![(None, v)]);
    }

    fn gauge(&mut self, series: &str, help: &str, v: u64) {
        self.push(series, help, false, vec![(None, v)]);
    }

    /// Every field of a group of counters (the pool's, the tiers', pins') as its
    /// series, named, typed and described by the group's model (`umbp_core::counters`).
    fn group<S: CounterSet>(&mut self, s: &S) {
        for (f, v) in s.pairs() {
            let counter = matches!(f.kind, CounterKind::Counter);
            self.push(&f.series(S::GROUP), &f.help(), counter, vec![(None, v)]);
        }
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for s in &self.0 {
            let kind = if s.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut family = encoder.encode_descriptor(&s.name, &s.help, None, kind)?;
            for (label, v) in &s.samples {
                let sample = match label {
                    Some(l) => family.encode_family(l)?,
                    None => family.encode_family(&NO_LABEL)?,
                };
                if s.counter {
                    ConstCounter::new(*v).encode(sample)?;
                } else {
                    ConstGauge::new(*v).encode(sample)?;
                }
            }
        }
        Ok(())
    }
}

impl Metrics {
    /// The Prometheus text exposition of everything ([`CONTENT_TYPE`]).
    pub(crate) fn render(&self, g: &Gauges) -> String {
        let mut o = Snapshot::default();
        if let Some(p) = &g.pool {
            o.group(p);
            // The store-wide count (every tier's damaged objects), under its name from before
            // the pool's group.
            o.counter(
                "corrupt_detected_total",
                "Objects whose bytes failed their checksum on the way to a client, in any tier \
                 (pool, disk, remote): each removed and its load failed, never copied out.",
                p.corrupt_detected,
            );
        }
        if let Some(r) = &g.remote {
            o.group(r);
        }
        if let Some(p) = &g.pins {
            o.group(p);
        }
        if let Some(d) = &g.disk {
            o.group(d);
            o.counter(
                "disk_errors_total",
                "Disk reads and writes that failed with an I/O error (read_errors + write_errors).",
                d.read_errors + d.write_errors,
            );
        }
        o.gauge("sessions", "Attached client sessions.", g.sessions);
        o.gauge(
            "registrations",
            "Memory registrations of attached sessions.",
            g.registrations,
        );
        o.gauge("layouts", "KV layouts of attached sessions.", g.layouts);
        o.gauge(
            "transfers_in_flight",
            "Transfers being copied.",
            g.transfers_in_flight,
        );
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        o.counter(
            "sessions_attached_total",
            "Sessions attached since start.",
            get(&self.sessions_attached),
        );
        o.counter(
            "sessions_released_total",
            "Sessions released since start.",
            get(&self.sessions_released),
        );
        o.counter(
            "requests_refused_total",
            "Requests refused (bad input, unknown ids, other uids).",
            get(&self.refused),
        );
        o.counter(
            "channel_transfers_total",
            "Transfers that came on transfer channels (the rest over gRPC).",
            get(&self.channel_transfers),
        );
        o.counter("lookups_total", "Lookup requests.", get(&self.lookups));
        o.counter(
            "lookup_keys_total",
            "Keys looked up.",
            get(&self.lookup_keys),
        );
        let by_direction = |f: fn(&DirectionMetrics) -> &AtomicU64| {
            vec![
                (Some([("direction", "store")]), get(f(&self.store))),
                (Some([("direction", "load")]), get(f(&self.load))),
            ]
        };
        o.push(
            "transfers_total",
            "Transfers finished.",
            true,
            by_direction(|m| &m.transfers),
        );
        o.push(
            "transfer_keys_ok_total",
            "Keys transferred (or already present).",
            true,
            by_direction(|m| &m.keys_ok),
        );
        o.push(
            "transfer_keys_failed_total",
            "Keys that failed, were missing or cancelled.",
            true,
            by_direction(|m| &m.keys_failed),
        );
        o.push(
            "transfer_bytes_total",
            "Bytes copied.",
            true,
            by_direction(|m| &m.bytes),
        );
        let mut registry = Registry::with_prefix("umbp");
        registry.register_collector(Box::new(o));
        // The registry ends these helps with a full stop (a collector's are written as given).
        registry.register(
            "lookup_seconds",
            "Lookup latency in the server",
            self.lookup_seconds.clone(),
        );
        registry.register(
            "transfer_seconds",
            "Transfer latency in the server, from request to reply",
            self.transfer_seconds.clone(),
        );
        let mut text = String::with_capacity(16 << 10);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every counter of every tier group reaches Prometheus, typed as its model says: a field
    /// added to a group without a series, or a series that lost its type line, fails here.
    #[test]
    fn every_counter_of_every_group_is_a_series() {
        let g = Gauges {
            pool: Some(umbp_pool::PoolCounters::default()),
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
        check::<umbp_pool::PoolCounters>(&text);
        // The names dashboards know, from before the model.
        for old in [
            "umbp_pool_capacity_bytes ",
            "umbp_pool_used_bytes ",
            "umbp_pool_objects ",
            "umbp_pool_reservations ",
            "umbp_pool_pinned_objects ",
            "umbp_pool_hits_total ",
            "umbp_pool_misses_total ",
            "umbp_pool_evictions_total ",
            "umbp_pool_promotions_total ",
            "umbp_pool_ghost_hits_total ",
            "umbp_pool_admissions_skipped_total ",
            "umbp_pool_admissions_forced_total ",
            "umbp_pool_leases_total ",
            "umbp_pool_leases_released_total ",
            "umbp_pool_leases_expired_total ",
            "umbp_pool_leases_refused_total ",
            "umbp_pool_leases_ended_total ",
            "umbp_pool_leased_bytes ",
            "umbp_pool_verified_total ",
            "umbp_corrupt_detected_total ",
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
