//! S3-FIFO against a plain reference model: same victims, same queue order, same ghost hits.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

/// The reference: two deques of ids with use counts and a ghost deque of fingerprints, all
/// objects one byte.
#[derive(Default)]
struct Model {
    small: VecDeque<u32>,
    main: VecDeque<u32>,
    freq: Vec<u8>,
    ghost: VecDeque<u64>,
    ghost_hits: u64,
}

fn fp(k: u32) -> u64 {
    u64::from(k) * 0x9E37_79B9 + 1
}

impl Model {
    fn present(&self, k: u32) -> bool {
        self.small.contains(&k) || self.main.contains(&k)
    }
    fn trim_ghost(&mut self) {
        let cap = self.main.len().max(MIN_GHOST);
        while self.ghost.len() > cap {
            self.ghost.pop_front();
        }
    }
    fn insert(&mut self, k: u32) {
        self.freq[k as usize] = 0;
        if let Some(at) = self.ghost.iter().position(|&g| g == fp(k)) {
            self.ghost.remove(at);
            self.ghost_hits += 1;
            self.main.push_back(k);
        } else {
            self.small.push_back(k);
        }
        self.trim_ghost();
    }
    fn remove(&mut self, k: u32) {
        self.small.retain(|&x| x != k);
        self.main.retain(|&x| x != k);
        self.trim_ghost();
    }
    fn evict(&mut self) -> Option<u32> {
        let total = (self.small.len() + self.main.len()) as u64;
        let from_small =
            self.small.len() as u64 > total * SMALL_PERCENT / 100 || self.main.is_empty();
        let order = if from_small {
            [true, false]
        } else {
            [false, true]
        };
        for small in order {
            let q = if small {
                &mut self.small
            } else {
                &mut self.main
            };
            let mut steps = q.len() * 4 + 1;
            while steps > 0 {
                steps -= 1;
                let Some(h) = (if small {
                    &mut self.small
                } else {
                    &mut self.main
                })
                .pop_front() else {
                    break;
                };
                let f = &mut self.freq[h as usize];
                if *f > 0 {
                    if small {
                        *f = 0;
                    } else {
                        *f -= 1;
                    }
                    self.main.push_back(h);
                    continue;
                }
                if small {
                    self.ghost.retain(|&g| g != fp(h));
                    self.ghost.push_back(fp(h));
                }
                self.trim_ghost();
                return Some(h);
            }
        }
        None
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u32),
    Access(u32),
    Remove(u32),
    Evict,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        5 => (0u32..64).prop_map(Op::Insert),
        4 => (0u32..64).prop_map(Op::Access),
        1 => (0u32..64).prop_map(Op::Remove),
        3 => Just(Op::Evict),
    ];
    proptest::collection::vec(op, 1..400)
}

/// One eviction the way the pool does it: plan, then the first queue with a candidate.
fn evict_one(p: &mut S3Fifo, now: u64) -> Option<u32> {
    let mut bytes = [0; QUEUES];
    p.queue_bytes(&mut bytes);
    for (q, quota) in plan(&bytes) {
        if quota == 0 {
            continue;
        }
        let mut out = Vec::new();
        p.candidates(q, 1, now, &|_| false, &mut out);
        if let Some(&(rank, idx)) = out.first() {
            assert!(p.still_candidate(idx, q, rank));
            p.remove(idx, fp(idx), 1, true);
            return Some(idx);
        }
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn s3fifo_matches_the_model(ops in ops()) {
        let mut p = S3Fifo::default();
        let mut m = Model { freq: vec![0; 64], ..Model::default() };
        for (tick, op) in ops.into_iter().enumerate() {
            let tick = tick as u64 + 1;
            match op {
                Op::Insert(k) if !m.present(k) => {
                    p.insert(k, fp(k), 1, tick);
                    m.insert(k);
                }
                Op::Access(k) if m.present(k) => {
                    p.access(k, tick);
                    let f = &mut m.freq[k as usize];
                    *f = (*f + 1).min(MAX_FREQ);
                }
                Op::Remove(k) if m.present(k) => {
                    p.remove(k, fp(k), 1, false);
                    m.remove(k);
                }
                Op::Evict => prop_assert_eq!(evict_one(&mut p, tick), m.evict()),
                _ => {}
            }
            let mut order = Vec::new();
            p.order(&mut order);
            let ids: Vec<u32> = order.iter().map(|&(_, i)| i).collect();
            let want: Vec<u32> = m.small.iter().chain(m.main.iter()).copied().collect();
            prop_assert_eq!(ids, want);
            prop_assert_eq!(p.counters().ghost_hits, m.ghost_hits);
            let mut bytes = [0; QUEUES];
            p.queue_bytes(&mut bytes);
            prop_assert_eq!(bytes, [m.small.len() as u64, m.main.len() as u64]);
        }
    }
}

#[test]
fn a_one_off_scan_does_not_displace_used_entries() {
    let mut p = S3Fifo::default();
    let mut tick = 0;
    let mut next = || {
        tick += 1;
        tick
    };
    // Ten entries used twice: they reach main.
    for k in 0..10 {
        p.insert(k, fp(k), 1, next());
        p.access(k, next());
    }
    for _ in 0..2 {
        let mut out = Vec::new();
        p.candidates(SMALL, 10, next(), &|_| false, &mut out);
    }
    // A scan of 100 one-off entries through a cache of 20.
    for k in 10..110 {
        p.insert(k, fp(k), 1, next());
        while p.queues[SMALL].len + p.queues[MAIN].len > 20 {
            let now = next();
            let v = evict_one(&mut p, now).expect("a victim");
            assert!(v >= 10, "evicted used entry {v}");
        }
    }
}
