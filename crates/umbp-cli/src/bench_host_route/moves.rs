//! The measured moves: one pass of every piece between the pool buffer and a client (local
//! memcpy or `process_vm_readv`/`writev`), over several threads, and a pass with its bytes
//! checked.

use std::time::Instant;

use anyhow::{bail, ensure, Result};

/// The most iovecs one `process_vm_readv`/`writev` call takes (`UIO_MAXIOV`).
pub(super) const IOV_MAX: usize = 1024;
/// Pieces whose bytes are checked in each warm-up round.
pub(super) const SAMPLES: usize = 64;

/// Where the client's bytes are reached.
#[derive(Debug, Clone, Copy)]
pub(super) enum Client {
    /// Memory mapped in this process at this address (the ceiling's buffer, or route (a)).
    Local(usize),
    /// Another process's memory (route (b)).
    Remote { pid: libc::pid_t, base: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Dir {
    /// Pool → client.
    In,
    /// Client → pool.
    Out,
}

impl Dir {
    pub(super) fn name(self) -> &'static str {
        match self {
            Dir::In => "into client",
            Dir::Out => "out of client",
        }
    }
}

/// Moves piece `i` of the pool to slot `perm[i]` of the client (or back) for every piece, over
/// `threads` threads; seconds taken.
pub(super) fn pass(
    client: Client,
    dir: Dir,
    pool: usize,
    perm: &[u32],
    piece: usize,
    threads: usize,
) -> Result<f64> {
    let per = perm.len().div_ceil(threads);
    let t0 = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..perm.len())
            .step_by(per)
            .map(|first| {
                let part = &perm[first..(first + per).min(perm.len())];
                s.spawn(move || move_pieces(client, dir, pool, first, part, piece))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a copy thread panicked"))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<()>>()?;
    Ok(secs)
}

/// Pieces `first..first + part.len()` of the pool, to or from client slots `part`.
pub(super) fn move_pieces(
    client: Client,
    dir: Dir,
    pool: usize,
    first: usize,
    part: &[u32],
    piece: usize,
) -> Result<()> {
    match client {
        Client::Local(base) => {
            for (k, &slot) in part.iter().enumerate() {
                let p = pool + (first + k) * piece;
                let c = base + slot as usize * piece;
                let (dst, src) = match dir {
                    Dir::In => (c, p),
                    Dir::Out => (p, c),
                };
                // SAFETY: `p` and `c` are whole pieces inside the pool buffer and the client
                // mapping (slots and indices are below total / piece); the two never overlap
                // and no other thread copies the same pieces.
                unsafe { umbp_copy::memcpy::copy(dst as *mut u8, src as *const u8, piece) };
            }
            umbp_copy::memcpy::fence();
            Ok(())
        }
        Client::Remote { pid, base } => {
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            let mut local = vec![empty; IOV_MAX];
            let mut remote = vec![empty; IOV_MAX];
            for (b, batch) in part.chunks(IOV_MAX).enumerate() {
                for (k, &slot) in batch.iter().enumerate() {
                    local[k] = libc::iovec {
                        iov_base: (pool + (first + b * IOV_MAX + k) * piece) as *mut libc::c_void,
                        iov_len: piece,
                    };
                    remote[k] = libc::iovec {
                        iov_base: (base as usize + slot as usize * piece) as *mut libc::c_void,
                        iov_len: piece,
                    };
                }
                let n = batch.len();
                // SAFETY: the local iovecs name whole pieces of our pool buffer, the remote
                // ones whole pieces of the child's buffer; the kernel checks the remote side.
                let got = unsafe {
                    match dir {
                        Dir::In => libc::process_vm_writev(
                            pid,
                            local.as_ptr(),
                            n as libc::c_ulong,
                            remote.as_ptr(),
                            n as libc::c_ulong,
                            0,
                        ),
                        Dir::Out => libc::process_vm_readv(
                            pid,
                            local.as_ptr(),
                            n as libc::c_ulong,
                            remote.as_ptr(),
                            n as libc::c_ulong,
                            0,
                        ),
                    }
                };
                if got != (n * piece) as isize {
                    bail!(
                        "process_vm_{}v moved {got} of {} bytes: {}",
                        if dir == Dir::In { "write" } else { "read" },
                        n * piece,
                        std::io::Error::last_os_error()
                    );
                }
            }
            Ok(())
        }
    }
}

/// Reads the u64 at `off` of the client's memory.
pub(super) fn peek(c: Client, off: usize) -> Result<u64> {
    match c {
        // SAFETY: `off + 8` lies inside the client mapping; 8-aligned (pieces are multiples of
        // 64 bytes).
        Client::Local(base) => Ok(unsafe { ((base + off) as *const u64).read_volatile() }),
        Client::Remote { pid, base } => {
            let mut v = 0u64;
            let l = libc::iovec {
                iov_base: (&mut v as *mut u64).cast(),
                iov_len: 8,
            };
            let r = libc::iovec {
                iov_base: (base as usize + off) as *mut libc::c_void,
                iov_len: 8,
            };
            // SAFETY: the local iovec is `v`; the kernel checks the remote one.
            let n = unsafe { libc::process_vm_readv(pid, &l, 1, &r, 1, 0) };
            ensure!(
                n == 8,
                "process_vm_readv: {}",
                std::io::Error::last_os_error()
            );
            Ok(v)
        }
    }
}

/// Writes the u64 at `off` of the client's memory.
pub(super) fn poke(c: Client, off: usize, v: u64) -> Result<()> {
    match c {
        Client::Local(base) => {
            // SAFETY: as in `peek`.
            unsafe { ((base + off) as *mut u64).write_volatile(v) };
            Ok(())
        }
        Client::Remote { pid, base } => {
            let l = libc::iovec {
                iov_base: (&v as *const u64).cast_mut().cast(),
                iov_len: 8,
            };
            let r = libc::iovec {
                iov_base: (base as usize + off) as *mut libc::c_void,
                iov_len: 8,
            };
            // SAFETY: the local iovec is `v` (only read); the kernel checks the remote one.
            let n = unsafe { libc::process_vm_writev(pid, &l, 1, &r, 1, 0) };
            ensure!(
                n == 8,
                "process_vm_writev: {}",
                std::io::Error::last_os_error()
            );
            Ok(())
        }
    }
}

/// One pass with its bytes checked: marks are planted at both ends of sampled pieces on the
/// source side and must arrive at the other. Seconds the pass took.
pub(super) fn checked_pass(
    client: Client,
    dir: Dir,
    pool: usize,
    perm: &[u32],
    piece: usize,
    threads: usize,
    salt: u64,
) -> Result<f64> {
    let n = perm.len();
    let samples: Vec<usize> = (0..SAMPLES.min(n))
        .map(|k| k * n / SAMPLES.min(n))
        .collect();
    let mark = |i: usize, end: usize| {
        (salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((i as u64) << 1) ^ end as u64) | 1
    };
    let ends = |i: usize| [(0, i * piece), (1, i * piece + piece - 8)];
    let slot_ends = |i: usize| {
        let s = perm[i] as usize * piece;
        [(0, s), (1, s + piece - 8)]
    };
    let pool_word = |off: usize| (pool + off) as *mut u64;
    for &i in &samples {
        for ((e, p), (_, c)) in ends(i).into_iter().zip(slot_ends(i)) {
            match dir {
                // SAFETY: `p + 8` lies inside the pool buffer, 8-aligned.
                Dir::In => unsafe { pool_word(p).write_volatile(mark(i, e)) },
                Dir::Out => poke(client, c, mark(i, e))?,
            }
        }
    }
    let secs = pass(client, dir, pool, perm, piece, threads)?;
    for &i in &samples {
        for ((e, p), (_, c)) in ends(i).into_iter().zip(slot_ends(i)) {
            let got = match dir {
                Dir::In => peek(client, c)?,
                // SAFETY: as above.
                Dir::Out => unsafe { pool_word(p).read_volatile() },
            };
            ensure!(
                got == mark(i, e),
                "{} of {piece}-byte pieces: piece {i} (client slot {}) arrived wrong: {got:#x}, expected {:#x}",
                dir.name(),
                perm[i],
                mark(i, e)
            );
        }
    }
    Ok(secs)
}
