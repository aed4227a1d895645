//! Write-behind: a queue of objects bounded in bytes, drained by writer threads at a rate
//! that may be bounded. Enqueueing never waits; what does not fit is dropped and counted.

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

struct Pending {
    key: BlockKey,
    obj: Box<dyn ObjectBytes>,
}

#[derive(Default)]
struct State {
    items: VecDeque<Pending>,
    keys: HashSet<BlockKey>,
    bytes: u64,
    in_flight: usize,
    stop: bool,
}

/// The queue the writer threads drain.
pub(crate) struct Behind {
    state: Mutex<State>,
    work: Condvar,
    idle: Condvar,
    /// When the rate allows the next write to start.
    next_start: Mutex<Instant>,
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
            next_start: Mutex::new(Instant::now()),
        }
    }

    /// Queues `key`'s object, or drops it when the backlog would pass its bound.
    pub fn enqueue(&self, store: &Store, key: BlockKey, obj: Box<dyn ObjectBytes>) -> Queued {
        if store.contains(&key) {
            return Queued::Present;
        }
        let len = obj.bytes().len() as u64;
        let mut s = self.state.lock();
        if s.keys.contains(&key) {
            return Queued::Present;
        }
        if s.stop || s.bytes + len > store.cfg.write_backlog_bytes {
            drop(s);
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

    /// One writer thread: writes queued objects until stopped.
    pub fn writer(&self, store: &Store) {
        let mut buf = AlignedBuf::new();
        loop {
            let p = {
                let mut s = self.state.lock();
                while s.items.is_empty() && !s.stop {
                    self.work.wait(&mut s);
                }
                if s.stop {
                    return;
                }
                let p = s.items.pop_front().expect("not empty");
                s.in_flight += 1;
                p
            };
            let data = p.obj.bytes();
            self.pace(store.cfg.write_bytes_per_s, data.len() as u64);
            match store.write(&p.key, data, &mut buf) {
                Ok(_) => {}
                Err(DiskError::TooLarge { .. } | DiskError::Closed) => {
                    add(&store.c.writes_dropped, 1)
                }
                // Counted and logged by the store.
                Err(_) => {}
            }
            let len = data.len() as u64;
            drop(p.obj);
            let mut s = self.state.lock();
            s.bytes -= len;
            s.keys.remove(&p.key);
            s.in_flight -= 1;
            store.c.backlog_bytes_set(s.bytes);
            if s.items.is_empty() && s.in_flight == 0 {
                self.idle.notify_all();
            }
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
            s.bytes -= p.obj.bytes().len() as u64;
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
