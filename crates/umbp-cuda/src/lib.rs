//! The CUDA backend of UMBP's copy engine, on the driver layer of `umbp-cuda-driver`:
//! * [`PoolPinner`]: registers the pool for DMA in chunks on a background thread.
//! * [`CudaMover`]: the [`umbp_copy::Mover`] between CUDA memory and pool objects: DMA by default
//!   (merged, 2-D/3-D strided and batched copies), a brief staged gather/scatter for small
//!   pieces (`auto`), ordering after the submitter's stream through events.
//! * [`plan`]: the pure planning both methods use (unit-tested without a GPU).
//!
//! The driver's safe types are re-exported here, so the store and the server (which use the
//! mover too) name one crate; code that needs only the driver (the standalone client)
//! depends on `umbp-cuda-driver` alone.

mod mover;
mod pin;
pub mod plan;

pub use mover::{CopyMethod, CudaMover, CudaOptions, CudaStats, TraceSpan};
pub use pin::{PinProgress, PinStatus, PoolPinner, SPLIT_BYTES};
pub use umbp_cuda_driver::{
    device_by_uuid, driver, export_device_range, format_uuid, ipc, result, sys, vmm_granularity,
    CtxGuard, CudaError, Device, DeviceBuffer, DeviceExport, Driver, Event, HostBuffer,
    HostRegistration, ImportedIpc, ImportedVmm, Stream, VmmChunkExport,
};
