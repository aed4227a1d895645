//! The server's side for `cuMemAlloc` memory: another process's allocation opened with its
//! legacy IPC handle ([`ImportedIpc`]).

use std::sync::Arc;

use crate::device::Device;
use crate::error::CudaError;
use crate::result::memory;
use crate::result::{self, ipc, require, OptionalEntryPoint};
use crate::sys::types::*;

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
        require(drv, OptionalEntryPoint::IpcOpenMemHandle)?;
        require(drv, OptionalEntryPoint::IpcCloseMemHandle)?;
        let _g = dev.scoped()?;
        let h = CUipcMemHandle {
            reserved: handle.map(|b| b as _),
        };
        // The device's primary context is current; the driver validates the handle.
        let ptr =
            ipc::ipc_open_mem_handle(drv, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS).map_err(|e| {
                CudaError::Import {
                    reason: format!(
                    "{e}; the handle must be a live cudaMalloc allocation's, of a process that is \
                     still running and not this one, on device {device} (or a peer of it)"
                ),
                }
            })?;
        let imported = ImportedIpc {
            dev: Arc::clone(&dev),
            ptr,
            len: allocation_bytes,
        };
        // What the driver mapped must hold what the exporter described.
        // (Where the driver cannot say, or lacks cuMemGetAddressRange, it is not checked.)
        if let Ok((base, size)) = memory::mem_get_address_range(drv, ptr) {
            let holds = base <= ptr
                && ptr
                    .checked_add(allocation_bytes)
                    .is_some_and(|end| end <= base.saturating_add(size as u64));
            if !holds {
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
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: the mapping `open` made in this (now current) context; its user has
                // finished copying.
                let _ = unsafe { ipc::ipc_close_mem_handle(self.dev.driver(), self.ptr) };
            }
        }
    }
}
