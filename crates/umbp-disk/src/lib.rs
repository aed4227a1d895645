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
//! - **Trust.** The directory is checked from `/` down before anything is read or written
//!   there ([`umbp_unix::safedir`]): it must be the process's user's and writable by nobody
//!   else, every parent root's or that user's and not writable by others without the sticky
//!   bit, every symbolic link on the way root's or that user's. Files are opened relative to
//!   the directory's descriptor and never through a link (`openat2` with
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, or `openat` with `O_NOFOLLOW` where the kernel
//!   has no `openat2`); new ones exclusively (`O_EXCL`), mode 0600. The lock file must be the
//!   user's (mode narrowed to 0600), so no other user can hold its lock.
//! - **Failures.** A directory that cannot be made, written or locked, that another user
//!   could change, or a file system with less room than the capacity, is an error at start-up
//!   ([`DiskError`]) saying what to change; at run time I/O errors (disk full, directory
//!   removed, a name taken by a planted link) are counted misses or dropped writes.
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
#[cfg(test)]
mod trust_tests;
