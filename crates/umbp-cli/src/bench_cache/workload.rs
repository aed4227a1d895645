//! The synthetic prefix workload of `umbp bench cache`: a population of shared prefixes with
//! Zipf popularity, each request one prefix plus a unique suffix, and a burst of unique
//! one-off prompts in the middle of the trace.

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
/// request has, or a one-off prompt (`prefix` is `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub phase: Phase,
    pub prefix: Option<u32>,
    pub unique: u32,
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
    pub seed: u64,
}

impl Workload {
    /// The trace: warm, burst, recovery, after.
    pub fn trace(&self) -> Vec<Request> {
        let mut rng = Rng::new(self.seed);
        let zipf = Zipf::new(self.prefixes, self.zipf);
        let shared = |phase, rng: &mut Rng| Request {
            phase,
            prefix: Some(zipf.sample(rng) as u32),
            unique: self.suffix_blocks,
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
    }
}
