//! Turning a driver call's `CUresult` into `Result<(), CudaError>` naming the entry point, and
//! the entry points a driver may lack ([`OptionalEntryPoint`]): [`require`] makes a missing one
//! an error naming it.

use std::ffi::{c_char, CStr};

use crate::error::CudaError;
use crate::sys::library::Driver;
use crate::sys::types::*;

/// `cuGetErrorName` and `cuGetErrorString` of `rc`, or "unknown CUDA error" where the driver
/// does not know it.
fn error_text(drv: &Driver, rc: CUresult) -> (String, String) {
    let read = |f: FnGetErrorString| {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; the driver returns a static string or fails.
        let ok = unsafe { f(rc, &mut p) } == CUDA_SUCCESS && !p.is_null();
        if ok {
            // SAFETY: the driver's error strings are static NUL-terminated strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("unknown CUDA error {rc}")
        }
    };
    (read(drv.get_error_name), read(drv.get_error_string))
}

/// `Ok` when `rc` is `CUDA_SUCCESS`, else [`CudaError::Call`] naming `call`, with the
/// driver's name and text of the error.
pub fn check(drv: &Driver, call: &'static str, rc: CUresult) -> Result<(), CudaError> {
    if rc == CUDA_SUCCESS {
        return Ok(());
    }
    let (name, mut text) = error_text(drv, rc);
    if rc == CUDA_ERROR_NO_DEVICE {
        text.push_str(" (no CUDA device is visible: check CUDA_VISIBLE_DEVICES)");
    }
    Err(CudaError::Call {
        call,
        code: rc,
        name,
        text,
    })
}

/// A driver entry point UMBP loads without (the driver still loads where it is missing), for
/// [`require`] and [`is_available`]. The symbol each one names in errors is
/// [`OptionalEntryPoint::symbol`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionalEntryPoint {
    /// `cuDeviceGetUuid_v2` (or `cuDeviceGetUuid`).
    DeviceGetUuid,
    /// `cuMemGetAddressRange_v2`.
    MemGetAddressRange,
    /// `cuIpcGetMemHandle`.
    IpcGetMemHandle,
    /// `cuIpcOpenMemHandle_v2`.
    IpcOpenMemHandle,
    /// `cuIpcCloseMemHandle`.
    IpcCloseMemHandle,
    /// `cuMemRetainAllocationHandle`.
    MemRetainAllocationHandle,
    /// `cuMemExportToShareableHandle`.
    MemExportToShareableHandle,
    /// `cuMemImportFromShareableHandle`.
    MemImportFromShareableHandle,
    /// `cuMemRelease`.
    MemRelease,
    /// `cuMemGetAllocationPropertiesFromHandle`.
    MemGetAllocationPropertiesFromHandle,
    /// `cuMemAddressReserve`.
    MemAddressReserve,
    /// `cuMemAddressFree`.
    MemAddressFree,
    /// `cuMemMap`.
    MemMap,
    /// `cuMemUnmap`.
    MemUnmap,
    /// `cuMemSetAccess`.
    MemSetAccess,
    /// `cuMemGetAllocationGranularity`.
    MemGetAllocationGranularity,
    /// `cuMemCreate`.
    MemCreate,
}

impl OptionalEntryPoint {
    /// The export a missing entry point is named by in [`CudaError::MissingSymbol`].
    pub fn symbol(self) -> &'static str {
        use OptionalEntryPoint::*;
        match self {
            DeviceGetUuid => "cuDeviceGetUuid_v2",
            MemGetAddressRange => "cuMemGetAddressRange_v2",
            IpcGetMemHandle => "cuIpcGetMemHandle",
            IpcOpenMemHandle => "cuIpcOpenMemHandle_v2",
            IpcCloseMemHandle => "cuIpcCloseMemHandle",
            MemRetainAllocationHandle => "cuMemRetainAllocationHandle",
            MemExportToShareableHandle => "cuMemExportToShareableHandle",
            MemImportFromShareableHandle => "cuMemImportFromShareableHandle",
            MemRelease => "cuMemRelease",
            MemGetAllocationPropertiesFromHandle => "cuMemGetAllocationPropertiesFromHandle",
            MemAddressReserve => "cuMemAddressReserve",
            MemAddressFree => "cuMemAddressFree",
            MemMap => "cuMemMap",
            MemUnmap => "cuMemUnmap",
            MemSetAccess => "cuMemSetAccess",
            MemGetAllocationGranularity => "cuMemGetAllocationGranularity",
            MemCreate => "cuMemCreate",
        }
    }
}

/// Whether the driver exports `entry`.
pub fn is_available(drv: &Driver, entry: OptionalEntryPoint) -> bool {
    use OptionalEntryPoint::*;
    match entry {
        DeviceGetUuid => drv.device_get_uuid.is_some(),
        MemGetAddressRange => drv.mem_get_address_range.is_some(),
        IpcGetMemHandle => drv.ipc_get_mem_handle.is_some(),
        IpcOpenMemHandle => drv.ipc_open_mem_handle.is_some(),
        IpcCloseMemHandle => drv.ipc_close_mem_handle.is_some(),
        MemRetainAllocationHandle => drv.mem_retain_allocation_handle.is_some(),
        MemExportToShareableHandle => drv.mem_export_to_shareable_handle.is_some(),
        MemImportFromShareableHandle => drv.mem_import_from_shareable_handle.is_some(),
        MemRelease => drv.mem_release.is_some(),
        MemGetAllocationPropertiesFromHandle => {
            drv.mem_get_allocation_properties_from_handle.is_some()
        }
        MemAddressReserve => drv.mem_address_reserve.is_some(),
        MemAddressFree => drv.mem_address_free.is_some(),
        MemMap => drv.mem_map.is_some(),
        MemUnmap => drv.mem_unmap.is_some(),
        MemSetAccess => drv.mem_set_access.is_some(),
        MemGetAllocationGranularity => drv.mem_get_allocation_granularity.is_some(),
        MemCreate => drv.mem_create.is_some(),
    }
}

/// `Ok` where the driver exports `entry`, else [`CudaError::MissingSymbol`] naming it.
pub fn require(drv: &Driver, entry: OptionalEntryPoint) -> Result<(), CudaError> {
    need(drv, is_available(drv, entry).then_some(()), entry)
}

/// An optional entry point's function pointer `f`, or [`CudaError::MissingSymbol`] naming
/// `entry` where the driver lacks it.
pub(super) fn need<T>(
    drv: &Driver,
    f: Option<T>,
    entry: OptionalEntryPoint,
) -> Result<T, CudaError> {
    missing_symbol(&drv.lib, f, entry.symbol())
}

/// `f`, or [`CudaError::MissingSymbol`] naming `symbol` of `lib`.
fn missing_symbol<T>(lib: &str, f: Option<T>, symbol: &'static str) -> Result<T, CudaError> {
    f.ok_or_else(|| CudaError::MissingSymbol {
        lib: lib.to_owned(),
        symbol: symbol.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::library::LIBCUDA;

    #[test]
    fn a_missing_optional_entry_point_is_an_error_naming_it() {
        let e = missing_symbol::<FnIpcOpenMemHandle>(
            LIBCUDA,
            None,
            OptionalEntryPoint::IpcOpenMemHandle.symbol(),
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("cuIpcOpenMemHandle_v2") && m.contains("libcuda.so.1"),
            "{m}"
        );
        assert!(missing_symbol(LIBCUDA, Some(1u8), "x").is_ok());
    }

    #[test]
    fn error_messages_name_cuda() {
        let e = CudaError::NoDriver {
            lib: LIBCUDA.into(),
            reason: "libcuda.so.1: cannot open shared object file".into(),
        };
        let m = e.to_string();
        assert!(m.contains("CUDA") && m.contains("libcuda.so.1"), "{m}");
    }
}
