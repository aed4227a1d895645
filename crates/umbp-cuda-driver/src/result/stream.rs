//! Streams: one checked function per driver entry point (`cuStreamCreate*`,
//! `cuStreamDestroy`, `cuStreamSynchronize`, `cuStreamWaitEvent`, `cuStreamIsCapturing`, the
//! 32-bit stream memory operations).

use std::ffi::{c_int, c_uint};

use super::check::check;
use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuStreamCreate` in the current context, with `flags` (`CU_STREAM_*`).
pub fn stream_create(drv: &Driver, flags: c_uint) -> Result<CUstream, CudaError> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver fails without a current context.
    check(drv, "cuStreamCreate", unsafe {
        (drv.stream_create)(&mut s, flags)
    })?;
    Ok(s)
}

/// `cuStreamCreateWithPriority` in the current context, with `flags` (`CU_STREAM_*`) and
/// `priority` (see [`super::context::ctx_get_stream_priority_range`]).
pub fn stream_create_with_priority(
    drv: &Driver,
    flags: c_uint,
    priority: c_int,
) -> Result<CUstream, CudaError> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver clamps the priority to the context's range.
    check(drv, "cuStreamCreateWithPriority", unsafe {
        (drv.stream_create_with_priority)(&mut s, flags, priority)
    })?;
    Ok(s)
}

/// `cuStreamDestroy_v2`.
///
/// # Safety
/// `stream` must be a live stream that nothing uses after this call.
pub unsafe fn stream_destroy(drv: &Driver, stream: CUstream) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuStreamDestroy", unsafe {
        (drv.stream_destroy)(stream)
    })
}

/// `cuStreamSynchronize`: waits on the host for all work queued on `stream`.
///
/// # Safety
/// `stream` must be 0 or a live stream.
pub unsafe fn stream_synchronize(drv: &Driver, stream: CUstream) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuStreamSynchronize", unsafe {
        (drv.stream_synchronize)(stream)
    })
}

/// `cuStreamWaitEvent`: later work on `stream` waits for `event`'s latest record.
///
/// # Safety
/// `stream` must be a live stream and `event` a live event, of the same context.
pub unsafe fn stream_wait_event(
    drv: &Driver,
    stream: CUstream,
    event: CUevent,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract; flags must be 0.
    check(drv, "cuStreamWaitEvent", unsafe {
        (drv.stream_wait_event)(stream, event, 0)
    })
}

/// `cuStreamIsCapturing`: whether `stream` is being captured into a CUDA graph.
///
/// # Safety
/// `stream` must be 0 (the legacy default stream) or a live stream of the current context.
pub unsafe fn stream_is_capturing(drv: &Driver, stream: CUstream) -> Result<bool, CudaError> {
    let mut status: c_int = 0;
    // SAFETY: forwarded contract; a valid out-pointer.
    check(drv, "cuStreamIsCapturing", unsafe {
        (drv.stream_is_capturing)(stream, &mut status)
    })?;
    Ok(status != CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `cuStreamWaitValue32_v2`: later work on `stream` waits until the 32-bit word at device
/// address `addr` satisfies `flags` (`CU_STREAM_WAIT_VALUE_*`) against `value`. An error
/// where the driver does not export it (or `UMBP_CUDA_NO_STREAM_MEMOPS` is set).
///
/// # Safety
/// `stream` must be a live stream; `addr` a 4-byte-aligned word of device memory of its
/// device that stays allocated until the wait has completed.
pub unsafe fn stream_wait_value32(
    drv: &Driver,
    stream: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: c_uint,
) -> Result<(), CudaError> {
    let f = drv
        .stream_wait_value32
        .ok_or_else(|| CudaError::Invalid("cuStreamWaitValue32 is not exported".into()))?;
    // SAFETY: forwarded contract.
    check(drv, "cuStreamWaitValue32", unsafe {
        f(stream, addr, value, flags)
    })
}

/// `cuStreamWriteValue32_v2`: `stream` writes `value` to the 32-bit word at device address
/// `addr`, as `flags` (`CU_STREAM_WRITE_VALUE_*`) say. An error where the driver does not
/// export it (or `UMBP_CUDA_NO_STREAM_MEMOPS` is set).
///
/// # Safety
/// As [`stream_wait_value32`]; nothing else may use the word meanwhile.
pub unsafe fn stream_write_value32(
    drv: &Driver,
    stream: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: c_uint,
) -> Result<(), CudaError> {
    let f = drv
        .stream_write_value32
        .ok_or_else(|| CudaError::Invalid("cuStreamWriteValue32 is not exported".into()))?;
    // SAFETY: forwarded contract.
    check(drv, "cuStreamWriteValue32", unsafe {
        f(stream, addr, value, flags)
    })
}
