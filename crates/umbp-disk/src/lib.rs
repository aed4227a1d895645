//! The disk tier: a local (NVMe) object store under the DRAM pool.
//!
//! - **Layout.** Objects are appended to segment files (`seg-<id>.dat`), each a 4 KiB header
//!   block (magic, version, the full 64-byte key, the length, an XXH3-64 checksum of key and
//!   bytes) and the bytes padded to 4 KiB ([`format`]). Every object written adds a 128-byte
//!   record to the segment's index file (`seg-<id>.idx`) after its bytes are on disk.
//! - **I/O.** Direct I/O (`O_DIRECT`) through aligned buffers, by `io_threads` writer threads
//!   and as many readers, with positioned reads and writes (`umbp_unix::file`); a file system
//!   that refuses `O_DIRECT` (tmpfs before Linux 6.6) falls back to the page cache, logged.
//! - **Write-behind.** [`DiskTier::enqueue`] (an evicted object) and [`DiskTier::enqueue_key`]
//!   (an eager write on commit, by key: the bytes are fetched when written) never wait: a
//!   queue bounded in bytes, drained at an optionally bounded rate; what does not fit is
//!   dropped and counted. An object the disk holds already is not written again.
//! - **Promotion.** [`DiskTier::promote_prefix`] reads keys in parallel, checks each object
//!   (header, key, length, checksum: any mismatch is a miss, counted and dropped from the
//!   index) and hands the bytes to the caller's sink, within a deadline.
//! - **Capacity.** Segments are preallocated (a full disk fails when a segment is made, not
//!   mid-object); past the capacity the oldest segment is dropped whole (FIFO by segment).
//! - **Restart.** [`DiskTier::open`] rebuilds the index from the index files (time logged)
//!   and goes on filling the newest segment; a torn record is skipped, and a torn object fails
//!   its checksum when read: a miss.
//! - **Failures.** A directory that cannot be made, written or locked, or a file system with
//!   less room than the capacity, is an error at start-up ([`DiskError`]); at run time I/O
//!   errors (disk full, directory removed) are counted misses or dropped writes.
//!
//! Files by job: `config` ([`DiskConfig`]), [`format`], `segment`, `store` (index, write,
//! read, rebuild), `behind` (write-behind), `promote` (reads for lookups), `tier`
//! ([`DiskTier`]), `stats` ([`DiskStats`]), `buf` (aligned buffers), `error` ([`DiskError`]).

mod behind;
mod buf;
mod config;
mod error;
pub mod format;
mod promote;
mod segment;
mod stats;
mod store;
mod tier;

pub use behind::{ObjectBytes, Queued, Source};
pub use buf::AlignedBuf;
pub use config::{DiskConfig, DiskWrite, MIN_CAPACITY};
pub use error::DiskError;
pub use promote::Sink;
pub use stats::DiskStats;
pub use tier::DiskTier;
#[cfg(test)]
mod eager_tests;
#[cfg(test)]
mod full_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
