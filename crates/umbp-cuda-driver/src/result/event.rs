//! Events: one checked function per driver entry point (`cuEventCreate`, `cuEventRecord`,
//! `cuEventQuery`, `cuEventSynchronize`, `cuEventElapsedTime`, `cuEventDestroy`).

use std::ffi::c_uint;

use super::check::check;
use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuEventCreate` in the current context, with `flags` (`CU_EVENT_*`).
pub fn event_create(drv: &Driver, flags: c_uint) -> Result<CUevent, CudaError> {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver fails without a current context.
    check(drv, "cuEventCreate", unsafe {
        (drv.event_create)(&mut e, flags)
    })?;
    Ok(e)
}

/// `cuEventRecord`: records `event` on `stream`.
///
/// # Safety
/// `event` must be a live event and `stream` 0 (the legacy default stream) or a live stream,
/// of the same context.
pub unsafe fn event_record(
    drv: &Driver,
    event: CUevent,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuEventRecord", unsafe {
        (drv.event_record)(event, stream)
    })
}

/// `cuEventQuery`: whether `event`'s latest record has completed (never blocks;
/// `CUDA_ERROR_NOT_READY` is `Ok(false)`).
///
/// # Safety
/// `event` must be a live event.
pub unsafe fn event_query(drv: &Driver, event: CUevent) -> Result<bool, CudaError> {
    // SAFETY: forwarded contract.
    match unsafe { (drv.event_query)(event) } {
        CUDA_SUCCESS => Ok(true),
        CUDA_ERROR_NOT_READY => Ok(false),
        rc => check(drv, "cuEventQuery", rc).map(|_| false),
    }
}

/// `cuEventSynchronize`: waits on the host for `event`'s latest record.
///
/// # Safety
/// `event` must be a live event.
pub unsafe fn event_synchronize(drv: &Driver, event: CUevent) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuEventSynchronize", unsafe {
        (drv.event_synchronize)(event)
    })
}

/// `cuEventElapsedTime` (`_v2` where exported): milliseconds from `start` to `end`.
///
/// # Safety
/// Both must be live events (the driver refuses ones made with `CU_EVENT_DISABLE_TIMING`).
pub unsafe fn event_elapsed_time(
    drv: &Driver,
    start: CUevent,
    end: CUevent,
) -> Result<f32, CudaError> {
    let mut ms = 0f32;
    // SAFETY: a valid out-pointer; forwarded contract for the events.
    check(drv, "cuEventElapsedTime", unsafe {
        (drv.event_elapsed_time)(&mut ms, start, end)
    })?;
    Ok(ms)
}

/// `cuEventDestroy_v2` (the driver defers destruction until pending work completes).
///
/// # Safety
/// `event` must be a live event that nothing uses after this call.
pub unsafe fn event_destroy(drv: &Driver, event: CUevent) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuEventDestroy", unsafe { (drv.event_destroy)(event) })
}
