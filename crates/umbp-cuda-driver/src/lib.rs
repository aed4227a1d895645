//! The CUDA driver API as UMBP uses it, in three levels (as cudarc layers it):
//! * [`sys`]: the raw types, constants and structs of `cuda.h`, and the driver library's table
//!   of entry points, loaded with `dlopen` on first use, never at import ([`driver`]).
//! * [`result`]: one checked function per driver entry point UMBP uses, returning
//!   `Result<_, CudaError>` naming the entry point; every `unsafe` driver call is there.
//!   Without a driver every entry point returns a [`CudaError`] that names CUDA; nothing panics.
//! * The safe types, on [`result`] only: [`Device`] (a device's primary context, the one
//!   PyTorch uses), [`Stream`], [`Event`], [`Module`], memory ([`DeviceBuffer`],
//!   [`HostBuffer`], [`HostRegistration`]) and CUDA memory shared between processes ([`ipc`]):
//!   a client exports a range ([`export_device_range`]: a legacy IPC handle, or POSIX
//!   descriptors for memory of the virtual memory management API), a standalone server maps
//!   it ([`ImportedIpc`], [`ImportedVmm`]).
//!
//! Nothing here knows about pools, blocks or copies between them: that is `umbp-cuda`'s
//! mover, built on this crate. The standalone client needs only this one (to export its
//! memory), so it links neither the pool nor the copy engine.

mod device;
mod error;
pub mod ipc;
pub mod result;
pub mod sys;

pub use device::{
    CtxGuard, Device, DeviceBuffer, Event, HostBuffer, HostRegistration, Module, Stream,
};
pub use error::CudaError;
pub use ipc::{
    device_by_uuid, export_device_range, format_uuid, vmm_granularity, DeviceExport, ImportedIpc,
    ImportedVmm, VmmChunkExport,
};
pub use result::driver;
pub use sys::Driver;
