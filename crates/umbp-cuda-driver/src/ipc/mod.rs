//! CUDA memory of another process: a client exports a range of its device memory, a standalone
//! server maps it, and no KV byte goes over the socket.
//!
//! * Client side (`export.rs`): [`export_device_range`] looks at the memory and returns a
//!   [`DeviceExport`]: a legacy IPC handle (`cuIpcGetMemHandle`) for `cudaMalloc` / `cuMemAlloc`
//!   memory (PyTorch's default caching allocator), or one POSIX file descriptor per physical
//!   allocation for memory of the virtual memory management API (`cuMemCreate` + `cuMemMap`:
//!   PyTorch's `expandable_segments:True`, vLLM's sleep mode), where one tensor can span several
//!   allocations mapped back to back.
//! * Server side: [`device_by_uuid`] (`uuid.rs`) finds the device (ordinals differ between
//!   processes with different `CUDA_VISIBLE_DEVICES`), [`ImportedIpc`] (`legacy.rs`) opens a
//!   legacy handle, [`ImportedVmm`] (`vmm.rs`) maps the descriptors back to back into one
//!   reserved address range. Both ranges pass [`crate::Device::check_device_range`], which the
//!   store runs at registration.
//!
//! The handle bytes travel in a message; the descriptors beside it (`SCM_RIGHTS` on a Unix
//! socket). The client must keep the memory allocated, and use it for nothing else, while the
//! server may copy to or from it.

mod export;
mod legacy;
mod uuid;
mod vmm;

pub use export::{describe_pointer, export_device_range, DeviceExport, VmmChunkExport};
pub use legacy::ImportedIpc;
pub use uuid::{device_by_uuid, format_uuid};
pub use vmm::{vmm_granularity, ImportedVmm, VmmAllocation};

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
    use crate::result::driver;
    use crate::CudaError;

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
