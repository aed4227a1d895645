//! Reads into the pool: lookups hand the keys the pool missed, and where to put them (a
//! [`FetchSink`]: the lookup's fill of the pool), to the fetch threads, which get them from
//! the remote in pipelined chunks (the next chunk's request travelling while the last one is
//! checked), check each value and put the good ones in the sink.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use umbp_core::BlockKey;

use crate::conn::{self, is_redirect, is_transport, Conn};
use crate::host::{FetchSink, Placed};
use crate::object;
use crate::state::{TierState, MAX_TRACKED};
use crate::stats::add;

/// Keys per pipelined fetch: one round trip per node per chunk.
const FETCH_CHUNK: usize = 32;
/// Lookups queued for the fetch threads beyond those being served; more miss at once.
pub(crate) const FETCH_QUEUE: usize = 16;
pub(crate) const FETCH_THREADS: usize = 2;

/// What the fetch threads are asked.
pub(crate) struct FetchJob {
    keys: Vec<BlockKey>,
    /// Stop at the first key the remote lacks.
    prefix: bool,
    /// The caller stops waiting then; a job still queued at that time is not served.
    deadline: Instant,
    /// Set when a fetch thread takes the job (a job that waited in the queue all along says
    /// nothing about the remote).
    started: Arc<AtomicBool>,
    /// Per chunk: (index of its first key, which of its keys are now in the sink).
    reply: mpsc::Sender<(usize, Vec<bool>)>,
    /// Where the objects go: made when the lookup began, it commits no value read before a
    /// clear of the remote and the pool after that clear ([`Placed::Cleared`]).
    sink: Arc<dyn FetchSink>,
}

/// Asks the fetch threads for `keys` (those the pool missed) and waits for their answers
/// until `deadline` at most; which keys are now in `sink`. With `prefix`, stops at the first
/// key the remote lacks.
pub(crate) fn fetch_keys(
    inner: &TierState,
    jobs: &Mutex<Option<SyncSender<FetchJob>>>,
    keys: &[BlockKey],
    prefix: bool,
    deadline: Instant,
    sink: Arc<dyn FetchSink>,
) -> Vec<bool> {
    let mut got = vec![false; keys.len()];
    if keys.is_empty() {
        return got;
    }
    let c = &inner.c;
    if inner.is_down() {
        add(&c.skipped_lookups, 1);
        return got;
    }
    if inner.max_object_bytes.load(Ordering::Relaxed) == 0 {
        // No layout registered: nothing here could load what it fetched.
        log::debug!("remote tier: no object size allowed yet; the lookup misses");
        return got;
    }
    if Instant::now() >= deadline {
        return got;
    }
    let (tx, rx) = mpsc::channel();
    let started = Arc::new(AtomicBool::new(false));
    let job = FetchJob {
        sink,
        keys: keys.to_vec(),
        prefix,
        deadline,
        started: Arc::clone(&started),
        reply: tx,
    };
    let sent = match jobs.lock().as_ref() {
        Some(s) => s.try_send(job),
        None => return got,
    };
    match sent {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
            add(&c.skipped_lookups, 1);
            return got;
        }
    }
    let chunks = keys.len().div_ceil(FETCH_CHUNK);
    let mut seen = 0;
    while seen < chunks {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((at, present)) => {
                let stop = prefix && present.iter().any(|p| !p);
                got[at..at + present.len()].copy_from_slice(&present);
                seen += 1;
                if stop {
                    break;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                add(&c.timeouts, 1);
                if seen == 0 && started.load(Ordering::Acquire) {
                    // A fetch thread asked and not one chunk came back within the
                    // timeout: the remote is unresponsive, not merely busy with a long
                    // prefix (or this job queued behind others). Leave it alone a while.
                    inner.unresponsive();
                }
                break;
            }
            // The fetcher finished early (prefix stop, or an error: the rest missed).
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    got
}

/// A fetch thread: serves lookups, one at a time, with its own connection.
pub(crate) fn fetcher(inner: &TierState, jobs: &std::sync::Mutex<Receiver<FetchJob>>) {
    // Two connections: the next chunk's request travels on one while the last chunk's
    // objects are checked and copied into the sink from the other.
    let mut slots: [Option<Conn>; 2] = [None, None];
    // Connect at start, so the first lookup does not pay for it (a cluster connection asks
    // every node for its slots).
    for slot in &mut slots {
        if inner.conn(slot).is_none() {
            break;
        }
    }
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if Instant::now() >= job.deadline {
            // Its caller has given up: asking now would only load the remote.
            add(&inner.c.skipped_lookups, 1);
            continue;
        }
        job.started.store(true, Ordering::Release);
        serve_fetch(inner, &mut slots, job);
    }
}

type Values = Vec<Option<Vec<u8>>>;

/// One pipelined `GETRANGE` of `chunk` on `slot`'s connection; `None` when it failed (counted,
/// the connection dropped: a timed-out pipeline may still answer later).
fn get_chunk(inner: &TierState, slot: &mut Option<Conn>, chunk: &[BlockKey]) -> Option<Values> {
    let Some(con) = inner.conn(slot) else {
        add(&inner.c.skipped_lookups, 1);
        return None;
    };
    let names: Vec<String> = chunk.iter().map(object::remote_key).collect();
    let limit = inner.value_limit();
    let mut res = con.get_many(&names, limit);
    if res.as_ref().is_err_and(is_redirect) {
        // The cluster moved slots: a new connection reads the new slot map; once.
        *slot = None;
        res = match inner.conn(slot) {
            Some(con) => con.get_many(&names, limit),
            None => return None,
        };
    }
    if res.as_ref().is_err_and(conn::is_wrong_type) {
        // A key of the chunk holds a list or a hash (someone else's, or planted): that key
        // is a bad object, the others are read one by one.
        res = match inner.conn(slot) {
            Some(con) => con.get_each(&names, limit),
            None => return None,
        };
    }
    match res {
        Ok(v) => {
            inner.succeeded();
            Some(v)
        }
        Err(e) if crate::resp::is_too_long(&e) => {
            // A value longer than any object (or a reply past the reader's bounds) was not
            // read: that key is a bad object, the chunk's others miss, and the connection,
            // left in the middle of the reply, is dropped. The remote is not down.
            *slot = None;
            add(&inner.c.corrupt, 1);
            add(&inner.c.misses, chunk.len() as u64);
            log::warn!(
                "remote tier: a reply to a lookup was longer than the largest object ({e}); {} keys taken as misses",
                chunk.len()
            );
            None
        }
        Err(e) if is_transport(&e) => {
            // A timed-out pipeline may still answer later: never reuse the connection.
            *slot = None;
            inner.failed("a lookup", &e);
            None
        }
        Err(e) => {
            // The remote answered with errors (a slot still migrating, say): this chunk
            // misses, and no back-off follows; the connection is made again next time, so
            // that it reads the cluster's slot map afresh.
            *slot = None;
            add(&inner.c.errors, 1);
            log::warn!("remote tier: a lookup was refused: {e}");
            None
        }
    }
}

/// Checks the values of `chunk` and puts the good ones in `sink`; which keys are now there,
/// and whether a prefix broke.
fn take_chunk(
    inner: &TierState,
    chunk: &[BlockKey],
    values: Values,
    prefix: bool,
    sink: &dyn FetchSink,
) -> (Vec<bool>, bool) {
    let c = &inner.c;
    let limit = inner.value_limit();
    let mut present = Vec::with_capacity(chunk.len());
    let mut stop = false;
    for (key, v) in chunk.iter().zip(values) {
        if stop {
            present.push(false);
            continue;
        }
        let ok = match v {
            None => {
                add(&c.misses, 1);
                false
            }
            Some(v) => match Ok(&v)
                .and_then(|v| {
                    if v.len() as u64 > limit {
                        Err(object::Reject::TooLarge)
                    } else {
                        object::parse(&inner.seal, key, v)
                    }
                })
                .and_then(|(payload, check)| put_fetched(inner, sink, *key, payload, check))
            {
                Ok(stored) => stored,
                Err(why) => {
                    add(&c.corrupt, 1);
                    add(&c.misses, 1);
                    log::warn!(
                        "remote tier: the value under {} is not its object ({why:?}); taken as a miss",
                        object::remote_key(key)
                    );
                    false
                }
            },
        };
        present.push(ok);
        stop = prefix && !ok;
    }
    (present, stop)
}

fn serve_fetch(inner: &TierState, slots: &mut [Option<Conn>; 2], job: FetchJob) {
    add(&inner.c.lookup_keys, job.keys.len() as u64);
    let chunks: Vec<&[BlockKey]> = job.keys.chunks(FETCH_CHUNK).collect();
    let Some(mut values) = get_chunk(inner, &mut slots[0], chunks[0]) else {
        return;
    };
    for ci in 0..chunks.len() {
        let (this, other) = slots.split_at_mut(1);
        let next_slot = if ci % 2 == 0 {
            &mut other[0]
        } else {
            &mut this[0]
        };
        let next_chunk = chunks.get(ci + 1).copied();
        let current = std::mem::take(&mut values);
        // The next chunk's request travels while this one is checked, copied and answered;
        // the answer goes out before waiting for the next chunk.
        let next = std::thread::scope(|s| {
            let ahead = match next_chunk {
                Some(nc) => std::thread::Builder::new()
                    .name("umbp-remote-ahead".into())
                    .spawn_scoped(s, move || get_chunk(inner, next_slot, nc))
                    .map_err(|_| ()),
                None => Err(()),
            };
            let (present, stop) = take_chunk(inner, chunks[ci], current, job.prefix, &*job.sink);
            // The caller gone (timed out) or a prefix broken: no more chunks (a fetched-ahead
            // one is dropped).
            let go_on = job.reply.send((ci * FETCH_CHUNK, present)).is_ok() && !stop;
            match ahead {
                Ok(h) => h.join().ok().flatten().filter(|_| go_on),
                // No thread could be started: the next chunk is fetched here, after this one.
                Err(()) => match (next_chunk, go_on) {
                    (Some(nc), true) => {
                        // The failed spawn took the slot's connection with it: a new one.
                        log::debug!("remote tier: no look-ahead thread; fetching in turn");
                        get_chunk(inner, &mut None, nc)
                    }
                    _ => None,
                },
            }
        });
        match next {
            Some(v) => values = v,
            None => return,
        }
    }
}

/// Puts a fetched object in `sink`, its checksum or MAC checked while it is copied in:
/// `Ok(true)` stored (or already there), `Ok(false)` no room or a clear since the lookup
/// began, `Err` a bad checksum or MAC (nothing stored).
fn put_fetched(
    inner: &TierState,
    sink: &dyn FetchSink,
    key: BlockKey,
    payload: &[u8],
    check: object::Check<'_>,
) -> Result<bool, object::Reject> {
    // A checksummed value's sum is the pool's (XXH3-64 of the payload), checked here while
    // copying: the pool keeps it. A keyed value leaves the pool to sum it at commit.
    let sum = match &check {
        object::Check::Sum(sum) => Some(*sum),
        object::Check::Mac { .. } => None,
    };
    let mut check = Some(check);
    // Never evicts: on the lookup path a fetch must not push out what the same lookup just
    // counted (or an earlier chunk of it). What does not fit in the free room misses.
    let placed = sink.put_with(&key, payload.len() as u64, &mut |dst| {
        let check = check.take().expect("put_with writes once");
        // On an error the sink frees the room; nothing was visible.
        object::copy_checked(dst, payload, check, |d, p| sink.copy(d, p))?;
        // Before the commit: its event finds the key here.
        let mut fr = inner.from_remote.lock();
        if fr.len() >= MAX_TRACKED {
            fr.clear();
        }
        fr.insert(key);
        Ok(sum)
    })?;
    Ok(match placed {
        Placed::Held => true,
        // The sink logs why.
        Placed::NoRoom => false,
        Placed::Stored => {
            add(&inner.c.hits, 1);
            add(&inner.c.bytes_fetched, payload.len() as u64);
            true
        }
        // Another fetch (or the engine) committed it first, or the sink's admission declined
        // it. Its entry in the set stays for that commit's event (one entry per key).
        Placed::Discarded => true,
        // Read before a clear that has run since: what it read may be what was cleared.
        Placed::Cleared => {
            add(&inner.c.misses, 1);
            false
        }
    })
}
