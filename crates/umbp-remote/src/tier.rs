//! The running tier ([`RemoteTier`]): starts the event forwarder, the writer and the fetch
//! threads behind a store's objects ([`Source`]), and answers its callers: lookups
//! ([`crate::fetch`]), writes ([`crate::write`]), deletes, namespace resets, counters, flush
//! and close.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::config::{read_secret, RemoteConfig};
use umbp_core::address::redact_url;

use crate::conn::Backend;
use crate::error::RemoteError;
use crate::fetch::{self, FetchJob, FETCH_QUEUE, FETCH_THREADS};
use crate::host::{FetchSink, Source};
use crate::object;
use crate::state::{TierState, Tracked, WriterMsg};
use crate::stats::{Counters, RemoteStats};
use crate::write;

/// Events the writer may lag behind before the source drops them (counted by the source).
const EVENT_QUEUE: usize = 1 << 16;
/// How long clearing a namespace may take in all (a `SCAN` that never ends stops there).
const CLEAR_DEADLINE: Duration = Duration::from_secs(60);

/// A running remote tier. Dropping it (or [`RemoteTier::close`]) stops its threads.
#[derive(Debug)]
pub struct RemoteTier {
    inner: Arc<TierState>,
    fetch_tx: Mutex<Option<SyncSender<FetchJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl RemoteTier {
    /// Starts the tier behind `source` (a store's pool): checks the configuration (not the
    /// remote: a remote that is down at start is a remote that misses), subscribes to the
    /// source's commits and starts the writer and fetch threads.
    pub fn start(cfg: RemoteConfig, source: Arc<dyn Source>) -> Result<RemoteTier, RemoteError> {
        let target = cfg.validate()?;
        let seal = match &cfg.secret_file {
            Some(path) => object::Seal::Keyed(Box::new(read_secret(path)?)),
            None => object::Seal::Checksum,
        };
        let backend = Backend::new(&target, cfg.timeout)?;
        let events = source.subscribe(EVENT_QUEUE);
        // After subscribing: a commit racing with this line is counted here and also seen as
        // an event, so `flush` may return one such commit early (only commits made while the
        // tier starts). Read before subscribing, it would never return.
        let puts_before = source.commits();
        let inner = Arc::new(TierState {
            cfg,
            seal,
            max_object_bytes: AtomicU64::new(0),
            backend,
            source,
            c: Counters::default(),
            closed: AtomicBool::new(false),
            down_until: Mutex::new(None),
            reported_down: AtomicBool::new(false),
            from_remote: Mutex::new(HashSet::new()),
            candidates: Mutex::new(Tracked::default()),
            to_writer: Mutex::new(None),
            writes_queued: AtomicU64::new(0),
            puts_before,
        });
        // Bounded: when the writer lags this far, the forwarder waits, the source's own queue
        // fills and the source drops (and counts) events instead of anything growing.
        let (to_writer, writer_rx) = mpsc::sync_channel::<WriterMsg>(EVENT_QUEUE);
        *inner.to_writer.lock() = Some(to_writer.clone());
        let (fetch_tx, fetch_rx) = mpsc::sync_channel::<FetchJob>(FETCH_QUEUE);
        let fetch_rx = Arc::new(std::sync::Mutex::new(fetch_rx));
        let tier = RemoteTier {
            inner: Arc::clone(&inner),
            fetch_tx: Mutex::new(Some(fetch_tx)),
            threads: Mutex::new(Vec::new()),
        };
        let spawn = |name: String, what: &'static str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|source| RemoteError::Thread { what, source })
        };
        // The forwarder blocks on the source's events and hands them to the writer; it ends at
        // the first event after the writer is gone (not joined: it may wait for one forever).
        spawn(
            "umbp-remote-events".into(),
            "event forwarder",
            Box::new(move || {
                for ev in events {
                    if to_writer.send(WriterMsg::Event(ev)).is_err() {
                        return;
                    }
                }
            }),
        )?;
        let w = Arc::clone(&inner);
        let h = spawn(
            "umbp-remote-write".into(),
            "writer",
            Box::new(move || write::writer(&w, writer_rx)),
        )?;
        tier.threads.lock().push(h);
        for i in 0..FETCH_THREADS {
            let (f, rx) = (Arc::clone(&inner), Arc::clone(&fetch_rx));
            let h = spawn(
                format!("umbp-remote-fetch-{i}"),
                "fetch",
                Box::new(move || fetch::fetcher(&f, &rx)),
            )?;
            tier.threads.lock().push(h);
        }
        log::info!(
            "remote tier {}: values {}; writes {}{}, timeout {} ms, backlog {} MiB",
            redact_url(&inner.cfg.url),
            match inner.seal {
                object::Seal::Checksum => "checksummed (XXH3: catches accidents, not forgeries)",
                object::Seal::Keyed(_) => "sealed with the secret file's key (HMAC-SHA256)",
            },
            inner.cfg.write.name(),
            inner
                .cfg
                .ttl
                .map_or(String::new(), |t| format!(", TTL {} s", t.as_secs())),
            inner.cfg.timeout.as_millis(),
            inner.cfg.write_backlog_bytes >> 20
        );
        Ok(tier)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RemoteConfig {
        &self.inner.cfg
    }

    /// Lets fetches read objects of up to `bytes` (a registered layout's object size): a
    /// remote value is read only as far as the largest size allowed, so a planted huge value
    /// costs no more memory than a real one. Until a size is allowed, nothing is fetched.
    pub fn allow_object_bytes(&self, bytes: u64) {
        self.inner
            .max_object_bytes
            .fetch_max(bytes, Ordering::Relaxed);
    }

    /// Fetches `keys` (those the pool missed, in prefix order) into `sink` (the lookup's fill
    /// of the pool), stopping at the first the remote lacks; waits at most the tier's timeout.
    /// Returns how many keys from the first are now in the sink.
    pub fn fetch_prefix(&self, keys: &[BlockKey], sink: Arc<dyn FetchSink>) -> usize {
        self.fetch_prefix_by(keys, Instant::now() + self.inner.cfg.timeout, sink)
    }

    /// [`fetch_prefix`](Self::fetch_prefix), waiting until `deadline` at most (one deadline
    /// for the several calls of one lookup).
    pub fn fetch_prefix_by(
        &self,
        keys: &[BlockKey],
        deadline: Instant,
        sink: Arc<dyn FetchSink>,
    ) -> usize {
        let got = self.fetch(keys, true, deadline, sink);
        got.iter().take_while(|p| **p).count()
    }

    /// When a lookup that starts now must be answered.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.inner.cfg.timeout
    }

    /// Fetches every key of `keys` (those the pool missed) that the remote holds into `sink`
    /// (the lookup's fill of the pool); waits at most the tier's timeout. Returns which are
    /// now in the sink.
    pub fn fetch_present(&self, keys: &[BlockKey], sink: Arc<dyn FetchSink>) -> Vec<bool> {
        self.fetch(keys, false, self.deadline(), sink)
    }

    fn fetch(
        &self,
        keys: &[BlockKey],
        prefix: bool,
        deadline: Instant,
        sink: Arc<dyn FetchSink>,
    ) -> Vec<bool> {
        fetch::fetch_keys(&self.inner, &self.fetch_tx, keys, prefix, deadline, sink)
    }

    /// Tells the tier that lookups hit `keys` in the pool (the on-reuse policy writes an object
    /// at its second hit; a no-op with the eager policy).
    pub fn note_hits(&self, keys: impl IntoIterator<Item = BlockKey>) {
        write::note_hits(&self.inner, keys);
    }

    /// Queues the source's objects of `keys` for writing, whatever the policy (objects it
    /// does not hold are passed over). For publishing what a pool already holds, and
    /// benchmarks.
    pub fn write_keys(&self, keys: &[BlockKey]) {
        self.inner.send_writes(keys.iter().copied());
    }

    /// Deletes the remote copies of `keys` (best effort, bounded by the timeout). Returns how
    /// many delete requests were sent.
    pub fn delete(&self, keys: &[BlockKey]) -> usize {
        let mut slot = None;
        let Some(con) = self.inner.conn(&mut slot) else {
            return 0;
        };
        let names: Vec<String> = keys.iter().map(object::remote_key).collect();
        match con.del_many(&names) {
            Ok(()) => names.len(),
            Err(e) => {
                self.inner.failed("deleting", &e);
                0
            }
        }
    }

    /// Deletes every remote object of the namespace whose id is `namespace_id` (as in
    /// [`BlockKey::namespace_id`]): every rank, every group, whichever node wrote it. Waits
    /// for it (each request bounded by the timeout); returns how many were deleted, or `None`
    /// when the remote failed (counted, logged).
    pub fn clear_namespace(&self, namespace_id: &[u8; 16]) -> Option<u64> {
        let mut pattern = String::from(object::REMOTE_KEY_PREFIX);
        for b in namespace_id {
            pattern.push_str(&format!("{b:02x}"));
        }
        pattern.push('*');
        // A reset must not be skipped because of a back-off: it connects whatever the state.
        let mut con = match self.inner.backend.connect(self.inner.cfg.timeout) {
            Ok(c) => c,
            Err(e) => {
                self.inner.failed("connecting to clear a namespace", &e);
                log::warn!(
                    "remote tier: the namespace's remote objects ({pattern}) were NOT deleted; they expire by TTL or eviction, or delete them with redis-cli"
                );
                return None;
            }
        };
        // Each request is bounded by the timeout; the whole sweep by a minute.
        let deadline = Instant::now() + CLEAR_DEADLINE;
        match con.delete_matching(&pattern, deadline) {
            Ok(n) => {
                log::info!("remote tier: deleted {n} objects of the namespace ({pattern})");
                Some(n)
            }
            Err(e) => {
                self.inner.failed("clearing a namespace", &e);
                log::warn!(
                    "remote tier: the namespace's remote objects ({pattern}) may not all be deleted; they expire by TTL or eviction, or delete them with redis-cli"
                );
                None
            }
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> RemoteStats {
        self.inner.c.snapshot()
    }

    /// Waits until every commit of the source so far has been written (or dropped, or passed
    /// over by the policy), or `timeout` passes; whether it drained.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (i, end) = (&self.inner, Instant::now() + timeout);
        loop {
            let c = &i.c;
            if c.commits_seen.load(Ordering::Acquire) + i.puts_before >= i.source.commits()
                && c.backlog_bytes.load(Ordering::Acquire) == 0
                && !c.writing.load(Ordering::Acquire)
                && i.writes_queued.load(Ordering::Acquire) == 0
            {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the threads (the writer drops what it has not written).
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.fetch_tx.lock().take();
        if let Some(tx) = self.inner.to_writer.lock().take() {
            // A full queue means the writer is busy: it sees `closed` after its batch.
            let _ = tx.try_send(WriterMsg::Stop);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.close();
    }
}
