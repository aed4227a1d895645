//! How a pool chooses what it keeps: the eviction policy and the store admission, set by the
//! `eviction_policy` and `store_admission` options ([`crate::options`]) and carried in
//! [`crate::PoolConfig`]. umbp-pool implements them.

use std::fmt;
use std::str::FromStr;

use crate::CoreError;

/// Which objects eviction takes first (umbp-pool's `policy` module).
///
/// The default is S3-FIFO: on `umbp bench cache`'s mixed prefix workload (Zipf shared
/// prefixes, unique suffixes, a one-off burst twice the pool) it found 5-7 points more of
/// the tokens asked for than LRU at every capacity tried (docs/benchmarks.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Exact least-recently-used over the whole pool.
    Lru,
    /// S3-FIFO: a small probation FIFO, a main FIFO with use counts and a ghost set; a burst
    /// of one-off objects leaves through the small queue without displacing reused ones.
    #[default]
    S3Fifo,
}

impl EvictionPolicy {
    /// Every policy, in the order benchmarks print them.
    pub const ALL: [EvictionPolicy; 2] = [EvictionPolicy::Lru, EvictionPolicy::S3Fifo];

    /// The option's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::S3Fifo => "s3fifo",
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EvictionPolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "lru" => Ok(EvictionPolicy::Lru),
            "s3fifo" => Ok(EvictionPolicy::S3Fifo),
            _ => Err(CoreError::option(
                "eviction_policy",
                format!("unknown policy {s:?}; choose lru or s3fifo"),
            )),
        }
    }
}

/// Which committed objects the pool keeps. The default stores every commit: with S3-FIFO,
/// `on_reuse` wrote 44-63% fewer bytes but found 0.3-2.2 points fewer tokens on `umbp bench
/// cache`'s mixed workload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum StoreAdmission {
    /// Every commit is stored.
    #[default]
    All,
    /// A key is stored the second time it is seen within the admission window: a commit, a
    /// read that missed or the first missing key of a prefix lookup counts as seen; the first
    /// commit of a key not seen before is skipped (umbp-pool's `CommitOutcome::Skipped`).
    OnReuse,
}

impl StoreAdmission {
    /// Every setting, in the order benchmarks print them.
    pub const ALL: [StoreAdmission; 2] = [StoreAdmission::All, StoreAdmission::OnReuse];

    /// The option's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreAdmission::All => "all",
            StoreAdmission::OnReuse => "on_reuse",
        }
    }
}

impl fmt::Display for StoreAdmission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for StoreAdmission {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "all" => Ok(StoreAdmission::All),
            "on_reuse" => Ok(StoreAdmission::OnReuse),
            _ => Err(CoreError::option(
                "store_admission",
                format!("unknown admission {s:?}; choose all or on_reuse"),
            )),
        }
    }
}

/// How one store meets the pool's [`StoreAdmission`]. vLLM's connector asks for
/// [`Admit::Now`] for requests marked to be stored at once (a priority at or below
/// `store_priority_admit_at_most`, or `kv_transfer_params: {"umbp_store": "now"}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Admit {
    /// As the pool's store admission says (`on_reuse`: not on a key's first sighting).
    #[default]
    Policy,
    /// Stored on the key's first sighting whatever the admission says; the sighting is
    /// remembered as any other (counted in umbp-pool's `admissions_forced` when the
    /// admission would have refused it).
    Now,
}

/// Keys the `on_reuse` admission remembers by default (about 32 bytes each).
pub const DEFAULT_ADMISSION_WINDOW: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.as_str().parse::<EvictionPolicy>().unwrap(), p);
        }
        for a in StoreAdmission::ALL {
            assert_eq!(a.as_str().parse::<StoreAdmission>().unwrap(), a);
        }
        assert_eq!(
            "S3-FIFO".parse::<EvictionPolicy>().unwrap(),
            EvictionPolicy::S3Fifo
        );
        let e = "arc".parse::<EvictionPolicy>().unwrap_err().to_string();
        assert!(
            e.contains("eviction_policy") && e.contains("lru or s3fifo"),
            "{e}"
        );
        assert!("sometimes".parse::<StoreAdmission>().is_err());
    }
}
