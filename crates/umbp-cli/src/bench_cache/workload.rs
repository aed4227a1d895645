//! The synthetic prefix workload of `umbp bench cache`: a population of shared prefixes with
//! Zipf popularity, each request one prefix plus a unique suffix, optionally multi-turn
//! conversations (each turn the whole conversation so far plus its new blocks), and a burst
//! of unique one-off prompts in the middle of the trace.

/// A seeded generator (splitmix64): the same seed gives the same trace on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(`s`) over `n` ranks: rank `i` (0-based) is drawn with weight `1 / (i + 1)^s`.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n)
            .map(|i| {
                acc += 1.0 / ((i + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

/// Which phase of the trace a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Shared-prefix requests before the burst.
    Warm,
    /// The burst: one-off prompts, with shared-prefix requests between them.
    Burst,
    /// The first shared-prefix requests after the burst, while the pool recovers from it.
    Recovery,
    /// Shared-prefix requests after the recovery.
    After,
}

/// One request: `prefix` (a shared prefix's index) followed by `unique` blocks no other
/// request has, a conversation's turn (`turn`: its earlier turns' blocks, then `unique` new
/// ones), or a one-off prompt (neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub phase: Phase,
    pub prefix: Option<u32>,
    pub turn: Option<Turn>,
    pub unique: u32,
}

/// A turn of conversation `conversation`, after `context` blocks of its earlier turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    pub conversation: u32,
    pub context: u32,
}

/// The conversations going on at once: a turn goes to one of them, drawn uniformly, and a
/// conversation that had its last turn is replaced by a new one.
#[derive(Debug, Clone)]
struct Conversations {
    /// (id, turns so far) of each conversation going on.
    live: Vec<(u32, u32)>,
    next_id: u32,
    turns: u32,
    turn_blocks: u32,
}

impl Conversations {
    fn new(n: usize, turns: u32, turn_blocks: u32) -> Self {
        Conversations {
            live: (0..n as u32).map(|id| (id, 0)).collect(),
            next_id: n as u32,
            turns,
            turn_blocks,
        }
    }

    fn next(&mut self, rng: &mut Rng) -> Turn {
        let i = (rng.next_u64() % self.live.len() as u64) as usize;
        let (id, done) = self.live[i];
        let t = Turn {
            conversation: id,
            context: done * self.turn_blocks,
        };
        self.live[i] = if done + 1 == self.turns {
            self.next_id += 1;
            (self.next_id - 1, 0)
        } else {
            (id, done + 1)
        };
        t
    }
}

/// The workload's parameters.
#[derive(Debug, Clone)]
pub struct Workload {
    pub prefixes: usize,
    pub zipf: f64,
    pub suffix_blocks: u32,
    pub oneoff_blocks: u32,
    /// Shared-prefix requests before the burst and after it (each).
    pub requests: usize,
    /// One-off prompts in the burst.
    pub oneoffs: usize,
    /// Share of the burst's requests that are one-off prompts.
    pub burst_share: f64,
    /// Shared-prefix requests after the burst that count as its recovery.
    pub recovery: usize,
    /// Share of the non-burst requests that are a conversation's turn instead of a shared
    /// prefix (0: none).
    pub chat_share: f64,
    /// Conversations going on at once, turns per conversation, new blocks per turn.
    pub conversations: usize,
    pub turns: u32,
    pub turn_blocks: u32,
    pub seed: u64,
}

impl Workload {
    /// The trace: warm, burst, recovery, after.
    pub fn trace(&self) -> Vec<Request> {
        let mut rng = Rng::new(self.seed);
        let zipf = Zipf::new(self.prefixes, self.zipf);
        let mut chats = Conversations::new(
            self.conversations.max(1),
            self.turns.max(1),
            self.turn_blocks,
        );
        let mut shared = |phase, rng: &mut Rng| {
            if self.chat_share > 0.0 && rng.unit() < self.chat_share {
                Request {
                    phase,
                    prefix: None,
                    turn: Some(chats.next(rng)),
                    unique: self.turn_blocks,
                }
            } else {
                Request {
                    phase,
                    prefix: Some(zipf.sample(rng) as u32),
                    turn: None,
                    unique: self.suffix_blocks,
                }
            }
        };
        let mut out = Vec::new();
        for _ in 0..self.requests {
            out.push(shared(Phase::Warm, &mut rng));
        }
        let mut left = self.oneoffs;
        while left > 0 {
            if rng.unit() < self.burst_share {
                out.push(Request {
                    phase: Phase::Burst,
                    prefix: None,
                    turn: None,
                    unique: self.oneoff_blocks,
                });
                left -= 1;
            } else {
                out.push(shared(Phase::Burst, &mut rng));
            }
        }
        for i in 0..self.requests {
            let phase = if i < self.recovery {
                Phase::Recovery
            } else {
                Phase::After
            };
            out.push(shared(phase, &mut rng));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_favours_low_ranks_and_covers_all() {
        let z = Zipf::new(100, 1.0);
        let mut rng = Rng::new(7);
        let mut counts = [0u32; 100];
        for _ in 0..100_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        assert!(counts[0] > counts[9] * 5, "{counts:?}");
        assert!(counts[0] > 15_000 && counts[0] < 24_000, "{}", counts[0]);
        assert!(counts.iter().filter(|&&c| c > 0).count() > 90);
    }

    #[test]
    fn traces_are_seeded_and_phased() {
        let w = Workload {
            prefixes: 10,
            zipf: 1.0,
            suffix_blocks: 2,
            oneoff_blocks: 8,
            requests: 50,
            oneoffs: 20,
            burst_share: 0.5,
            recovery: 10,
            chat_share: 0.0,
            conversations: 4,
            turns: 3,
            turn_blocks: 2,
            seed: 3,
        };
        let t = w.trace();
        assert_eq!(t, w.trace());
        let oneoffs = t.iter().filter(|r| r.prefix.is_none()).count();
        assert_eq!(oneoffs, 20);
        assert_eq!(t.iter().filter(|r| r.phase == Phase::Warm).count(), 50);
        assert_eq!(t.iter().filter(|r| r.phase == Phase::Recovery).count(), 10);
        assert_eq!(t.iter().filter(|r| r.phase == Phase::After).count(), 40);
        let first_burst = t.iter().position(|r| r.phase == Phase::Burst).unwrap();
        assert!(t[first_burst..].iter().all(|r| r.phase != Phase::Warm));
        assert!(t
            .iter()
            .all(|r| r.prefix.is_some() || r.phase == Phase::Burst));
        assert!(t.iter().all(|r| r.turn.is_none()));
    }

    #[test]
    fn conversations_grow_turn_by_turn_and_end() {
        let w = Workload {
            prefixes: 10,
            zipf: 1.0,
            suffix_blocks: 2,
            oneoff_blocks: 8,
            requests: 200,
            oneoffs: 0,
            burst_share: 0.5,
            recovery: 10,
            chat_share: 0.5,
            conversations: 4,
            turns: 3,
            turn_blocks: 2,
            seed: 9,
        };
        let t = w.trace();
        let turns: Vec<Turn> = t.iter().filter_map(|r| r.turn).collect();
        assert!(turns.len() > 150 && turns.len() < 250, "{}", turns.len());
        assert!(t.iter().all(|r| r.prefix.is_some() != r.turn.is_some()));
        // Each conversation's turns come with context 0, 2, 4 in that order, then it ends.
        let mut seen = std::collections::HashMap::<u32, Vec<u32>>::new();
        for x in &turns {
            seen.entry(x.conversation).or_default().push(x.context);
        }
        assert!(seen.len() > 4);
        for ctx in seen.values() {
            assert!(ctx.len() <= 3, "{ctx:?}");
            assert!(
                ctx.iter().enumerate().all(|(i, c)| *c == 2 * i as u32),
                "{ctx:?}"
            );
        }
    }
}
