//! The disk tier's settings.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::DiskError;
use crate::format::ALIGN;

/// Smallest capacity: a handful of the smallest segments.
pub const MIN_CAPACITY: u64 = 8 << 20;
/// Longest close budget (`close_write`), in seconds.
pub const MAX_CLOSE_WRITE_S: u64 = 3600;
/// The default segment size's bounds: capacity / 16, between these.
const SEGMENT_MIN: u64 = 16 << 20;
const SEGMENT_MAX: u64 = 256 << 20;

/// When objects go to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DiskWrite {
    /// When the pool evicts them (write-behind): the disk holds what outlived DRAM.
    #[default]
    OnEvict,
    /// When they are committed (still written behind, never waited for), and on eviction
    /// those the queue could not take: a crash loses only the last moments' objects.
    Eager,
}

impl DiskWrite {
    /// The spellings, as the option and the flag take them.
    pub const NAMES: &'static [&'static str] = &["on_evict", "eager"];

    /// The spelling of this value.
    pub fn name(self) -> &'static str {
        match self {
            DiskWrite::OnEvict => "on_evict",
            DiskWrite::Eager => "eager",
        }
    }
}

impl std::str::FromStr for DiskWrite {
    type Err = DiskError;

    fn from_str(s: &str) -> Result<Self, DiskError> {
        match s {
            "on_evict" => Ok(DiskWrite::OnEvict),
            "eager" => Ok(DiskWrite::Eager),
            other => Err(DiskError::Setting {
                name: "disk_write",
                why: format!("must be \"on_evict\" or \"eager\", got {other:?}"),
            }),
        }
    }
}

/// Settings of a disk tier.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskConfig {
    /// The directory of the tier's files; created when missing. One writer at a time (a lock
    /// file refuses a second).
    pub dir: PathBuf,
    /// Bytes of the directory the tier may fill (segment files, whole).
    pub capacity_bytes: u64,
    /// Bytes per segment file; 0 chooses capacity / 16 between 16 and 256 MiB. Eviction on
    /// disk drops whole segments, oldest first. An object larger than a segment is not written.
    pub segment_bytes: u64,
    /// Threads writing objects and as many reading them.
    pub io_threads: usize,
    /// Bytes of objects waiting to be written; past it new ones are dropped (counted).
    pub write_backlog_bytes: u64,
    /// Upper bound of the write rate in bytes per second (0: none).
    pub write_bytes_per_s: u64,
    /// How long a lookup waits for disk reads; what has not arrived is a miss.
    pub read_timeout: Duration,
    /// Direct I/O (`O_DIRECT`); off, or on a file system without it, the page cache is used.
    pub direct_io: bool,
    /// How long closing the store may spend writing the pool's objects the disk does not
    /// hold yet, so a clean restart finds them (zero: none are written; objects still queued
    /// are dropped).
    pub close_write: Duration,
    /// When objects go to disk: on eviction (the default) or eagerly on commit. The tier
    /// itself only offers both queues; its owner (the store) follows the pool's commits.
    pub write: DiskWrite,
}

impl DiskConfig {
    /// Defaults for `dir` and `capacity_bytes`.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> DiskConfig {
        DiskConfig {
            dir: dir.into(),
            capacity_bytes,
            segment_bytes: 0,
            io_threads: 4,
            write_backlog_bytes: 256 << 20,
            write_bytes_per_s: 0,
            read_timeout: Duration::from_millis(500),
            direct_io: true,
            close_write: Duration::from_secs(30),
            write: DiskWrite::OnEvict,
        }
    }

    /// The segment size in use.
    pub fn effective_segment_bytes(&self) -> u64 {
        if self.segment_bytes > 0 {
            return self.segment_bytes;
        }
        let s = (self.capacity_bytes / 16).clamp(SEGMENT_MIN, SEGMENT_MAX);
        s / ALIGN * ALIGN
    }

    /// Segments the capacity holds.
    pub fn max_segments(&self) -> u64 {
        self.capacity_bytes / self.effective_segment_bytes()
    }

    /// Checks every setting; the message names the option and what to change.
    pub fn validate(&self) -> Result<(), DiskError> {
        let bad = |name, why: String| Err(DiskError::Setting { name, why });
        if self.dir.as_os_str().is_empty() || !self.dir.is_absolute() {
            return bad(
                "disk_dir",
                format!("{:?} must be an absolute path", self.dir),
            );
        }
        if self.capacity_bytes < MIN_CAPACITY {
            return bad(
                "disk_capacity_bytes",
                format!(
                    "{} is below the minimum of {MIN_CAPACITY} bytes (8 MiB)",
                    self.capacity_bytes
                ),
            );
        }
        let seg = self.effective_segment_bytes();
        if !seg.is_multiple_of(ALIGN) || seg < ALIGN * 4 {
            return bad(
                "disk_segment_bytes",
                format!("{seg} must be a multiple of 4096 of at least 16384"),
            );
        }
        if self.max_segments() < 2 {
            return bad(
                "disk_capacity_bytes",
                format!(
                    "{} holds fewer than two segments of {seg} bytes; raise it or lower the segment size",
                    self.capacity_bytes
                ),
            );
        }
        if !(1..=64).contains(&self.io_threads) {
            return bad(
                "disk_io_threads",
                format!("{} must be between 1 and 64", self.io_threads),
            );
        }
        if self.write_backlog_bytes == 0 {
            return bad(
                "disk_write_backlog_bytes",
                "must be above 0 (objects wait there to be written)".into(),
            );
        }
        if self.read_timeout.is_zero() || self.read_timeout > Duration::from_secs(60) {
            return bad(
                "disk_timeout_ms",
                format!(
                    "{} ms must be between 1 and 60000",
                    self.read_timeout.as_millis()
                ),
            );
        }
        if self.close_write > Duration::from_secs(MAX_CLOSE_WRITE_S) {
            return bad(
                "disk_close_write_s",
                format!(
                    "{} s must be between 0 (do not write on close) and {MAX_CLOSE_WRITE_S}",
                    self.close_write.as_secs()
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_segments_scale_with_capacity() {
        let c = DiskConfig::new("/var/cache/umbp", 1 << 40);
        c.validate().unwrap();
        assert_eq!(c.effective_segment_bytes(), 256 << 20);
        let c = DiskConfig::new("/x", 64 << 20);
        assert_eq!(c.effective_segment_bytes(), 16 << 20);
        assert_eq!(c.max_segments(), 4);
    }

    #[test]
    fn bad_settings_name_the_option() {
        let mut c = DiskConfig::new("rel/dir", 1 << 30);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("disk_dir"));
        c.dir = "/d".into();
        c.capacity_bytes = 1000;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("disk_capacity_bytes"));
        c.capacity_bytes = 24 << 20;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("two segments"));
        assert_eq!("eager".parse::<DiskWrite>().unwrap(), DiskWrite::Eager);
        assert!("lazy"
            .parse::<DiskWrite>()
            .unwrap_err()
            .to_string()
            .starts_with("disk_write"));
        c.capacity_bytes = 1 << 30;
        c.io_threads = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("disk_io_threads"));
    }
}
