//! The checked layer over the CUDA driver: one Rust function per driver entry point UMBP uses,
//! which makes the call through the table of [`crate::sys`], checks its `CUresult` and returns
//! `Result<_, CudaError>` naming the entry point. Every `unsafe` driver call of the crate is
//! here; a function is `unsafe` only where a handle or address it is given must be live or
//! valid memory, and says so in its `# Safety` section. The safe types (`Device`, `Stream`,
//! `Event`, the buffers, the IPC mappings) sit on these functions, not on `sys`.
//!
//! Every function takes the loaded driver ([`driver`]) rather than looking it up, so that hot
//! paths pay no extra check per call.

mod check;
pub mod context;
pub mod event;
mod init;
pub mod ipc;
pub mod memory;
pub mod module;
pub mod stream;

pub use check::{check, is_available, require, OptionalEntryPoint};
pub use init::{driver, is_loaded};
