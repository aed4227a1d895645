//! The driver, loaded and initialised once per process: `cuInit` and `cuDriverGetVersion` on
//! the table [`crate::sys`] resolves, and the check that this process is the one that did it
//! (CUDA does not survive `fork`).

use std::ffi::c_int;
use std::sync::OnceLock;

use super::check::check;
use crate::error::CudaError;
use crate::sys::library::{BatchFn, Driver};
use crate::sys::types::*;

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

/// The driver, loaded and initialised (`cuInit`) on the first call. Fails with a message that
/// names CUDA when there is no driver, and with [`CudaError::Forked`] in a forked child of the
/// process that loaded it.
pub fn driver() -> Result<&'static Driver, CudaError> {
    let d = DRIVER
        .get_or_init(|| Driver::load().and_then(init))
        .as_ref()
        .map_err(Clone::clone)?;
    let pid = std::process::id();
    if pid != d.init_pid {
        return Err(CudaError::Forked {
            init_pid: d.init_pid,
            pid,
        });
    }
    Ok(d)
}

/// Whether this process has loaded the driver (for tests of "no CUDA at import").
pub fn is_loaded() -> bool {
    DRIVER.get().is_some()
}

/// `cuInit` (refusing the toolkit's stub library) and `cuDriverGetVersion` on a freshly
/// loaded table.
fn init(mut d: Driver) -> Result<Driver, CudaError> {
    // SAFETY: cuInit takes flags that must be 0.
    let rc = unsafe { (d.init)(0) };
    if rc == CUDA_ERROR_STUB_LIBRARY {
        return Err(CudaError::NoDriver {
            lib: d.lib,
            reason: "it is the CUDA toolkit's stub library, not the NVIDIA driver's".into(),
        });
    }
    check(&d, "cuInit", rc)?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    check(&d, "cuDriverGetVersion", unsafe {
        (d.driver_get_version)(&mut v)
    })?;
    d.version = v;
    log::info!(
        "umbp: loaded the CUDA driver {} (driver API {}), batched copies: {}",
        d.lib,
        d.version,
        match d.memcpy_batch_async {
            Some(BatchFn::V2(_)) => "cuMemcpyBatchAsync_v2",
            Some(BatchFn::V1(_)) => "cuMemcpyBatchAsync (12.8)",
            None => "not used",
        }
    );
    Ok(d)
}
