//! Memory of a [`Device`]: device allocations ([`DeviceBuffer`]), pinned host allocations
//! ([`HostBuffer`]), host memory registered for DMA ([`HostRegistration`] and the pool's
//! chunks), and the plain copies and memsets between them.

use std::ffi::c_void;
use std::sync::Arc;

use super::context::Device;
use super::stream::Stream;
use crate::error::CudaError;
use crate::result;
use crate::sys::types::*;

impl Device {
    /// Allocates `len` bytes of device memory.
    pub fn alloc(self: &Arc<Self>, len: u64) -> Result<DeviceBuffer, CudaError> {
        let _g = self.scoped()?;
        let p = result::memory::mem_alloc(self.drv, len as usize)?;
        Ok(DeviceBuffer {
            dev: Arc::clone(self),
            ptr: p,
            len,
        })
    }

    /// Allocates `len` bytes of pinned (page-locked) host memory with `cuMemHostAlloc`, mapped
    /// into the device's address space (see [`HostBuffer::device_ptr`]).
    pub fn alloc_host(self: &Arc<Self>, len: u64) -> Result<HostBuffer, CudaError> {
        let _g = self.scoped()?;
        // PORTABLE | DEVICEMAP: pinned for every context and mapped.
        let p = result::memory::mem_host_alloc(
            self.drv,
            len as usize,
            CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
        )?;
        let mut buf = HostBuffer {
            dev: Arc::clone(self),
            ptr: p as *mut u8,
            len,
            dptr: 0,
        };
        // SAFETY: `p` is a mapped allocation of this context, owned by `buf`.
        buf.dptr = unsafe { result::memory::mem_host_get_device_pointer(self.drv, p) }?;
        Ok(buf)
    }

    /// Sets `len` bytes at device address `ptr` to `value`, in order on `stream`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be device memory of this device that nothing else uses meanwhile.
    pub unsafe fn memset(
        &self,
        ptr: u64,
        value: u8,
        len: u64,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream.
        unsafe { result::memory::memset_d8_async(self.drv, ptr, value, len as usize, stream.raw()) }
    }

    /// Copies `len` bytes from host `src` to device `dst`, in order on `stream`.
    ///
    /// # Safety
    /// Both ranges must be valid (host readable, device memory of this device) until the copy
    /// has completed, and the host side must not be written meanwhile.
    pub unsafe fn copy_htod(
        &self,
        dst: u64,
        src: *const u8,
        len: u64,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream.
        unsafe {
            result::memory::memcpy_htod_async(
                self.drv,
                dst,
                src as *const c_void,
                len as usize,
                stream.raw(),
            )
        }
    }

    /// Copies `len` bytes from device `src` to host `dst`, in order on `stream`.
    ///
    /// # Safety
    /// As [`Device::copy_htod`], with the host side writable and untouched until completion.
    pub unsafe fn copy_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        len: u64,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; a live stream.
        unsafe {
            result::memory::memcpy_dtoh_async(
                self.drv,
                dst as *mut c_void,
                src,
                len as usize,
                stream.raw(),
            )
        }
    }

    /// Registers (pins) existing host memory for DMA until the returned guard drops.
    ///
    /// # Safety
    /// The memory must stay mapped until the guard is dropped.
    pub unsafe fn register_host(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: u64,
    ) -> Result<HostRegistration, CudaError> {
        let _g = self.scoped()?;
        // SAFETY: forwarded contract; PORTABLE | DEVICEMAP as for the pool.
        unsafe {
            result::memory::mem_host_register(
                self.drv,
                ptr as *mut c_void,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        }?;
        Ok(HostRegistration {
            dev: Arc::clone(self),
            ptr,
        })
    }

    /// Registers `[addr, addr + len)` of host memory for DMA from every context (portable,
    /// mapped), with no guard: the caller unregisters it with [`Device::host_unregister`].
    /// Needs a current context.
    ///
    /// # Safety
    /// The memory must stay mapped until it is unregistered.
    pub unsafe fn host_register(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; PORTABLE makes it pinned for every context, DEVICEMAP
        // maps it for the device.
        unsafe {
            result::memory::mem_host_register(
                self.drv,
                addr as *mut c_void,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        }
    }

    /// Unregisters host memory that [`Device::host_register`] registered at `addr` (its
    /// exact base). Needs a current context.
    ///
    /// # Safety
    /// No copy may use the memory any more.
    pub unsafe fn host_unregister(&self, addr: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded contract.
        unsafe { result::memory::mem_host_unregister(self.drv, addr as *mut c_void) }
    }
}

/// Device memory owned by UMBP.
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Arc<Device>,
    ptr: CUdeviceptr,
    len: u64,
}

impl DeviceBuffer {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our allocation; callers synchronise the streams that use it first.
                let _ = unsafe { result::memory::mem_free(self.dev.drv, self.ptr) };
            }
        }
    }
}

/// Pinned host memory from `cuMemHostAlloc`.
#[derive(Debug)]
pub struct HostBuffer {
    dev: Arc<Device>,
    ptr: *mut u8,
    len: u64,
    dptr: u64,
}

// SAFETY: plain memory; access is coordinated by its owner.
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Host address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The address kernels use to reach it.
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our allocation, no longer used.
                let _ =
                    unsafe { result::memory::mem_free_host(self.dev.drv, self.ptr as *mut c_void) };
            }
        }
    }
}

/// Host memory registered with [`Device::register_host`]; unregistered when dropped.
#[derive(Debug)]
pub struct HostRegistration {
    dev: Arc<Device>,
    ptr: *mut u8,
}

// SAFETY: only the address is kept; it is used to unregister.
unsafe impl Send for HostRegistration {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: the base this guard registered; its user stopped copying.
                let _ = unsafe {
                    result::memory::mem_host_unregister(self.dev.drv, self.ptr as *mut c_void)
                };
            }
        }
    }
}
