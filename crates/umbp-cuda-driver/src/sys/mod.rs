//! The raw layer over the CUDA driver API: the types, constants and structs of `cuda.h`
//! ([`types`]) and the driver library's table of entry points ([`library`]). Nothing here
//! calls the driver or checks a `CUresult`: [`crate::result`] does, one function per entry
//! point, and the safe types sit on it.

pub mod library;
pub mod types;

pub use library::{BatchFn, Driver, LIBCUDA, LIBCUDA_ENV};
pub use types::*;
