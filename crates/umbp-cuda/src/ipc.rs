//! CUDA memory of another process: a client exports a range of its device memory, a standalone
//! server maps it, and no KV byte goes over the socket.
//!
//! * Client side: [`export_device_range`] looks at the memory and returns a [`DeviceExport`]:
//!   a legacy IPC handle (`cuIpcGetMemHandle`) for `cudaMalloc` / `cuMemAlloc` memory (PyTorch's
//!   default caching allocator), or one POSIX file descriptor per physical allocation for memory
//!   of the virtual memory management API (`cuMemCreate` + `cuMemMap`: PyTorch's
//!   `expandable_segments:True`, vLLM's sleep mode), where one tensor can span several
//!   allocations mapped back to back.
//! * Server side: [`device_by_uuid`] finds the device (ordinals differ between processes with
//!   different `CUDA_VISIBLE_DEVICES`), [`ImportedIpc`] opens a legacy handle, [`ImportedVmm`]
//!   maps the descriptors back to back into one reserved address range. Both ranges pass
//!   [`Device::check_device_range`], which the store runs at registration.
//!
//! The handle bytes travel in a message; the descriptors beside it (`SCM_RIGHTS` on a Unix
//! socket). The client must keep the memory allocated, and use it for nothing else, while the
//! server may copy to or from it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::device::{device_uuid, pointer_attribute, vmm_mapping};
use crate::sys::library::{driver, Driver};
use crate::sys::types::*;
use crate::{CudaError, Device};

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
    let drv = driver()?;
    let ordinal =
        pointer_attribute(drv, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr).map_err(|e| {
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
    let range = drv.need(drv.mem_get_address_range, "cuMemGetAddressRange_v2")?;
    let get = drv.need(drv.ipc_get_mem_handle, "cuIpcGetMemHandle")?;
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; the device's context is current.
    drv.check("cuMemGetAddressRange", unsafe {
        range(&mut base, &mut size, addr)
    })?;
    let size = size as u64;
    if addr < base || end > base.saturating_add(size) {
        return Err(bad(format!(
            "it runs past its allocation {base:#x}+{size}; export the tensor's own bytes"
        )));
    }
    let mut h = CUipcMemHandle {
        reserved: [0; CU_IPC_HANDLE_SIZE],
    };
    // SAFETY: a valid out-pointer; `base` is the start of a live allocation of this context.
    drv.check("cuIpcGetMemHandle", unsafe { get(&mut h, base) })
        .map_err(|e| bad(e.to_string()))?;
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
    let retain = drv.need(
        drv.mem_retain_allocation_handle,
        "cuMemRetainAllocationHandle",
    )?;
    let release = drv.need(drv.mem_release, "cuMemRelease")?;
    let export = drv.need(
        drv.mem_export_to_shareable_handle,
        "cuMemExportToShareableHandle",
    )?;
    let mut h: CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-pointer; `base` is the start of a cuMemMap mapping.
    drv.check("cuMemRetainAllocationHandle", unsafe {
        retain(&mut h, base as *mut c_void)
    })?;
    // The reference taken above is dropped whatever happens next.
    struct Retained(FnMemRelease, CUmemGenericAllocationHandle);
    impl Drop for Retained {
        fn drop(&mut self) {
            // SAFETY: drops the one reference cuMemRetainAllocationHandle took.
            unsafe { (self.0)(self.1) };
        }
    }
    let _retained = Retained(release, h);
    // What the allocation was created to be exported as, where the driver says.
    let types = match drv.mem_get_allocation_properties_from_handle {
        Some(props) => {
            let mut prop = CUmemAllocationProp::device(0, CU_MEM_HANDLE_TYPE_NONE);
            // SAFETY: a valid out-pointer to a CUmemAllocationProp and a live handle.
            let rc = unsafe { props(&mut prop, h) };
            (rc == CUDA_SUCCESS).then_some(prop.requestedHandleTypes as u32 as u64)
        }
        None => pointer_attribute(drv, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, base).ok(),
    };
    if let Some(t) = types {
        if t & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as u64 == 0 {
            return Err(bad(not_exportable(Some(t))));
        }
    }
    let mut fd: c_int = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int into the pointed-to `fd`; the
    // handle is live (retained above); flags must be 0.
    let rc = unsafe {
        export(
            &mut fd as *mut c_int as *mut c_void,
            h,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    if let Err(e) = drv.check("cuMemExportToShareableHandle", rc) {
        return Err(bad(
            if rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED {
                format!("{} ({e})", not_exportable(types))
            } else {
                format!("the allocation mapped at {base:#x}+{size}: {e}")
            },
        ));
    }
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

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` writes a device's UUID.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The ordinal, in this process, of the device with UUID `uuid`.
pub fn device_by_uuid(uuid: &[u8; 16]) -> Result<i32, CudaError> {
    let drv = driver()?;
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer.
    drv.check("cuDeviceGetCount", unsafe {
        (drv.device_get_count)(&mut count)
    })?;
    let mut seen = Vec::new();
    for i in 0..count {
        let mut d: CUdevice = 0;
        // SAFETY: a valid out-pointer and an ordinal below the count.
        drv.check("cuDeviceGet", unsafe { (drv.device_get)(&mut d, i) })?;
        let u = device_uuid(drv, d)?;
        if &u == uuid {
            return Ok(i);
        }
        seen.push(format!("{i}: {}", format_uuid(&u)));
    }
    Err(CudaError::UnknownDevice {
        uuid: format_uuid(uuid),
        seen: if seen.is_empty() {
            "no device".into()
        } else {
            seen.join(", ")
        },
    })
}

/// Another process's `cuMemAlloc` allocation, opened with its legacy IPC handle; closed when
/// dropped. Send and Sync: it is an address in this process's address space and a retained
/// context, both usable from any thread (the driver API is thread-safe).
#[derive(Debug)]
pub struct ImportedIpc {
    dev: Arc<Device>,
    ptr: CUdeviceptr,
    len: u64,
}

impl ImportedIpc {
    /// Opens `handle` ([`DeviceExport::Legacy`]) on device `device` of this process (see
    /// [`device_by_uuid`]), in its primary context; `allocation_bytes` is the exporter's size
    /// of the allocation, checked against what the driver maps.
    ///
    /// A handle that is not a live allocation's (bytes of something else, a freed allocation,
    /// one of a process that has exited) is an error. A handle cannot be opened in the process
    /// that exported it.
    pub fn open(device: i32, handle: &[u8; 64], allocation_bytes: u64) -> Result<Self, CudaError> {
        if allocation_bytes == 0 {
            return Err(CudaError::Import {
                reason: "the allocation's size is 0".into(),
            });
        }
        let dev = Device::open(device)?;
        let drv = dev.driver();
        let open = drv.need(drv.ipc_open_mem_handle, "cuIpcOpenMemHandle_v2")?;
        drv.need(drv.ipc_close_mem_handle, "cuIpcCloseMemHandle")?;
        let _g = dev.scoped()?;
        let h = CUipcMemHandle {
            reserved: handle.map(|b| b as _),
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: a valid out-pointer and a 64-byte handle passed by value; the device's
        // primary context is current. The driver validates the handle's contents.
        let rc = unsafe { open(&mut ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) };
        drv.check("cuIpcOpenMemHandle", rc)
            .map_err(|e| CudaError::Import {
                reason: format!(
                    "{e}; the handle must be a live cudaMalloc allocation's, of a process that is \
                     still running and not this one, on device {device} (or a peer of it)"
                ),
            })?;
        let imported = ImportedIpc {
            dev: Arc::clone(&dev),
            ptr,
            len: allocation_bytes,
        };
        // What the driver mapped must hold what the exporter described.
        if let Some(range) = drv.mem_get_address_range {
            let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid out-pointers; `ptr` was just mapped in the current context.
            let rc = unsafe { range(&mut base, &mut size, ptr) };
            let holds = base <= ptr
                && ptr
                    .checked_add(allocation_bytes)
                    .is_some_and(|end| end <= base.saturating_add(size as u64));
            if rc == CUDA_SUCCESS && !holds {
                return Err(CudaError::Import {
                    reason: format!(
                        "the handle maps {base:#x}+{size}, not an allocation of \
                         {allocation_bytes} bytes: the handle and the size do not belong together"
                    ),
                });
            }
        }
        Ok(imported)
    }

    /// Where the allocation is mapped in this process.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never: an empty allocation is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ImportedIpc {
    fn drop(&mut self) {
        if driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                if let Some(close) = self.dev.driver().ipc_close_mem_handle {
                    // SAFETY: the mapping `open` made in this (now current) context; its user
                    // has finished copying.
                    unsafe { close(self.ptr) };
                }
            }
        }
    }
}

/// Checks that chunks `(offset, size)` lie back to back from offset 0, in order; returns their
/// total size.
fn chunk_layout(chunks: impl IntoIterator<Item = (u64, u64)>) -> Result<u64, CudaError> {
    let bad = |reason: String| CudaError::Import { reason };
    let mut next = 0u64;
    let mut n = 0usize;
    for (i, (offset, size)) in chunks.into_iter().enumerate() {
        if size == 0 {
            return Err(bad(format!("chunk {i} is empty")));
        }
        if offset != next {
            return Err(bad(format!(
                "chunk {i} starts at offset {offset}, where the chunks before it end at {next}: \
                 the chunks must lie back to back from offset 0, in order, as \
                 export_device_range returns them"
            )));
        }
        next = offset
            .checked_add(size)
            .ok_or_else(|| bad(format!("chunk {i} wraps the address space")))?;
        n += 1;
    }
    if n == 0 {
        return Err(bad("no chunks".into()));
    }
    Ok(next)
}

/// Checks that every chunk's size is a multiple of the allocation granularity.
fn check_granularity(
    chunks: impl IntoIterator<Item = (u64, u64)>,
    granularity: u64,
) -> Result<(), CudaError> {
    for (i, (_, size)) in chunks.into_iter().enumerate() {
        if granularity == 0 || size % granularity != 0 {
            return Err(CudaError::Import {
                reason: format!(
                    "chunk {i}'s size {size} is not a multiple of the device's allocation \
                     granularity {granularity}: it is not a whole cuMemCreate allocation"
                ),
            });
        }
    }
    Ok(())
}

/// The minimum allocation granularity of pinned device memory exportable as POSIX file
/// descriptors (`cuMemGetAllocationGranularity`). Needs no current context.
fn granularity(dev: &Device) -> Result<u64, CudaError> {
    let drv = dev.driver();
    let f = drv.need(
        drv.mem_get_allocation_granularity,
        "cuMemGetAllocationGranularity",
    )?;
    let prop =
        CUmemAllocationProp::device(dev.raw_device(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    let mut g: usize = 0;
    // SAFETY: a valid out-pointer and a fully initialised CUmemAllocationProp.
    drv.check("cuMemGetAllocationGranularity", unsafe {
        f(&mut g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    })?;
    if g == 0 {
        return Err(CudaError::Invalid(
            "cuMemGetAllocationGranularity returned 0".into(),
        ));
    }
    Ok(g as u64)
}

/// The allocation granularity of device `device`'s memory for the virtual memory management
/// API: every chunk [`ImportedVmm::map`] maps is a multiple of it.
pub fn vmm_granularity(device: i32) -> Result<u64, CudaError> {
    granularity(&*Device::open(device)?)
}

/// The entry points a [`VmmRange`] needs, resolved once (an old driver may lack them).
#[derive(Debug, Clone, Copy)]
struct VmmFns {
    reserve: FnMemAddressReserve,
    free: FnMemAddressFree,
    map: FnMemMap,
    unmap: FnMemUnmap,
    release: FnMemRelease,
    set_access: FnMemSetAccess,
}

impl VmmFns {
    fn load(drv: &Driver) -> Result<Self, CudaError> {
        Ok(VmmFns {
            reserve: drv.need(drv.mem_address_reserve, "cuMemAddressReserve")?,
            free: drv.need(drv.mem_address_free, "cuMemAddressFree")?,
            map: drv.need(drv.mem_map, "cuMemMap")?,
            unmap: drv.need(drv.mem_unmap, "cuMemUnmap")?,
            release: drv.need(drv.mem_release, "cuMemRelease")?,
            set_access: drv.need(drv.mem_set_access, "cuMemSetAccess")?,
        })
    }
}

/// One physical allocation of a [`VmmRange`].
#[derive(Debug)]
struct Piece {
    offset: u64,
    size: u64,
    handle: CUmemGenericAllocationHandle,
    mapped: bool,
}

/// A reserved address range with physical allocations mapped into it back to back. Dropping
/// it undoes whatever was done: unmaps what was mapped, releases every handle it holds, frees
/// the addresses (so a failure half-way through building one leaves nothing behind).
#[derive(Debug)]
struct VmmRange {
    dev: Arc<Device>,
    fns: VmmFns,
    va: CUdeviceptr,
    len: u64,
    pieces: Vec<Piece>,
}

impl VmmRange {
    /// Reserves `len` bytes of addresses aligned to `align`. Needs the device's context
    /// current.
    fn reserve(dev: &Arc<Device>, fns: VmmFns, len: u64, align: u64) -> Result<Self, CudaError> {
        let mut va: CUdeviceptr = 0;
        // SAFETY: a valid out-pointer; no fixed address is asked for; flags must be 0.
        dev.driver().check("cuMemAddressReserve", unsafe {
            (fns.reserve)(&mut va, len as usize, align as usize, 0, 0)
        })?;
        Ok(VmmRange {
            dev: Arc::clone(dev),
            fns,
            va,
            len,
            pieces: Vec::new(),
        })
    }

    /// Maps the whole allocation `handle` (which the range now owns: it is released on drop,
    /// also when mapping fails) at `offset`.
    fn map_piece(
        &mut self,
        offset: u64,
        size: u64,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<(), CudaError> {
        self.pieces.push(Piece {
            offset,
            size,
            handle,
            mapped: false,
        });
        debug_assert!(offset + size <= self.len);
        // SAFETY: `[va + offset, va + offset + size)` lies in our reservation and nothing is
        // mapped there (the pieces are back to back); the handle is live; flags must be 0.
        self.dev.driver().check("cuMemMap", unsafe {
            (self.fns.map)(self.va + offset, size as usize, 0, handle, 0)
        })?;
        if let Some(p) = self.pieces.last_mut() {
            p.mapped = true;
        }
        Ok(())
    }

    /// Lets the device read and write every piece (per mapping, as PyTorch does).
    fn allow_access(&self) -> Result<(), CudaError> {
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.dev.raw_device(),
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for p in &self.pieces {
            // SAFETY: a mapped range of our reservation and one valid descriptor.
            self.dev.driver().check("cuMemSetAccess", unsafe {
                (self.fns.set_access)(self.va + p.offset, p.size as usize, &desc, 1)
            })?;
        }
        Ok(())
    }
}

impl Drop for VmmRange {
    fn drop(&mut self) {
        if driver().is_err() {
            return;
        }
        let Ok(_g) = self.dev.scoped() else {
            return;
        };
        for p in self.pieces.iter().filter(|p| p.mapped) {
            // SAFETY: a mapping this range made; its user has finished copying.
            unsafe { (self.fns.unmap)(self.va + p.offset, p.size as usize) };
        }
        for p in &self.pieces {
            // SAFETY: the handle this range owns (created or imported), unmapped above.
            unsafe { (self.fns.release)(p.handle) };
        }
        // SAFETY: our reservation, with nothing mapped in it any more.
        unsafe { (self.fns.free)(self.va, self.len as usize) };
    }
}

/// Another process's memory of the virtual memory management API, mapped into this one: its
/// physical allocations, imported from their descriptors, back to back in one reserved range;
/// unmapped and released when dropped. Send and Sync: addresses and driver handles, usable
/// from any thread.
#[derive(Debug)]
pub struct ImportedVmm {
    range: VmmRange,
}

impl ImportedVmm {
    /// Maps `chunks` (descriptor, offset, size: [`DeviceExport::Vmm`]'s chunks, received over
    /// a Unix socket) on device `device` of this process, back to back from offset 0, readable
    /// and writable by the device. The descriptors are only borrowed: the caller may close
    /// them afterwards.
    pub fn map(device: i32, chunks: &[(BorrowedFd<'_>, u64, u64)]) -> Result<Self, CudaError> {
        let layout = || chunks.iter().map(|c| (c.1, c.2));
        let total = chunk_layout(layout())?;
        let dev = Device::open(device)?;
        let drv = dev.driver();
        let import = drv.need(
            drv.mem_import_from_shareable_handle,
            "cuMemImportFromShareableHandle",
        )?;
        let fns = VmmFns::load(drv)?;
        let g = granularity(&dev)?;
        check_granularity(layout(), g)?;
        let _g = dev.scoped()?;
        let mut range = VmmRange::reserve(&dev, fns, total, g)?;
        for (i, (fd, offset, size)) in chunks.iter().enumerate() {
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: a valid out-pointer; for POSIX_FILE_DESCRIPTOR the driver takes the
            // descriptor's value in the pointer argument and only reads the descriptor, which
            // is open for as long as it is borrowed.
            let rc = unsafe {
                import(
                    &mut h,
                    std::ptr::without_provenance_mut(fd.as_raw_fd() as usize),
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            drv.check("cuMemImportFromShareableHandle", rc)
                .map_err(|e| CudaError::Import {
                    reason: format!(
                        "chunk {i} (descriptor {}): {e}; pass the descriptors \
                         export_device_range made, received over a Unix socket (SCM_RIGHTS)",
                        fd.as_raw_fd()
                    ),
                })?;
            range
                .map_piece(*offset, *size, h)
                .map_err(|e| CudaError::Import {
                    reason: format!(
                        "chunk {i}: {e}; each chunk's size must be its whole allocation's"
                    ),
                })?;
        }
        range.allow_access()?;
        Ok(ImportedVmm { range })
    }

    /// Where the chunks are mapped in this process (the first chunk's start).
    pub fn addr(&self) -> u64 {
        self.range.va
    }

    /// The chunks' total size.
    pub fn len(&self) -> u64 {
        self.range.len
    }

    /// Whether it is empty (never: no chunks is refused).
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }
}

/// Test support (not part of the API): memory of the virtual memory management API, as
/// PyTorch's expandable segments make it: `cuMemCreate` allocations of `chunk_sizes` (each a
/// multiple of [`vmm_granularity`]) mapped back to back into one reserved range, readable and
/// writable by the device; `exportable` asks for POSIX file descriptors as handle types.
#[doc(hidden)]
#[derive(Debug)]
pub struct VmmAllocation {
    range: VmmRange,
}

#[doc(hidden)]
impl VmmAllocation {
    /// Test support: see [`VmmAllocation`].
    pub fn create(device: i32, chunk_sizes: &[u64], exportable: bool) -> Result<Self, CudaError> {
        let mut offsets = Vec::with_capacity(chunk_sizes.len());
        let mut next = 0u64;
        for &s in chunk_sizes {
            offsets.push((next, s));
            next = next.saturating_add(s);
        }
        let total = chunk_layout(offsets.iter().copied())?;
        let dev = Device::open(device)?;
        let drv = dev.driver();
        let create = drv.need(drv.mem_create, "cuMemCreate")?;
        let fns = VmmFns::load(drv)?;
        let g = granularity(&dev)?;
        check_granularity(offsets.iter().copied(), g)?;
        let _g = dev.scoped()?;
        let mut range = VmmRange::reserve(&dev, fns, total, g)?;
        let types = if exportable {
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            CU_MEM_HANDLE_TYPE_NONE
        };
        let prop = CUmemAllocationProp::device(dev.raw_device(), types);
        for (offset, size) in offsets {
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: a valid out-pointer and a fully initialised prop; flags must be 0.
            drv.check("cuMemCreate", unsafe {
                create(&mut h, size as usize, &prop, 0)
            })?;
            range.map_piece(offset, size, h)?;
        }
        range.allow_access()?;
        Ok(VmmAllocation { range })
    }

    /// Test support: the range's start.
    pub fn addr(&self) -> u64 {
        self.range.va
    }

    /// Test support: the range's size.
    pub fn len(&self) -> u64 {
        self.range.len
    }

    /// Test support: whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }
}

/// Test support (not part of the API): what the driver says about the address `addr`, one
/// `name=value` per pointer attribute this module reads, for a GPU test's log.
#[doc(hidden)]
pub fn describe_pointer(addr: u64) -> String {
    let drv = match driver() {
        Ok(d) => d,
        Err(e) => return e.to_string(),
    };
    let dev = pointer_attribute(drv, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
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
        .map(|&(name, a)| match pointer_attribute(drv, a, addr) {
            Ok(v) => format!("{name}={v:#x}"),
            Err(CudaError::Call { name: n, .. }) => format!("{name}=<{n}>"),
            Err(e) => format!("{name}=<{e}>"),
        })
        .collect();
    out.push(format!("vmm_mapping={:x?}", vmm_mapping(drv, addr)));
    if let Some(f) = drv.mem_get_address_range {
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers.
        let rc = unsafe { f(&mut base, &mut size, addr) };
        out.push(format!("address_range(rc {rc})={base:#x}+{size:#x}"));
    }
    format!("{addr:#x}: {}", out.join(" "))
}

// The exports and imports are plain data, addresses and driver handles (the driver API may be
// called from any thread, and a mapping belongs to the process, not to a thread), so they are
// Send and Sync without an `unsafe impl`; this keeps it so.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<DeviceExport>();
    send_sync::<ImportedIpc>();
    send_sync::<ImportedVmm>();
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_must_lie_back_to_back_from_zero() {
        assert_eq!(chunk_layout([(0, 4), (4, 8), (12, 4)]), Ok(16));
        assert_eq!(chunk_layout([(0, 2 << 20)]), Ok(2 << 20));
        let m = chunk_layout([(0, 4), (8, 4)]).unwrap_err().to_string();
        assert!(
            m.contains("chunk 1 starts at offset 8") && m.contains("end at 4"),
            "{m}"
        );
        let m = chunk_layout([(4, 4)]).unwrap_err().to_string();
        assert!(m.contains("chunk 0 starts at offset 4"), "{m}");
        // Out of order is refused too (overlap included).
        assert!(chunk_layout([(4, 4), (0, 4)]).is_err());
        assert!(chunk_layout([(0, 8), (4, 4)]).is_err());
        let m = chunk_layout([(0, 4), (4, 0)]).unwrap_err().to_string();
        assert!(m.contains("chunk 1 is empty"), "{m}");
        assert!(chunk_layout(std::iter::empty()).is_err());
        assert!(chunk_layout([(0, u64::MAX), (u64::MAX, 1)]).is_err());
        assert!(chunk_layout([(0, u64::MAX - 1), (u64::MAX - 1, 2)]).is_err());
    }

    #[test]
    fn chunk_sizes_must_be_whole_allocations() {
        let g = 2 << 20;
        assert!(check_granularity([(0, g), (g, 2 * g)], g).is_ok());
        let m = check_granularity([(0, g), (g, g / 2)], g)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("chunk 1's size") && m.contains("granularity"),
            "{m}"
        );
        assert!(check_granularity([(0, g)], 0).is_err());
    }

    #[test]
    fn uuids_are_written_as_nvidia_smi_does() {
        let u: [u8; 16] = std::array::from_fn(|i| (i as u8) * 17);
        assert_eq!(format_uuid(&u), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

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

    /// Without a driver (this machine's tests) every entry point says so; the layout is
    /// checked before the driver is needed.
    #[test]
    fn without_a_driver_every_entry_point_is_an_error() {
        let Err(no) = driver() else {
            return; // a machine with CUDA: the GPU test (tests/ipc.rs) covers it
        };
        assert_eq!(export_device_range(0x1000, 16).unwrap_err(), no);
        assert_eq!(device_by_uuid(&[0; 16]).unwrap_err(), no);
        assert_eq!(ImportedIpc::open(0, &[0; 64], 1 << 20).unwrap_err(), no);
        assert_eq!(vmm_granularity(0).unwrap_err(), no);
        let f = std::fs::File::open("/dev/null").unwrap();
        let fd = std::os::fd::AsFd::as_fd(&f);
        assert_eq!(ImportedVmm::map(0, &[(fd, 0, 2 << 20)]).unwrap_err(), no);
        assert!(matches!(
            ImportedVmm::map(0, &[(fd, 0, 2 << 20), (fd, 4 << 20, 2 << 20)]),
            Err(CudaError::Import { .. })
        ));
        assert!(matches!(
            ImportedVmm::map(0, &[]),
            Err(CudaError::Import { .. })
        ));
        assert!(matches!(
            export_device_range(0, 16),
            Err(CudaError::Export { .. })
        ));
        assert!(describe_pointer(0x1000).contains("CUDA"));
    }
}
