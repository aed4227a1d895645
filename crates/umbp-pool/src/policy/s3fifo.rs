//! S3-FIFO (Yang et al., SOSP '23): new entries go to a small probation FIFO; an entry used
//! while there moves to the main FIFO when it reaches the small queue's head, an unused one
//! is evicted and its fingerprint kept in a ghost set. An insert found in the ghost set goes
//! straight to main. Main is a FIFO with a use count of 0..=3: at main's head a used entry
//! goes back to the tail with its count lowered, an unused one is evicted. A read only bumps
//! the count, so a one-off burst passes through the small queue without displacing main.
//!
//! Per shard: the queues, the counts and a ghost set as large as the shard's main queue. The
//! pool sums the queues' bytes over the shards to choose which queue to evict from ([`plan`]:
//! small while it holds more than [`SMALL_PERCENT`] % of the bytes) and merges the shards'
//! candidates by the tick each entered its queue, so each queue is FIFO across the whole pool;
//! what is not exact is that a shard moves used entries out of the head of its queues while
//! collecting candidates, up to a batch ahead of the pool-wide order.

use super::api::{slot_for, Place, PolicyCounters, ShardPolicy, QUEUES};
use super::list::{Link, List, NIL};
use crate::window::FpWindow;

pub(crate) const SMALL: usize = 0;
pub(crate) const MAIN: usize = 1;
/// The small queue's share of the bytes.
pub(crate) const SMALL_PERCENT: u64 = 10;
const MAX_FREQ: u8 = 3;
/// The smallest ghost set a shard keeps.
const MIN_GHOST: usize = 64;

#[derive(Debug, Clone, Copy, Default)]
struct Node {
    link: Link,
    /// The tick this entry entered its queue.
    rank: u64,
    len: u64,
    queue: u8,
    freq: u8,
}

impl AsMut<Link> for Node {
    fn as_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

#[derive(Debug)]
pub(crate) struct S3Fifo {
    nodes: Vec<Node>,
    queues: [List; QUEUES],
    bytes: [u64; QUEUES],
    ghost: FpWindow,
    counters: PolicyCounters,
}

impl Default for S3Fifo {
    fn default() -> Self {
        S3Fifo {
            nodes: Vec::new(),
            queues: [List::default(); QUEUES],
            bytes: [0; QUEUES],
            ghost: FpWindow::new(MIN_GHOST),
            counters: PolicyCounters::default(),
        }
    }
}

/// Which queue to evict from: small while it holds more than its share (or main is empty),
/// giving up its excess or an eighth of it, whichever is more, before the plan is made again;
/// otherwise main. (Giving up only the excess, often one object, would cost a whole round of
/// candidates per object when the background evictor frees many: small may end a round up
/// to an eighth below its share instead.)
pub(crate) fn plan(bytes: &[u64; QUEUES]) -> [(usize, u64); QUEUES] {
    let total = bytes[SMALL] + bytes[MAIN];
    let share = total * SMALL_PERCENT / 100;
    if bytes[SMALL] > share || bytes[MAIN] == 0 {
        let quota = (bytes[SMALL] - share).max(bytes[SMALL] / 8).max(1);
        [(SMALL, quota), (MAIN, u64::MAX)]
    } else {
        [(MAIN, u64::MAX), (SMALL, u64::MAX)]
    }
}

impl S3Fifo {
    fn push(&mut self, idx: u32, queue: usize, rank: u64) {
        let n = &mut self.nodes[idx as usize];
        n.queue = queue as u8;
        n.rank = rank;
        let len = n.len;
        self.queues[queue].push_tail(&mut self.nodes, idx);
        self.bytes[queue] += len;
    }

    fn unlink(&mut self, idx: u32) -> usize {
        let n = self.nodes[idx as usize];
        let q = n.queue as usize;
        self.queues[q].unlink(&mut self.nodes, idx);
        self.bytes[q] -= n.len;
        q
    }

    fn fit_ghost(&mut self) {
        self.ghost
            .set_capacity(self.queues[MAIN].len.max(MIN_GHOST));
    }
}

impl ShardPolicy for S3Fifo {
    fn insert(&mut self, idx: u32, fp: u64, len: u64, tick: u64) {
        *slot_for(&mut self.nodes, idx) = Node {
            len,
            ..Node::default()
        };
        let queue = if self.ghost.take(fp) {
            self.counters.ghost_hits += 1;
            MAIN
        } else {
            SMALL
        };
        self.push(idx, queue, tick);
        self.fit_ghost();
    }

    fn insert_at(&mut self, idx: u32, _fp: u64, len: u64, tick: u64, place: Place) {
        *slot_for(&mut self.nodes, idx) = Node {
            len,
            freq: place.freq.min(MAX_FREQ),
            ..Node::default()
        };
        self.push(idx, usize::from(place.queue).min(MAIN), tick);
        self.fit_ghost();
    }

    fn place(&self, idx: u32) -> Place {
        let n = &self.nodes[idx as usize];
        Place {
            queue: n.queue,
            freq: n.freq,
            rank: n.rank,
        }
    }

    fn access(&mut self, idx: u32, _tick: u64) {
        let n = &mut self.nodes[idx as usize];
        n.freq = (n.freq + 1).min(MAX_FREQ);
    }

    fn remove(&mut self, idx: u32, fp: u64, _len: u64, evicted: bool) {
        let q = self.unlink(idx);
        if evicted {
            self.counters.evicted[q] += 1;
            if q == SMALL {
                self.ghost.insert(fp);
            }
        }
        self.fit_ghost();
    }

    fn queue_bytes(&self, out: &mut [u64; QUEUES]) {
        out[SMALL] += self.bytes[SMALL];
        out[MAIN] += self.bytes[MAIN];
    }

    fn candidates(
        &mut self,
        queue: usize,
        limit: usize,
        now: u64,
        pinned: &dyn Fn(u32) -> bool,
        out: &mut Vec<(u64, u32)>,
    ) {
        // Main's used entries go back to its tail, where the walk may meet them again (at
        // most MAX_FREQ times each): bound the walk.
        let mut steps = self.queues[queue].len * (usize::from(MAX_FREQ) + 1) + 1;
        let start = out.len();
        let mut i = self.queues[queue].head;
        while i != NIL && out.len() - start < limit && steps > 0 {
            steps -= 1;
            let n = self.nodes[i as usize];
            let next = n.link.next;
            if pinned(i) {
                i = next;
                continue;
            }
            if n.freq > 0 {
                self.unlink(i);
                if queue == SMALL {
                    self.nodes[i as usize].freq = 0;
                } else {
                    self.nodes[i as usize].freq -= 1;
                }
                self.push(i, MAIN, now);
                self.counters.promotions += 1;
                // Main's tail going back to the tail is met again at once (its next is the
                // entries re-queued behind it, or itself); one moved out of small is left for
                // main's own walk.
                if queue == MAIN && next == NIL {
                    i = self.queues[MAIN].tail;
                    continue;
                }
            } else {
                out.push((n.rank, i));
            }
            i = next;
        }
        self.fit_ghost();
    }

    fn still_candidate(&self, idx: u32, queue: usize, rank: u64) -> bool {
        self.nodes
            .get(idx as usize)
            .is_some_and(|n| n.rank == rank && n.freq == 0 && n.queue as usize == queue)
    }

    fn order(&self, out: &mut Vec<(u64, u32)>) {
        for q in [SMALL, MAIN] {
            let mut i = self.queues[q].head;
            while i != NIL {
                let n = &self.nodes[i as usize];
                out.push((n.rank, i));
                i = n.link.next;
            }
        }
    }

    fn counters(&self) -> PolicyCounters {
        self.counters
    }

    fn metadata_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>() + self.ghost.metadata_bytes()
    }
}

#[cfg(test)]
mod tests;
