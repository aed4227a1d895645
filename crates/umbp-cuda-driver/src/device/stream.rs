//! Streams owned by UMBP ([`Stream`]): made on a [`Device`], the copies, flag operations and
//! kernel launches queued on them, and the caller's streams UMBP only inspects.

use std::ffi::c_void;
use std::sync::Arc;

use super::context::Device;
use crate::error::CudaError;
use crate::result;
use crate::sys::types::*;

impl Device {
    /// A new non-blocking stream (no implicit synchronisation with the legacy default stream).
    pub fn stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        let _g = self.scoped()?;
        let s = result::stream::stream_create(self.drv, CU_STREAM_NON_BLOCKING)?;
        Ok(Stream {
            dev: Arc::clone(self),
            raw: s,
        })
    }

    /// A new non-blocking stream with the context's greatest priority: the GPU schedules its
    /// pending thread blocks ahead of other streams' (for the brief staging kernels, so they
    /// are not starved by long compute kernels).
    pub fn priority_stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        let _g = self.scoped()?;
        let (_least, greatest) = result::context::ctx_get_stream_priority_range(self.drv)?;
        let s = result::stream::stream_create_with_priority(
            self.drv,
            CU_STREAM_NON_BLOCKING,
            greatest,
        )?;
        Ok(Stream {
            dev: Arc::clone(self),
            raw: s,
        })
    }

    /// Whether `stream` (a caller's raw handle; 0 is the legacy default stream) is being
    /// captured into a CUDA graph. Needs a current context.
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream handle of this device's context.
    pub unsafe fn is_capturing(&self, stream: CUstream) -> Result<bool, CudaError> {
        // SAFETY: forwarded contract.
        unsafe { result::stream::stream_is_capturing(self.drv, stream) }
    }

    /// Waits for all work on `stream`.
    pub fn synchronize(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: a live stream of this device.
        unsafe { result::stream::stream_synchronize(self.drv, stream.raw) }
    }
}

/// A stream owned by UMBP.
#[derive(Debug)]
pub struct Stream {
    dev: Arc<Device>,
    raw: CUstream,
}

// SAFETY: stream handles may be used from any thread; the driver serialises calls on a stream.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// The raw handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Makes later work on this stream wait for `event`'s latest record.
    ///
    /// # Safety
    /// `event` must be a live event of this device's context.
    pub unsafe fn wait(&self, event: CUevent) -> Result<(), CudaError> {
        // SAFETY: a live stream; forwarded contract for the event.
        unsafe { result::stream::stream_wait_event(self.dev.drv, self.raw, event) }
    }

    /// Makes later work on this stream wait until the 32-bit word at device address `flag`
    /// has reached `value` (cyclically: `(i32)(*flag - value) >= 0`), a stream memory
    /// operation: the GPU polls device memory, no PCIe.
    ///
    /// # Safety
    /// `flag` must be a 4-byte-aligned word of device memory of this device that stays
    /// allocated until the wait has completed.
    pub unsafe fn wait_flag(&self, flag: u64, value: u32) -> Result<(), CudaError> {
        // SAFETY: a live stream; forwarded contract for `flag`.
        unsafe {
            result::stream::stream_wait_value32(
                self.dev.drv,
                self.raw,
                flag,
                value,
                CU_STREAM_WAIT_VALUE_GEQ,
            )
        }
    }

    /// Writes `value` to the 32-bit word at device address `flag` once this stream's earlier
    /// work has finished and its writes are visible (the driver refuses the variant without
    /// that barrier on the H200 here).
    ///
    /// # Safety
    /// As [`Stream::wait_flag`]; nothing else may use the word but flag waits and writes.
    pub unsafe fn write_flag(&self, flag: u64, value: u32) -> Result<(), CudaError> {
        // SAFETY: as for `wait_flag`: a live stream, forwarded contract.
        unsafe {
            result::stream::stream_write_value32(
                self.dev.drv,
                self.raw,
                flag,
                value,
                CU_STREAM_WRITE_VALUE_DEFAULT,
            )
        }
    }

    /// Queues the 2-D copy `c`.
    ///
    /// # Safety
    /// Every row of both sides must be valid memory (device memory of this device, or host
    /// memory registered or pageable) until the copy has completed, and nothing else may write
    /// the destination meanwhile.
    pub unsafe fn copy_2d(&self, c: &CUDA_MEMCPY2D) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream.
        unsafe { result::memory::memcpy_2d_async(self.dev.drv, c, self.raw) }
    }

    /// Queues the 3-D copy `c`.
    ///
    /// # Safety
    /// As [`Stream::copy_2d`], for every slice.
    pub unsafe fn copy_3d(&self, c: &CUDA_MEMCPY3D) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream.
        unsafe { result::memory::memcpy_3d_async(self.dev.drv, c, self.raw) }
    }

    /// Whether the driver can batch copies ([`Stream::copy_batch`]).
    pub fn can_batch(&self) -> bool {
        self.dev.drv.has_batch_copy()
    }

    /// Queues `sizes.len()` plain copies, `srcs[i]` to `dsts[i]`, in one driver call, ordered
    /// after the stream's earlier work and preferring overlap with compute.
    ///
    /// # Safety
    /// The three slices have the same length; each pair of ranges is valid device memory of
    /// this device or registered host memory until the copies complete, and nothing else
    /// writes the destinations meanwhile.
    pub unsafe fn copy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
    ) -> Result<(), CudaError> {
        let n = sizes.len();
        debug_assert!(dsts.len() == n && srcs.len() == n);
        let mut attrs = [CUmemcpyAttributes {
            srcAccessOrder: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            flags: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
            ..Default::default()
        }];
        let mut idx = [0usize];
        // SAFETY: forwarded contract; one attribute applies to all copies; the stream is ours
        // (never the legacy NULL stream).
        unsafe {
            result::memory::memcpy_batch_async(
                self.dev.drv,
                dsts,
                srcs,
                sizes,
                &mut attrs,
                &mut idx,
                self.raw,
            )
        }
    }

    /// Queues kernel `f` on `grid` thread blocks of `block` threads.
    ///
    /// # Safety
    /// `f` is a function of a live module of this context, `params` points at one live value
    /// per kernel parameter with the kernel's types, and every address the kernel reads or
    /// writes through them stays valid until the kernel has completed.
    pub unsafe fn launch(
        &self,
        f: CUfunction,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream; no dynamic shared memory, no extra
        // options.
        unsafe {
            result::module::launch_kernel(
                self.dev.drv,
                f,
                (grid, 1, 1),
                (block, 1, 1),
                0,
                self.raw,
                params,
            )
        }
    }

    /// Waits on the host for all work queued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.synchronize(self)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our stream; nothing uses it after drop.
                unsafe {
                    let _ = result::stream::stream_synchronize(self.dev.drv, self.raw);
                    let _ = result::stream::stream_destroy(self.dev.drv, self.raw);
                }
            }
        }
    }
}
