//! A CUDA device with its retained primary context (the one PyTorch uses), and making that
//! context current: for UMBP's own threads ([`Device::bind_thread`]) or for the span of a
//! call on a caller's thread ([`Device::scoped`]).

use std::ffi::c_int;
use std::sync::Arc;

use crate::error::CudaError;
use crate::result;
use crate::sys::library::Driver;
use crate::sys::types::*;

thread_local! {
    /// Whether this thread was put in the relaxed stream capture mode ([`Device::bind_thread`]).
    static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// One CUDA device and its retained primary context (the context PyTorch uses too).
#[derive(Debug)]
pub struct Device {
    pub(super) drv: &'static Driver,
    ordinal: i32,
    dev: CUdevice,
    ctx: Ctx,
    /// `CU_DEVICE_ATTRIBUTE_MAX_PITCH`: the largest pitch of a 2-D / 3-D copy.
    pub max_pitch: u64,
    /// Multiprocessors.
    pub sm_count: u32,
    /// Copy engines (`ASYNC_ENGINE_COUNT`).
    pub copy_engines: u32,
    /// The device's name.
    pub name: String,
}

#[derive(Debug, Clone, Copy)]
struct Ctx(CUcontext);
// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe; a
// context is made current per thread before use).
unsafe impl Send for Ctx {}
// SAFETY: as above; the handle is never mutated through a shared reference.
unsafe impl Sync for Ctx {}

/// Pops the context pushed by [`Device::scoped`] when dropped.
#[derive(Debug)]
pub struct CtxGuard<'a> {
    dev: &'a Device,
}

impl Drop for CtxGuard<'_> {
    fn drop(&mut self) {
        // Pops the context this guard pushed on this thread.
        let _ = result::context::ctx_pop_current(self.dev.drv);
    }
}

impl Device {
    /// Loads the driver if needed, and retains device `ordinal`'s primary context.
    pub fn open(ordinal: i32) -> Result<Arc<Device>, CudaError> {
        let drv = result::driver()?;
        let count = result::context::device_get_count(drv)?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::Device {
                device: ordinal,
                reason: format!(
                    "this process sees {count} CUDA device(s) (ordinals 0..{count}); check CUDA_VISIBLE_DEVICES"
                ),
            });
        }
        let dev = result::context::device_get(drv, ordinal)?;
        let ctx = result::context::primary_ctx_retain(drv, dev)?;
        let attr = |a: c_int| -> Result<i64, CudaError> {
            Ok(i64::from(result::context::device_get_attribute(
                drv, dev, a,
            )?))
        };
        let name = result::context::device_get_name(drv, dev).unwrap_or_else(|_| "unknown".into());
        let d = Device {
            drv,
            ordinal,
            dev,
            ctx: Ctx(ctx),
            max_pitch: attr(CU_DEVICE_ATTRIBUTE_MAX_PITCH)?.max(1) as u64,
            sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
            copy_engines: attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?.max(0) as u32,
            name,
        };
        log::info!(
            "umbp: CUDA device {} ({}): {} SMs, {} copy engines, max pitch {}",
            d.ordinal,
            d.name,
            d.sm_count,
            d.copy_engines,
            d.max_pitch
        );
        Ok(Arc::new(d))
    }

    /// The driver.
    pub fn driver(&self) -> &'static Driver {
        self.drv
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The driver's handle of the device.
    pub fn raw_device(&self) -> CUdevice {
        self.dev
    }

    /// The device's UUID (`cuDeviceGetUuid_v2`: a MIG instance's own): the same in every
    /// process, unlike the ordinal, which depends on `CUDA_VISIBLE_DEVICES`.
    pub fn uuid(&self) -> Result<[u8; 16], CudaError> {
        result::context::device_get_uuid(self.drv, self.dev)
    }

    /// Makes the primary context current on this thread, for UMBP's own threads only (never
    /// an engine's): the first call on a thread also puts it in the relaxed stream capture
    /// mode. In the default (global) mode, a driver call that CUDA deems unsafe during
    /// capture (`cuMemHostRegister`, `cuMemAlloc`, ...) made by any thread while another
    /// thread captures a CUDA graph fails and invalidates that capture: the pool's background
    /// registration broke vLLM's graph capture at start-up and the engine failed to start
    /// (issue 28). None of UMBP's calls touch a stream being captured, so relaxed is safe.
    pub fn bind_thread(&self) -> Result<(), CudaError> {
        result::driver()?;
        // SAFETY: a retained primary context.
        unsafe { result::context::ctx_set_current(self.drv, self.ctx.0) }?;
        RELAXED.with(|done| {
            if done.get() {
                return Ok(());
            }
            result::context::thread_exchange_stream_capture_mode(
                self.drv,
                CU_STREAM_CAPTURE_MODE_RELAXED,
            )?;
            done.set(true);
            Ok(())
        })
    }

    /// Pushes the primary context on this thread until the guard drops (for callers' threads,
    /// whose current context is left as it was).
    pub fn scoped(&self) -> Result<CtxGuard<'_>, CudaError> {
        result::driver()?;
        // SAFETY: a retained primary context, retained until `self` drops, after the guard
        // that pops it.
        unsafe { result::context::ctx_push_current(self.drv, self.ctx.0) }?;
        Ok(CtxGuard { dev: self })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            // SAFETY: releases the retain taken in `open`; nothing uses the context through
            // this device any more.
            let _ = unsafe { result::context::primary_ctx_release(self.drv, self.dev) };
        }
    }
}
