//! The CUDA driver library and its table of entry points, resolved with `dlopen`/`dlsym` (the
//! raw layer: nothing here calls the driver; [`crate::result::driver`] loads the table on first
//! use, never at import, and initialises the driver).
//!
//! Every entry point is resolved by its exact versioned export name (`cuMemcpyHtoDAsync_v2`,
//! not the 32-bit-era `cuMemcpyHtoDAsync`). Nothing here panics: a missing library or symbol is
//! a [`CudaError`] whose message names CUDA.

use std::ffi::{c_void, CStr, CString};

use super::types::*;
use crate::error::CudaError;

/// The environment variable that overrides the driver library's path.
pub const LIBCUDA_ENV: &str = "UMBP_LIBCUDA";
/// The driver library's SONAME.
pub const LIBCUDA: &str = "libcuda.so.1";

/// The batched copy entry point, in whichever ABI the driver exports.
#[derive(Debug, Clone, Copy)]
pub enum BatchFn {
    /// CUDA 13.0: `cuMemcpyBatchAsync_v2` (8 arguments).
    V2(FnMemcpyBatchAsyncV2),
    /// CUDA 12.8: `cuMemcpyBatchAsync` (9 arguments, with `failIdx`).
    V1(FnMemcpyBatchAsyncV1),
}

/// Resolved driver entry points. The raw function pointers are private to this crate: other
/// crates reach the driver through [`crate::result`] and the safe types.
#[derive(Debug)]
pub struct Driver {
    /// The library that was loaded.
    pub lib: String,
    /// `cuDriverGetVersion` (e.g. 13000).
    pub version: i32,
    /// The process that initialised CUDA.
    pub init_pid: u32,
    pub(crate) init: FnInit,
    pub(crate) driver_get_version: FnDriverGetVersion,
    pub(crate) device_get_count: FnDeviceGetCount,
    pub(crate) device_get: FnDeviceGet,
    pub(crate) device_get_attribute: FnDeviceGetAttribute,
    pub(crate) device_get_name: FnDeviceGetName,
    pub(crate) primary_ctx_retain: FnDevicePrimaryCtxRetain,
    pub(crate) primary_ctx_release: FnDevicePrimaryCtxRelease,
    pub(crate) ctx_set_current: FnCtxSetCurrent,
    pub(crate) thread_exchange_stream_capture_mode: FnThreadExchangeStreamCaptureMode,
    pub(crate) ctx_push_current: FnCtxPushCurrent,
    pub(crate) ctx_pop_current: FnCtxPopCurrent,
    pub(crate) stream_create: FnStreamCreate,
    pub(crate) stream_create_with_priority: FnStreamCreateWithPriority,
    pub(crate) ctx_get_stream_priority_range: FnCtxGetStreamPriorityRange,
    pub(crate) stream_destroy: FnStreamDestroy,
    pub(crate) stream_synchronize: FnStreamSynchronize,
    pub(crate) stream_wait_event: FnStreamWaitEvent,
    pub(crate) stream_is_capturing: FnStreamIsCapturing,
    /// Stream memory operations (device-side flags between streams), where exported.
    pub(crate) stream_wait_value32: Option<FnStreamValue32>,
    pub(crate) stream_write_value32: Option<FnStreamValue32>,
    pub(crate) event_create: FnEventCreate,
    pub(crate) event_record: FnEventRecord,
    pub(crate) event_query: FnEventQuery,
    pub(crate) event_synchronize: FnEventSynchronize,
    pub(crate) event_destroy: FnEventDestroy,
    pub(crate) event_elapsed_time: FnEventElapsedTime,
    pub(crate) mem_alloc: FnMemAlloc,
    pub(crate) mem_free: FnMemFree,
    pub(crate) memset_d8_async: FnMemsetD8Async,
    pub(crate) mem_host_register: FnMemHostRegister,
    pub(crate) mem_host_unregister: FnMemHostUnregister,
    pub(crate) mem_host_alloc: FnMemHostAlloc,
    pub(crate) mem_free_host: FnMemFreeHost,
    pub(crate) mem_host_get_device_pointer: FnMemHostGetDevicePointer,
    pub(crate) memcpy_htod_async: FnMemcpyHtoDAsync,
    pub(crate) memcpy_dtoh_async: FnMemcpyDtoHAsync,
    pub(crate) memcpy_2d_async: FnMemcpy2DAsync,
    pub(crate) memcpy_3d_async: FnMemcpy3DAsync,
    pub(crate) memcpy_batch_async: Option<BatchFn>,
    pub(crate) pointer_get_attribute: FnPointerGetAttribute,
    pub(crate) get_error_name: FnGetErrorString,
    pub(crate) get_error_string: FnGetErrorString,
    pub(crate) module_load_data_ex: FnModuleLoadDataEx,
    pub(crate) module_get_function: FnModuleGetFunction,
    pub(crate) module_unload: FnModuleUnload,
    pub(crate) launch_kernel: FnLaunchKernel,
    /// Inter-process memory (crate::ipc): optional, so that a driver without one of them
    /// still loads; [`crate::result::require`] turns a missing one into an error naming it.
    pub(crate) device_get_uuid: Option<FnDeviceGetUuid>,
    pub(crate) mem_get_address_range: Option<FnMemGetAddressRange>,
    pub(crate) ipc_get_mem_handle: Option<FnIpcGetMemHandle>,
    pub(crate) ipc_open_mem_handle: Option<FnIpcOpenMemHandle>,
    pub(crate) ipc_close_mem_handle: Option<FnIpcCloseMemHandle>,
    pub(crate) mem_retain_allocation_handle: Option<FnMemRetainAllocationHandle>,
    pub(crate) mem_export_to_shareable_handle: Option<FnMemExportToShareableHandle>,
    pub(crate) mem_import_from_shareable_handle: Option<FnMemImportFromShareableHandle>,
    pub(crate) mem_release: Option<FnMemRelease>,
    pub(crate) mem_get_allocation_properties_from_handle:
        Option<FnMemGetAllocationPropertiesFromHandle>,
    pub(crate) mem_address_reserve: Option<FnMemAddressReserve>,
    pub(crate) mem_address_free: Option<FnMemAddressFree>,
    pub(crate) mem_map: Option<FnMemMap>,
    pub(crate) mem_unmap: Option<FnMemUnmap>,
    pub(crate) mem_set_access: Option<FnMemSetAccess>,
    pub(crate) mem_get_allocation_granularity: Option<FnMemGetAllocationGranularity>,
    pub(crate) mem_create: Option<FnMemCreate>,
}

/// Reinterprets a `dlsym` result as a function pointer of type `T`.
///
/// # Safety
/// `T` must be an `extern "C"` function pointer type matching the symbol's prototype.
unsafe fn fn_ptr<T: Copy>(p: *mut c_void) -> T {
    const { assert!(std::mem::size_of::<T>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); the caller vouches for the prototype.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl Driver {
    /// Opens the driver library (`$UMBP_LIBCUDA`, else [`LIBCUDA`]) and resolves every entry
    /// point; calls none of them ([`crate::result::driver`] runs `cuInit`). `version` is 0.
    pub(crate) fn load() -> Result<Driver, CudaError> {
        let lib = std::env::var(LIBCUDA_ENV).unwrap_or_else(|_| LIBCUDA.to_owned());
        let c_lib = CString::new(lib.clone()).map_err(|_| CudaError::NoDriver {
            lib: lib.clone(),
            reason: "the path contains a NUL byte".into(),
        })?;
        // SAFETY: a valid NUL-terminated path; RTLD_LOCAL keeps the driver's symbols out of the
        // global namespace. The handle is never closed: the function pointers live for the
        // process.
        let handle = unsafe { libc::dlopen(c_lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(CudaError::NoDriver {
                lib,
                reason: dlerror_string(),
            });
        }
        let sym = |name: &CStr| -> Result<*mut c_void, CudaError> {
            // SAFETY: `handle` is a live dlopen handle and `name` is NUL-terminated.
            let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
            if p.is_null() {
                Err(CudaError::MissingSymbol {
                    lib: lib.clone(),
                    symbol: name.to_string_lossy().into_owned(),
                })
            } else {
                Ok(p)
            }
        };
        macro_rules! load {
            ($name:literal) => {{
                let p = sym($name)?;
                // SAFETY: the symbol is the driver export named in cuda.h for this prototype
                // (see ffi.rs).
                unsafe { fn_ptr(p) }
            }};
        }
        // An entry point UMBP can do without (None where the driver lacks it).
        macro_rules! optional {
            ($name:literal) => {
                sym($name).ok().map(|p| {
                    // SAFETY: as for `load!`: the export named in cuda.h for the field's
                    // prototype (see ffi.rs).
                    unsafe { fn_ptr(p) }
                })
            };
        }
        let init: FnInit = load!(c"cuInit");
        let get_error_name: FnGetErrorString = load!(c"cuGetErrorName");
        let get_error_string: FnGetErrorString = load!(c"cuGetErrorString");
        let driver_get_version: FnDriverGetVersion = load!(c"cuDriverGetVersion");
        let memcpy_batch_async = if std::env::var_os("UMBP_CUDA_NO_BATCH").is_some() {
            None
        } else if let Ok(p) = sym(c"cuMemcpyBatchAsync_v2") {
            // SAFETY: the CUDA 13.0 export of the 8-argument prototype.
            Some(BatchFn::V2(unsafe { fn_ptr::<FnMemcpyBatchAsyncV2>(p) }))
        } else if let Ok(p) = sym(c"cuMemcpyBatchAsync") {
            // SAFETY: the CUDA 12.8 export of the 9-argument prototype (with failIdx).
            Some(BatchFn::V1(unsafe { fn_ptr::<FnMemcpyBatchAsyncV1>(p) }))
        } else {
            None
        };
        // Stream memory operations, unless turned off (to compare with event waits).
        let no_memops = std::env::var_os("UMBP_CUDA_NO_STREAM_MEMOPS").is_some();
        let memops = |name: &str| -> Option<*mut c_void> {
            if no_memops {
                return None;
            }
            sym(&CString::new(name).ok()?).ok()
        };
        Ok(Driver {
            lib: lib.clone(),
            version: 0,
            init_pid: std::process::id(),
            init,
            driver_get_version,
            device_get_count: load!(c"cuDeviceGetCount"),
            device_get: load!(c"cuDeviceGet"),
            device_get_attribute: load!(c"cuDeviceGetAttribute"),
            device_get_name: load!(c"cuDeviceGetName"),
            primary_ctx_retain: load!(c"cuDevicePrimaryCtxRetain"),
            primary_ctx_release: load!(c"cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: load!(c"cuCtxSetCurrent"),
            thread_exchange_stream_capture_mode: load!(c"cuThreadExchangeStreamCaptureMode"),
            ctx_push_current: load!(c"cuCtxPushCurrent_v2"),
            ctx_pop_current: load!(c"cuCtxPopCurrent_v2"),
            stream_create: load!(c"cuStreamCreate"),
            stream_create_with_priority: load!(c"cuStreamCreateWithPriority"),
            ctx_get_stream_priority_range: load!(c"cuCtxGetStreamPriorityRange"),
            stream_destroy: load!(c"cuStreamDestroy_v2"),
            stream_synchronize: load!(c"cuStreamSynchronize"),
            stream_wait_event: load!(c"cuStreamWaitEvent"),
            stream_is_capturing: load!(c"cuStreamIsCapturing"),
            stream_wait_value32: memops("cuStreamWaitValue32_v2").map(|p| {
                // SAFETY: the CUDA 11.7+ export of the (stream, address, value, flags)
                // prototype.
                unsafe { fn_ptr::<FnStreamValue32>(p) }
            }),
            stream_write_value32: memops("cuStreamWriteValue32_v2").map(|p| {
                // SAFETY: as above.
                unsafe { fn_ptr::<FnStreamValue32>(p) }
            }),
            event_create: load!(c"cuEventCreate"),
            event_record: load!(c"cuEventRecord"),
            event_query: load!(c"cuEventQuery"),
            event_synchronize: load!(c"cuEventSynchronize"),
            event_destroy: load!(c"cuEventDestroy_v2"),
            event_elapsed_time: match sym(c"cuEventElapsedTime_v2") {
                // SAFETY: same prototype as cuEventElapsedTime (CUDA 12.8 renamed the export).
                Ok(p) => unsafe { fn_ptr::<FnEventElapsedTime>(p) },
                Err(_) => load!(c"cuEventElapsedTime"),
            },
            mem_alloc: load!(c"cuMemAlloc_v2"),
            mem_free: load!(c"cuMemFree_v2"),
            memset_d8_async: load!(c"cuMemsetD8Async"),
            mem_host_register: load!(c"cuMemHostRegister_v2"),
            mem_host_unregister: load!(c"cuMemHostUnregister"),
            mem_host_alloc: load!(c"cuMemHostAlloc"),
            mem_free_host: load!(c"cuMemFreeHost"),
            mem_host_get_device_pointer: load!(c"cuMemHostGetDevicePointer_v2"),
            memcpy_htod_async: load!(c"cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: load!(c"cuMemcpyDtoHAsync_v2"),
            memcpy_2d_async: load!(c"cuMemcpy2DAsync_v2"),
            memcpy_3d_async: load!(c"cuMemcpy3DAsync_v2"),
            memcpy_batch_async,
            pointer_get_attribute: load!(c"cuPointerGetAttribute"),
            get_error_name,
            get_error_string,
            module_load_data_ex: load!(c"cuModuleLoadDataEx"),
            module_get_function: load!(c"cuModuleGetFunction"),
            module_unload: load!(c"cuModuleUnload"),
            launch_kernel: load!(c"cuLaunchKernel"),
            // cuDeviceGetUuid_v2 (CUDA 11.4+) reports a MIG instance's own UUID; the older
            // export has the same prototype.
            device_get_uuid: optional!(c"cuDeviceGetUuid_v2")
                .or_else(|| optional!(c"cuDeviceGetUuid")),
            mem_get_address_range: optional!(c"cuMemGetAddressRange_v2"),
            ipc_get_mem_handle: optional!(c"cuIpcGetMemHandle"),
            ipc_open_mem_handle: optional!(c"cuIpcOpenMemHandle_v2"),
            ipc_close_mem_handle: optional!(c"cuIpcCloseMemHandle"),
            mem_retain_allocation_handle: optional!(c"cuMemRetainAllocationHandle"),
            mem_export_to_shareable_handle: optional!(c"cuMemExportToShareableHandle"),
            mem_import_from_shareable_handle: optional!(c"cuMemImportFromShareableHandle"),
            mem_release: optional!(c"cuMemRelease"),
            mem_get_allocation_properties_from_handle: optional!(
                c"cuMemGetAllocationPropertiesFromHandle"
            ),
            mem_address_reserve: optional!(c"cuMemAddressReserve"),
            mem_address_free: optional!(c"cuMemAddressFree"),
            mem_map: optional!(c"cuMemMap"),
            mem_unmap: optional!(c"cuMemUnmap"),
            mem_set_access: optional!(c"cuMemSetAccess"),
            mem_get_allocation_granularity: optional!(c"cuMemGetAllocationGranularity"),
            mem_create: optional!(c"cuMemCreate"),
        })
    }

    /// Whether the driver exports a batched copy entry point UMBP can use.
    pub fn has_batch_copy(&self) -> bool {
        self.memcpy_batch_async.is_some()
    }
}
