//! Memory shared between processes: one checked function per driver entry point of legacy
//! IPC handles (`cuIpc*MemHandle`) and of the virtual memory management API (`cuMemCreate`,
//! `cuMemRetainAllocationHandle`, `cuMem*ShareableHandle`, `cuMemAddress*`, `cuMemMap`, ...).
//! All of them are optional entry points: each is an error naming its export where the driver
//! lacks it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check::{check, need, OptionalEntryPoint};
use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuIpcGetMemHandle`: the legacy IPC handle of the `cuMemAlloc` allocation starting at
/// `base`.
pub fn ipc_get_mem_handle(drv: &Driver, base: CUdeviceptr) -> Result<CUipcMemHandle, CudaError> {
    let f = need(
        drv,
        drv.ipc_get_mem_handle,
        OptionalEntryPoint::IpcGetMemHandle,
    )?;
    let mut h = CUipcMemHandle {
        reserved: [0; CU_IPC_HANDLE_SIZE],
    };
    // SAFETY: a valid out-pointer; the driver only looks `base` up (and fails where it is not
    // the start of a live allocation of the current context).
    check(drv, "cuIpcGetMemHandle", unsafe { f(&mut h, base) })?;
    Ok(h)
}

/// `cuIpcOpenMemHandle_v2`: maps another process's allocation in the current context, with
/// `flags` (`CU_IPC_MEM_*`); close it with [`ipc_close_mem_handle`].
pub fn ipc_open_mem_handle(
    drv: &Driver,
    handle: CUipcMemHandle,
    flags: std::ffi::c_uint,
) -> Result<CUdeviceptr, CudaError> {
    let f = need(
        drv,
        drv.ipc_open_mem_handle,
        OptionalEntryPoint::IpcOpenMemHandle,
    )?;
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer and a 64-byte handle passed by value; the driver validates
    // the handle's contents.
    check(drv, "cuIpcOpenMemHandle", unsafe {
        f(&mut ptr, handle, flags)
    })?;
    Ok(ptr)
}

/// `cuIpcCloseMemHandle`: unmaps what [`ipc_open_mem_handle`] mapped at `ptr`.
///
/// # Safety
/// `ptr` must be a mapping of [`ipc_open_mem_handle`] in the current context that no queued
/// or later work uses.
pub unsafe fn ipc_close_mem_handle(drv: &Driver, ptr: CUdeviceptr) -> Result<(), CudaError> {
    let f = need(
        drv,
        drv.ipc_close_mem_handle,
        OptionalEntryPoint::IpcCloseMemHandle,
    )?;
    // SAFETY: forwarded contract.
    check(drv, "cuIpcCloseMemHandle", unsafe { f(ptr) })
}

/// `cuMemRetainAllocationHandle`: a new reference to the physical allocation mapped at `ptr`
/// (drop it with [`mem_release`]); fails for an address no `cuMemMap` mapping holds.
pub fn mem_retain_allocation_handle(
    drv: &Driver,
    ptr: CUdeviceptr,
) -> Result<CUmemGenericAllocationHandle, CudaError> {
    let f = need(
        drv,
        drv.mem_retain_allocation_handle,
        OptionalEntryPoint::MemRetainAllocationHandle,
    )?;
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer; the driver only looks the address up.
    check(drv, "cuMemRetainAllocationHandle", unsafe {
        f(&mut h, ptr as *mut c_void)
    })?;
    Ok(h)
}

/// `cuMemRelease`: drops one reference to a physical allocation.
///
/// # Safety
/// The caller owns that reference (of [`mem_retain_allocation_handle`], [`mem_create`] or
/// [`mem_import_from_shareable_handle`]) and does not use the handle afterwards.
pub unsafe fn mem_release(
    drv: &Driver,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CudaError> {
    let f = need(drv, drv.mem_release, OptionalEntryPoint::MemRelease)?;
    // SAFETY: forwarded contract.
    check(drv, "cuMemRelease", unsafe { f(handle) })
}

/// `cuMemGetAllocationPropertiesFromHandle`: what the physical allocation `handle` was
/// created as.
///
/// # Safety
/// `handle` must be a live allocation handle (a reference the caller holds).
pub unsafe fn mem_get_allocation_properties_from_handle(
    drv: &Driver,
    handle: CUmemGenericAllocationHandle,
) -> Result<CUmemAllocationProp, CudaError> {
    let f = need(
        drv,
        drv.mem_get_allocation_properties_from_handle,
        OptionalEntryPoint::MemGetAllocationPropertiesFromHandle,
    )?;
    let mut prop = CUmemAllocationProp::device(0, CU_MEM_HANDLE_TYPE_NONE);
    // SAFETY: a valid out-pointer to a CUmemAllocationProp; forwarded contract for the handle.
    check(drv, "cuMemGetAllocationPropertiesFromHandle", unsafe {
        f(&mut prop, handle)
    })?;
    Ok(prop)
}

/// `cuMemExportToShareableHandle` as `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a new file
/// descriptor of the physical allocation `handle`, which the caller then owns (the driver
/// may also return a negative one, which the caller must refuse).
///
/// # Safety
/// `handle` must be a live allocation handle (a reference the caller holds).
pub unsafe fn mem_export_to_posix_fd(
    drv: &Driver,
    handle: CUmemGenericAllocationHandle,
) -> Result<c_int, CudaError> {
    let f = need(
        drv,
        drv.mem_export_to_shareable_handle,
        OptionalEntryPoint::MemExportToShareableHandle,
    )?;
    let mut fd: c_int = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int into the pointed-to `fd`;
    // forwarded contract for the handle; flags must be 0.
    let rc = unsafe {
        f(
            &mut fd as *mut c_int as *mut c_void,
            handle,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check(drv, "cuMemExportToShareableHandle", rc)?;
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` of a `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a new
/// reference to the physical allocation `fd` describes (drop it with [`mem_release`]). The
/// descriptor is only read: the caller keeps it.
pub fn mem_import_from_posix_fd(
    drv: &Driver,
    fd: BorrowedFd<'_>,
) -> Result<CUmemGenericAllocationHandle, CudaError> {
    let f = need(
        drv,
        drv.mem_import_from_shareable_handle,
        OptionalEntryPoint::MemImportFromShareableHandle,
    )?;
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer; for POSIX_FILE_DESCRIPTOR the driver takes the
    // descriptor's value in the pointer argument and only reads the descriptor, which is
    // open for as long as it is borrowed.
    let rc = unsafe {
        f(
            &mut h,
            std::ptr::without_provenance_mut(fd.as_raw_fd() as usize),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    check(drv, "cuMemImportFromShareableHandle", rc)?;
    Ok(h)
}

/// `cuMemCreate`: a physical allocation of `size` bytes as `prop` describes (drop it with
/// [`mem_release`]).
pub fn mem_create(
    drv: &Driver,
    size: usize,
    prop: &CUmemAllocationProp,
) -> Result<CUmemGenericAllocationHandle, CudaError> {
    let f = need(drv, drv.mem_create, OptionalEntryPoint::MemCreate)?;
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer and a fully initialised prop; flags must be 0.
    check(drv, "cuMemCreate", unsafe { f(&mut h, size, prop, 0) })?;
    Ok(h)
}

/// `cuMemGetAllocationGranularity` of allocations as `prop` describes, with `flags`
/// (`CU_MEM_ALLOC_GRANULARITY_*`).
pub fn mem_get_allocation_granularity(
    drv: &Driver,
    prop: &CUmemAllocationProp,
    flags: c_int,
) -> Result<usize, CudaError> {
    let f = need(
        drv,
        drv.mem_get_allocation_granularity,
        OptionalEntryPoint::MemGetAllocationGranularity,
    )?;
    let mut g: usize = 0;
    // SAFETY: a valid out-pointer and a fully initialised CUmemAllocationProp.
    check(drv, "cuMemGetAllocationGranularity", unsafe {
        f(&mut g, prop, flags)
    })?;
    Ok(g)
}

/// `cuMemAddressReserve`: `len` bytes of device addresses aligned to `align`, anywhere (free
/// them with [`mem_address_free`]).
pub fn mem_address_reserve(
    drv: &Driver,
    len: usize,
    align: usize,
) -> Result<CUdeviceptr, CudaError> {
    let f = need(
        drv,
        drv.mem_address_reserve,
        OptionalEntryPoint::MemAddressReserve,
    )?;
    let mut va: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; no fixed address is asked for; flags must be 0.
    check(drv, "cuMemAddressReserve", unsafe {
        f(&mut va, len, align, 0, 0)
    })?;
    Ok(va)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `[va, va + len)` must be a whole reservation of [`mem_address_reserve`] with nothing
/// mapped in it any more.
pub unsafe fn mem_address_free(drv: &Driver, va: CUdeviceptr, len: usize) -> Result<(), CudaError> {
    let f = need(
        drv,
        drv.mem_address_free,
        OptionalEntryPoint::MemAddressFree,
    )?;
    // SAFETY: forwarded contract.
    check(drv, "cuMemAddressFree", unsafe { f(va, len) })
}

/// `cuMemMap`: maps `size` bytes of the physical allocation `handle`, from its `offset`, at
/// `va`.
///
/// # Safety
/// `[va, va + size)` must lie in a reservation of the caller's with nothing mapped there, and
/// `handle` be a live allocation handle.
pub unsafe fn mem_map(
    drv: &Driver,
    va: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), CudaError> {
    let f = need(drv, drv.mem_map, OptionalEntryPoint::MemMap)?;
    // SAFETY: forwarded contract; flags must be 0.
    check(drv, "cuMemMap", unsafe { f(va, size, offset, handle, 0) })
}

/// `cuMemUnmap`.
///
/// # Safety
/// `[va, va + size)` must be a mapping of the caller's ([`mem_map`]) that no queued or later
/// work uses.
pub unsafe fn mem_unmap(drv: &Driver, va: CUdeviceptr, size: usize) -> Result<(), CudaError> {
    let f = need(drv, drv.mem_unmap, OptionalEntryPoint::MemUnmap)?;
    // SAFETY: forwarded contract.
    check(drv, "cuMemUnmap", unsafe { f(va, size) })
}

/// `cuMemSetAccess`: gives the locations of `desc` their access to `[va, va + size)`.
///
/// # Safety
/// `[va, va + size)` must be mapped memory of the caller's ([`mem_map`]).
pub unsafe fn mem_set_access(
    drv: &Driver,
    va: CUdeviceptr,
    size: usize,
    desc: &[CUmemAccessDesc],
) -> Result<(), CudaError> {
    let f = need(drv, drv.mem_set_access, OptionalEntryPoint::MemSetAccess)?;
    // SAFETY: forwarded contract; `desc` holds as many descriptors as passed.
    check(drv, "cuMemSetAccess", unsafe {
        f(va, size, desc.as_ptr(), desc.len())
    })
}
