//! Memory and copies: one checked function per driver entry point (`cuMemAlloc`,
//! `cuMemFree`, `cuMemHost*`, `cuMemsetD8Async`, the `cuMemcpy*Async` family,
//! `cuPointerGetAttribute`, `cuMemGetAddressRange`).

use std::ffi::{c_int, c_uint, c_void};

use super::check::{check, need, OptionalEntryPoint};
use crate::error::CudaError;
use crate::sys::library::{BatchFn, Driver};
use crate::sys::types::*;

/// `cuMemAlloc_v2`: `len` bytes of device memory in the current context.
pub fn mem_alloc(drv: &Driver, len: usize) -> Result<CUdeviceptr, CudaError> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; the driver fails without a current context.
    check(drv, "cuMemAlloc", unsafe { (drv.mem_alloc)(&mut p, len) })?;
    Ok(p)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// `ptr` must be an allocation of [`mem_alloc`] that no queued or later work uses.
pub unsafe fn mem_free(drv: &Driver, ptr: CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemFree", unsafe { (drv.mem_free)(ptr) })
}

/// `cuMemHostAlloc`: `len` bytes of pinned host memory, with `flags`
/// (`CU_MEMHOSTALLOC_*`, the same bits as `CU_MEMHOSTREGISTER_*`).
pub fn mem_host_alloc(drv: &Driver, len: usize, flags: c_uint) -> Result<*mut c_void, CudaError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(drv, "cuMemHostAlloc", unsafe {
        (drv.mem_host_alloc)(&mut p, len, flags)
    })?;
    Ok(p)
}

/// `cuMemHostGetDevicePointer_v2`: the device address of mapped pinned host memory `ptr`.
///
/// # Safety
/// `ptr` must be live pinned host memory mapped for the device ([`mem_host_alloc`] or
/// [`mem_host_register`] with `DEVICEMAP`).
pub unsafe fn mem_host_get_device_pointer(
    drv: &Driver,
    ptr: *mut c_void,
) -> Result<CUdeviceptr, CudaError> {
    let mut d: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; forwarded contract for `ptr`; flags must be 0.
    check(drv, "cuMemHostGetDevicePointer", unsafe {
        (drv.mem_host_get_device_pointer)(&mut d, ptr, 0)
    })?;
    Ok(d)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` must be an allocation of [`mem_host_alloc`] that nothing uses any more.
pub unsafe fn mem_free_host(drv: &Driver, ptr: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemFreeHost", unsafe { (drv.mem_free_host)(ptr) })
}

/// `cuMemHostRegister_v2`: pins `[ptr, ptr + len)` of host memory for DMA, with `flags`
/// (`CU_MEMHOSTREGISTER_*`).
///
/// # Safety
/// The memory must stay mapped until it is unregistered ([`mem_host_unregister`]).
pub unsafe fn mem_host_register(
    drv: &Driver,
    ptr: *mut c_void,
    len: usize,
    flags: c_uint,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemHostRegister", unsafe {
        (drv.mem_host_register)(ptr, len, flags)
    })
}

/// `cuMemHostUnregister` of the registration starting at `ptr` (its exact base).
///
/// # Safety
/// No queued or later copy may use the memory as registered memory.
pub unsafe fn mem_host_unregister(drv: &Driver, ptr: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemHostUnregister", unsafe {
        (drv.mem_host_unregister)(ptr)
    })
}

/// `cuMemsetD8Async`: sets `len` bytes at device address `ptr` to `value`, in order on
/// `stream`.
///
/// # Safety
/// `[ptr, ptr + len)` must be device memory that nothing else uses meanwhile; `stream` a live
/// stream (or 0) of its context.
pub unsafe fn memset_d8_async(
    drv: &Driver,
    ptr: CUdeviceptr,
    value: u8,
    len: usize,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemsetD8Async", unsafe {
        (drv.memset_d8_async)(ptr, value, len, stream)
    })
}

/// `cuMemcpyHtoDAsync_v2`: `len` bytes from host `src` to device `dst`, in order on `stream`.
///
/// # Safety
/// Both ranges must be valid (host readable, device memory of the stream's device) until the
/// copy has completed, and the host side must not be written meanwhile; `stream` a live
/// stream (or 0).
pub unsafe fn memcpy_htod_async(
    drv: &Driver,
    dst: CUdeviceptr,
    src: *const c_void,
    len: usize,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemcpyHtoDAsync", unsafe {
        (drv.memcpy_htod_async)(dst, src, len, stream)
    })
}

/// `cuMemcpyDtoHAsync_v2`: `len` bytes from device `src` to host `dst`, in order on `stream`.
///
/// # Safety
/// As [`memcpy_htod_async`], with the host side writable and untouched until completion.
pub unsafe fn memcpy_dtoh_async(
    drv: &Driver,
    dst: *mut c_void,
    src: CUdeviceptr,
    len: usize,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuMemcpyDtoHAsync", unsafe {
        (drv.memcpy_dtoh_async)(dst, src, len, stream)
    })
}

/// `cuMemcpy2DAsync_v2`: the 2-D copy `copy`, in order on `stream`.
///
/// # Safety
/// Every row of both sides must be valid memory (device memory of the stream's device, or
/// host memory registered or pageable) until the copy has completed, nothing else may write
/// the destination meanwhile, and `stream` must be a live stream (or 0).
pub unsafe fn memcpy_2d_async(
    drv: &Driver,
    copy: &CUDA_MEMCPY2D,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract; `copy` is a fully initialised struct.
    check(drv, "cuMemcpy2DAsync", unsafe {
        (drv.memcpy_2d_async)(copy, stream)
    })
}

/// `cuMemcpy3DAsync_v2`: the 3-D copy `copy`, in order on `stream`.
///
/// # Safety
/// As [`memcpy_2d_async`], for every slice.
pub unsafe fn memcpy_3d_async(
    drv: &Driver,
    copy: &CUDA_MEMCPY3D,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract; `copy` is a fully initialised struct.
    check(drv, "cuMemcpy3DAsync", unsafe {
        (drv.memcpy_3d_async)(copy, stream)
    })
}

/// `cuMemcpyBatchAsync_v2` (CUDA 13.0) or `cuMemcpyBatchAsync` (CUDA 12.8, whose failure
/// index is dropped): `sizes.len()` plain copies, `srcs[i]` to `dsts[i]`, in order on
/// `stream`, attribute `attrs[j]` applying from copy `attr_idxs[j]` on. An error where the
/// driver exports neither (or `UMBP_CUDA_NO_BATCH` is set).
///
/// # Safety
/// `dsts`, `srcs` and `sizes` have the same length, and so do `attrs` and `attr_idxs`; each
/// pair of ranges is valid device memory of the stream's device or registered host memory
/// until the copies complete, nothing else writes the destinations meanwhile, and `stream`
/// is a live stream (never the legacy NULL stream).
pub unsafe fn memcpy_batch_async(
    drv: &Driver,
    dsts: &mut [CUdeviceptr],
    srcs: &mut [CUdeviceptr],
    sizes: &mut [usize],
    attrs: &mut [CUmemcpyAttributes],
    attr_idxs: &mut [usize],
    stream: CUstream,
) -> Result<(), CudaError> {
    let batch = drv
        .memcpy_batch_async
        .as_ref()
        .ok_or_else(|| CudaError::Invalid("cuMemcpyBatchAsync is not exported".into()))?;
    let rc = match batch {
        // SAFETY: forwarded contract: the arrays hold as many entries as passed.
        BatchFn::V2(f) => unsafe {
            f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                attrs.as_mut_ptr(),
                attr_idxs.as_mut_ptr(),
                attrs.len(),
                stream,
            )
        },
        BatchFn::V1(f) => {
            let mut fail = 0usize;
            // SAFETY: as above, with the 12.8 ABI's failIdx out-pointer.
            unsafe {
                f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    sizes.len(),
                    attrs.as_mut_ptr(),
                    attr_idxs.as_mut_ptr(),
                    attrs.len(),
                    &mut fail,
                    stream,
                )
            }
        }
    };
    check(drv, "cuMemcpyBatchAsync", rc)
}

/// The pointer attributes [`pointer_get_attribute`] reads: each one's value fits in 8 bytes.
const ATTRIBUTES_IN_EIGHT_BYTES: [c_int; 10] = [
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CU_POINTER_ATTRIBUTE_IS_MANAGED,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
    CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
    CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
];

/// `cuPointerGetAttribute` of `attr` at address `ptr`, widened to a u64 (booleans, ordinals,
/// types and flags land in its low bytes). Only the `CU_POINTER_ATTRIBUTE_*` constants of
/// [`crate::sys`] are read; any other attribute is an error (its value might not fit).
pub fn pointer_get_attribute(
    drv: &Driver,
    attr: c_int,
    ptr: CUdeviceptr,
) -> Result<u64, CudaError> {
    if !ATTRIBUTES_IN_EIGHT_BYTES.contains(&attr) {
        return Err(CudaError::Invalid(format!(
            "cuPointerGetAttribute: pointer attribute {attr} is not one UMBP reads"
        )));
    }
    let mut v: u64 = 0;
    // SAFETY: every attribute let through above writes at most 8 bytes into the zeroed u64;
    // the driver only looks the address up.
    check(drv, "cuPointerGetAttribute", unsafe {
        (drv.pointer_get_attribute)(&mut v as *mut u64 as *mut c_void, attr, ptr)
    })?;
    Ok(v)
}

/// `cuMemGetAddressRange_v2`: the start and size of the allocation holding `ptr`.
pub fn mem_get_address_range(
    drv: &Driver,
    ptr: CUdeviceptr,
) -> Result<(CUdeviceptr, usize), CudaError> {
    let f = need(
        drv,
        drv.mem_get_address_range,
        OptionalEntryPoint::MemGetAddressRange,
    )?;
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; the driver only looks the address up.
    check(drv, "cuMemGetAddressRange", unsafe {
        f(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}
