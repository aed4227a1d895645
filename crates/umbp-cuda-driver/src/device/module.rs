//! PTX modules loaded into a [`Device`]'s context ([`Module`]) and the kernels they hold.

use std::ffi::CStr;
use std::sync::Arc;

use super::context::Device;
use crate::error::CudaError;
use crate::result;
use crate::sys::types::*;

/// A loaded PTX module; unloaded when dropped.
#[derive(Debug)]
pub struct Module {
    dev: Arc<Device>,
    raw: CUmodule,
}

// SAFETY: module and function handles may be used from any thread of the process; the handle
// is never mutated.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// JIT-compiles and loads `ptx` (NUL-terminated) into the device's context; the error
    /// carries the JIT log.
    pub fn load_ptx(dev: &Arc<Device>, ptx: &str) -> Result<Module, CudaError> {
        if !ptx.ends_with('\0') {
            return Err(CudaError::Invalid("PTX must be NUL-terminated".into()));
        }
        // What the driver reads: the text up to its first NUL.
        let ptx = CStr::from_bytes_until_nul(ptx.as_bytes())
            .map_err(|_| CudaError::Invalid("PTX must be NUL-terminated".into()))?;
        let _g = dev.scoped()?;
        let mut log = vec![0u8; 8192];
        let raw = match result::module::module_load_data_ex(dev.drv, ptx, &mut log) {
            Ok(raw) => raw,
            Err(e) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                return Err(CudaError::Invalid(format!(
                    "{e}; JIT log: {}",
                    String::from_utf8_lossy(&log[..end])
                )));
            }
        };
        Ok(Module {
            dev: Arc::clone(dev),
            raw,
        })
    }

    /// The kernel `name` of this module.
    pub fn function(&self, name: &CStr) -> Result<CUfunction, CudaError> {
        // SAFETY: a loaded module.
        unsafe { result::module::module_get_function(self.dev.drv, self.raw, name) }
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            if let Ok(_g) = self.dev.scoped() {
                // SAFETY: our module; its owner synchronised every stream that launched its
                // kernels before dropping it.
                let _ = unsafe { result::module::module_unload(self.dev.drv, self.raw) };
            }
        }
    }
}
