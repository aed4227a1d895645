//! Modules and kernels: one checked function per driver entry point (`cuModuleLoadDataEx`,
//! `cuModuleGetFunction`, `cuModuleUnload`, `cuLaunchKernel`).

use std::ffi::{c_uint, c_void, CStr};

use super::check::check;
use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuModuleLoadDataEx` of the NUL-terminated PTX `ptx` into the current context, with the
/// JIT's error log written into `error_log` (NUL-terminated where it fits).
pub fn module_load_data_ex(
    drv: &Driver,
    ptx: &CStr,
    error_log: &mut [u8],
) -> Result<CUmodule, CudaError> {
    let mut raw: CUmodule = std::ptr::null_mut();
    let mut opts = [CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut vals: [*mut c_void; 2] = [
        error_log.as_mut_ptr() as *mut c_void,
        error_log.len() as *mut c_void,
    ];
    // SAFETY: `ptx` is NUL-terminated; the two JIT options point at a live buffer of that
    // size; a valid out-pointer.
    let rc = unsafe {
        (drv.module_load_data_ex)(
            &mut raw,
            ptx.as_ptr() as *const c_void,
            2,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    };
    check(drv, "cuModuleLoadDataEx", rc)?;
    Ok(raw)
}

/// `cuModuleGetFunction`: the kernel `name` of `module`.
///
/// # Safety
/// `module` must be a loaded module.
pub unsafe fn module_get_function(
    drv: &Driver,
    module: CUmodule,
    name: &CStr,
) -> Result<CUfunction, CudaError> {
    let mut f: CUfunction = std::ptr::null_mut();
    // SAFETY: forwarded contract; a valid out-pointer and a NUL-terminated name.
    check(drv, "cuModuleGetFunction", unsafe {
        (drv.module_get_function)(&mut f, module, name.as_ptr())
    })?;
    Ok(f)
}

/// `cuModuleUnload`.
///
/// # Safety
/// `module` must be a loaded module whose kernels no stream will run any more.
pub unsafe fn module_unload(drv: &Driver, module: CUmodule) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuModuleUnload", unsafe {
        (drv.module_unload)(module)
    })
}

/// `cuLaunchKernel`: queues kernel `f` on `stream`, on `grid` (x, y, z) thread blocks of
/// `block` (x, y, z) threads with `shared_mem_bytes` of dynamic shared memory, and no extra
/// options.
///
/// # Safety
/// `f` is a function of a live module of `stream`'s context, `stream` a live stream (or 0),
/// `params` points at one live value per kernel parameter with the kernel's types, and every
/// address the kernel reads or writes through them stays valid until the kernel has
/// completed.
pub unsafe fn launch_kernel(
    drv: &Driver,
    f: CUfunction,
    grid: (c_uint, c_uint, c_uint),
    block: (c_uint, c_uint, c_uint),
    shared_mem_bytes: c_uint,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<(), CudaError> {
    // SAFETY: forwarded contract.
    check(drv, "cuLaunchKernel", unsafe {
        (drv.launch_kernel)(
            f,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared_mem_bytes,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}
