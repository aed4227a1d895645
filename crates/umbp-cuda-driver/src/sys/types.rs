//! The few CUDA driver API types, constants, structs and function pointer types UMBP uses,
//! mirrored by hand from `cuda.h` (the raw layer: nothing here calls the driver).
//!
//! Sizes, offsets and values were checked against `cuda.h` of CUDA 12.8 and 13.0 (x86-64 LP64);
//! the `const` assertions below keep the struct layouts honest on every build.

// The names are those of `cuda.h`, so they can be checked against it.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::{align_of, offset_of, size_of};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUarray = *mut c_void;
/// A physical allocation of the virtual memory management API (`cuMemCreate`).
pub type CUmemGenericAllocationHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STUB_LIBRARY: CUresult = 34;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: the thread's calls never count as unsafe during another
/// thread's stream capture (nor fail it).
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;

pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// Whether `cuIpcGetMemHandle` can export the memory (`cuMemAlloc` memory).
pub const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
/// A bitmask of `CUmemAllocationHandleType` (VMM memory).
pub const CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: c_int = 14;
/// The `CUmemAccess_flags` the current context's device has on VMM memory.
pub const CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: c_int = 16;
/// The size of the `cuMemMap` mapping the pointer is in (CUDA 11.7+).
pub const CU_POINTER_ATTRIBUTE_MAPPING_SIZE: c_int = 18;
/// The start of the `cuMemMap` mapping the pointer is in (CUDA 11.7+).
pub const CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: c_int = 19;

pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;

pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x1;
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x2;

pub const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// `cuStreamWaitValue32`: wait until `(int32_t)(*addr - value) >= 0` (a cyclic comparison:
/// wraparound is harmless and a later value also satisfies the wait).
pub const CU_STREAM_WAIT_VALUE_GEQ: c_uint = 0x0;
/// `cuStreamWriteValue32`: write after a memory barrier over the stream's earlier work.
pub const CU_STREAM_WRITE_VALUE_DEFAULT: c_uint = 0x0;
pub const CU_EVENT_BLOCKING_SYNC: c_uint = 1;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;

pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;

pub const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: c_int = 1;
pub const CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: c_uint = 1;

pub const CU_DEVICE_ATTRIBUTE_MAX_PITCH: c_int = 11;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: c_int = 40;

pub const CU_JIT_ERROR_LOG_BUFFER: c_int = 5;
pub const CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;

/// `CU_IPC_HANDLE_SIZE`.
pub const CU_IPC_HANDLE_SIZE: usize = 64;
/// `cuIpcOpenMemHandle`: enable peer access lazily (the only flag).
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;

/// `CUmemAllocationHandleType`.
pub const CU_MEM_HANDLE_TYPE_NONE: c_int = 0x0;
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 0x1;
/// `CUmemAllocationType`.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 0x1;
/// `CUmemLocationType`.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 0x1;
/// `CUmemAccess_flags`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 0x3;
/// `CUmemAllocationGranularity_flags`.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0x0;

/// `CUipcMemHandle` (passed by value to `cuIpcOpenMemHandle`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [c_char; CU_IPC_HANDLE_SIZE],
}

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [c_char; 16],
}

/// The anonymous `allocFlags` struct of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUmemAllocationPropAllocFlags {
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requestedHandleTypes: c_int,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: CUmemAllocationPropAllocFlags,
}

impl CUmemAllocationProp {
    /// Pinned device memory of device `dev`, exportable as the `handle_types` bitmask.
    pub fn device(dev: CUdevice, handle_types: c_int) -> Self {
        CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: handle_types,
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocationPropAllocFlags::default(),
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUmemcpyAttributes {
    pub srcAccessOrder: c_int,
    pub srcLocHint: CUmemLocation,
    pub dstLocHint: CUmemLocation,
    pub flags: c_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_MEMCPY2D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub srcPitch: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub dstPitch: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_MEMCPY3D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcZ: usize,
    pub srcLOD: usize,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub reserved0: *mut c_void,
    pub srcPitch: usize,
    pub srcHeight: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstZ: usize,
    pub dstLOD: usize,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub reserved1: *mut c_void,
    pub dstPitch: usize,
    pub dstHeight: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
    pub Depth: usize,
}

impl CUDA_MEMCPY2D {
    /// All fields zero / null.
    pub fn zeroed() -> Self {
        CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: 0,
            srcHost: std::ptr::null(),
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: 0,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: 0,
            dstHost: std::ptr::null_mut(),
            dstDevice: 0,
            dstArray: std::ptr::null_mut(),
            dstPitch: 0,
            WidthInBytes: 0,
            Height: 0,
        }
    }
}

impl CUDA_MEMCPY3D {
    /// All fields zero / null (the reserved pointers must stay null).
    pub fn zeroed() -> Self {
        CUDA_MEMCPY3D {
            srcXInBytes: 0,
            srcY: 0,
            srcZ: 0,
            srcLOD: 0,
            srcMemoryType: 0,
            srcHost: std::ptr::null(),
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            reserved0: std::ptr::null_mut(),
            srcPitch: 0,
            srcHeight: 0,
            dstXInBytes: 0,
            dstY: 0,
            dstZ: 0,
            dstLOD: 0,
            dstMemoryType: 0,
            dstHost: std::ptr::null_mut(),
            dstDevice: 0,
            dstArray: std::ptr::null_mut(),
            reserved1: std::ptr::null_mut(),
            dstPitch: 0,
            dstHeight: 0,
            WidthInBytes: 0,
            Height: 0,
            Depth: 0,
        }
    }
}

const _: () = assert!(size_of::<CUDA_MEMCPY2D>() == 128 && align_of::<CUDA_MEMCPY2D>() == 8);
const _: () = assert!(
    offset_of!(CUDA_MEMCPY2D, srcMemoryType) == 16 && offset_of!(CUDA_MEMCPY2D, srcHost) == 24
);
const _: () = assert!(
    offset_of!(CUDA_MEMCPY2D, srcPitch) == 48 && offset_of!(CUDA_MEMCPY2D, dstMemoryType) == 72
);
const _: () =
    assert!(offset_of!(CUDA_MEMCPY2D, dstHost) == 80 && offset_of!(CUDA_MEMCPY2D, dstPitch) == 104);
const _: () = assert!(
    offset_of!(CUDA_MEMCPY2D, WidthInBytes) == 112 && offset_of!(CUDA_MEMCPY2D, Height) == 120
);
const _: () = assert!(size_of::<CUDA_MEMCPY3D>() == 200);
const _: () = assert!(
    offset_of!(CUDA_MEMCPY3D, srcMemoryType) == 32 && offset_of!(CUDA_MEMCPY3D, reserved0) == 64
);
const _: () = assert!(
    offset_of!(CUDA_MEMCPY3D, srcHeight) == 80 && offset_of!(CUDA_MEMCPY3D, dstMemoryType) == 120
);
const _: () =
    assert!(offset_of!(CUDA_MEMCPY3D, dstHeight) == 168 && offset_of!(CUDA_MEMCPY3D, Depth) == 192);
const _: () =
    assert!(size_of::<CUmemcpyAttributes>() == 24 && align_of::<CUmemcpyAttributes>() == 4);
const _: () = assert!(
    offset_of!(CUmemcpyAttributes, srcLocHint) == 4
        && offset_of!(CUmemcpyAttributes, dstLocHint) == 12
);
const _: () = assert!(offset_of!(CUmemcpyAttributes, flags) == 20);
const _: () = assert!(size_of::<CUipcMemHandle>() == 64 && align_of::<CUipcMemHandle>() == 1);
const _: () = assert!(size_of::<CUuuid>() == 16);
const _: () = assert!(size_of::<CUmemLocation>() == 8 && align_of::<CUmemLocation>() == 4);
const _: () =
    assert!(size_of::<CUmemAllocationProp>() == 32 && align_of::<CUmemAllocationProp>() == 8);
const _: () = assert!(
    offset_of!(CUmemAllocationProp, requestedHandleTypes) == 4
        && offset_of!(CUmemAllocationProp, location) == 8
);
const _: () = assert!(
    offset_of!(CUmemAllocationProp, win32HandleMetaData) == 16
        && offset_of!(CUmemAllocationProp, allocFlags) == 24
);
const _: () = assert!(size_of::<CUmemAllocationPropAllocFlags>() == 8);
const _: () = assert!(size_of::<CUmemAccessDesc>() == 12 && align_of::<CUmemAccessDesc>() == 4);
const _: () = assert!(offset_of!(CUmemAccessDesc, flags) == 8);

pub type FnInit = unsafe extern "C" fn(c_uint) -> CUresult;
pub type FnDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type FnDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type FnDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
pub type FnDeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CUresult;
pub type FnDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult;
pub type FnDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
pub type FnDevicePrimaryCtxRelease = unsafe extern "C" fn(CUdevice) -> CUresult;
pub type FnCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode, returns the old one.
pub type FnThreadExchangeStreamCaptureMode = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type FnCtxPushCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type FnCtxPopCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub type FnStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
pub type FnStreamCreateWithPriority =
    unsafe extern "C" fn(*mut CUstream, c_uint, c_int) -> CUresult;
pub type FnCtxGetStreamPriorityRange = unsafe extern "C" fn(*mut c_int, *mut c_int) -> CUresult;
pub type FnStreamDestroy = unsafe extern "C" fn(CUstream) -> CUresult;
pub type FnStreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
pub type FnStreamWaitEvent = unsafe extern "C" fn(CUstream, CUevent, c_uint) -> CUresult;
/// `cuStreamWaitValue32_v2` and `cuStreamWriteValue32_v2`: (stream, address, value, flags).
pub type FnStreamValue32 = unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult;
pub type FnStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
pub type FnEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
pub type FnEventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub type FnEventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
pub type FnEventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
pub type FnEventDestroy = unsafe extern "C" fn(CUevent) -> CUresult;
pub type FnEventElapsedTime = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
pub type FnMemAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
pub type FnMemFree = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type FnMemsetD8Async = unsafe extern "C" fn(CUdeviceptr, u8, usize, CUstream) -> CUresult;
pub type FnMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
pub type FnMemHostGetDevicePointer =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult;
pub type FnMemFreeHost = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub type FnMemHostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
pub type FnMemHostUnregister = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub type FnMemcpyHtoDAsync =
    unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;
pub type FnMemcpyDtoHAsync =
    unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult;
pub type FnMemcpy2DAsync = unsafe extern "C" fn(*const CUDA_MEMCPY2D, CUstream) -> CUresult;
pub type FnMemcpy3DAsync = unsafe extern "C" fn(*const CUDA_MEMCPY3D, CUstream) -> CUresult;
/// CUDA 13.0 ABI, exported as `cuMemcpyBatchAsync_v2`.
pub type FnMemcpyBatchAsyncV2 = unsafe extern "C" fn(
    *mut CUdeviceptr,
    *mut CUdeviceptr,
    *mut usize,
    usize,
    *mut CUmemcpyAttributes,
    *mut usize,
    usize,
    CUstream,
) -> CUresult;
/// CUDA 12.8 ABI (with `failIdx`), exported as `cuMemcpyBatchAsync`.
pub type FnMemcpyBatchAsyncV1 = unsafe extern "C" fn(
    *mut CUdeviceptr,
    *mut CUdeviceptr,
    *mut usize,
    usize,
    *mut CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    CUstream,
) -> CUresult;
pub type FnPointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, CUdeviceptr) -> CUresult;
pub type FnGetErrorString = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;
pub type FnModuleLoadDataEx = unsafe extern "C" fn(
    *mut CUmodule,
    *const c_void,
    c_uint,
    *mut c_int,
    *mut *mut c_void,
) -> CUresult;
pub type FnModuleGetFunction =
    unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
pub type FnModuleUnload = unsafe extern "C" fn(CUmodule) -> CUresult;
pub type FnLaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;

// Inter-process memory: legacy IPC handles and the virtual memory management API.
pub type FnMemGetAddressRange =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult;
pub type FnDeviceGetUuid = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
pub type FnIpcGetMemHandle = unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult;
/// `cuIpcOpenMemHandle_v2`: the handle is passed by value.
pub type FnIpcOpenMemHandle =
    unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> CUresult;
pub type FnIpcCloseMemHandle = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type FnMemRetainAllocationHandle =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> CUresult;
/// `cuMemExportToShareableHandle(void *shareableHandle, handle, handleType, flags)`.
pub type FnMemExportToShareableHandle =
    unsafe extern "C" fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64) -> CUresult;
/// `cuMemImportFromShareableHandle(handle *, void *osHandle, handleType)`.
pub type FnMemImportFromShareableHandle =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int) -> CUresult;
pub type FnMemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
pub type FnMemGetAllocationPropertiesFromHandle =
    unsafe extern "C" fn(*mut CUmemAllocationProp, CUmemGenericAllocationHandle) -> CUresult;
/// `cuMemAddressReserve(ptr *, size, alignment, addr, flags)`.
pub type FnMemAddressReserve =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CUresult;
pub type FnMemAddressFree = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
/// `cuMemMap(ptr, size, offset, handle, flags)`.
pub type FnMemMap =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
pub type FnMemUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type FnMemSetAccess =
    unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult;
pub type FnMemGetAllocationGranularity =
    unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult;
pub type FnMemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
