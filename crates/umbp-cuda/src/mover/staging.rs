//! What the staged method keeps between calls and shares with the mover: staging slots and
//! their ring, the descriptor limits, `auto`'s health watch on the staging kernels and its
//! thresholds, the hand-off between streams, and the device flag words.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Device, DeviceBuffer, Event, HostBuffer, Stream};

/// Most descriptors one staging slot carries.
pub(super) const MAX_DESCS: usize = 16384;

/// Descriptor buffers per staging slot where device flags order the stages: the host writes
/// a slice's descriptors while up to this many earlier kernels of the slot are still queued.
pub(super) const DESC_BUFFERS: usize = 4;

#[derive(Debug)]
pub(super) struct Slot {
    pub(super) stage: DeviceBuffer,
    /// Descriptor buffers (`devs | offs | lens`, `u64` each), written by the host and read by
    /// the kernel through the mapping; used in turn.
    pub(super) descs: Vec<HostBuffer>,
    /// Per descriptor buffer: recorded after the kernel that read it.
    pub(super) descs_read: Vec<Event>,
    pub(super) descs_used: Vec<bool>,
    pub(super) next_desc: usize,
    /// Events mode: recorded after the slot's last stage; the host waits for it before
    /// reusing the slot.
    pub(super) free: Event,
    /// Events mode: recorded after the slot's first stage; the second stage's stream waits
    /// for it.
    pub(super) ready: Event,
    /// Flags mode (both non-zero): device addresses of two 32-bit words. Use `seq` of the slot
    /// writes `seq` to `ready_flag` after its first stage (the second stage waits for it) and
    /// to `free_flag` after its last stage (the next use's first stage waits for it). Each
    /// flag is written by one stream, in increasing order, and waits are cyclic `>=`, so a
    /// value written twice or skipped on an error path never strands a wait. The GPU polls
    /// device memory, so no host thread waits between stages.
    pub(super) ready_flag: u64,
    pub(super) free_flag: u64,
    /// The slot's use count.
    pub(super) seq: u32,
    pub(super) used: bool,
}

impl Slot {
    /// Whether the slot hands off through a device flag word (else through its event).
    pub(super) fn flags(&self) -> bool {
        self.ready_flag != 0
    }
}

#[derive(Debug)]
pub(super) struct Ring {
    pub(super) slots: Vec<Slot>,
    pub(super) next: usize,
}

/// How long the staging kernels of one direction take per GB (GPU time from the moment their
/// stream reaches them, so the wait for free SMs is included) and whether `auto` therefore
/// sends small pieces by DMA for now. When compute kernels fill every SM, staging kernels
/// start only as SMs free up. Measured on the H200 beside a full-GPU bf16 matmul: with 16 MiB
/// slots they took 24-160 ms per GB and moved 12-34 GB/s, less than DMA (33-50 GB/s for 8
/// to 64 KiB pieces); with the default 128 MiB slots, 6-12 ms per GB and 46-53 GB/s, more
/// than DMA, so the switch stays off there and guards against compute that leaves even fewer
/// gaps.
#[derive(Debug, Default)]
pub(super) struct StagedHealth {
    /// Recent kernel milliseconds per GB (an exponential average, as f64 bits; 0: none yet).
    pub(super) ms_per_gb: AtomicU64,
    /// Small pieces go by DMA (set above [`STAGED_SLOW_MS_PER_GB`], cleared below
    /// [`STAGED_FAST_MS_PER_GB`]).
    pub(super) by_dma: std::sync::atomic::AtomicBool,
    /// Calls decided while `by_dma`: every [`STAGED_PROBE_EVERY`]-th is staged anyway, to notice
    /// when SMs are free again.
    pub(super) calls: AtomicU64,
    /// Times `auto` switched between the two.
    pub(super) switches: AtomicU64,
}

/// Above this many kernel milliseconds per GB the staging kernels alone move less than 40 GB/s,
/// about what DMA moves for small pieces while compute fills the GPU: `auto` switches small
/// pieces to DMA.
pub(super) const STAGED_SLOW_MS_PER_GB: f64 = 25.0;
/// Below this (the kernels no longer limit the copy: idle they take about 1 ms per GB) `auto`
/// stages small pieces again.
pub(super) const STAGED_FAST_MS_PER_GB: f64 = 15.0;
/// Below this the staging kernels find free SMs (idle they take about 1 ms per GB, beside a
/// full-GPU matmul 6-12): jobs start and end with short calls ([`CudaMover::edge_batch`]).
pub(super) const SMS_FREE_MS_PER_GB: f64 = 3.0;
/// While small pieces go by DMA, one call in this many is staged to measure the kernels again.
pub(super) const STAGED_PROBE_EVERY: u64 = 8;

/// Whether `auto` should send small pieces by DMA, given whether it does now and the staging
/// kernels' recent milliseconds per GB (with hysteresis between the two thresholds).
pub(super) fn small_pieces_by_dma(now: bool, ms_per_gb: f64) -> bool {
    if now {
        ms_per_gb >= STAGED_FAST_MS_PER_GB
    } else {
        ms_per_gb > STAGED_SLOW_MS_PER_GB
    }
}

/// Makes `to`'s later work wait for `from`'s work so far on `slot`: through the slot's device
/// flag where there is one, else through its `ready` event.
pub(super) fn handoff(slot: &Slot, from: &Stream, to: &Stream) -> Result<(), CudaError> {
    if slot.flags() {
        // SAFETY: the slot's flag word lives as long as the mover's flag buffer.
        unsafe { from.write_flag(slot.ready_flag, slot.seq) }?;
        // SAFETY: as above.
        unsafe { to.wait_flag(slot.ready_flag, slot.seq) }
    } else {
        slot.ready.record(from)?;
        // SAFETY: the slot's own live event.
        unsafe { to.wait(slot.ready.raw()) }
    }
}

/// `n` zeroed 32-bit flag words in device memory, once a write and a wait through them were
/// seen to work on this device.
pub(super) fn device_flags(dev: &Arc<Device>, n: usize) -> Result<DeviceBuffer, CudaError> {
    let buf = dev.alloc((4 * n as u64).max(256))?;
    let s = dev.stream()?;
    let k = dev.stream()?;
    // SAFETY: our own fresh allocation, used by nothing else yet.
    unsafe { dev.memset(buf.ptr(), 0, buf.len(), &s) }?;
    // SAFETY: a word of our fresh allocation, alive while `buf` is.
    unsafe { s.write_flag(buf.ptr(), 1) }?;
    // SAFETY: as above.
    unsafe { k.wait_flag(buf.ptr(), 1) }?;
    // SAFETY: the flag word of our fresh allocation, alive while `buf` is.
    unsafe { k.write_flag(buf.ptr(), 0) }?;
    k.synchronize()?;
    s.synchronize()?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_switches_small_pieces_with_hysteresis() {
        // Idle kernels (2-8 ms per GB, measured) stay staged; kernels waiting for SMs beside
        // a full-GPU matmul (24-160 ms per GB with 16 MiB slots) switch to DMA; back only once clearly fast.
        assert!(!small_pieces_by_dma(false, 2.0));
        assert!(!small_pieces_by_dma(false, 8.0));
        assert!(!small_pieces_by_dma(false, 24.0));
        assert!(small_pieces_by_dma(false, 40.0));
        assert!(small_pieces_by_dma(true, 20.0));
        assert!(!small_pieces_by_dma(true, 10.0));
    }
}
