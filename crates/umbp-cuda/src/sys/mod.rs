//! The raw layer over the CUDA driver API: the types, constants and structs of `cuda.h`
//! ([`types`]) and the driver library's table of entry points ([`library`]).

pub mod library;
pub(crate) mod types;

pub use library::{driver, is_loaded, BatchFn, Driver, LIBCUDA, LIBCUDA_ENV};
