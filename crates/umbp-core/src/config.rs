//! Pool configuration and its validation.
//!
//! Option names in errors are the connector's (`capacity_bytes`, `dram_high_watermark`, ...),
//! which the standalone server's environment variables map onto one to one.

use crate::caching::{EvictionPolicy, StoreAdmission, DEFAULT_ADMISSION_WINDOW};
use crate::integrity::Integrity;
use crate::{options, CoreError};

pub use crate::sizes::{HugepageSize, GIB, MIB};

/// How the pool's memory is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryBacking {
    /// Private anonymous memory (the embedded default).
    #[default]
    Anonymous,
    /// A memfd, shareable with other processes by passing its descriptor (the standalone server).
    Memfd,
}

/// Everything that shapes one host-DRAM pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Pool size in bytes.
    pub capacity_bytes: u64,
    /// Occupancy (fraction of capacity) above which background eviction starts.
    pub high_watermark: f64,
    /// Occupancy background eviction brings the pool down to.
    pub low_watermark: f64,
    /// Ask for huge pages (falls back to normal pages with a warning when the kernel has none).
    pub use_hugepages: bool,
    /// Which huge page size to ask for.
    pub hugepage_size: HugepageSize,
    /// Bind the pool's memory to this NUMA node.
    pub numa_node: Option<u32>,
    /// Touch every page up front so copies never take page faults.
    pub prefault: bool,
    /// Threads used to prefault (0: as many as the machine has, at most 8).
    pub prefault_threads: usize,
    /// Anonymous or memfd-backed memory.
    pub backing: MemoryBacking,
    /// Size of the allocator's segments (0: derived from the capacity).
    pub segment_bytes: u64,
    /// Which objects eviction takes first.
    pub eviction_policy: EvictionPolicy,
    /// Which committed objects are kept at all.
    pub store_admission: StoreAdmission,
    /// How many distinct keys `on_reuse` remembers as seen once (oldest forgotten first): a
    /// key reused after more other keys than this were seen is skipped again. Not a connector
    /// option; [`DEFAULT_ADMISSION_WINDOW`] unless a benchmark sets it.
    pub admission_window: usize,
    /// How long, in milliseconds, a hit a lookup reports is kept from eviction for the load
    /// that follows (released by that load; counted in `leases_expired` when it runs out
    /// first). 0: lookups take no leases. [`DEFAULT_LOOKUP_LEASE_MS`] unless set.
    pub lookup_lease_ms: u64,
    /// Whether objects are checksummed and how many loads verify them.
    pub integrity: Integrity,
    /// Bytes of objects one key namespace may keep from eviction (`Pool::keep`, the pins of
    /// agents' KV); 0: a quarter of the pool. Every namespace together may keep at most half.
    pub keep_namespace_bytes: u64,
}

/// How long a lookup's hits are kept for their load by default: 5 s.
pub const DEFAULT_LOOKUP_LEASE_MS: u64 = 5000;

impl Default for PoolConfig {
    /// The connector options' defaults ([`crate::options`]), so the store and the connector
    /// never disagree.
    fn default() -> Self {
        PoolConfig {
            capacity_bytes: options::CAPACITY_BYTES.default_u64(),
            high_watermark: options::DRAM_HIGH_WATERMARK.default_f64(),
            low_watermark: options::DRAM_LOW_WATERMARK.default_f64(),
            use_hugepages: options::DRAM_USE_HUGEPAGES.default_bool(),
            hugepage_size: options::DRAM_HUGEPAGE_SIZE
                .default_str()
                .parse()
                .expect("the schema's huge page size parses"),
            numa_node: None,
            prefault: options::DRAM_PREFAULT.default_bool(),
            prefault_threads: 0,
            backing: MemoryBacking::Anonymous,
            segment_bytes: 0,
            eviction_policy: options::EVICTION_POLICY
                .default_str()
                .parse()
                .expect("the schema's eviction policy parses"),
            store_admission: options::STORE_ADMISSION
                .default_str()
                .parse()
                .expect("the schema's store admission parses"),
            admission_window: DEFAULT_ADMISSION_WINDOW,
            lookup_lease_ms: DEFAULT_LOOKUP_LEASE_MS,
            integrity: Integrity::default(),
            keep_namespace_bytes: 0,
        }
    }
}

impl PoolConfig {
    /// Bytes one namespace may keep in a pool of `capacity` usable bytes
    /// ([`PoolConfig::keep_namespace_bytes`], 0 resolved to a quarter of it).
    pub fn keep_namespace_bytes(&self, capacity: u64) -> u64 {
        match self.keep_namespace_bytes {
            0 => capacity / 4,
            b => b,
        }
    }

    /// A default configuration of `capacity_bytes`.
    pub fn with_capacity(capacity_bytes: u64) -> Self {
        PoolConfig {
            capacity_bytes,
            ..PoolConfig::default()
        }
    }

    /// Checks every option that can be checked without asking the system, with the ranges
    /// and messages of the connector's options ([`crate::options`]).
    pub fn validate(&self) -> Result<(), CoreError> {
        options::CAPACITY_BYTES.check_u64(self.capacity_bytes)?;
        options::DRAM_HIGH_WATERMARK.check_f64(self.high_watermark)?;
        options::DRAM_LOW_WATERMARK.check_f64(self.low_watermark)?;
        options::check_watermarks(self.high_watermark, self.low_watermark)?;
        if self.segment_bytes != 0
            && (!self.segment_bytes.is_power_of_two() || self.segment_bytes < 64 * 1024)
        {
            return Err(CoreError::option(
                "segment_bytes",
                format!(
                    "{} must be a power of two of at least 65536, or 0 to derive it",
                    self.segment_bytes
                ),
            ));
        }
        Ok(())
    }

    /// The segment size in use: the configured one, or 1/64 of the capacity clamped to
    /// 1 MiB..=64 MiB and rounded down to a power of two.
    pub fn effective_segment_bytes(&self) -> u64 {
        if self.segment_bytes != 0 {
            return self.segment_bytes;
        }
        let target = (self.capacity_bytes / 64).clamp(MIB, 64 * MIB);
        1u64 << (63 - target.leading_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        PoolConfig::default().validate().unwrap();
    }

    #[test]
    fn the_caching_types_default_to_the_schema() {
        let d = PoolConfig::default();
        assert_eq!(d.eviction_policy, EvictionPolicy::default());
        assert_eq!(d.store_admission, StoreAdmission::default());
        assert_eq!(d.admission_window, DEFAULT_ADMISSION_WINDOW);
    }

    #[test]
    fn errors_name_the_option() {
        let e = PoolConfig::with_capacity(0).validate().unwrap_err();
        assert!(e.to_string().contains("capacity_bytes"), "{e}");
        let c = PoolConfig {
            low_watermark: 0.9,
            high_watermark: 0.9,
            ..PoolConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("dram_low_watermark") && e.contains("below"),
            "{e}"
        );
        let c = PoolConfig {
            high_watermark: 1.5,
            ..PoolConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("dram_high_watermark"));
        let e = "4M".parse::<HugepageSize>().unwrap_err().to_string();
        assert!(
            e.contains("dram_hugepage_size") && e.contains("2MiB"),
            "{e}"
        );
    }

    #[test]
    fn hugepage_sizes_parse() {
        assert_eq!(
            "2MiB".parse::<HugepageSize>().unwrap(),
            HugepageSize::Size2MiB
        );
        assert_eq!(
            "1g".parse::<HugepageSize>().unwrap(),
            HugepageSize::Size1GiB
        );
        assert_eq!(
            "2097152".parse::<HugepageSize>().unwrap(),
            HugepageSize::Size2MiB
        );
    }

    #[test]
    fn segment_size_is_derived() {
        assert_eq!(
            PoolConfig::with_capacity(64 * GIB).effective_segment_bytes(),
            64 * MIB
        );
        assert_eq!(
            PoolConfig::with_capacity(16 * MIB).effective_segment_bytes(),
            MIB
        );
        assert_eq!(
            PoolConfig::with_capacity(3 * GIB).effective_segment_bytes(),
            32 * MIB
        );
    }
}
