//! The client's side: a range of this process's CUDA memory made into what another process
//! can map ([`DeviceExport`]): a legacy IPC handle of a `cuMemAlloc` allocation, or one POSIX
//! file descriptor per physical allocation of memory mapped with `cuMemMap`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::device::pointer::vmm_mapping;
use crate::device::Device;
use crate::error::CudaError;
use crate::result::memory::{self, pointer_get_attribute};
use crate::result::{self, ipc, require, OptionalEntryPoint};
use crate::sys::library::Driver;
use crate::sys::types::*;

/// What a client hands a server so that the server can map a range of the client's CUDA
/// memory. The range is `[offset, offset + length)` of what the server maps.
#[derive(Debug)]
pub enum DeviceExport {
    /// `cudaMalloc` / `cuMemAlloc` memory: a legacy IPC handle of the whole allocation.
    Legacy {
        /// The device's UUID ([`device_by_uuid`] finds it in the server).
        device_uuid: [u8; 16],
        /// `cuIpcGetMemHandle` of the allocation's start.
        handle: [u8; 64],
        /// The allocation's size (what [`ImportedIpc::open`] maps).
        allocation_bytes: u64,
        /// Where the range starts in the allocation.
        offset: u64,
        /// The range's length.
        length: u64,
    },
    /// Memory mapped with `cuMemMap`: one descriptor per physical allocation the range touches,
    /// in address order.
    Vmm {
        /// The device's UUID.
        device_uuid: [u8; 16],
        /// The allocations, back to back from the first one's start.
        chunks: Vec<VmmChunkExport>,
        /// Where the range starts, from the first chunk's start.
        offset: u64,
        /// The range's length.
        length: u64,
    },
}

/// One physical allocation of a [`DeviceExport::Vmm`].
#[derive(Debug)]
pub struct VmmChunkExport {
    /// `cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)` of the allocation (close-on-exec).
    pub fd: OwnedFd,
    /// Where its mapping starts, from the first chunk's start.
    pub offset: u64,
    /// Its mapping's size.
    pub size: u64,
}

impl DeviceExport {
    /// The device's UUID.
    pub fn device_uuid(&self) -> &[u8; 16] {
        match self {
            DeviceExport::Legacy { device_uuid, .. } | DeviceExport::Vmm { device_uuid, .. } => {
                device_uuid
            }
        }
    }

    /// Where the range starts in what the server maps.
    pub fn offset(&self) -> u64 {
        match self {
            DeviceExport::Legacy { offset, .. } | DeviceExport::Vmm { offset, .. } => *offset,
        }
    }

    /// The range's length.
    pub fn length(&self) -> u64 {
        match self {
            DeviceExport::Legacy { length, .. } | DeviceExport::Vmm { length, .. } => *length,
        }
    }
}

/// Exports `[addr, addr + len)` of this process's CUDA device memory for another process.
///
/// Needs no current context (the memory's device is found from the address). Refuses host,
/// managed and `cudaMallocAsync` pool memory, a range past its allocation or mapping, and VMM
/// memory whose allocations were not created exportable as POSIX file descriptors.
pub fn export_device_range(addr: u64, len: u64) -> Result<DeviceExport, CudaError> {
    let bad = |reason: String| CudaError::Export { addr, len, reason };
    if addr == 0 || len == 0 {
        return Err(bad("address and length must be non-zero".into()));
    }
    let end = addr
        .checked_add(len)
        .ok_or_else(|| bad("the range wraps the address space".into()))?;
    let drv = result::driver()?;
    let ordinal =
        pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr).map_err(|e| {
            bad(format!(
                "the driver does not know the address ({e}); pass a CUDA tensor's data_ptr()"
            ))
        })?;
    let dev = Device::open(ordinal as i32)?;
    let _g = dev.scoped()?;
    let mt = dev.attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)?;
    if mt as u32 != CU_MEMORYTYPE_DEVICE {
        return Err(bad(format!(
            "it is not device memory (memory type {mt}); host memory is shared with a memfd"
        )));
    }
    if dev
        .attribute(CU_POINTER_ATTRIBUTE_IS_MANAGED, addr)
        .is_ok_and(|v| v != 0)
    {
        return Err(bad(
            "it is managed memory (cudaMallocManaged), which CUDA cannot share between processes; \
             allocate the KV cache with cudaMalloc (PyTorch's default allocator)"
                .into(),
        ));
    }
    let device_uuid = dev.uuid()?;
    let legacy = dev
        .attribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, addr)
        .is_ok_and(|v| v != 0);
    if legacy {
        return export_legacy(&dev, addr, end, device_uuid, &bad);
    }
    let first = vmm_mapping(drv, addr).map_err(|e| bad(e.to_string()))?;
    match first {
        Some(_) => export_vmm(&dev, addr, end, device_uuid, &bad),
        None => Err(bad(
            "it is neither cudaMalloc memory (legacy IPC capable) nor memory mapped with \
             cuMemMap whose mapping the driver reports (cudaMallocAsync pool memory, for one, is \
             neither); allocate the KV cache with PyTorch's default caching allocator, with or \
             without expandable segments, on a driver of CUDA 11.7 or newer"
                .into(),
        )),
    }
}

fn export_legacy(
    dev: &Device,
    addr: u64,
    end: u64,
    device_uuid: [u8; 16],
    bad: &impl Fn(String) -> CudaError,
) -> Result<DeviceExport, CudaError> {
    let drv = dev.driver();
    require(drv, OptionalEntryPoint::MemGetAddressRange)?;
    require(drv, OptionalEntryPoint::IpcGetMemHandle)?;
    // The device's context is current.
    let (base, size) = memory::mem_get_address_range(drv, addr)?;
    let size = size as u64;
    if addr < base || end > base.saturating_add(size) {
        return Err(bad(format!(
            "it runs past its allocation {base:#x}+{size}; export the tensor's own bytes"
        )));
    }
    // `base` is the start of a live allocation of this context.
    let h = ipc::ipc_get_mem_handle(drv, base).map_err(|e| bad(e.to_string()))?;
    Ok(DeviceExport::Legacy {
        device_uuid,
        handle: h.reserved.map(|b| b as u8),
        allocation_bytes: size,
        offset: addr - base,
        length: end - addr,
    })
}

fn export_vmm(
    dev: &Device,
    addr: u64,
    end: u64,
    device_uuid: [u8; 16],
    bad: &impl Fn(String) -> CudaError,
) -> Result<DeviceExport, CudaError> {
    let drv = dev.driver();
    let mut chunks: Vec<VmmChunkExport> = Vec::new();
    let mut start = 0u64;
    let mut p = addr;
    while p < end {
        if p != addr {
            let ord = dev
                .attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)
                .map_err(|e| {
                    bad(format!(
                        "{p:#x} is not mapped ({e}): the range runs past the memory mapped at \
                         {addr:#x}"
                    ))
                })?;
            if ord as i32 != dev.ordinal() {
                return Err(bad(format!(
                    "{p:#x} is memory of CUDA device {ord}, {addr:#x} of device {}",
                    dev.ordinal()
                )));
            }
        }
        let (base, size) = vmm_mapping(drv, p)
            .map_err(|e| bad(e.to_string()))?
            .ok_or_else(|| {
                bad(format!(
                    "{p:#x} is not memory mapped with cuMemMap, unlike {addr:#x}: export each \
                     allocation's own bytes"
                ))
            })?;
        if chunks.is_empty() {
            start = base;
        } else if base != p {
            return Err(bad(format!(
                "the mapping holding {p:#x} starts at {base:#x}, inside the one before it"
            )));
        }
        let fd = export_allocation(drv, base, size, bad)?;
        chunks.push(VmmChunkExport {
            fd,
            offset: base - start,
            size,
        });
        p = base.saturating_add(size);
    }
    Ok(DeviceExport::Vmm {
        device_uuid,
        chunks,
        offset: addr - start,
        length: end - addr,
    })
}

/// Why VMM memory cannot be exported, given the allocation's handle types where known.
fn not_exportable(handle_types: Option<u64>) -> String {
    let types = match handle_types {
        Some(t) => format!(" (it has {t:#x})"),
        None => String::new(),
    };
    format!(
        "its physical allocation was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR \
         in CUmemAllocationProp::requestedHandleTypes{types}, so no other process can map it; \
         have the allocator ask for POSIX file descriptors (PyTorch's expandable segments do so \
         only in releases that can share them between processes), or allocate the KV cache \
         without expandable_segments"
    )
}

/// `cuMemExportToShareableHandle` of the allocation mapped at `base` (its mapping's start).
fn export_allocation(
    drv: &Driver,
    base: u64,
    size: u64,
    bad: &impl Fn(String) -> CudaError,
) -> Result<OwnedFd, CudaError> {
    require(drv, OptionalEntryPoint::MemRetainAllocationHandle)?;
    require(drv, OptionalEntryPoint::MemRelease)?;
    require(drv, OptionalEntryPoint::MemExportToShareableHandle)?;
    // `base` is the start of a cuMemMap mapping.
    let h = ipc::mem_retain_allocation_handle(drv, base)?;
    // The reference taken above is dropped whatever happens next.
    struct Retained<'a>(&'a Driver, CUmemGenericAllocationHandle);
    impl Drop for Retained<'_> {
        fn drop(&mut self) {
            // SAFETY: drops the one reference cuMemRetainAllocationHandle took.
            let _ = unsafe { ipc::mem_release(self.0, self.1) };
        }
    }
    let _retained = Retained(drv, h);
    // What the allocation was created to be exported as, where the driver says.
    // SAFETY: a live handle (retained above).
    let types = match unsafe { ipc::mem_get_allocation_properties_from_handle(drv, h) } {
        Ok(prop) => Some(prop.requestedHandleTypes as u32 as u64),
        Err(CudaError::MissingSymbol { .. }) => {
            pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, base).ok()
        }
        Err(_) => None,
    };
    if let Some(t) = types {
        if t & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as u64 == 0 {
            return Err(bad(not_exportable(Some(t))));
        }
    }
    // SAFETY: the handle is live (retained above).
    let exported = unsafe { ipc::mem_export_to_posix_fd(drv, h) };
    let fd = match exported {
        Ok(fd) => fd,
        Err(e) => {
            let rc = match e {
                CudaError::Call { code, .. } => code,
                _ => CUDA_SUCCESS,
            };
            return Err(bad(
                if rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED {
                    format!("{} ({e})", not_exportable(types))
                } else {
                    format!("the allocation mapped at {base:#x}+{size}: {e}")
                },
            ));
        }
    };
    if fd < 0 {
        return Err(bad(format!(
            "cuMemExportToShareableHandle returned descriptor {fd} for the allocation at {base:#x}"
        )));
    }
    // SAFETY: the driver made the descriptor for us; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Not inherited by the client's child processes (it stays usable with SCM_RIGHTS).
    // SAFETY: F_SETFD on a descriptor we own.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(fd)
}

/// Test support (not part of the API): what the driver says about the address `addr`, one
/// `name=value` per pointer attribute this module reads, for a GPU test's log.
#[doc(hidden)]
pub fn describe_pointer(addr: u64) -> String {
    let drv = match result::driver() {
        Ok(d) => d,
        Err(e) => return e.to_string(),
    };
    let dev = pointer_get_attribute(drv, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
        .ok()
        .and_then(|o| Device::open(o as i32).ok());
    let _g = dev.as_ref().and_then(|d| d.scoped().ok());
    let attrs = [
        ("memory_type", CU_POINTER_ATTRIBUTE_MEMORY_TYPE),
        ("device", CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL),
        (
            "legacy_ipc",
            CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        ),
        ("range_start", CU_POINTER_ATTRIBUTE_RANGE_START_ADDR),
        ("range_size", CU_POINTER_ATTRIBUTE_RANGE_SIZE),
        (
            "allowed_handle_types",
            CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
        ),
        ("access_flags", CU_POINTER_ATTRIBUTE_ACCESS_FLAGS),
        ("mapping_base", CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR),
        ("mapping_size", CU_POINTER_ATTRIBUTE_MAPPING_SIZE),
    ];
    let mut out: Vec<String> = attrs
        .iter()
        .map(|&(name, a)| match pointer_get_attribute(drv, a, addr) {
            Ok(v) => format!("{name}={v:#x}"),
            Err(CudaError::Call { name: n, .. }) => format!("{name}=<{n}>"),
            Err(e) => format!("{name}=<{e}>"),
        })
        .collect();
    out.push(format!("vmm_mapping={:x?}", vmm_mapping(drv, addr)));
    // Nothing where the driver lacks cuMemGetAddressRange_v2.
    match memory::mem_get_address_range(drv, addr) {
        Ok((base, size)) => out.push(format!(
            "address_range(rc {CUDA_SUCCESS})={base:#x}+{size:#x}"
        )),
        Err(CudaError::Call { code, .. }) => out.push(format!("address_range(rc {code})=0x0+0x0")),
        Err(_) => {}
    }
    format!("{addr:#x}: {}", out.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_not_exportable_message_says_what_to_change() {
        let m = not_exportable(Some(0));
        assert!(
            m.contains("requestedHandleTypes")
                && m.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")
                && m.contains("expandable"),
            "{m}"
        );
    }
}
