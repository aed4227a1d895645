//! Devices and contexts: one checked function per driver entry point (`cuDeviceGet*`,
//! `cuDevicePrimaryCtx*`, `cuCtx*`, `cuThreadExchangeStreamCaptureMode`).

use std::ffi::{c_char, c_int, CStr};

use super::check::{check, need, OptionalEntryPoint};
use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuDeviceGetCount`: the devices this process sees.
pub fn device_get_count(drv: &Driver) -> Result<c_int, CudaError> {
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer.
    check(drv, "cuDeviceGetCount", unsafe {
        (drv.device_get_count)(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`: the handle of device `ordinal` (the driver refuses an ordinal it does not
/// have).
pub fn device_get(drv: &Driver, ordinal: c_int) -> Result<CUdevice, CudaError> {
    let mut dev: CUdevice = 0;
    // SAFETY: a valid out-pointer; the driver checks the ordinal.
    check(drv, "cuDeviceGet", unsafe {
        (drv.device_get)(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// `cuDeviceGetAttribute`: attribute `attr` (`CU_DEVICE_ATTRIBUTE_*`) of device `dev`.
pub fn device_get_attribute(drv: &Driver, dev: CUdevice, attr: c_int) -> Result<c_int, CudaError> {
    let mut v: c_int = 0;
    // SAFETY: a valid out-pointer; the driver checks the device handle and attribute.
    check(drv, "cuDeviceGetAttribute", unsafe {
        (drv.device_get_attribute)(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// `cuDeviceGetName`: device `dev`'s name (at most 127 bytes).
pub fn device_get_name(drv: &Driver, dev: CUdevice) -> Result<String, CudaError> {
    let mut name = [0 as c_char; 128];
    // SAFETY: the buffer holds 128 bytes and the driver writes a NUL-terminated name of at
    // most that many.
    check(drv, "cuDeviceGetName", unsafe {
        (drv.device_get_name)(name.as_mut_ptr(), 128, dev)
    })?;
    // SAFETY: NUL-terminated by the driver (and by our zeroed buffer's end).
    Ok(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cuDeviceGetUuid_v2` (a MIG instance's own UUID; `cuDeviceGetUuid` on older drivers):
/// device `dev`'s UUID, the same in every process.
pub fn device_get_uuid(drv: &Driver, dev: CUdevice) -> Result<[u8; 16], CudaError> {
    let f = need(drv, drv.device_get_uuid, OptionalEntryPoint::DeviceGetUuid)?;
    let mut u = CUuuid::default();
    // SAFETY: a valid out-pointer to a 16-byte CUuuid; the driver checks the device handle.
    check(drv, "cuDeviceGetUuid", unsafe { f(&mut u, dev) })?;
    Ok(u.bytes.map(|b| b as u8))
}

/// `cuDevicePrimaryCtxRetain`: device `dev`'s primary context, retained (release it with
/// [`primary_ctx_release`]).
pub fn primary_ctx_retain(drv: &Driver, dev: CUdevice) -> Result<CUcontext, CudaError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver checks the device handle.
    check(drv, "cuDevicePrimaryCtxRetain", unsafe {
        (drv.primary_ctx_retain)(&mut ctx, dev)
    })?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease_v2`: drops one retain of device `dev`'s primary context.
///
/// # Safety
/// The caller holds a retain of it ([`primary_ctx_retain`]) that nothing uses any more.
pub unsafe fn primary_ctx_release(drv: &Driver, dev: CUdevice) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuDevicePrimaryCtxRelease", unsafe {
        (drv.primary_ctx_release)(dev)
    })
}

/// `cuCtxSetCurrent`: makes `ctx` this thread's current context.
///
/// # Safety
/// `ctx` must be a live (retained) context.
pub unsafe fn ctx_set_current(drv: &Driver, ctx: CUcontext) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuCtxSetCurrent", unsafe {
        (drv.ctx_set_current)(ctx)
    })
}

/// `cuCtxPushCurrent_v2`: pushes `ctx` on this thread's context stack (pop it with
/// [`ctx_pop_current`]).
///
/// # Safety
/// `ctx` must be a live (retained) context, retained until it is popped.
pub unsafe fn ctx_push_current(drv: &Driver, ctx: CUcontext) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuCtxPushCurrent", unsafe {
        (drv.ctx_push_current)(ctx)
    })
}

/// `cuCtxPopCurrent_v2`: pops this thread's current context, returning it.
pub fn ctx_pop_current(drv: &Driver) -> Result<CUcontext, CudaError> {
    let mut old: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver refuses to pop an empty stack.
    check(drv, "cuCtxPopCurrent", unsafe {
        (drv.ctx_pop_current)(&mut old)
    })?;
    Ok(old)
}

/// `cuCtxGetStreamPriorityRange` of the current context: `(least, greatest)` priority.
pub fn ctx_get_stream_priority_range(drv: &Driver) -> Result<(c_int, c_int), CudaError> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: valid out-pointers; the driver fails without a current context.
    check(drv, "cuCtxGetStreamPriorityRange", unsafe {
        (drv.ctx_get_stream_priority_range)(&mut least, &mut greatest)
    })?;
    Ok((least, greatest))
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's stream capture mode to `mode`
/// (`CU_STREAM_CAPTURE_MODE_*`), returning the one it had.
pub fn thread_exchange_stream_capture_mode(drv: &Driver, mode: c_int) -> Result<c_int, CudaError> {
    let mut mode = mode;
    // SAFETY: a valid in/out pointer; changes only this thread's capture mode.
    let code = unsafe { (drv.thread_exchange_stream_capture_mode)(&mut mode) };
    check(drv, "cuThreadExchangeStreamCaptureMode", code)?;
    Ok(mode)
}
