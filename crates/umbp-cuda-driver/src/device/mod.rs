//! The safe types over the driver's [`crate::result`] layer: a CUDA device with its primary
//! context (`context.rs`), streams (`stream.rs`), events (`event.rs`), memory (`memory.rs`),
//! PTX modules (`module.rs`) and what the driver says about an address (`pointer.rs`).

mod context;
mod event;
mod memory;
mod module;
pub(crate) mod pointer;
mod stream;

pub use context::{CtxGuard, Device};
pub use event::Event;
pub use memory::{DeviceBuffer, HostBuffer, HostRegistration};
pub use module::Module;
pub use stream::Stream;
