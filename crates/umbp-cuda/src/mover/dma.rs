//! The DMA method: copy engines only. Pieces adjacent on both sides merge, equal pieces at
//! constant strides become one 2-D copy (3-D above the maximum pitch), the rest go in batched
//! copy calls where the driver has them.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use umbp_copy::{BlockCopy, MoveResult};

use super::spans::Timed;
use super::{CudaMover, Dir};
use crate::plan::{self, Run};
use umbp_cuda_driver::sys::types::*;
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Event, Stream};

impl CudaMover {
    pub(super) fn run_dma(
        &self,
        dir: Dir,
        blocks: &[BlockCopy<'_>],
        after: Option<CUevent>,
        done: &Event,
        results: &mut [MoveResult],
        timings: &mut Vec<Timed>,
    ) -> Result<(), CudaError> {
        let lane = self.lane(dir);
        if let Some(ev) = after {
            // SAFETY: `ev` is the job's token event, alive until the job finishes.
            unsafe { lane.dma.wait(ev) }?;
        }
        let (base, g) = (self.pinner.progress().base, self.pinner.progress().chunk);
        let ps = plan::split(&plan::pieces(blocks), base, g);
        let runs = plan::runs(&ps, base, g);
        let t0 = self.dma_begin(&lane.dma);
        let mut singles: Vec<Run> = Vec::new();
        let mut bytes = 0u64;
        for r in runs {
            bytes += r.bytes();
            if r.count == 1 {
                singles.push(r);
                continue;
            }
            if let Err(e) = self.strided(dir, &lane.dma, &r) {
                log::debug!("umbp: strided copy failed ({e}); copying its rows one by one");
                for i in 0..r.count {
                    singles.push(Run {
                        dev: r.dev + i * r.dev_stride,
                        host: r.host + i * r.host_stride,
                        count: 1,
                        ..r
                    });
                }
            }
        }
        self.singles(dir, &lane.dma, &singles, results);
        self.dma_end(&lane.dma, t0, bytes, timings);
        self.counters.dma_bytes.fetch_add(bytes, Ordering::Relaxed);
        done.record(&lane.dma)
    }

    /// One strided run as a 2-D copy, or a 3-D copy when a stride is above the maximum pitch.
    pub(super) fn strided(&self, dir: Dir, stream: &Stream, r: &Run) -> Result<(), CudaError> {
        let maxp = self.dev.max_pitch;
        if r.dev_stride <= maxp && r.host_stride <= maxp {
            let mut c = CUDA_MEMCPY2D::zeroed();
            c.WidthInBytes = r.len as usize;
            c.Height = r.count as usize;
            match dir {
                Dir::Store => {
                    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
                    c.srcDevice = r.dev;
                    c.srcPitch = r.dev_stride as usize;
                    c.dstMemoryType = CU_MEMORYTYPE_HOST;
                    c.dstHost = r.host as *mut c_void;
                    c.dstPitch = r.host_stride as usize;
                }
                Dir::Load => {
                    c.srcMemoryType = CU_MEMORYTYPE_HOST;
                    c.srcHost = r.host as *const c_void;
                    c.srcPitch = r.host_stride as usize;
                    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                    c.dstDevice = r.dev;
                    c.dstPitch = r.dev_stride as usize;
                }
            }
            // SAFETY: both sides were checked by the engine (device side against a CUDA
            // registration, host side is a pool object of this batch); the struct is fully
            // initialised.
            unsafe { stream.copy_2d(&c) }?;
            self.counters.copies_2d.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let no_fit = || CudaError::Invalid(format!("no pitch <= {maxp} divides stride"));
        let (dp, dh) = plan::pitch_for(r.dev_stride, r.len, maxp).ok_or_else(no_fit)?;
        let (hp, hh) = plan::pitch_for(r.host_stride, r.len, maxp).ok_or_else(no_fit)?;
        let mut c = CUDA_MEMCPY3D::zeroed();
        c.WidthInBytes = r.len as usize;
        c.Height = 1;
        c.Depth = r.count as usize;
        match dir {
            Dir::Store => {
                c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
                c.srcDevice = r.dev;
                c.srcPitch = dp as usize;
                c.srcHeight = dh as usize;
                c.dstMemoryType = CU_MEMORYTYPE_HOST;
                c.dstHost = r.host as *mut c_void;
                c.dstPitch = hp as usize;
                c.dstHeight = hh as usize;
            }
            Dir::Load => {
                c.srcMemoryType = CU_MEMORYTYPE_HOST;
                c.srcHost = r.host as *const c_void;
                c.srcPitch = hp as usize;
                c.srcHeight = hh as usize;
                c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                c.dstDevice = r.dev;
                c.dstPitch = dp as usize;
                c.dstHeight = dh as usize;
            }
        }
        // SAFETY: as for the 2-D copy; slice z starts at pitch * height * z = stride * z.
        unsafe { stream.copy_3d(&c) }?;
        self.counters.copies_3d.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Plain copies: batched where the driver can and every host side is registered, else one
    /// call each. A failure fails the blocks the copy touches.
    pub(super) fn singles(
        &self,
        dir: Dir,
        stream: &Stream,
        runs: &[Run],
        results: &mut [MoveResult],
    ) {
        if runs.is_empty() {
            return;
        }
        let pin = self.pinner.progress();
        let batchable = runs.len() >= 2 && runs.iter().all(|r| pin.is_registered(r.host, r.len));
        if batchable && stream.can_batch() {
            let mut ok = true;
            for chunk in runs.chunks(4096) {
                let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) = chunk
                    .iter()
                    .map(|r| match dir {
                        Dir::Store => (r.host, r.dev),
                        Dir::Load => (r.dev, r.host),
                    })
                    .unzip();
                let mut sizes: Vec<usize> = chunk.iter().map(|r| r.len as usize).collect();
                // SAFETY: the arrays hold one entry per copy; every device address was checked
                // by the engine and every host side is a registered pool object of this batch.
                let rc = unsafe { stream.copy_batch(&mut dsts, &mut srcs, &mut sizes) };
                if let Err(e) = rc {
                    log::debug!("umbp: batched copy failed ({e}); copying one by one");
                    ok = false;
                    break;
                }
                self.counters.batch_calls.fetch_add(1, Ordering::Relaxed);
            }
            if ok {
                return;
            }
        }
        for r in runs {
            let rc = match dir {
                // SAFETY: as for the batched copies; `r.host` is a pool object, `r.dev` checked.
                Dir::Store => unsafe {
                    self.dev.copy_dtoh(r.host as *mut u8, r.dev, r.len, stream)
                },
                // SAFETY: as above.
                Dir::Load => unsafe {
                    self.dev
                        .copy_htod(r.dev, r.host as *const u8, r.len, stream)
                },
            };
            match rc {
                Ok(()) => {
                    self.counters.copies_1d.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    for b in r.first_block..=r.last_block {
                        results[b as usize] = Err(self.move_error(&e));
                    }
                }
            }
        }
    }
}
