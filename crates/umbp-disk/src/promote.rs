//! Reads for lookups: the keys a lookup wants are read by the reader threads in parallel,
//! each object checked and handed to the caller's sink (the pool) on the reader thread; the
//! lookup waits until they are done or its deadline passes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use umbp_core::BlockKey;

use crate::buf::AlignedBuf;
use crate::stats::add;
use crate::store::{ReadOutcome, Store};

/// Where promoted objects go: called on a reader thread with the key and its checked bytes;
/// returns whether it took them (a full pool does not).
pub type Sink = Arc<dyn Fn(&BlockKey, &[u8]) -> bool + Send + Sync>;

/// One lookup's reads.
struct Batch {
    sink: Sink,
    deadline: Instant,
    /// Per key: `None` while unread, then whether it was promoted.
    done: Mutex<(Vec<Option<bool>>, usize)>,
    cv: Condvar,
}

struct Job {
    batch: Arc<Batch>,
    i: usize,
    key: BlockKey,
}

#[derive(Default)]
struct Jobs {
    q: VecDeque<Job>,
    stop: bool,
}

/// The reader threads' queue.
pub(crate) struct Readers {
    jobs: Mutex<Jobs>,
    cv: Condvar,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readers")
            .field("queued", &self.jobs.lock().q.len())
            .finish()
    }
}

impl Readers {
    pub fn new() -> Readers {
        Readers {
            jobs: Mutex::new(Jobs::default()),
            cv: Condvar::new(),
        }
    }

    /// One reader thread: reads jobs until stopped; a job whose lookup has given up is not
    /// read.
    pub fn reader(&self, store: &Store) {
        let mut buf = AlignedBuf::new();
        loop {
            let job = {
                let mut j = self.jobs.lock();
                while j.q.is_empty() && !j.stop {
                    self.cv.wait(&mut j);
                }
                if j.stop {
                    return;
                }
                j.q.pop_front().expect("not empty")
            };
            let b = &job.batch;
            let hit = Instant::now() < b.deadline
                && store.read(&job.key, &mut buf, &*b.sink) == ReadOutcome::Hit;
            let mut d = b.done.lock();
            d.0[job.i] = Some(hit);
            d.1 -= 1;
            if d.1 == 0 {
                b.cv.notify_all();
            }
        }
    }

    /// Reads `keys` (those the caller's pool missed), handing each checked object to `sink`;
    /// with `prefix`, only as far as the disk holds the keys from the first. Waits until
    /// `deadline` at most. Returns, per key, whether it was promoted.
    pub fn promote(
        &self,
        store: &Store,
        keys: &[BlockKey],
        prefix: bool,
        deadline: Instant,
        sink: Sink,
    ) -> Vec<bool> {
        add(&store.c.lookup_keys, keys.len() as u64);
        let held = store.contains_many(keys);
        let wanted: Vec<usize> = if prefix {
            (0..keys.len()).take_while(|&i| held[i]).collect()
        } else {
            (0..keys.len()).filter(|&i| held[i]).collect()
        };
        let mut out = vec![false; keys.len()];
        if !wanted.is_empty() {
            let batch = Arc::new(Batch {
                sink,
                deadline,
                done: Mutex::new((vec![None; keys.len()], wanted.len())),
                cv: Condvar::new(),
            });
            {
                let mut j = self.jobs.lock();
                for &i in &wanted {
                    j.q.push_back(Job {
                        batch: Arc::clone(&batch),
                        i,
                        key: keys[i],
                    });
                }
            }
            self.cv.notify_all();
            let mut d = batch.done.lock();
            while d.1 > 0 {
                if batch.cv.wait_until(&mut d, deadline).timed_out() {
                    break;
                }
            }
            let mut late = 0;
            for &i in &wanted {
                match d.0[i] {
                    Some(hit) => out[i] = hit,
                    None => late += 1,
                }
            }
            add(&store.c.timeouts, late);
        }
        let hits = out.iter().filter(|h| **h).count() as u64;
        add(&store.c.misses, keys.len() as u64 - hits);
        out
    }

    /// Stops the readers (queued reads are abandoned; their lookups time out).
    pub fn stop(&self) {
        self.jobs.lock().stop = true;
        self.cv.notify_all();
    }
}
