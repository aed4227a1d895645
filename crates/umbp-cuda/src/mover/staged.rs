//! The staged method: a brief gather (store) or scatter (load) kernel between the KV cache and a
//! device staging slot, and one DMA per run of neighbouring pool objects; and `auto`'s watch on
//! the kernels while compute holds the SMs ([`StagedHealth`]).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use umbp_copy::MoveResult;

use super::spans::Timed;
use super::staging::*;
use super::{CopyMethod, CudaMover, Dir};
use crate::plan::{Run, Slice};
use umbp_cuda_driver::sys::types::*;
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Event, Stream};

impl CudaMover {
    /// Folds one staged call's kernel time per GB (its kernels moved `bytes`) into `auto`'s
    /// view and switches small pieces between staged and DMA when the kernels have become
    /// slow or fast again. A call weighs by its share of a staging slot: a short call's
    /// kernel waits for free SMs as long as a full one's and moves less, so its time per GB
    /// alone would overstate how slow the kernels are.
    pub(super) fn note_kernels(&self, dir: Dir, ms_per_gb: f64, bytes: u64) {
        let h = &self.staged_health[dir.index()];
        let old = f64::from_bits(h.ms_per_gb.load(Ordering::Relaxed));
        let weight = 0.5 * (bytes as f64 / self.slot_bytes.max(1) as f64).min(1.0);
        let avg = if old > 0.0 {
            (1.0 - weight) * old + weight * ms_per_gb
        } else if weight >= 0.25 {
            ms_per_gb
        } else {
            return; // a first view from a short call would be mostly its launch's wait
        };
        h.ms_per_gb.store(avg.to_bits(), Ordering::Relaxed);
        if self.opts.method != CopyMethod::Auto {
            return;
        }
        let by_dma = h.by_dma.load(Ordering::Relaxed);
        let want = small_pieces_by_dma(by_dma, avg);
        if want != by_dma {
            h.by_dma.store(want, Ordering::Relaxed);
            h.switches.fetch_add(1, Ordering::Relaxed);
            log::debug!(
                "umbp: {} staging kernels take {avg:.1} ms per GB (SMs are {}): small pieces go {}",
                dir.name(),
                if want { "busy" } else { "free again" },
                if want { "by DMA" } else { "staged" }
            );
        }
    }

    /// The DMAs between a staging slot and the pool objects of slice `s`; a failure fails
    /// the slice's blocks.
    pub(super) fn slot_dmas(
        &self,
        dir: Dir,
        stream: &Stream,
        s: &Slice,
        stage: u64,
        results: &mut [MoveResult],
    ) {
        let runs: Vec<Run> = s
            .dmas
            .iter()
            .map(|m| Run {
                dev: stage + m.off,
                host: m.host,
                len: m.len,
                dev_stride: 0,
                host_stride: 0,
                count: 1,
                first_block: 0,
                last_block: 0,
            })
            .collect();
        let mut outcome = [Ok(())];
        self.singles(dir, stream, &runs, &mut outcome);
        if let [Err(e)] = outcome {
            for &b in &s.blocks {
                results[b] = Err(e.clone());
            }
        }
    }

    pub(super) fn run_staged(
        &self,
        dir: Dir,
        slices: &[Slice],
        after: Option<CUevent>,
        done: &Event,
        results: &mut [MoveResult],
        timings: &mut Vec<Timed>,
    ) -> Result<(), CudaError> {
        let lane = self.lane(dir);
        let kernels = self
            .kernels
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("staging kernels are not loaded".into()))?;
        let ring = lane
            .ring
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no staging memory".into()))?;
        // Held only while this call's slices are queued (in flags mode no host thread waits
        // for the GPU here, except, rarely, for a descriptor buffer).
        let mut ring = ring.lock();
        if dir == Dir::Store {
            if let Some(ev) = after {
                // SAFETY: `ev` is the job's token event, alive until the job finishes.
                unsafe { lane.kern.wait(ev) }?;
            }
        }
        // Store: gather on `kern`, then DMA on `dma`. Load: DMA on `dma`, then scatter.
        let (first, second) = match dir {
            Dir::Store => (&lane.kern, &lane.dma),
            Dir::Load => (&lane.dma, &lane.kern),
        };
        let mut bytes = 0u64;
        for (k, s) in slices.iter().enumerate() {
            let i = ring.next;
            ring.next = (i + 1) % ring.slots.len();
            let slot = &mut ring.slots[i];
            if !slot.flags() && slot.used {
                self.host_wait(dir, "slot_wait", &slot.free)?;
            }
            let j = slot.next_desc;
            slot.next_desc = (j + 1) % slot.descs.len();
            if slot.flags() && slot.descs_used[j] {
                self.host_wait(dir, "desc_wait", &slot.descs_read[j])?;
            }
            let n = s.descs.len();
            // Descriptors: devs | offs | lens.
            // SAFETY: the buffer holds 3 * MAX_DESCS u64 and n <= MAX_DESCS (plan::staged);
            // the kernel that last read it has finished (waited for above).
            let desc =
                unsafe { std::slice::from_raw_parts_mut(slot.descs[j].ptr() as *mut u64, 3 * n) };
            for (m, x) in s.descs.iter().enumerate() {
                desc[m] = x.dev;
                desc[n + m] = x.off;
                desc[2 * n + m] = x.len;
            }
            slot.descs_used[j] = true;
            slot.used = true;
            let prev = slot.seq;
            slot.seq = prev.wrapping_add(1);
            let slot = &*slot;
            let stage = slot.stage.ptr();
            // The kernel reads the descriptors through the mapping (24 bytes per piece over
            // PCIe): measured faster than uploading them, whose copy queues behind the bulk
            // host-to-device DMAs of loads.
            let dp = slot.descs[j].device_ptr();
            let slice_bytes = s.descs.iter().map(|x| x.len).sum::<u64>();
            let launch = |f: CUfunction| -> Result<Timed, CudaError> {
                let stream = &lane.kern;
                let t0 = self.take_event(true)?;
                let t1 = self.take_event(true)?;
                t0.record(stream)?;
                let mut a0: u64 = dp;
                let mut a1: u64 = dp + 8 * n as u64;
                let mut a2: u64 = dp + 16 * n as u64;
                let mut a3: u64 = stage;
                let mut a4: u32 = n as u32;
                let mut params: [*mut c_void; 5] = [
                    &mut a0 as *mut u64 as *mut c_void,
                    &mut a1 as *mut u64 as *mut c_void,
                    &mut a2 as *mut u64 as *mut c_void,
                    &mut a3 as *mut u64 as *mut c_void,
                    &mut a4 as *mut u32 as *mut c_void,
                ];
                let grid = (n.div_ceil(8) as u32).clamp(1, self.opts.max_ctas);
                // SAFETY: the kernel takes (u64, u64, u64, u64, u32), matching `params`;
                // every descriptor names a checked device range and a range inside this slot.
                unsafe { stream.launch(f, grid, 256, &mut params) }?;
                t1.record(stream)?;
                slot.descs_read[j].record(stream)?;
                self.counters
                    .kernel_launches
                    .fetch_add(1, Ordering::Relaxed);
                Ok(Timed {
                    step: "kernel",
                    bytes: slice_bytes,
                    t0,
                    t1,
                })
            };
            let dmas = |results: &mut [MoveResult], timings: &mut Vec<Timed>| {
                let t0 = self.dma_begin(&lane.dma);
                self.slot_dmas(dir, &lane.dma, s, stage, results);
                self.dma_end(&lane.dma, t0, slice_bytes, timings);
            };
            let step = |results: &mut [MoveResult],
                        timings: &mut Vec<Timed>|
             -> Result<Timed, CudaError> {
                if slot.flags() {
                    // The previous use of the slot has finished with its staging memory.
                    // SAFETY: the slot's flag word lives as long as the mover's flag buffer.
                    unsafe { first.wait_flag(slot.free_flag, prev) }?;
                }
                let t = match dir {
                    Dir::Store => {
                        let t = launch(kernels.gather)?;
                        handoff(slot, first, second)?;
                        dmas(results, timings);
                        t
                    }
                    Dir::Load => {
                        dmas(results, timings);
                        handoff(slot, first, second)?;
                        if k == 0 {
                            if let Some(ev) = after {
                                // SAFETY: `ev` is the job's token event, alive until the job finishes.
                                unsafe { lane.kern.wait(ev) }?;
                            }
                        }
                        launch(kernels.scatter)?
                    }
                };
                if slot.flags() {
                    // SAFETY: the slot's flag word lives as long as the mover's flag buffer.
                    unsafe { second.write_flag(slot.free_flag, slot.seq) }?;
                } else {
                    slot.free.record(second)?;
                }
                Ok(t)
            };
            match step(results, timings) {
                Ok(t) => {
                    timings.push(t);
                    bytes += slice_bytes;
                }
                Err(e) => {
                    for &b in &s.blocks {
                        results[b] = Err(self.move_error(&e));
                    }
                    // Keep the protocol whatever was queued, so that no later wait hangs and
                    // `done` (on the second stream) still follows everything of this use:
                    // first waits for the previous use (a repeated wait is harmless), hands
                    // over to second, and second marks the slot free.
                    if slot.flags() {
                        // SAFETY: the slot's flag word lives as long as the mover's flag buffer.
                        let _ = unsafe { first.wait_flag(slot.free_flag, prev) };
                    }
                    let _ = handoff(slot, first, second);
                    if slot.flags() {
                        // SAFETY: the slot's flag word lives as long as the mover's flag buffer.
                        let _ = unsafe { second.write_flag(slot.free_flag, slot.seq) };
                    } else {
                        let _ = slot.free.record(second);
                    }
                    let _ = slot.descs_read[j].record(&lane.kern);
                }
            }
        }
        self.counters
            .staged_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        done.record(second)
    }

    /// Waits on the host for `ev` (a step the caller cannot go on without), traced as `what`.
    pub(super) fn host_wait(
        &self,
        dir: Dir,
        what: &'static str,
        ev: &Event,
    ) -> Result<(), CudaError> {
        if ev.query()? {
            return Ok(());
        }
        let w = std::time::Instant::now();
        ev.synchronize()?;
        if self.tracing.load(Ordering::Relaxed) {
            self.trace_host(dir, what, 0, w);
        }
        Ok(())
    }
}
