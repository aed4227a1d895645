//! The state a running tier's threads share ([`TierState`]): its configuration and seal,
//! the store's objects it writes behind ([`Source`]), the counters, whether the remote is in
//! back-off after a failure (and making connections only outside it), the keys fetched from
//! the remote and the on-reuse candidates, and the writer's queue.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::config::RemoteConfig;
use umbp_core::address::redact_url;

use crate::conn::{Backend, Conn};
use crate::host::{ObjectEvent, Source};
use crate::object;
use crate::stats::{add, Counters};

/// How long the remote is left alone after a failure.
const BACKOFF: Duration = Duration::from_secs(1);
/// Bounds of the writer's bookkeeping sets (cleared when full: at worst an object is written
/// twice or once too few).
pub(crate) const MAX_TRACKED: usize = 1 << 20;

/// A set that forgets everything when it grows past [`MAX_TRACKED`].
#[derive(Debug, Default)]
pub(crate) struct Tracked<V> {
    pub(crate) map: HashMap<BlockKey, V>,
}

impl<V> Tracked<V> {
    pub(crate) fn insert(&mut self, k: BlockKey, v: V) {
        if self.map.len() >= MAX_TRACKED {
            self.map.clear();
        }
        self.map.insert(k, v);
    }
}

/// How often lookups hit a committed object not written yet (on-reuse policy).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Reuse {
    pub(crate) hits: u8,
    pub(crate) last: Option<Instant>,
}

/// What a tier's threads (and its handle) share: configuration, connection health,
/// counters and the writer's queue.
#[derive(Debug)]
pub(crate) struct TierState {
    pub(crate) cfg: RemoteConfig,
    /// How values are sealed (from the secret file, if any).
    pub(crate) seal: object::Seal,
    /// The largest object this node's layouts make ([`crate::RemoteTier::allow_object_bytes`]):
    /// a fetched value is read only that far (0: none registered, nothing is fetched).
    pub(crate) max_object_bytes: AtomicU64,
    pub(crate) backend: Backend,
    /// The store whose commits it writes behind.
    pub(crate) source: Arc<dyn Source>,
    pub(crate) c: Counters,
    pub(crate) closed: AtomicBool,
    /// No request before this instant (after a failure).
    pub(crate) down_until: Mutex<Option<Instant>>,
    /// Whether the remote's being down was logged as a warning (cleared on success).
    pub(crate) reported_down: AtomicBool,
    /// Keys the fetchers put in the store: their commits are not written back.
    pub(crate) from_remote: Mutex<HashSet<BlockKey>>,
    /// On-reuse policy: committed keys not written yet, and how often lookups hit them.
    pub(crate) candidates: Mutex<Tracked<Reuse>>,
    /// The writer's queue: the store's commits (through the forwarder thread), objects to
    /// write, stop.
    pub(crate) to_writer: Mutex<Option<SyncSender<WriterMsg>>>,
    /// `Write` messages sent and not yet taken by the writer.
    pub(crate) writes_queued: AtomicU64,
    /// The store's commits before the tier subscribed to them.
    pub(crate) puts_before: u64,
}

/// What the writer thread is told.
#[derive(Debug)]
pub(crate) enum WriterMsg {
    /// A commit or removal in the store.
    Event(ObjectEvent),
    /// Write this object of the store (on-reuse promotion, or `write_keys`).
    Write(BlockKey),
    /// Stop.
    Stop,
}

impl TierState {
    pub(crate) fn send_writes(&self, keys: impl IntoIterator<Item = BlockKey>) {
        if let Some(tx) = self.to_writer.lock().as_ref() {
            for k in keys {
                self.writes_queued.fetch_add(1, Ordering::AcqRel);
                // Never waits (a lookup calls this): a full queue drops the write.
                if tx.try_send(WriterMsg::Write(k)).is_err() {
                    self.writes_queued.fetch_sub(1, Ordering::AcqRel);
                    add(&self.c.writes_dropped, 1);
                }
            }
        }
    }
}

impl TierState {
    /// The longest value a fetch reads: the largest allowed object and its header.
    pub(crate) fn value_limit(&self) -> u64 {
        self.max_object_bytes.load(Ordering::Relaxed) + self.seal.header_bytes() as u64
    }

    pub(crate) fn is_down(&self) -> bool {
        let mut d = self.down_until.lock();
        match *d {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *d = None;
                false
            }
            None => false,
        }
    }

    pub(crate) fn failed(&self, what: &str, e: &redis::RedisError) {
        add(&self.c.errors, 1);
        let was = self.c.connected.swap(false, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + BACKOFF);
        // The first failure of a remote that never answered (a wrong password, a TLS
        // mismatch) is a warning too, not only the loss of a connected one.
        let first = !self.reported_down.swap(true, Ordering::Relaxed);
        if was || first {
            log::warn!(
                "remote tier {}: {what} failed ({e}); lookups miss and writes are dropped for {} s, then it retries",
                redact_url(&self.cfg.url),
                BACKOFF.as_secs()
            );
        } else {
            log::debug!("remote tier: {what} failed again: {e}");
        }
    }

    pub(crate) fn unresponsive(&self) {
        let was = self.c.connected.swap(false, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + BACKOFF);
        if was {
            log::warn!(
                "remote tier {}: a lookup got no answer within {} ms; lookups miss for {} s, then it retries",
                redact_url(&self.cfg.url),
                self.cfg.timeout.as_millis(),
                BACKOFF.as_secs()
            );
        }
    }

    pub(crate) fn succeeded(&self) {
        self.reported_down.store(false, Ordering::Relaxed);
        if !self.c.connected.swap(true, Ordering::Relaxed) {
            log::info!("remote tier {}: connected", redact_url(&self.cfg.url));
        }
    }

    /// A connection, made if `slot` has none (and the remote is not in back-off).
    pub(crate) fn conn<'s>(&self, slot: &'s mut Option<Conn>) -> Option<&'s mut Conn> {
        if slot.is_none() {
            if self.is_down() {
                return None;
            }
            match self.backend.connect(self.cfg.timeout) {
                Ok(c) => {
                    *slot = Some(c);
                    self.succeeded();
                }
                Err(e) => {
                    self.failed("connecting", &e);
                    return None;
                }
            }
        }
        slot.as_mut()
    }
}
