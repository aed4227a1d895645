//! Registering the pool's memory for DMA (`cuMemHostRegister`) without blocking start-up.
//!
//! The pool is registered in chunks of `chunk` bytes (64 MiB by default; a multiple of
//! [`SPLIT_BYTES`], so no pool object crosses a chunk boundary), each its own registration:
//!
//! * a background thread, started when the first CUDA memory is registered, registers the
//!   chunks in ascending address order (the allocator fills the pool from the bottom);
//! * a copy that touches a chunk not registered yet registers that chunk itself first (a few
//!   milliseconds), so DMA never reads or writes unregistered pool memory;
//! * the background thread pauses between chunks (half a chunk's time; three times that while
//!   copies run), so no driver call, ours or the engine's, waits behind more than one chunk's
//!   registration (the driver serialises them; back-to-back registrations starved other calls
//!   for the whole registration on the H200).
//!
//! The copy planner cuts every copy at chunk boundaries, so none straddles two registrations.
//! If registering a chunk fails, copies to it take the driver's pageable path after waiting on
//! the host for the submitter's work (correct, slower; logged).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_pool::Pool;

use umbp_cuda_driver::sys::types::*;
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::Device;

/// Registration chunks are multiples of this; pool segments (at most 64 MiB, powers of two)
/// never cross it.
pub const SPLIT_BYTES: u64 = 64 << 20;

const TODO: u8 = 0;
const BUSY: u8 = 1;
const OURS: u8 = 2;
const FOREIGN: u8 = 3;
const FAILED: u8 = 4;

/// How far registration has come.
#[derive(Debug)]
pub struct PinProgress {
    /// First byte of the pool.
    pub base: u64,
    /// Bytes of the pool.
    pub len: u64,
    /// Bytes per registration.
    pub chunk: u64,
    states: Vec<AtomicU8>,
    registered: AtomicU64,
    done: AtomicBool,
    started: Instant,
    /// Copies in flight.
    active: AtomicUsize,
    /// Nanoseconds since `started` when the latest copy ended (0: none yet).
    last_copy: AtomicU64,
    seconds: Mutex<Option<f64>>,
    error: Mutex<Option<String>>,
}

/// A snapshot of [`PinProgress`].
#[derive(Debug, Clone, PartialEq)]
pub struct PinStatus {
    /// Bytes registered.
    pub registered_bytes: u64,
    /// Bytes of the pool.
    pub total_bytes: u64,
    /// Whether every chunk has been tried.
    pub done: bool,
    /// Seconds from the start until every chunk was tried.
    pub seconds: Option<f64>,
    /// The first registration failure, if any.
    pub error: Option<String>,
}

impl PinProgress {
    fn new(base: u64, len: u64, chunk: u64) -> PinProgress {
        PinProgress {
            base,
            len,
            chunk,
            states: (0..len.div_ceil(chunk))
                .map(|_| AtomicU8::new(TODO))
                .collect(),
            registered: AtomicU64::new(0),
            done: AtomicBool::new(false),
            started: Instant::now(),
            active: AtomicUsize::new(0),
            last_copy: AtomicU64::new(0),
            seconds: Mutex::new(None),
            error: Mutex::new(None),
        }
    }

    /// Bytes registered so far.
    pub fn registered(&self) -> u64 {
        self.registered.load(Ordering::Acquire)
    }

    fn chunks_of(&self, addr: u64, len: u64) -> Option<std::ops::Range<usize>> {
        if len == 0 || addr < self.base || addr + len > self.base + self.len {
            return None;
        }
        let first = ((addr - self.base) / self.chunk) as usize;
        let last = ((addr + len - 1 - self.base) / self.chunk) as usize;
        Some(first..last + 1)
    }

    /// Whether all of `[addr, addr + len)` is registered.
    pub fn is_registered(&self, addr: u64, len: u64) -> bool {
        self.chunks_of(addr, len).is_some_and(|r| {
            r.into_iter()
                .all(|c| matches!(self.states[c].load(Ordering::Acquire), OURS | FOREIGN))
        })
    }

    /// A snapshot.
    pub fn status(&self) -> PinStatus {
        PinStatus {
            registered_bytes: self.registered(),
            total_bytes: self.len,
            done: self.done.load(Ordering::Acquire),
            seconds: *self.seconds.lock(),
            error: self.error.lock().clone(),
        }
    }

    /// Waits until every chunk was tried or `timeout` passed; returns whether it finished.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.done.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// Marks a copy in flight until the guard drops (the background thread then paces
    /// itself, so the copy never waits behind more than one chunk's registration).
    pub(crate) fn copying(&self) -> CopyGuard<'_> {
        self.active.fetch_add(1, Ordering::AcqRel);
        CopyGuard { p: self }
    }

    fn copies_recent(&self) -> bool {
        if self.active.load(Ordering::Acquire) > 0 {
            return true;
        }
        let last = self.last_copy.load(Ordering::Relaxed);
        last != 0 && (self.started.elapsed().as_nanos() as u64).saturating_sub(last) < 50_000_000
    }

    /// Registers chunk `c` unless it is registered or being registered (then waits for it).
    /// Needs a current context. Returns whether the chunk is usable for DMA.
    fn register_chunk(&self, dev: &Device, c: usize) -> bool {
        let s = &self.states[c];
        loop {
            match s.compare_exchange(TODO, BUSY, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(OURS | FOREIGN) => return true,
                Err(FAILED) => return false,
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            }
        }
        let addr = self.base + c as u64 * self.chunk;
        let n = self.chunk.min(self.base + self.len - addr);
        // SAFETY: `[addr, addr + n)` lies inside the pool's mapping, which the pinner keeps
        // alive until it unregisters every chunk.
        let state = match unsafe { dev.host_register(addr, n) } {
            Ok(()) => OURS,
            Err(CudaError::Call { code, .. })
                if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED =>
            {
                FOREIGN
            }
            Err(e) => {
                let msg = e.to_string();
                log::warn!(
                    "umbp: registering pool bytes {addr:#x}+{n} for DMA failed ({msg}); copies to them use the driver's slower pageable path"
                );
                self.error.lock().get_or_insert(msg);
                FAILED
            }
        };
        if state != FAILED {
            self.registered.fetch_add(n, Ordering::AcqRel);
        }
        s.store(state, Ordering::Release);
        state != FAILED
    }

    /// Makes sure `[addr, addr + len)` (pool memory) is registered, registering missing chunks
    /// now. Needs a current context. Returns false when a chunk cannot be registered.
    pub(crate) fn ensure(&self, dev: &Device, addr: u64, len: u64) -> bool {
        match self.chunks_of(addr, len) {
            Some(r) => r.into_iter().all(|c| self.register_chunk(dev, c)),
            None => false,
        }
    }
}

/// A copy in flight (see [`PinProgress::copying`]).
#[derive(Debug)]
pub(crate) struct CopyGuard<'a> {
    p: &'a PinProgress,
}

impl Drop for CopyGuard<'_> {
    fn drop(&mut self) {
        let ns = self.p.started.elapsed().as_nanos() as u64;
        self.p.last_copy.store(ns.max(1), Ordering::Relaxed);
        self.p.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Registers a pool for DMA in the background and unregisters it when shut down.
#[derive(Debug)]
pub struct PoolPinner {
    progress: Arc<PinProgress>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    dev: Arc<Device>,
    // Keeps the pool's memory mapped until every chunk is unregistered.
    _pool: Arc<Pool>,
}

impl PoolPinner {
    /// Starts registering `pool` in chunks of `chunk_bytes` (a multiple of [`SPLIT_BYTES`]).
    pub fn start(
        dev: Arc<Device>,
        pool: Arc<Pool>,
        chunk_bytes: u64,
    ) -> Result<PoolPinner, CudaError> {
        if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(SPLIT_BYTES) {
            return Err(CudaError::Option {
                name: "cuda_pin_chunk_bytes",
                reason: format!("{chunk_bytes} is not a positive multiple of 64 MiB"),
            });
        }
        let (base, len) = pool.memory();
        let progress = Arc::new(PinProgress::new(base, len, chunk_bytes));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (progress, stop, dev) =
                (Arc::clone(&progress), Arc::clone(&stop), Arc::clone(&dev));
            std::thread::Builder::new()
                .name("umbp-cuda-pin".into())
                .spawn(move || pin_loop(&dev, &progress, &stop))
                .map_err(|e| CudaError::Spawn {
                    thread: "umbp-cuda-pin",
                    reason: e.to_string(),
                })?
        };
        Ok(PoolPinner {
            progress,
            stop,
            thread: Mutex::new(Some(thread)),
            dev,
            _pool: pool,
        })
    }

    /// Registration progress.
    pub fn progress(&self) -> &Arc<PinProgress> {
        &self.progress
    }

    /// Stops registering and unregisters every chunk this pinner registered. Call only after
    /// every copy that may touch the pool has finished. Idempotent.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let Some(t) = self.thread.lock().take() else {
            return;
        };
        let _ = t.join();
        let p = &self.progress;
        let Ok(_g) = self.dev.scoped() else {
            return;
        };
        for (c, s) in p.states.iter().enumerate() {
            if s.swap(TODO, Ordering::AcqRel) == OURS {
                let addr = p.base + c as u64 * p.chunk;
                // SAFETY: the exact base of a chunk this pinner registered; no copy uses it any
                // more (the caller's contract).
                if let Err(e) = unsafe { self.dev.host_unregister(addr) } {
                    log::warn!("umbp: {e}");
                }
            }
        }
        p.registered.store(0, Ordering::Release);
    }
}

impl Drop for PoolPinner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn pin_loop(dev: &Device, p: &PinProgress, stop: &AtomicBool) {
    let finish = |p: &PinProgress| {
        let secs = p.started.elapsed().as_secs_f64();
        *p.seconds.lock() = Some(secs);
        let gib = p.len as f64 / (1u64 << 30) as f64;
        log::info!(
            "umbp: registered {:.2} of {gib:.2} GiB of pool for DMA in {secs:.2} s ({:.3} s/GiB)",
            p.registered() as f64 / (1u64 << 30) as f64,
            secs / gib.max(1e-9)
        );
        p.done.store(true, Ordering::Release);
    };
    if let Err(e) = dev.bind_thread() {
        *p.error.lock() = Some(e.to_string());
        p.done.store(true, Ordering::Release);
        return;
    }
    for c in 0..p.states.len() {
        if stop.load(Ordering::Acquire) {
            p.done.store(true, Ordering::Release);
            return;
        }
        let t0 = Instant::now();
        p.register_chunk(dev, c);
        // The driver serialises other calls (ours and the engine's) with a registration, and
        // back-to-back registrations would starve them: always leave a gap, so any call waits
        // behind at most one chunk. While copies run, leave the driver to them most of the time.
        let took = t0.elapsed();
        let gap = if p.copies_recent() {
            took * 3
        } else {
            took / 2
        };
        std::thread::sleep(gap.clamp(Duration::from_millis(1), Duration::from_millis(50)));
    }
    finish(p);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_ranges_inside_the_pool_only() {
        let p = PinProgress::new(1 << 30, 5 * SPLIT_BYTES / 2, SPLIT_BYTES);
        assert_eq!(p.states.len(), 3);
        assert_eq!(p.chunks_of(1 << 30, 1), Some(0..1));
        assert_eq!(p.chunks_of((1 << 30) + SPLIT_BYTES - 1, 2), Some(0..2));
        assert_eq!(
            p.chunks_of((1 << 30) + 2 * SPLIT_BYTES, SPLIT_BYTES / 2),
            Some(2..3)
        );
        assert_eq!(p.chunks_of((1 << 30) + 2 * SPLIT_BYTES, SPLIT_BYTES), None);
        assert_eq!(p.chunks_of((1 << 30) - 1, 2), None);
        assert!(!p.is_registered(1 << 30, 1));
        p.states[0].store(OURS, Ordering::Release);
        assert!(p.is_registered(1 << 30, SPLIT_BYTES));
        assert!(!p.is_registered(1 << 30, SPLIT_BYTES + 1));
    }
}
