//! A CUDA device with its primary context, and small owned wrappers for streams, events and
//! memory.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use crate::sys::library::{driver, BatchFn, Driver};
use crate::sys::types::*;
use crate::CudaError;

thread_local! {
    /// Whether this thread was put in the relaxed stream capture mode ([`Device::bind_thread`]).
    static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// One CUDA device and its retained primary context (the context PyTorch uses too).
#[derive(Debug)]
pub struct Device {
    drv: &'static Driver,
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
        let mut old: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed on this thread.
        let _ = unsafe { (self.dev.drv.ctx_pop_current)(&mut old) };
    }
}

impl Device {
    /// Loads the driver if needed, and retains device `ordinal`'s primary context.
    pub fn open(ordinal: i32) -> Result<Arc<Device>, CudaError> {
        let drv = driver()?;
        let mut count: c_int = 0;
        // SAFETY: valid out-pointer.
        drv.check("cuDeviceGetCount", unsafe {
            (drv.device_get_count)(&mut count)
        })?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::Device {
                device: ordinal,
                reason: format!(
                    "this process sees {count} CUDA device(s) (ordinals 0..{count}); check CUDA_VISIBLE_DEVICES"
                ),
            });
        }
        let mut dev: CUdevice = 0;
        // SAFETY: valid out-pointer, ordinal checked.
        drv.check("cuDeviceGet", unsafe {
            (drv.device_get)(&mut dev, ordinal)
        })?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        drv.check("cuDevicePrimaryCtxRetain", unsafe {
            (drv.primary_ctx_retain)(&mut ctx, dev)
        })?;
        let attr = |a: c_int| -> Result<i64, CudaError> {
            let mut v: c_int = 0;
            // SAFETY: valid out-pointer and device handle.
            drv.check("cuDeviceGetAttribute", unsafe {
                (drv.device_get_attribute)(&mut v, a, dev)
            })?;
            Ok(i64::from(v))
        };
        let mut name = [0 as c_char; 128];
        // SAFETY: the buffer holds 128 bytes and the driver writes a NUL-terminated name.
        let name = if unsafe { (drv.device_get_name)(name.as_mut_ptr(), 128, dev) } == CUDA_SUCCESS
        {
            // SAFETY: NUL-terminated by the driver (and by our zeroed buffer's end).
            unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".into()
        };
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
    pub(crate) fn raw_device(&self) -> CUdevice {
        self.dev
    }

    /// The device's UUID (`cuDeviceGetUuid_v2`: a MIG instance's own): the same in every
    /// process, unlike the ordinal, which depends on `CUDA_VISIBLE_DEVICES`.
    pub fn uuid(&self) -> Result<[u8; 16], CudaError> {
        device_uuid(self.drv, self.dev)
    }

    /// Makes the primary context current on this thread, for UMBP's own threads only (never
    /// an engine's): the first call on a thread also puts it in the relaxed stream capture
    /// mode. In the default (global) mode, a driver call that CUDA deems unsafe during
    /// capture (`cuMemHostRegister`, `cuMemAlloc`, ...) made by any thread while another
    /// thread captures a CUDA graph fails and invalidates that capture: the pool's background
    /// registration broke vLLM's graph capture at start-up and the engine failed to start
    /// (issue 28). None of UMBP's calls touch a stream being captured, so relaxed is safe.
    pub fn bind_thread(&self) -> Result<(), CudaError> {
        driver()?;
        // SAFETY: a retained primary context.
        self.drv.check("cuCtxSetCurrent", unsafe {
            (self.drv.ctx_set_current)(self.ctx.0)
        })?;
        RELAXED.with(|done| {
            if done.get() {
                return Ok(());
            }
            let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
            let exchange = self.drv.thread_exchange_stream_capture_mode;
            // SAFETY: a valid in/out pointer; changes only this thread's capture mode.
            let code = unsafe { exchange(&mut mode) };
            self.drv.check("cuThreadExchangeStreamCaptureMode", code)?;
            done.set(true);
            Ok(())
        })
    }

    /// Pushes the primary context on this thread until the guard drops (for callers' threads,
    /// whose current context is left as it was).
    pub fn scoped(&self) -> Result<CtxGuard<'_>, CudaError> {
        driver()?;
        // SAFETY: a retained primary context; the guard pops it.
        self.drv.check("cuCtxPushCurrent", unsafe {
            (self.drv.ctx_push_current)(self.ctx.0)
        })?;
        Ok(CtxGuard { dev: self })
    }

    /// Checks that `[addr, addr + len)` is device memory of this device, inside one allocation
    /// (`cuMemAlloc` memory), or inside mappings of the virtual memory management API that lie
    /// back to back, each device memory of this device that it can read and write
    /// (`cuMemCreate` + `cuMemMap`: PyTorch's expandable segments, vLLM's sleep mode, ranges a
    /// server imported with [`crate::ImportedVmm`]).
    pub fn check_device_range(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        let bad = |reason: String| CudaError::BadMemory {
            addr,
            len,
            device: self.ordinal,
            reason,
        };
        if addr == 0 || len == 0 {
            return Err(bad("address and length must be non-zero".into()));
        }
        let last = addr
            .checked_add(len - 1)
            .ok_or_else(|| bad("the range wraps the address space".into()))?;
        let _g = self.scoped()?;
        for p in [addr, last] {
            let mt = self
                .attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)
                .map_err(|e| {
                    bad(format!(
                        "the driver does not know {p:#x} ({e}); pass a CUDA tensor's data_ptr()"
                    ))
                })?;
            if mt as u32 != CU_MEMORYTYPE_DEVICE {
                return Err(bad(format!(
                    "{p:#x} is not device memory (memory type {mt}); register host memory with register_memory"
                )));
            }
            let ord = self
                .attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)
                .map_err(|e| bad(e.to_string()))?;
            if ord as i32 != self.ordinal {
                return Err(bad(format!("{p:#x} is memory of CUDA device {ord}")));
            }
        }
        // Memory mapped with cuMemMap can span several physical allocations mapped back to back
        // (the RANGE_* attributes need not describe more than one of them): every mapping the
        // range touches is checked instead.
        let vmm = vmm_mapping(self.drv, addr)
            .map_err(|e| bad(format!("cannot tell where its cuMemMap mapping lies ({e})")))?;
        if vmm.is_some() {
            return self.check_vmm_span(addr, last, &bad);
        }
        // Where the driver reports the allocation (cuMemAlloc, PyTorch's caching allocator),
        // the range must lie inside it.
        if let (Ok(start), Ok(size)) = (
            self.attribute(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr),
            self.attribute(CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr),
        ) {
            if start != 0 && size != 0 && (addr < start || last >= start + size) {
                return Err(bad(format!(
                    "it runs past its allocation {start:#x}+{size}; register the tensor's own bytes"
                )));
            }
        }
        Ok(())
    }

    /// [`Device::check_device_range`] for VMM memory: walks the mappings from `addr` to `last`
    /// (inclusive). Needs this device's context current.
    fn check_vmm_span(
        &self,
        addr: u64,
        last: u64,
        bad: &impl Fn(String) -> CudaError,
    ) -> Result<(), CudaError> {
        let mut p = addr;
        loop {
            let mt = self
                .attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)
                .map_err(|e| {
                    bad(format!(
                        "{p:#x} is not mapped ({e}): the range runs past the memory mapped at \
                         {addr:#x}"
                    ))
                })?;
            if mt as u32 != CU_MEMORYTYPE_DEVICE {
                return Err(bad(format!(
                    "{p:#x} is not device memory (memory type {mt})"
                )));
            }
            let ord = self
                .attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)
                .map_err(|e| bad(e.to_string()))?;
            if ord as i32 != self.ordinal {
                return Err(bad(format!("{p:#x} is memory of CUDA device {ord}")));
            }
            let (base, size) = vmm_mapping(self.drv, p)
                .map_err(|e| {
                    bad(format!(
                        "cannot tell where the mapping at {p:#x} lies ({e})"
                    ))
                })?
                .ok_or_else(|| {
                    bad(format!(
                        "{p:#x} is not memory mapped with cuMemMap, unlike {addr:#x}: register \
                         each allocation's own bytes"
                    ))
                })?;
            // Where the driver says, this device must be able to read and write the mapping
            // (cuMemSetAccess); copies to and from it would fail otherwise.
            if let Ok(flags) = self.attribute(CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, p) {
                if flags as c_int != CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
                    return Err(bad(format!(
                        "device {} may not read and write the mapping {base:#x}+{size} (access \
                         flags {flags:#x}); give it CU_MEM_ACCESS_FLAGS_PROT_READWRITE with \
                         cuMemSetAccess",
                        self.ordinal
                    )));
                }
            }
            let end = base.saturating_add(size);
            if end > last {
                return Ok(());
            }
            p = end;
        }
    }

    pub(crate) fn attribute(&self, attr: c_int, ptr: u64) -> Result<u64, CudaError> {
        pointer_attribute(self.drv, attr, ptr)
    }

    /// A new non-blocking stream (no implicit synchronisation with the legacy default stream).
    pub fn stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        let _g = self.scoped()?;
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a context is current.
        self.drv.check("cuStreamCreate", unsafe {
            (self.drv.stream_create)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream {
            dev: Arc::clone(self),
            raw: s,
        })
    }

    /// A new non-blocking stream with the context's greatest priority: the GPU schedules its
    /// pending thread blocks ahead of other streams' (for the brief staging kernels, so they
    /// are not starved by long compute kernels).
    pub fn priority_stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        let _g = self.scoped()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: valid out-pointers; a context is current.
        self.drv.check("cuCtxGetStreamPriorityRange", unsafe {
            (self.drv.ctx_get_stream_priority_range)(&mut least, &mut greatest)
        })?;
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a priority inside the context's range.
        self.drv.check("cuStreamCreateWithPriority", unsafe {
            (self.drv.stream_create_with_priority)(&mut s, CU_STREAM_NON_BLOCKING, greatest)
        })?;
        Ok(Stream {
            dev: Arc::clone(self),
            raw: s,
        })
    }

    /// A new event: `timing` for elapsed-time measurement, else the cheapest kind; completion
    /// waits yield the CPU instead of spinning.
    pub fn event(self: &Arc<Self>, timing: bool) -> Result<Event, CudaError> {
        let _g = self.scoped()?;
        let flags = if timing {
            CU_EVENT_BLOCKING_SYNC
        } else {
            CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC
        };
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a context is current.
        self.drv.check("cuEventCreate", unsafe {
            (self.drv.event_create)(&mut e, flags)
        })?;
        Ok(Event {
            dev: Arc::clone(self),
            raw: e,
        })
    }

    /// Allocates `len` bytes of device memory.
    pub fn alloc(self: &Arc<Self>, len: u64) -> Result<DeviceBuffer, CudaError> {
        let _g = self.scoped()?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: valid out-pointer; a context is current.
        self.drv.check("cuMemAlloc", unsafe {
            (self.drv.mem_alloc)(&mut p, len as usize)
        })?;
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
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; PORTABLE | DEVICEMAP: pinned for every context and mapped.
        self.drv.check("cuMemHostAlloc", unsafe {
            (self.drv.mem_host_alloc)(
                &mut p,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        })?;
        let mut buf = HostBuffer {
            dev: Arc::clone(self),
            ptr: p as *mut u8,
            len,
            dptr: 0,
        };
        let mut d: CUdeviceptr = 0;
        // SAFETY: `p` is a mapped allocation of this context; flags must be 0.
        self.drv.check("cuMemHostGetDevicePointer", unsafe {
            (self.drv.mem_host_get_device_pointer)(&mut d, p, 0)
        })?;
        buf.dptr = d;
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
        // SAFETY: forwarded contract.
        self.drv.check("cuMemsetD8Async", unsafe {
            (self.drv.memset_d8_async)(ptr, value, len as usize, stream.raw())
        })
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
        // SAFETY: forwarded contract.
        self.drv.check("cuMemcpyHtoDAsync", unsafe {
            (self.drv.memcpy_htod_async)(dst, src as *const c_void, len as usize, stream.raw())
        })
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
        // SAFETY: forwarded contract.
        self.drv.check("cuMemcpyDtoHAsync", unsafe {
            (self.drv.memcpy_dtoh_async)(dst as *mut c_void, src, len as usize, stream.raw())
        })
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
        self.drv.check("cuMemHostRegister", unsafe {
            (self.drv.mem_host_register)(
                ptr as *mut c_void,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        })?;
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
    pub(crate) unsafe fn host_register(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded contract; PORTABLE makes it pinned for every context, DEVICEMAP
        // maps it for the device.
        self.drv.check("cuMemHostRegister", unsafe {
            (self.drv.mem_host_register)(
                addr as *mut c_void,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        })
    }

    /// Unregisters host memory that [`Device::host_register`] registered at `addr` (its
    /// exact base). Needs a current context.
    ///
    /// # Safety
    /// No copy may use the memory any more.
    pub(crate) unsafe fn host_unregister(&self, addr: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded contract.
        self.drv.check("cuMemHostUnregister", unsafe {
            (self.drv.mem_host_unregister)(addr as *mut c_void)
        })
    }

    /// Whether `stream` (a caller's raw handle; 0 is the legacy default stream) is being
    /// captured into a CUDA graph. Needs a current context.
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream handle of this device's context.
    pub(crate) unsafe fn is_capturing(&self, stream: CUstream) -> Result<bool, CudaError> {
        let mut status: c_int = 0;
        // SAFETY: forwarded contract; a valid out-pointer.
        self.drv.check("cuStreamIsCapturing", unsafe {
            (self.drv.stream_is_capturing)(stream, &mut status)
        })?;
        Ok(status != CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits on the host for the latest record of `event`.
    ///
    /// # Safety
    /// `event` must be a live event handle of this device's context.
    pub(crate) unsafe fn wait_event(&self, event: CUevent) -> Result<(), CudaError> {
        // SAFETY: forwarded contract.
        self.drv.check("cuEventSynchronize", unsafe {
            (self.drv.event_synchronize)(event)
        })
    }

    /// Whether the latest record of `event` has completed (never blocks; an error reads as
    /// not completed).
    ///
    /// # Safety
    /// `event` must be a live event handle of this device's context.
    pub(crate) unsafe fn event_done(&self, event: CUevent) -> bool {
        // SAFETY: forwarded contract.
        unsafe { (self.drv.event_query)(event) == CUDA_SUCCESS }
    }

    /// Waits for all work on `stream`.
    pub fn synchronize(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: a live stream of this device.
        self.drv.check("cuStreamSynchronize", unsafe {
            (self.drv.stream_synchronize)(stream.raw)
        })
    }
}

/// `cuPointerGetAttribute` of `attr` at `ptr`; every attribute asked for in this crate fits
/// the u64 (booleans, ordinals, types and flags are written into its low bytes).
pub(crate) fn pointer_attribute(drv: &Driver, attr: c_int, ptr: u64) -> Result<u64, CudaError> {
    let mut v: u64 = 0;
    // SAFETY: every attribute asked for here writes at most 8 bytes into the zeroed u64.
    drv.check("cuPointerGetAttribute", unsafe {
        (drv.pointer_get_attribute)(&mut v as *mut u64 as *mut c_void, attr, ptr)
    })?;
    Ok(v)
}

/// The UUID of device `dev`.
pub(crate) fn device_uuid(drv: &Driver, dev: CUdevice) -> Result<[u8; 16], CudaError> {
    let f = drv.need(drv.device_get_uuid, "cuDeviceGetUuid_v2")?;
    let mut u = CUuuid::default();
    // SAFETY: a valid out-pointer to a 16-byte CUuuid and a device handle of cuDeviceGet.
    drv.check("cuDeviceGetUuid", unsafe { f(&mut u, dev) })?;
    Ok(u.bytes.map(|b| b as u8))
}

/// Where `p` is memory mapped with `cuMemMap` (the virtual memory management API): the start
/// and size of its mapping; `None` for other memory (`cuMemAlloc`, `cuMemAllocAsync` pools,
/// host memory) and where the driver cannot tell (it lacks `cuMemRetainAllocationHandle`, or
/// the `MAPPING_*` pointer attributes of CUDA 11.7).
pub(crate) fn vmm_mapping(drv: &Driver, p: u64) -> Result<Option<(u64, u64)>, CudaError> {
    // cuMemAlloc memory is legacy-IPC capable, VMM memory never is.
    if pointer_attribute(drv, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p)
        .is_ok_and(|v| v != 0)
    {
        return Ok(None);
    }
    let (Some(retain), Some(release)) = (drv.mem_retain_allocation_handle, drv.mem_release) else {
        return Ok(None);
    };
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer; the driver only looks the address up (and fails for an
    // address no cuMemMap mapping holds).
    if unsafe { retain(&mut h, p as *mut c_void) } != CUDA_SUCCESS {
        return Ok(None);
    }
    // SAFETY: drops the reference cuMemRetainAllocationHandle just took.
    unsafe { release(h) };
    let (Ok(base), Ok(size)) = (
        pointer_attribute(drv, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p),
        pointer_attribute(drv, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, p),
    ) else {
        return Ok(None);
    };
    if size == 0 || base > p || p - base >= size {
        return Err(CudaError::Invalid(format!(
            "the driver says the cuMemMap mapping holding {p:#x} is {base:#x}+{size}, which does \
             not hold it"
        )));
    }
    Ok(Some((base, size)))
}

impl Drop for Device {
    fn drop(&mut self) {
        if driver().is_ok() {
            // SAFETY: releases the retain taken in `open`.
            let _ = unsafe { (self.drv.primary_ctx_release)(self.dev) };
        }
    }
}

/// A stream owned by UMBP.
#[derive(Debug)]
pub struct Stream {
    dev: Arc<Device>,
    raw: CUstream,
}

// SAFETY: stream handles may be used from any thread; the driver serialises calls on a stream.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// The raw handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Makes later work on this stream wait for `event`'s latest record.
    ///
    /// # Safety
    /// `event` must be a live event of this device's context.
    pub(crate) unsafe fn wait(&self, event: CUevent) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: a live stream; forwarded contract for the event.
        d.check("cuStreamWaitEvent", unsafe {
            (d.stream_wait_event)(self.raw, event, 0)
        })
    }

    /// Makes later work on this stream wait until the 32-bit word at device address `flag`
    /// has reached `value` (cyclically: `(i32)(*flag - value) >= 0`), a stream memory
    /// operation: the GPU polls device memory, no PCIe.
    ///
    /// # Safety
    /// `flag` must be a 4-byte-aligned word of device memory of this device that stays
    /// allocated until the wait has completed.
    pub(crate) unsafe fn wait_flag(&self, flag: u64, value: u32) -> Result<(), CudaError> {
        let d = self.dev.drv;
        let f = d
            .stream_wait_value32
            .ok_or_else(|| CudaError::Invalid("cuStreamWaitValue32 is not exported".into()))?;
        // SAFETY: a live stream; forwarded contract for `flag`.
        d.check("cuStreamWaitValue32", unsafe {
            f(self.raw, flag, value, CU_STREAM_WAIT_VALUE_GEQ)
        })
    }

    /// Writes `value` to the 32-bit word at device address `flag` once this stream's earlier
    /// work has finished and its writes are visible (the driver refuses the variant without
    /// that barrier on the H200 here).
    ///
    /// # Safety
    /// As [`Stream::wait_flag`]; nothing else may use the word but flag waits and writes.
    pub(crate) unsafe fn write_flag(&self, flag: u64, value: u32) -> Result<(), CudaError> {
        let d = self.dev.drv;
        let f = d
            .stream_write_value32
            .ok_or_else(|| CudaError::Invalid("cuStreamWriteValue32 is not exported".into()))?;
        // SAFETY: as for `wait_flag`: forwarded contract.
        d.check("cuStreamWriteValue32", unsafe {
            f(self.raw, flag, value, CU_STREAM_WRITE_VALUE_DEFAULT)
        })
    }

    /// Queues the 2-D copy `c`.
    ///
    /// # Safety
    /// Every row of both sides must be valid memory (device memory of this device, or host
    /// memory registered or pageable) until the copy has completed, and nothing else may write
    /// the destination meanwhile.
    pub(crate) unsafe fn copy_2d(&self, c: &CUDA_MEMCPY2D) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: forwarded contract; `c` is fully initialised.
        d.check("cuMemcpy2DAsync", unsafe {
            (d.memcpy_2d_async)(c, self.raw)
        })
    }

    /// Queues the 3-D copy `c`.
    ///
    /// # Safety
    /// As [`Stream::copy_2d`], for every slice.
    pub(crate) unsafe fn copy_3d(&self, c: &CUDA_MEMCPY3D) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: forwarded contract.
        d.check("cuMemcpy3DAsync", unsafe {
            (d.memcpy_3d_async)(c, self.raw)
        })
    }

    /// Whether the driver can batch copies ([`Stream::copy_batch`]).
    pub(crate) fn can_batch(&self) -> bool {
        self.dev.drv.memcpy_batch_async.is_some()
    }

    /// Queues `sizes.len()` plain copies, `srcs[i]` to `dsts[i]`, in one driver call, ordered
    /// after the stream's earlier work and preferring overlap with compute.
    ///
    /// # Safety
    /// The three slices have the same length; each pair of ranges is valid device memory of
    /// this device or registered host memory until the copies complete, and nothing else
    /// writes the destinations meanwhile.
    pub(crate) unsafe fn copy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
    ) -> Result<(), CudaError> {
        let d = self.dev.drv;
        let batch = d
            .memcpy_batch_async
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("cuMemcpyBatchAsync is not exported".into()))?;
        let n = sizes.len();
        debug_assert!(dsts.len() == n && srcs.len() == n);
        let mut attrs = [CUmemcpyAttributes {
            srcAccessOrder: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            flags: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
            ..Default::default()
        }];
        let mut idx = [0usize];
        let rc = match batch {
            // SAFETY: forwarded contract; the arrays hold `n` entries each and one attribute
            // applies to all copies; the stream is ours (never the legacy NULL stream).
            BatchFn::V2(f) => unsafe {
                f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    attrs.as_mut_ptr(),
                    idx.as_mut_ptr(),
                    1,
                    self.raw,
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
                        n,
                        attrs.as_mut_ptr(),
                        idx.as_mut_ptr(),
                        1,
                        &mut fail,
                        self.raw,
                    )
                }
            }
        };
        d.check("cuMemcpyBatchAsync", rc)
    }

    /// Queues kernel `f` on `grid` thread blocks of `block` threads.
    ///
    /// # Safety
    /// `f` is a function of a live module of this context, `params` points at one live value
    /// per kernel parameter with the kernel's types, and every address the kernel reads or
    /// writes through them stays valid until the kernel has completed.
    pub(crate) unsafe fn launch(
        &self,
        f: CUfunction,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: forwarded contract; no dynamic shared memory, no extra options.
        d.check("cuLaunchKernel", unsafe {
            (d.launch_kernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                self.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Waits on the host for all work queued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.synchronize(self)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our stream; nothing uses it after drop.
                unsafe {
                    (self.dev.drv.stream_synchronize)(self.raw);
                    (self.dev.drv.stream_destroy)(self.raw);
                }
            }
        }
    }
}

/// An event owned by UMBP.
#[derive(Debug)]
pub struct Event {
    dev: Arc<Device>,
    raw: CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// Records the event on a raw stream handle (any stream of this device's primary context,
    /// 0 for the legacy default stream).
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream of this device's primary context.
    pub(crate) unsafe fn record_raw(&self, stream: CUstream) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: a live event; forwarded contract for the stream.
        d.check("cuEventRecord", unsafe {
            (d.event_record)(self.raw, stream)
        })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: one of our live streams.
        unsafe { self.record_raw(stream.raw) }
    }

    /// Blocks (yielding) until the event's latest record completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let d = self.dev.drv;
        // SAFETY: a live event.
        d.check("cuEventSynchronize", unsafe {
            (d.event_synchronize)(self.raw)
        })
    }

    /// Whether the latest record completed (never blocks).
    pub fn query(&self) -> Result<bool, CudaError> {
        let d = self.dev.drv;
        // SAFETY: a live event.
        match unsafe { (d.event_query)(self.raw) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            rc => d.check("cuEventQuery", rc).map(|_| false),
        }
    }

    /// Milliseconds from `start` to this event (both timing events, both completed).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, CudaError> {
        let d = self.dev.drv;
        let mut ms = 0f32;
        // SAFETY: valid out-pointer and live events.
        d.check("cuEventElapsedTime", unsafe {
            (d.event_elapsed_time)(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if driver().is_ok() {
            // SAFETY: our event; the driver defers destruction until pending work completes.
            unsafe { (self.dev.drv.event_destroy)(self.raw) };
        }
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
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our allocation; callers synchronise the streams that use it first.
                unsafe { (self.dev.drv.mem_free)(self.ptr) };
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
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our allocation, no longer used.
                unsafe { (self.dev.drv.mem_free_host)(self.ptr as *mut c_void) };
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
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: the base this guard registered; its user stopped copying.
                unsafe { (self.dev.drv.mem_host_unregister)(self.ptr as *mut c_void) };
            }
        }
    }
}

/// A loaded PTX module; unloaded when dropped.
#[derive(Debug)]
pub(crate) struct Module {
    dev: Arc<Device>,
    raw: CUmodule,
}

// SAFETY: module and function handles may be used from any thread of the process; the handle
// is never mutated.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// JIT-compiles and loads `ptx` (NUL-terminated) into the device's context; the error
    /// carries the JIT log.
    pub(crate) fn load_ptx(dev: &Arc<Device>, ptx: &str) -> Result<Module, CudaError> {
        if !ptx.ends_with('\0') {
            return Err(CudaError::Invalid("PTX must be NUL-terminated".into()));
        }
        let _g = dev.scoped()?;
        let d = dev.drv;
        let mut raw: CUmodule = std::ptr::null_mut();
        let mut log = vec![0u8; 8192];
        let mut opts = [CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut vals: [*mut c_void; 2] =
            [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
        // SAFETY: `ptx` is NUL-terminated (checked); the two JIT options point at a live
        // buffer of that size.
        let rc = unsafe {
            (d.module_load_data_ex)(
                &mut raw,
                ptx.as_ptr() as *const c_void,
                2,
                opts.as_mut_ptr(),
                vals.as_mut_ptr(),
            )
        };
        if let Err(e) = d.check("cuModuleLoadDataEx", rc) {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(CudaError::Invalid(format!(
                "{e}; JIT log: {}",
                String::from_utf8_lossy(&log[..end])
            )));
        }
        Ok(Module {
            dev: Arc::clone(dev),
            raw,
        })
    }

    /// The kernel `name` of this module.
    pub(crate) fn function(&self, name: &std::ffi::CStr) -> Result<CUfunction, CudaError> {
        let d = self.dev.drv;
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        d.check("cuModuleGetFunction", unsafe {
            (d.module_get_function)(&mut f, self.raw, name.as_ptr())
        })?;
        Ok(f)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our module; its owner synchronised every stream that launched its
                // kernels before dropping it.
                unsafe { (self.dev.drv.module_unload)(self.raw) };
            }
        }
    }
}
