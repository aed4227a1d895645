//! What every request handler and both transports share: the store, the sessions, the
//! metrics, the server's identity and whether it is shutting down.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;
use umbp_core::ErrorKind;
use umbp_proto::errors::status;
use umbp_proto::Endpoint;
use umbp_store::EmbeddedStore;

use crate::config::Access;
use crate::metrics::{Gauges, Metrics};
use crate::sessions::Sessions;

/// Everything the service's handlers share.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) store: Arc<EmbeddedStore>,
    pub(crate) sessions: Arc<Sessions>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) boot_id: String,
    pub(crate) started: Instant,
    pub(crate) access: Access,
    pub(crate) endpoint: Endpoint,
    pub(crate) max_message_bytes: usize,
    /// How long a transfer channel's reader watches its socket before blocking on it.
    pub(crate) busy_poll: Duration,
    /// Set when the server starts shutting down: new transfers are refused.
    pub(crate) draining: AtomicBool,
    pub(crate) in_flight: AtomicU64,
    /// Descriptor budgets (`budget`).
    pub(crate) budget: Arc<crate::budget::Budget>,
    /// Where lookups run (`lookup_pool`).
    pub(crate) lookups: crate::lookup_pool::LookupPool,
}

impl State {
    /// Statistics of the pool and the sessions.
    pub(crate) fn gauges(&self) -> Gauges {
        let t = self.sessions.totals();
        let mut g = Gauges {
            sessions: self.sessions.len() as u64,
            registrations: t.registrations,
            layouts: t.layouts,
            transfers_in_flight: self.in_flight.load(Ordering::Relaxed),
            ..Gauges::default()
        };
        g.pool = self.store.stats().ok().map(|p| p.counters);
        g.remote = self.store.remote_stats();
        g.disk = self.store.disk_stats();
        g.pins = Some(self.store.pin_stats());
        g
    }

    /// Counts refusal `s` (and logs it at debug level); returns it.
    pub(crate) fn refuse(&self, s: Status) -> Status {
        self.metrics.refused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(code = ?s.code(), message = s.message(), "request refused");
        s
    }

    /// Unavailable once the server is shutting down.
    pub(crate) fn refuse_if_draining(&self) -> Result<(), Status> {
        if self.draining.load(Ordering::Acquire) {
            return Err(status(
                ErrorKind::Unavailable,
                "the server is shutting down; transfer refused",
            ));
        }
        Ok(())
    }
}
