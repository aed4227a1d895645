//! End-to-end integrity: whether the pool keeps a checksum of every object and how many
//! loads verify it, set by the `integrity` and `integrity_sample_every` options
//! ([`crate::options`]) and carried in [`crate::PoolConfig`]. umbp-pool keeps the sums;
//! the writers compute them where the bytes already pass a CPU.

use std::fmt;

use crate::{options, CoreError};

/// What the pool does about object checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Integrity {
    /// No checksums: nothing is computed or verified.
    Off,
    /// Every stored object is checksummed; one load in `every` verifies its object before
    /// copying it out.
    Sample {
        /// One load in this many is verified (1: every load).
        every: u32,
    },
    /// Every stored object is checksummed and every load verifies it.
    All,
}

impl Default for Integrity {
    /// The connector options' default ([`options::INTEGRITY`]).
    fn default() -> Self {
        Integrity::from_options(
            options::INTEGRITY.default_str(),
            options::INTEGRITY_SAMPLE_EVERY.default_u64(),
        )
        .expect("the schema's integrity default parses")
    }
}

impl Integrity {
    /// The setting the options `integrity` (`off`, `sample`, `all`) and
    /// `integrity_sample_every` (used by `sample` only) name.
    pub fn from_options(mode: &str, sample_every: u64) -> Result<Integrity, CoreError> {
        options::INTEGRITY_SAMPLE_EVERY.check_u64(sample_every)?;
        match mode.to_ascii_lowercase().as_str() {
            "off" => Ok(Integrity::Off),
            "sample" => Ok(Integrity::Sample {
                every: sample_every as u32,
            }),
            "all" => Ok(Integrity::All),
            _ => Err(CoreError::option(
                "integrity",
                format!("unknown setting {mode:?}; choose off, sample or all"),
            )),
        }
    }

    /// Whether stored objects get a checksum.
    pub fn sums(self) -> bool {
        self != Integrity::Off
    }

    /// The option's spelling (`off`, `sample`, `all`).
    pub fn as_str(self) -> &'static str {
        match self {
            Integrity::Off => "off",
            Integrity::Sample { .. } => "sample",
            Integrity::All => "all",
        }
    }

    /// One load in how many is verified (0: none).
    pub fn verify_every(self) -> u32 {
        match self {
            Integrity::Off => 0,
            Integrity::Sample { every } => every,
            Integrity::All => 1,
        }
    }
}

impl fmt::Display for Integrity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Integrity::Sample { every } => write!(f, "sample (1 in {every})"),
            other => f.write_str(other.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_name_the_option() {
        assert_eq!(Integrity::from_options("off", 16).unwrap(), Integrity::Off);
        assert_eq!(Integrity::from_options("ALL", 16).unwrap(), Integrity::All);
        assert_eq!(
            Integrity::from_options("sample", 8).unwrap(),
            Integrity::Sample { every: 8 }
        );
        let e = Integrity::from_options("some", 8).unwrap_err().to_string();
        assert!(e.contains("integrity") && e.contains("sample"), "{e}");
        let e = Integrity::from_options("sample", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("integrity_sample_every"), "{e}");
        assert_eq!(Integrity::All.verify_every(), 1);
        assert_eq!(Integrity::Off.verify_every(), 0);
        assert!(!Integrity::Off.sums() && Integrity::Sample { every: 4 }.sums());
    }
}
