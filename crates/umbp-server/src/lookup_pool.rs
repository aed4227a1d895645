//! Where `Exists` lookups run: threads of their own, off the runtime's threads (which serve
//! every client's requests, pings and gRPC transfers among them), at a lower CPU priority than
//! the copy workers (nice +10), and fair between clients: each connection has a queue, and the
//! threads take the connections in turn, one lookup each. A client looping the largest lookup
//! the server accepts then delays another client's lookup by at most one lookup per thread,
//! and nobody's ping or transfer.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use tonic::Status;
use umbp_core::ErrorKind;
use umbp_proto::errors::status;

/// Lookups one connection may have waiting at once: 64 (a scheduler asks one at a time).
pub(crate) const MAX_QUEUED_PER_CLIENT: usize = 64;
/// The CPU priority of the lookup threads: nice +10 (below the copy workers).
const NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queues {
    by_client: HashMap<u64, VecDeque<Job>>,
    /// Clients with work, in the order they are served.
    turn: VecDeque<u64>,
    closed: bool,
}

struct Inner {
    q: Mutex<Queues>,
    cv: Condvar,
}

/// The lookup threads and their per-client queues.
pub(crate) struct LookupPool {
    inner: Arc<Inner>,
    threads: usize,
}

impl std::fmt::Debug for LookupPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LookupPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl LookupPool {
    /// Starts `threads` lookup threads (at least one).
    pub(crate) fn new(threads: usize) -> std::io::Result<LookupPool> {
        let inner = Arc::new(Inner {
            q: Mutex::new(Queues::default()),
            cv: Condvar::new(),
        });
        let threads = threads.max(1);
        for i in 0..threads {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name(format!("umbp-lookup-{i}"))
                .spawn(move || work(&inner))?;
        }
        Ok(LookupPool { inner, threads })
    }

    /// Runs `f` on a lookup thread in client `client`'s turn and returns what it returned.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        client: u64,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Status> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut q = self.inner.q.lock();
            if q.closed {
                return Err(status(ErrorKind::Unavailable, "the server is stopping"));
            }
            let mine = q.by_client.entry(client).or_default();
            if mine.len() >= MAX_QUEUED_PER_CLIENT {
                return Err(status(
                    ErrorKind::Resource,
                    format!(
                        "this connection has {MAX_QUEUED_PER_CLIENT} lookups waiting already, the \
                         most one may have; wait for their answers before asking more"
                    ),
                ));
            }
            let first = mine.is_empty();
            mine.push_back(Box::new(move || {
                let _ = tx.send(f());
            }));
            if first {
                q.turn.push_back(client);
            }
        }
        self.inner.cv.notify_one();
        rx.await
            .map_err(|_| status(ErrorKind::Internal, "the lookup was dropped"))
    }

    /// Lets the threads end once the queued lookups are done.
    pub(crate) fn close(&self) {
        self.inner.q.lock().closed = true;
        self.inner.cv.notify_all();
    }
}

impl Drop for LookupPool {
    fn drop(&mut self) {
        self.close();
    }
}

/// A lookup thread: the next client in turn, one lookup of it, and that client to the back
/// of the line when it has more.
fn work(inner: &Inner) {
    // SAFETY: setpriority on this thread's own id (gettid) changes only its priority; raising
    // the nice value needs no privilege.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICE);
    }
    loop {
        let job = {
            let mut q = inner.q.lock();
            loop {
                if let Some(c) = q.turn.pop_front() {
                    let mine = q
                        .by_client
                        .get_mut(&c)
                        .expect("a client in turn has a queue");
                    let job = mine.pop_front().expect("a client in turn has work");
                    if mine.is_empty() {
                        q.by_client.remove(&c);
                    } else {
                        q.turn.push_back(c);
                    }
                    break job;
                }
                if q.closed {
                    return;
                }
                inner.cv.wait(&mut q);
            }
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_are_served_in_turn_and_a_full_queue_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pool = Arc::new(LookupPool::new(1).unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        // Holds the one thread until every lookup is queued.
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        rt.block_on(async {
            let (p, g) = (Arc::clone(&pool), Arc::clone(&gate));
            let held = tokio::spawn(async move {
                p.run(0, move || {
                    let mut open = g.0.lock();
                    while !*open {
                        g.1.wait(&mut open);
                    }
                })
                .await
            });
            tokio::task::yield_now().await;
            let mut waits = Vec::new();
            // Client 1 asks five times, then client 2 once: client 2 is served second.
            for (client, n) in [(1u64, 5), (2, 1)] {
                for i in 0..n {
                    let (p, o) = (Arc::clone(&pool), Arc::clone(&order));
                    waits.push(tokio::spawn(async move {
                        p.run(client, move || o.lock().push((client, i))).await
                    }));
                }
            }
            for _ in 0..MAX_QUEUED_PER_CLIENT {
                let p = Arc::clone(&pool);
                waits.push(tokio::spawn(async move { p.run(3, || ()).await }));
            }
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            let e = pool.run(3, || ()).await.unwrap_err();
            assert!(
                e.message().contains("64 lookups waiting"),
                "{}",
                e.message()
            );
            *gate.0.lock() = true;
            gate.1.notify_all();
            held.await.unwrap().unwrap();
            for w in waits {
                w.await.unwrap().unwrap();
            }
        });
        let got = order.lock().clone();
        assert_eq!(got[0], (1, 0));
        assert_eq!(
            got[1],
            (2, 0),
            "client 2 waits behind one of client 1's, not five"
        );
        assert_eq!(got.len(), 6);
    }
}
