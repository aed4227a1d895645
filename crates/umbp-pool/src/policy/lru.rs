//! Exact least-recently-used: one list per shard, oldest first; a use moves the entry to the
//! tail and stamps it with the pool's tick, so merging the shards' heads by tick is the
//! pool-wide LRU order.

use super::api::{slot_for, Place, PolicyCounters, ShardPolicy, QUEUES};
use super::list::{Link, List, NIL};

/// LRU's only queue.
pub(crate) const QUEUE: usize = 1;

#[derive(Debug, Clone, Copy, Default)]
struct Node {
    link: Link,
    tick: u64,
    len: u64,
}

impl AsMut<Link> for Node {
    fn as_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

#[derive(Debug, Default)]
pub(crate) struct Lru {
    nodes: Vec<Node>,
    list: List,
    bytes: u64,
    evicted: u64,
}

impl ShardPolicy for Lru {
    fn insert(&mut self, idx: u32, _fp: u64, len: u64, tick: u64) {
        *slot_for(&mut self.nodes, idx) = Node {
            link: Link::default(),
            tick,
            len,
        };
        self.list.push_tail(&mut self.nodes, idx);
        self.bytes += len;
    }

    fn insert_at(&mut self, idx: u32, fp: u64, len: u64, tick: u64, _place: Place) {
        // One queue, ordered by use: the taker inserts in the giver's order.
        self.insert(idx, fp, len, tick);
    }

    fn place(&self, idx: u32) -> Place {
        Place {
            queue: QUEUE as u8,
            freq: 0,
            rank: self.nodes[idx as usize].tick,
        }
    }

    fn access(&mut self, idx: u32, tick: u64) {
        self.list.unlink(&mut self.nodes, idx);
        self.nodes[idx as usize].tick = tick;
        self.list.push_tail(&mut self.nodes, idx);
    }

    fn remove(&mut self, idx: u32, _fp: u64, _len: u64, evicted: bool) {
        self.list.unlink(&mut self.nodes, idx);
        self.bytes -= self.nodes[idx as usize].len;
        self.evicted += u64::from(evicted);
    }

    fn queue_bytes(&self, out: &mut [u64; QUEUES]) {
        out[QUEUE] += self.bytes;
    }

    fn candidates(
        &mut self,
        _queue: usize,
        limit: usize,
        _now: u64,
        pinned: &dyn Fn(u32) -> bool,
        out: &mut Vec<(u64, u32)>,
    ) {
        let mut i = self.list.head;
        let mut n = 0;
        while i != NIL && n < limit {
            let node = &self.nodes[i as usize];
            if !pinned(i) {
                out.push((node.tick, i));
                n += 1;
            }
            i = node.link.next;
        }
    }

    fn still_candidate(&self, idx: u32, _queue: usize, rank: u64) -> bool {
        self.nodes.get(idx as usize).is_some_and(|n| n.tick == rank)
    }

    fn order(&self, out: &mut Vec<(u64, u32)>) {
        let mut i = self.list.head;
        while i != NIL {
            let node = &self.nodes[i as usize];
            out.push((node.tick, i));
            i = node.link.next;
        }
    }

    fn counters(&self) -> PolicyCounters {
        let mut c = PolicyCounters::default();
        c.evicted[QUEUE] = self.evicted;
        c
    }

    fn metadata_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_least_recently_used_first_skipping_pinned() {
        let mut p = Lru::default();
        for i in 0..4 {
            p.insert(i, u64::from(i), 10, u64::from(i) + 1);
        }
        p.access(0, 9);
        let mut out = Vec::new();
        p.candidates(QUEUE, 3, 10, &|i| i == 1, &mut out);
        assert_eq!(out, vec![(3, 2), (4, 3), (9, 0)]);
        assert!(p.still_candidate(2, QUEUE, 3));
        p.access(2, 11);
        assert!(!p.still_candidate(2, QUEUE, 3));
        p.remove(3, 3, 10, true);
        let mut b = [0; QUEUES];
        p.queue_bytes(&mut b);
        assert_eq!(b[QUEUE], 30);
        assert_eq!(p.counters().evicted[QUEUE], 1);
    }
}
