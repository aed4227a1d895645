//! The gather and scatter kernels of the staged method, embedded as PTX and JIT-loaded once per
//! mover.

use std::sync::Arc;

use umbp_cuda_driver::sys::types::CUfunction;
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Device, Module};

pub(super) const PTX: &str = concat!(include_str!("../umbp_copy.ptx"), "\0");

#[derive(Debug)]
pub(super) struct Kernels {
    /// Keeps the functions loaded; unloaded when the mover drops (after its streams).
    _module: Module,
    pub(super) gather: CUfunction,
    pub(super) scatter: CUfunction,
}

// SAFETY: function handles may be used from any thread of the process; they are never mutated.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// JIT-loads the kernels into `dev`'s context.
pub(super) fn load_kernels(dev: &Arc<Device>) -> Result<Kernels, CudaError> {
    let module = Module::load_ptx(dev, PTX)?;
    Ok(Kernels {
        gather: module.function(c"umbp_gather")?,
        scatter: module.function(c"umbp_scatter")?,
        _module: module,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_are_embedded_nul_terminated() {
        assert!(PTX.ends_with('\0'));
        assert!(PTX.contains(".entry umbp_gather") && PTX.contains(".entry umbp_scatter"));
    }
}
