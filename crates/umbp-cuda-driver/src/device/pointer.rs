//! What the driver says about a device address: whether a range a caller hands UMBP is device
//! memory of this device ([`Device::check_device_range`]), and where a `cuMemMap` mapping lies
//! ([`vmm_mapping`]).

use std::ffi::c_int;

use super::context::Device;
use crate::error::CudaError;
use crate::result::ipc;
use crate::result::memory::pointer_get_attribute;
use crate::result::{self, is_available, OptionalEntryPoint};
use crate::sys::library::Driver;
use crate::sys::types::*;

impl Device {
    /// Checks that `[addr, addr + len)` is device memory of this device, inside one allocation
    /// (`cuMemAlloc` memory), or inside mappings of the virtual memory management API that lie
    /// back to back, each device memory of this device that it can read and write
    /// (`cuMemCreate` + `cuMemMap`: PyTorch's expandable segments, vLLM's sleep mode, ranges a
    /// server imported with [`crate::ImportedVmm`]).
    pub fn check_device_range(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        let bad = |reason: String| CudaError::BadMemory {
            addr,
            len,
            device: self.ordinal(),
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
            if ord as i32 != self.ordinal() {
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
            if ord as i32 != self.ordinal() {
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
                        self.ordinal()
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

    /// `cuPointerGetAttribute` of `attr` at `ptr` (see
    /// [`result::memory::pointer_get_attribute`]).
    pub(crate) fn attribute(&self, attr: c_int, ptr: u64) -> Result<u64, CudaError> {
        result::memory::pointer_get_attribute(self.drv, attr, ptr)
    }
}

/// Where `p` is memory mapped with `cuMemMap` (the virtual memory management API): the start
/// and size of its mapping; `None` for other memory (`cuMemAlloc`, `cuMemAllocAsync` pools,
/// host memory) and where the driver cannot tell (it lacks `cuMemRetainAllocationHandle`, or
/// the `MAPPING_*` pointer attributes of CUDA 11.7).
pub(crate) fn vmm_mapping(drv: &Driver, p: u64) -> Result<Option<(u64, u64)>, CudaError> {
    // cuMemAlloc memory is legacy-IPC capable, VMM memory never is.
    if pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p)
        .is_ok_and(|v| v != 0)
    {
        return Ok(None);
    }
    if !(is_available(drv, OptionalEntryPoint::MemRetainAllocationHandle)
        && is_available(drv, OptionalEntryPoint::MemRelease))
    {
        return Ok(None);
    }
    // The driver fails for an address no cuMemMap mapping holds.
    let Ok(h) = ipc::mem_retain_allocation_handle(drv, p) else {
        return Ok(None);
    };
    // SAFETY: drops the reference cuMemRetainAllocationHandle just took.
    let _ = unsafe { ipc::mem_release(drv, h) };
    let (Ok(base), Ok(size)) = (
        pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p),
        pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, p),
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
