//! UMBP's Unix plumbing: the one place the workspace makes the system calls its processes use
//! to share memory and descriptors with each other.
//!
//! * [`memfd`]: memfds, their seals, and checking a received descriptor is a sealed memfd;
//! * [`fdpass`]: bytes with descriptors over a Unix socket (`SCM_RIGHTS`);
//! * [`peer`]: who is at the other end of a Unix socket (`SO_PEERCRED`), and who we are;
//! * [`eventfd`]: a counter one thread signals and another polls;
//! * [`epoll`]: one thread waiting on many descriptors;
//! * [`futex`]: sleeping on a `u32` of memory shared between processes;
//! * [`socket`]: a non-blocking read or peek, a send without `SIGPIPE`, waiting on several
//!   descriptors, buffer sizes;
//! * [`mapping`]: owned `MAP_SHARED` mappings, unmapped on drop;
//! * [`arena`]: owned mappings of a process's own memory (anonymous, huge pages, or a shared
//!   file), bound to a NUMA node and populated up front;
//! * [`process`]: a pidfd, the file-creation mask, random bytes;
//! * [`file`]: files opened for direct I/O (`O_DIRECT`, past the page cache), positioned
//!   reads and writes, space reservation, advisory locks and the file system's free space;
//! * [`safedir`]: a directory only this user can change, checked from `/` down, and files in
//!   it opened by descriptor without following links (`openat2`);
//! * [`clock`]: the host-wide monotonic clock and the page size.
//!
//! Built on `rustix`; every operation fails with [`UnixError`], which names the call and the
//! errno.

pub mod arena;
pub mod clock;
pub mod epoll;
pub mod error;
pub mod eventfd;
pub mod fdpass;
pub mod file;
pub mod futex;
pub mod mapping;
pub mod memfd;
pub mod peer;
pub mod process;
pub mod safedir;
pub mod socket;

pub use error::{Op, UnixError};
