//! Stores behind the pool (write-behind): the writer thread follows the store's commits (or,
//! with the on-reuse policy, the objects lookups hit twice) and writes objects to the remote
//! in pipelined batches, bounded by a backlog in bytes and optionally a rate; what does not
//! fit, or finds the remote down, is dropped and counted.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use umbp_core::BlockKey;

use crate::config::WritePolicy;
use crate::conn::{is_redirect, is_transport, Conn};
use crate::host::ObjectEvent;
use crate::object;
use crate::state::{Reuse, TierState, WriterMsg};
use crate::stats::add;

/// Objects and bytes per pipelined write.
const WRITE_BATCH: usize = 32;
const WRITE_BATCH_BYTES: u64 = 32 << 20;
/// Hits of one key closer together than this count as one (on-reuse policy).
const REUSE_WINDOW: Duration = Duration::from_secs(1);

/// Tells the tier that lookups hit `keys` in the pool (the on-reuse policy writes an object
/// at its second hit; a no-op with the eager policy).
pub(crate) fn note_hits(inner: &TierState, keys: impl IntoIterator<Item = BlockKey>) {
    if inner.cfg.write != WritePolicy::OnReuse {
        return;
    }
    let mut cand = inner.candidates.lock();
    if cand.map.is_empty() {
        return;
    }
    let mut promoted = Vec::new();
    let now = Instant::now();
    for k in keys {
        if let Some(r) = cand.map.get_mut(&k) {
            // vLLM asks again for a request that waits, every scheduler step: hits of
            // one key closer than REUSE_WINDOW count once.
            if r.last.is_some_and(|t| now.duration_since(t) < REUSE_WINDOW) {
                continue;
            }
            r.last = Some(now);
            r.hits += 1;
            if r.hits >= 2 {
                cand.map.remove(&k);
                promoted.push(k);
            }
        }
    }
    drop(cand);
    inner.send_writes(promoted);
}

/// The writer thread's queue of objects to write.
#[derive(Debug, Default)]
struct Backlog {
    keys: VecDeque<(BlockKey, u64)>,
    bytes: u64,
}

/// The writer thread: follows the store's commits, writes objects in pipelined batches.
pub(crate) fn writer(inner: &TierState, rx: Receiver<WriterMsg>) {
    let mut slot: Option<Conn> = None;
    let _ = inner.conn(&mut slot);
    let mut backlog = Backlog::default();
    let mut rate = Rate::new(inner.cfg.write_bytes_per_s);
    let c = &inner.c;
    loop {
        // Block for work only when there is none.
        let first = if backlog.keys.is_empty() {
            c.writing.store(false, Ordering::Release);
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return,
            }
        } else {
            None
        };
        c.writing.store(true, Ordering::Release);
        for m in first.into_iter().chain(rx.try_iter()) {
            match m {
                WriterMsg::Stop => return,
                WriterMsg::Event(ObjectEvent::Stored { key, bytes }) => {
                    c.commits_seen.fetch_add(1, Ordering::Release);
                    if inner.from_remote.lock().remove(&key) {
                        continue;
                    }
                    match inner.cfg.write {
                        WritePolicy::Eager => enqueue(inner, &mut backlog, key, bytes),
                        WritePolicy::OnReuse => {
                            inner.candidates.lock().insert(key, Reuse::default())
                        }
                        WritePolicy::Never => {}
                    }
                }
                WriterMsg::Event(ObjectEvent::Removed { key }) => {
                    if inner.cfg.write == WritePolicy::OnReuse {
                        inner.candidates.lock().map.remove(&key);
                    }
                }
                WriterMsg::Write(key) => {
                    match inner.source.object(&key).map(|o| o.bytes().len() as u64) {
                        Some(bytes) => enqueue(inner, &mut backlog, key, bytes),
                        None => add(&c.writes_evicted, 1),
                    }
                    inner.writes_queued.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if backlog.keys.is_empty() {
            continue;
        }
        if inner.is_down() {
            // The remote is failing: what waits is dropped, not kept for later.
            add(&c.writes_dropped, backlog.keys.len() as u64);
            backlog = Backlog::default();
            c.backlog_bytes.store(0, Ordering::Relaxed);
            continue;
        }
        // One batch, pinned until its bytes are copied into the pipeline.
        let mut batch = Vec::new();
        let mut batch_bytes = 0u64;
        while batch.len() < WRITE_BATCH && batch_bytes < WRITE_BATCH_BYTES {
            let Some((key, bytes)) = backlog.keys.pop_front() else {
                break;
            };
            backlog.bytes -= bytes;
            let Some(obj) = inner.source.object(&key) else {
                add(&c.writes_evicted, 1);
                continue;
            };
            // A checksummed value carries the pool's sum as is (checked by every reader); a
            // keyed one is sealed over the bytes, so they are verified first (a damaged
            // object is counted and removed by the pool, and not written).
            let sum = obj.checksum();
            if sum.is_some() && matches!(inner.seal, object::Seal::Keyed(_)) && !obj.intact() {
                continue;
            }
            batch_bytes += obj.bytes().len() as u64;
            batch.push((key, object::remote_key(&key), obj, sum));
        }
        c.backlog_bytes.store(backlog.bytes, Ordering::Relaxed);
        if batch.is_empty() {
            continue;
        }
        let pairs: Vec<(String, object::Encoded<'_>)> = batch
            .iter()
            .map(|(key, name, obj, sum)| {
                (
                    name.clone(),
                    object::Encoded {
                        seal: &inner.seal,
                        key,
                        payload: obj.bytes(),
                        sum: *sum,
                    },
                )
            })
            .collect();
        let n = pairs.len() as u64;
        // The objects' bytes go into the pipeline here; the pins end with it.
        let prepared = inner.backend.prepare_sets(&pairs, inner.cfg.ttl);
        drop(pairs);
        drop(batch);
        rate.wait(batch_bytes, &inner.closed);
        let Some(con) = inner.conn(&mut slot) else {
            add(&c.writes_dropped, n);
            continue;
        };
        let mut res = con.run_sets(&prepared);
        if res.as_ref().is_err_and(is_redirect) {
            // The cluster moved slots: a new connection reads the new slot map; once.
            slot = None;
            res = match inner.conn(&mut slot) {
                Some(con) => con.run_sets(&prepared),
                None => {
                    add(&c.writes_dropped, n);
                    continue;
                }
            };
        }
        match res {
            Ok(()) => {
                inner.succeeded();
                add(&c.writes, n);
                add(&c.bytes_written, batch_bytes);
            }
            Err(e) if is_transport(&e) => {
                slot = None;
                add(&c.writes_dropped, n);
                inner.failed("a write", &e);
            }
            Err(e) => {
                // The remote answered with an error (full: OOM under `noeviction`, read-only
                // replica, ...): this batch is lost, the connection and the lookups are fine.
                add(&c.writes_dropped, n);
                add(&c.errors, 1);
                log::warn!("remote tier: a write batch of {n} objects was refused: {e}");
            }
        }
    }
}

fn enqueue(inner: &TierState, backlog: &mut Backlog, key: BlockKey, bytes: u64) {
    if backlog.bytes + bytes > inner.cfg.write_backlog_bytes {
        add(&inner.c.writes_dropped, 1);
        return;
    }
    backlog.bytes += bytes;
    backlog.keys.push_back((key, bytes));
    inner
        .c
        .backlog_bytes
        .store(backlog.bytes, Ordering::Relaxed);
}

/// A byte-rate limit (none at 0 bytes/s).
#[derive(Debug)]
struct Rate {
    per_s: u64,
    start: Instant,
    sent: u64,
}

impl Rate {
    fn new(per_s: u64) -> Rate {
        Rate {
            per_s,
            start: Instant::now(),
            sent: 0,
        }
    }

    fn wait(&mut self, bytes: u64, closed: &AtomicBool) {
        if self.per_s == 0 {
            return;
        }
        // Restart the window after idle periods, so idle time earns no burst.
        let due = Duration::from_secs_f64(self.sent as f64 / self.per_s as f64);
        let elapsed = self.start.elapsed();
        if elapsed > due + Duration::from_secs(1) {
            self.start = Instant::now();
            self.sent = 0;
        }
        self.sent += bytes;
        let due = Duration::from_secs_f64(self.sent as f64 / self.per_s as f64);
        while let Some(left) = due.checked_sub(self.start.elapsed()) {
            if closed.load(Ordering::Acquire) || left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
}
