//! A client's host memory (a CPU engine's KV cache) made reachable by the standalone server
//! without a KV byte crossing the socket.
//!
//! The client's KV cache is backed by a memfd; the client sends the descriptor to the server
//! (`SCM_RIGHTS`), which maps it `MAP_SHARED` (umbp-server's `hostmem`, after checking its
//! seals) and copies between it and its pool with the same copy path it uses for everything
//! else. Two ways to get there:
//! * [`alloc_shared_host`]: fresh memory in a new memfd, for callers that can allocate their
//!   cache in it;
//! * [`share_host_range`]: memory the process already has (a torch tensor's `data_ptr()`), moved
//!   onto a memfd *in place*: the bytes are copied into the memfd and the memfd is mapped over
//!   the same virtual addresses, so every pointer into the range stays valid.
//!
//! The memfd is sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`): the client cannot truncate it under the server's mapping, which would raise
//! `SIGBUS` in the server.
//!
//! # Why shared memory and not `process_vm_readv`/`process_vm_writev`
//!
//! Two routes let a server reach a client's memory directly: (a) this one, a shared mapping
//! copied with plain `memcpy`; (b) cross-process copies (`process_vm_readv/writev`), which the
//! client permits by the ptrace rules (under Yama, `prctl(PR_SET_PTRACER, server_pid)`).
//! Route (a) was chosen by measurement: `umbp bench host-route` (release build, 2026-12-01, a
//! 16-core Intel Xeon VM, Linux 6.18, THP `madvise`, `shmem_enabled` `never`), one run, 1 GiB
//! each way per case, one thread, client pieces in random order, best of 3 rounds; GB/s and
//! the ratio to a copy between two buffers of one process with the same copy function as
//! route (a) (`umbp_copy::memcpy::copy`):
//!
//! ```text
//! pages    piece  direction      memcpy GB/s   (a) shm GB/s  ratio   (b) pvm GB/s  ratio
//! 4k       4 KiB  out of client         6.36           6.46   1.02           2.85   0.45
//! 4k       4 KiB  into client           7.70           8.17   1.06           2.92   0.38
//! 4k      16 KiB  out of client         7.59           6.48   0.85           4.12   0.54
//! 4k      16 KiB  into client           8.44           7.79   0.92           4.04   0.48
//! 4k      64 KiB  out of client         7.89           7.38   0.94           4.72   0.60
//! 4k      64 KiB  into client           7.43           7.13   0.96           4.64   0.62
//! 4k     256 KiB  out of client         8.12           8.55   1.05           5.05   0.62
//! 4k     256 KiB  into client           7.71           7.44   0.97           4.82   0.62
//! 4k       1 MiB  out of client         7.85           8.22   1.05           4.77   0.61
//! 4k       1 MiB  into client           6.96           7.09   1.02           4.48   0.64
//! thp      4 KiB  out of client         8.03           6.49   0.81           3.67   0.46
//! thp      4 KiB  into client           8.55           8.43   0.99           3.47   0.41
//! thp     16 KiB  out of client         8.85           7.39   0.84           4.36   0.49
//! thp     16 KiB  into client           8.51           8.56   1.01           4.57   0.54
//! thp     64 KiB  out of client         8.68           8.29   0.96           5.14   0.59
//! thp     64 KiB  into client           7.77           7.88   1.01           4.89   0.63
//! thp    256 KiB  out of client         8.83           7.16   0.81           5.11   0.58
//! thp    256 KiB  into client           7.87           8.41   1.07           5.14   0.65
//! thp      1 MiB  out of client         7.88           7.86   1.00           4.84   0.61
//! thp      1 MiB  into client           7.21           7.06   0.98           4.92   0.68
//! ```
//!
//! Route (a) runs at the speed of an in-process copy at every piece size and page size (ratio
//! 0.81–1.07 in one thread, 0.94–1.02 with `--threads 4`, where the ceiling is 20–27 GB/s);
//! route (b) reaches 0.38–0.68 (0.35–0.71 with four threads), worst at 4 KiB pieces. Route (b)
//! pays a system call per batch of at most `IOV_MAX` pieces and pins and maps every client page
//! on every call; route (a) has no system call per transfer, needs no ptrace permission (it
//! works under any Yama setting and in containers without `CAP_SYS_PTRACE`), and reuses the
//! server's one copy path (the copy engine over registered memory, streaming stores included).
//!
//! Its price: the first touch of each page of a new server mapping is a page fault (a one-time
//! cost: the first pass over a fresh 1 GiB mapping ran at 4.4 GB/s instead of about 7), and the
//! shared pages are shmem, so the host's `shmem_enabled`, not `enabled`, decides whether they
//! can be transparent huge pages. In the `thp` rows above both sides of route (a) were still
//! 4 KiB pages (`shmem_enabled` `never`) against huge pages for the others; with `shmem_enabled`
//! `advise` both mappings of route (a) were huge pages throughout (checked on a 2-core machine,
//! whose figures are too noisy to quote).
//!
//! # What sharing in place changes for the process
//!
//! After [`share_host_range`] the range is a `MAP_SHARED` mapping of the memfd: a `fork`ed
//! child shares it instead of getting a copy-on-write copy; the pages count as `Shmem` (still
//! in the same memory cgroup); they are allocated by the calling thread's NUMA policy (the old
//! pages' placement is not carried); and transparent huge pages follow `shmem_enabled`. Memory
//! freed back to a heap stays a shared mapping: `MADV_DONTNEED` (as `malloc_trim` does) does
//! not return shared pages, which go back only when the mapping is unmapped (large allocations
//! are their own mappings, unmapped by `free`).
//!
//! # Where the code is
//!
//! * `memfd`: the sealed memfds, [`SharedHostMemory`], fresh shared memory
//!   ([`alloc_shared_host`]) and populating a span before the server maps it;
//! * `maps`: this process's mappings as `/proc/self/smaps` lists them, what kind of memory
//!   each is, and finding a memfd's open descriptor;
//! * `in_place`: moving existing memory onto a memfd ([`share_host_range`]).

mod in_place;
mod maps;
mod memfd;
#[cfg(test)]
mod tests;

pub use in_place::share_host_range;
pub(crate) use memfd::populate;
pub(crate) use memfd::shared_mapping;
pub use memfd::{alloc_shared_host, SharedHostMemory, MEMFD_NAME, SEALS};
