//! Write-behind: a queue of objects bounded in bytes, drained by writer threads at a rate
//! that may be bounded. Enqueueing never waits; what does not fit is dropped and counted.
//!
//! An entry holds either the object's bytes (an evicted pool object, pinned until written) or
//! only its key and length (an eager write on commit: the writer asks the tier's [`Source`]
//! for the bytes when it gets to it, so waiting objects stay evictable; one evicted meanwhile
//! comes back with its bytes through the eviction path and replaces the key-only entry).
//! Removing keys ([`Behind::cancel`]) takes them out of the queue, and a key being written at
//! that moment is dropped from the index once its write ends.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use umbp_core::BlockKey;

use crate::buf::AlignedBuf;
use crate::error::DiskError;
use crate::stats::add;
use crate::store::Store;

/// An object's bytes, owned by whoever queued it until it is written (a pinned pool object
/// stays pinned that long).
pub trait ObjectBytes: Send {
    /// The bytes.
    fn bytes(&self) -> &[u8];

    /// Whether the bytes are still what their owner stored (the pool's checksum, when it
    /// keeps one), asked on the writer's thread just before writing: a damaged object is not
    /// written (its owner counts it), so the disk's own checksum never vouches for it.
    fn intact(&self) -> bool {
        true
    }
}

impl ObjectBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl ObjectBytes for Arc<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Where key-only entries get their bytes: the object of a key, pinned, or `None` when it is
/// gone (evicted or removed).
pub type Source = Arc<dyn Fn(&BlockKey) -> Option<Box<dyn ObjectBytes>> + Send + Sync>;

/// What became of an object handed to the write-behind queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// It will be written.
    Queued,
    /// The disk holds the key already, or it is queued already.
    Present,
    /// Dropped: the backlog is full or the tier closed (counted in `writes_dropped`).
    Dropped,
}

/// An entry's object: its bytes, or only its length (fetched from the [`Source`] when written).
enum Obj {
    Bytes(Box<dyn ObjectBytes>),
    Key(u64),
}

impl Obj {
    fn len(&self) -> u64 {
        match self {
            Obj::Bytes(b) => b.bytes().len() as u64,
            Obj::Key(len) => *len,
        }
    }
}

struct Pending {
    key: BlockKey,
    obj: Obj,
}

/// The longest a cancel waits for writes of the keys it removed (one object's write, paced).
const CANCEL_WAIT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    items: VecDeque<Pending>,
    /// Keys queued or being written.
    keys: HashSet<BlockKey>,
    /// Keys being written that were removed meanwhile: dropped from the index once written.
    cancelled: HashSet<BlockKey>,
    bytes: u64,
    in_flight: usize,
    stop: bool,
}

/// The queue the writer threads drain.
pub(crate) struct Behind {
    state: Mutex<State>,
    work: Condvar,
    idle: Condvar,
    /// Notified whenever a write ends (a cancel waits for writes of the keys it removed).
    written: Condvar,
    /// When the rate allows the next write to start.
    next_start: Mutex<Instant>,
    /// Where key-only entries get their bytes.
    source: parking_lot::RwLock<Option<Source>>,
}

impl std::fmt::Debug for Behind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Behind")
            .field("queued", &s.items.len())
            .field("bytes", &s.bytes)
            .finish()
    }
}

impl Behind {
    pub fn new() -> Behind {
        Behind {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            idle: Condvar::new(),
            written: Condvar::new(),
            next_start: Mutex::new(Instant::now()),
            source: parking_lot::RwLock::new(None),
        }
    }

    /// Sets where key-only entries get their bytes.
    pub fn set_source(&self, source: Option<Source>) {
        *self.source.write() = source;
    }

    /// Queues `key`'s object of bytes `obj`, or drops it when the backlog would pass its
    /// bound. A key-only entry of the same key takes the bytes (and keeps its place).
    pub fn enqueue(&self, store: &Store, key: BlockKey, obj: Box<dyn ObjectBytes>) -> Queued {
        if store.contains(&key) {
            return Queued::Present;
        }
        let mut s = self.state.lock();
        if s.keys.contains(&key) {
            let st = &mut *s;
            if let Some(p) = st
                .items
                .iter_mut()
                .find(|p| p.key == key && matches!(p.obj, Obj::Key(_)))
            {
                st.bytes = st.bytes - p.obj.len() + obj.bytes().len() as u64;
                p.obj = Obj::Bytes(obj);
                store.c.backlog_bytes_set(st.bytes);
                return Queued::Queued;
            }
            return Queued::Present;
        }
        self.push(store, s, key, Obj::Bytes(obj))
    }

    /// Whether an object of `len` bytes would fit the backlog now (the tier not closing). An
    /// answer only: [`Behind::enqueue`] decides under the lock.
    pub fn has_room(&self, store: &Store, len: u64) -> bool {
        let s = self.state.lock();
        !s.stop && s.bytes + len <= store.cfg.write_backlog_bytes
    }

    /// Queues `key`'s object of `len` bytes by key only: the writer asks the source for its
    /// bytes when it gets to it. Dropped when the backlog would pass its bound.
    pub fn enqueue_key(&self, store: &Store, key: BlockKey, len: u64) -> Queued {
        if store.contains(&key) {
            return Queued::Present;
        }
        let s = self.state.lock();
        if s.keys.contains(&key) {
            return Queued::Present;
        }
        self.push(store, s, key, Obj::Key(len))
    }

    /// Counts one object dropped without queueing it (no room).
    pub fn drop_one(&self, store: &Store) -> Queued {
        add(&store.c.writes_dropped, 1);
        Queued::Dropped
    }

    fn push(
        &self,
        store: &Store,
        mut s: parking_lot::MutexGuard<'_, State>,
        key: BlockKey,
        obj: Obj,
    ) -> Queued {
        let len = obj.len();
        if s.stop || s.bytes + len > store.cfg.write_backlog_bytes {
            drop(s);
            drop(obj);
            add(&store.c.writes_dropped, 1);
            return Queued::Dropped;
        }
        s.bytes += len;
        s.keys.insert(key);
        s.items.push_back(Pending { key, obj });
        store.c.backlog_bytes_set(s.bytes);
        drop(s);
        self.work.notify_one();
        Queued::Queued
    }

    /// Takes the keys `matches` accepts out of the queue (their objects are released); keys
    /// being written now are dropped from the index once written, and the call waits for
    /// that (up to [`CANCEL_WAIT`]): when it returns, no write of theirs can still show up
    /// in the index. Returns how many entries left the queue.
    pub fn cancel(&self, store: &Store, matches: impl Fn(&BlockKey) -> bool) -> u64 {
        let mut s = self.state.lock();
        let before = s.items.len();
        let mut gone = Vec::new();
        let mut freed = 0;
        s.items.retain_mut(|p| {
            if matches(&p.key) {
                freed += p.obj.len();
                gone.push(p.key);
                false
            } else {
                true
            }
        });
        let n = (before - s.items.len()) as u64;
        s.bytes -= freed;
        for k in &gone {
            s.keys.remove(k);
        }
        // What is left of the matching keys is being written.
        let writing: Vec<BlockKey> = s.keys.iter().filter(|k| matches(k)).copied().collect();
        s.cancelled.extend(writing.iter().copied());
        store.c.backlog_bytes_set(s.bytes);
        if s.items.is_empty() && s.in_flight == 0 {
            self.idle.notify_all();
        }
        // A write that ends after this returns would leave its key in the index for a moment
        // (a lookup could promote what was removed): wait for them.
        let until = Instant::now() + CANCEL_WAIT;
        while writing.iter().any(|k| s.cancelled.contains(k)) {
            if self.written.wait_until(&mut s, until).timed_out() {
                log::warn!(
                    "umbp: disk tier: {} write(s) of removed objects still running after \
                     {CANCEL_WAIT:?}; they leave the index when they end",
                    writing.iter().filter(|k| s.cancelled.contains(k)).count()
                );
                break;
            }
        }
        n
    }

    /// One writer thread: writes queued objects until stopped.
    pub fn writer(&self, store: &Store) {
        let mut buf = AlignedBuf::new();
        loop {
            let (key, len, obj) = {
                let mut s = self.state.lock();
                loop {
                    while s.items.is_empty() && !s.stop {
                        self.work.wait(&mut s);
                    }
                    if s.stop {
                        return;
                    }
                    let p = s.items.pop_front().expect("not empty");
                    let len = p.obj.len();
                    // A key-only entry's bytes, pinned under the queue's lock: an eviction of
                    // the object meanwhile waits for the lock and then queues its bytes anew.
                    let obj = match p.obj {
                        Obj::Bytes(b) => Some(b),
                        Obj::Key(_) => self.source.read().as_ref().and_then(|f| f(&p.key)),
                    };
                    match obj {
                        Some(obj) => {
                            s.in_flight += 1;
                            break (p.key, len, obj);
                        }
                        None => {
                            // Gone from the pool (evicted, and queued again by the eviction,
                            // or removed): nothing to write.
                            s.bytes -= len;
                            s.keys.remove(&p.key);
                            store.c.backlog_bytes_set(s.bytes);
                            add(&store.c.eager_gone, 1);
                            if s.items.is_empty() && s.in_flight == 0 {
                                self.idle.notify_all();
                            }
                        }
                    }
                }
            };
            let data = obj.bytes();
            if obj.intact() {
                self.pace(store.cfg.write_bytes_per_s, data.len() as u64);
                match store.write(&key, data, &mut buf) {
                    Ok(_) => {}
                    Err(DiskError::TooLarge { .. } | DiskError::Closed) => {
                        add(&store.c.writes_dropped, 1)
                    }
                    // Counted and logged by the store.
                    Err(_) => {}
                }
            }
            drop(obj);
            let mut s = self.state.lock();
            s.bytes -= len;
            s.keys.remove(&key);
            if s.cancelled.remove(&key) {
                // Removed while being written.
                store.remove(&key);
            }
            s.in_flight -= 1;
            store.c.backlog_bytes_set(s.bytes);
            if s.items.is_empty() && s.in_flight == 0 {
                self.idle.notify_all();
            }
            self.written.notify_all();
        }
    }

    /// Waits until the rate allows writing `len` more bytes.
    fn pace(&self, bytes_per_s: u64, len: u64) {
        if bytes_per_s == 0 {
            return;
        }
        let start = {
            let mut next = self.next_start.lock();
            let now = Instant::now();
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(len as f64 / bytes_per_s as f64);
            start
        };
        let now = Instant::now();
        if start > now {
            std::thread::sleep(start - now);
        }
    }

    /// Waits until every queued object is written (or dropped), at most `timeout`; whether it
    /// drained.
    pub fn flush(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut s = self.state.lock();
        while !(s.items.is_empty() && s.in_flight == 0) {
            if self.idle.wait_until(&mut s, end).timed_out() {
                return s.items.is_empty() && s.in_flight == 0;
            }
        }
        true
    }

    /// Stops the writers; what is still queued is dropped (counted). Returns how many.
    pub fn stop(&self, store: &Store) -> u64 {
        let mut s = self.state.lock();
        s.stop = true;
        let items = std::mem::take(&mut s.items);
        let n = items.len() as u64;
        for p in items {
            s.bytes -= p.obj.len();
            s.keys.remove(&p.key);
        }
        store.c.backlog_bytes_set(s.bytes);
        drop(s);
        add(&store.c.writes_dropped, n);
        self.work.notify_all();
        self.idle.notify_all();
        n
    }
}
