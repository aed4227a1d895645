//! What a [`Mover`] is given and what it answers: the blocks of one call, the submitter's
//! [`OrderToken`], and per block `Ok` or a typed [`MoveError`] (a job reports it for its key as
//! a [`KeyOutcome::Failed`]).

use std::sync::Arc;

#[cfg(doc)]
use umbp_core::KeyOutcome;
use umbp_core::{CopyRange, FailureKind, KeyFailure};

use crate::memcpy;
use umbp_pool::Summer;

/// Bytes the host mover sums and then copies at a time while summing a store: small enough
/// that the copy reads them from the cache the sum brought them into.
const SUM_CHUNK: u64 = 32 << 10;

impl From<MoveError> for KeyFailure {
    fn from(e: MoveError) -> Self {
        KeyFailure::new(e.failure_kind(), e.to_string())
    }
}

/// Why a mover could not copy a block (per block, in a mover's answer; its key then fails with
/// [`KeyFailure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoveError {
    /// The device failed in a way that lasts: every later call on its context fails too (CUDA's
    /// sticky errors, such as an illegal address in a kernel). No transfer to or from this
    /// device can succeed until the process restarts.
    DeviceLost {
        /// The device, in words ("CUDA device 0").
        device: String,
        /// The failure.
        message: String,
    },
    /// One device call failed; the device stays usable.
    Device(String),
    /// The mover was handed something it cannot copy (memory of another device, a token of
    /// another mover, a block larger than it supports).
    Unsupported(String),
}

impl std::fmt::Display for MoveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MoveError::DeviceLost { device, message } => write!(
                f,
                "{device} is unusable after {message}; every later transfer with it fails until the process restarts"
            ),
            MoveError::Device(m) | MoveError::Unsupported(m) => f.write_str(m),
        }
    }
}

impl MoveError {
    /// Whether the device this error came from is unusable from now on.
    pub fn is_device_lost(&self) -> bool {
        matches!(self, MoveError::DeviceLost { .. })
    }

    /// The failure its key reports.
    pub fn failure_kind(&self) -> FailureKind {
        match self {
            MoveError::DeviceLost { .. } => FailureKind::DeviceLost,
            MoveError::Device(_) => FailureKind::Device,
            MoveError::Unsupported(_) => FailureKind::Unsupported,
        }
    }
}

/// Something a mover made that orders a job's copies after the submitter's work (for CUDA, an
/// event recorded on the submitter's stream). It belongs to the job it was made for and goes
/// back to its maker when dropped, which the job does when its last key has finished.
pub struct OrderToken {
    raw: u64,
    owner: Arc<dyn TokenOwner>,
}

/// The maker of [`OrderToken`]s, given each token back when it is dropped.
pub trait TokenOwner: Send + Sync + std::fmt::Debug {
    /// Takes back token `raw` (called once per token, from any thread).
    fn release(&self, raw: u64);
}

impl OrderToken {
    /// A token `raw` (non-zero) that `owner` made and takes back on drop.
    pub fn new(raw: u64, owner: Arc<dyn TokenOwner>) -> OrderToken {
        OrderToken { raw, owner }
    }

    /// The value the owner knows the token by.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// Whether `owner` made this token (a mover must only use its own tokens).
    pub fn is_from(&self, owner: &Arc<dyn TokenOwner>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.owner), Arc::as_ptr(owner))
    }
}

impl Drop for OrderToken {
    fn drop(&mut self) {
        self.owner.release(self.raw);
    }
}

impl std::fmt::Debug for OrderToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderToken")
            .field("raw", &self.raw)
            .finish()
    }
}

/// One block's side of a copy: the pool object's address and the engine ranges.
#[derive(Debug, Clone, Copy)]
pub struct BlockCopy<'a> {
    /// First byte of the pool object.
    pub object: *mut u8,
    /// Engine ranges, with their offsets inside the object.
    pub ranges: &'a [CopyRange],
}

impl BlockCopy<'_> {
    /// Bytes of the object the ranges reach (the end of the furthest range).
    pub fn extent(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| r.object_offset + r.len)
            .max()
            .unwrap_or(0)
    }
}

/// What a mover answers per block.
pub type MoveResult = Result<(), MoveError>;

/// Moves bytes between engine memory and pool objects, a batch of blocks at a time. The host
/// implementation uses CPU copies; each device kind (CUDA today) plugs in its own, one per
/// device, and the copy engine picks it by the kind of memory a job moves.
pub trait Mover: Send + Sync + std::fmt::Debug {
    /// Blocks a worker hands over per call, for a job whose blocks are `object_bytes` long
    /// in at most `pieces_per_block` ranges each.
    fn batch_size(&self, object_bytes: u64, pieces_per_block: usize) -> usize {
        let _ = (object_bytes, pieces_per_block);
        8
    }

    /// Blocks of a job's first and last calls, for a job of `job_blocks` blocks in calls of
    /// `batch` (as [`Mover::batch_size`] answered for `object_bytes` and
    /// `pieces_per_block`); at most `batch`, and the default, `batch`, cuts no call short. A
    /// device mover whose calls run as stages (a gather kernel before its DMA, a scatter
    /// kernel after it) asks for short first and last calls in jobs of many calls: the
    /// copies start after a few blocks are planned instead of a whole call, and the job ends
    /// with a short stage.
    fn edge_batch(
        &self,
        batch: usize,
        job_blocks: usize,
        object_bytes: u64,
        pieces_per_block: usize,
    ) -> usize {
        let _ = (job_blocks, object_bytes, pieces_per_block);
        batch
    }

    /// Copies each block's engine ranges into its object. `after` is the submitter's ordering
    /// token, if any; the copies must not read engine memory before the work it marks is
    /// done. Returns one result per block.
    ///
    /// # Safety
    /// Every range must lie inside a live registration of the kind this mover serves, and each
    /// object must point to at least `max(object_offset + len)` writable bytes that nothing else
    /// accesses during the call.
    unsafe fn gather(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult>;

    /// [`Mover::gather`], also answering in `sums[i]` the checksum ([`umbp_pool::checksum`])
    /// of block `i`'s object where the mover can compute it while the bytes pass a CPU; where
    /// it cannot (a DMA engine moved them), it leaves `sums[i]` `None` and the pool sums the
    /// object when it is committed. `sums` is as long as `blocks`.
    ///
    /// # Safety
    /// As for [`Mover::gather`].
    unsafe fn gather_summed(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
        sums: &mut [Option<u64>],
    ) -> Vec<MoveResult> {
        let _ = sums;
        // SAFETY: the caller's guarantees are `gather`'s.
        unsafe { self.gather(blocks, after) }
    }

    /// Copies each object into its block's engine ranges.
    ///
    /// # Safety
    /// As for [`Mover::gather`], with the objects readable and the engine ranges writable.
    unsafe fn scatter(
        &self,
        blocks: &[BlockCopy<'_>],
        after: Option<&OrderToken>,
    ) -> Vec<MoveResult>;

    /// Most workers one job may occupy at once.
    fn max_workers_per_job(&self) -> usize {
        usize::MAX
    }
}

/// Copies between host memories (large pieces with the bulk copy chosen for this CPU, see
/// [`crate::memcpy`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMover;

impl Mover for HostMover {
    unsafe fn gather(
        &self,
        blocks: &[BlockCopy<'_>],
        _after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        for b in blocks {
            for r in b.ranges {
                // SAFETY: the caller guarantees both sides are valid for `r.len` bytes and do
                // not overlap (one is pool memory, the other registered engine memory).
                unsafe {
                    memcpy::copy(
                        b.object.add(r.object_offset as usize),
                        r.host_addr as *const u8,
                        r.len as usize,
                    )
                };
            }
        }
        memcpy::fence();
        vec![Ok(()); blocks.len()]
    }

    unsafe fn gather_summed(
        &self,
        blocks: &[BlockCopy<'_>],
        _after: Option<&OrderToken>,
        sums: &mut [Option<u64>],
    ) -> Vec<MoveResult> {
        let mut summer = Summer::new();
        for (b, sum) in blocks.iter().zip(sums.iter_mut()) {
            // The sum is of the object, so the ranges must tile it in order; a layout's do
            // (runs concatenated), anything else is summed by the pool at commit.
            let mut next = 0;
            let in_order = b.ranges.iter().all(|r| {
                let ok = r.object_offset == next;
                next = r.object_offset + r.len;
                ok
            });
            summer.reset();
            for r in b.ranges {
                let mut done = 0;
                while done < r.len {
                    let n = (r.len - done).min(SUM_CHUNK);
                    let src = (r.host_addr + done) as *const u8;
                    if in_order {
                        // SAFETY: the caller guarantees the engine range is readable for
                        // `r.len` bytes while the call lasts.
                        summer.update(unsafe { std::slice::from_raw_parts(src, n as usize) });
                    }
                    // SAFETY: as in `gather`; the chunk was just read, so the copy reads it
                    // from the cache.
                    unsafe {
                        memcpy::copy(
                            b.object.add((r.object_offset + done) as usize),
                            src,
                            n as usize,
                        )
                    };
                    done += n;
                }
            }
            *sum = in_order.then(|| summer.finish());
        }
        memcpy::fence();
        vec![Ok(()); blocks.len()]
    }

    unsafe fn scatter(
        &self,
        blocks: &[BlockCopy<'_>],
        _after: Option<&OrderToken>,
    ) -> Vec<MoveResult> {
        for b in blocks {
            for r in b.ranges {
                // SAFETY: as in `gather`, in the other direction.
                unsafe {
                    memcpy::copy(
                        r.host_addr as *mut u8,
                        b.object.add(r.object_offset as usize),
                        r.len as usize,
                    )
                };
            }
        }
        memcpy::fence();
        vec![Ok(()); blocks.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Debug, Default)]
    struct Counter(AtomicU64);
    impl TokenOwner for Counter {
        fn release(&self, raw: u64) {
            self.0.fetch_add(raw, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_host_mover_sums_objects_whose_ranges_tile_them_in_order() {
        // Two pieces of 100 KiB (more than one summing chunk each) from one source.
        let src: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let at = src.as_ptr() as u64;
        let mut obj = vec![0u8; 200_000];
        let in_order = [
            CopyRange {
                host_addr: at + 100_000,
                object_offset: 0,
                len: 100_000,
            },
            CopyRange {
                host_addr: at,
                object_offset: 100_000,
                len: 100_000,
            },
        ];
        let swapped = [in_order[1], in_order[0]];
        for (ranges, summed) in [(&in_order, true), (&swapped, false)] {
            obj.fill(0);
            let blocks = [BlockCopy {
                object: obj.as_mut_ptr(),
                ranges,
            }];
            let mut sums = [None];
            // SAFETY: both buffers live through the call and do not overlap.
            let r = unsafe { HostMover.gather_summed(&blocks, None, &mut sums) };
            assert_eq!(r, vec![Ok(())]);
            let mut want = src[100_000..].to_vec();
            want.extend_from_slice(&src[..100_000]);
            assert_eq!(obj, want, "the copy is the same either way");
            let expect = summed.then(|| umbp_pool::checksum(&want));
            assert_eq!(sums[0], expect, "in order: {summed}");
        }
    }

    #[test]
    fn a_token_goes_back_to_its_owner_once_when_dropped() {
        let c = Arc::new(Counter::default());
        let owner: Arc<dyn TokenOwner> = c.clone();
        let other: Arc<dyn TokenOwner> = Arc::new(Counter::default());
        let t = OrderToken::new(7, Arc::clone(&owner));
        assert!(t.is_from(&owner) && !t.is_from(&other));
        assert_eq!(t.raw(), 7);
        assert_eq!(c.0.load(Ordering::SeqCst), 0);
        drop(t);
        assert_eq!(c.0.load(Ordering::SeqCst), 7);
    }

    #[test]
    fn a_lost_device_reads_differently_from_a_bad_range() {
        let lost = KeyFailure::from(MoveError::DeviceLost {
            device: "CUDA device 0".into(),
            message: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        });
        let range = KeyFailure::new(
            FailureKind::InvalidRange,
            "range 0x10+4 is outside registered memory",
        );
        assert_eq!(lost.kind, FailureKind::DeviceLost);
        assert!(lost.to_string().contains("restarts"), "{lost}");
        assert_ne!(lost, range);
    }
}
