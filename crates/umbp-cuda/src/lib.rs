//! The CUDA backend of UMBP's copy engine.
//!
//! Layered as three levels over the driver API:
//! * [`sys`]: the raw types, constants and structs of `cuda.h`, and the driver library's table
//!   of entry points, loaded with `dlopen` on first use, never at import ([`driver`]).
//! * [`result`]: one checked function per driver entry point UMBP uses, returning
//!   `Result<_, CudaError>` naming the entry point; every `unsafe` driver call is there.
//!   Without a driver every entry point returns a [`CudaError`] that names CUDA; nothing panics.
//! * The safe types, on [`result`] only: [`Device`] (a device's primary context, the one
//!   PyTorch uses), [`Stream`], [`Event`], memory ([`DeviceBuffer`], [`HostBuffer`],
//!   [`HostRegistration`]) and the mappings of another process's memory ([`ipc`]).
//!
//! On them:
//! * [`PoolPinner`]: registers the pool for DMA in chunks on a background thread.
//! * [`CudaMover`]: the [`umbp_copy::Mover`] between CUDA memory and pool objects: DMA by default
//!   (merged, 2-D/3-D strided and batched copies), a brief staged gather/scatter for small
//!   pieces (`auto`), ordering after the submitter's stream through events.
//! * [`plan`]: the pure planning both methods use (unit-tested without a GPU).
//! * [`ipc`]: CUDA memory shared between processes: a client exports a range
//!   ([`export_device_range`]: a legacy IPC handle, or POSIX descriptors for memory of the
//!   virtual memory management API), a standalone server maps it ([`ImportedIpc`],
//!   [`ImportedVmm`]).

mod device;
mod error;
pub mod ipc;
mod mover;
mod pin;
pub mod plan;
pub mod result;
pub mod sys;

pub use device::{CtxGuard, Device, DeviceBuffer, Event, HostBuffer, HostRegistration, Stream};
pub use error::CudaError;
pub use ipc::{
    device_by_uuid, export_device_range, format_uuid, vmm_granularity, DeviceExport, ImportedIpc,
    ImportedVmm, VmmChunkExport,
};
pub use mover::{CopyMethod, CudaMover, CudaOptions, CudaStats, TraceSpan};
pub use pin::{PinProgress, PinStatus, PoolPinner, SPLIT_BYTES};
pub use result::driver;
pub use sys::Driver;
