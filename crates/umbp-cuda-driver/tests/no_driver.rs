//! Without a loadable driver every entry point is an error that names CUDA; nothing panics.

use umbp_cuda_driver::{CudaError, Device};

#[test]
fn every_entry_point_reports_a_missing_driver() {
    // One test in this binary: the variable is read once per process, on first use.
    std::env::set_var("UMBP_LIBCUDA", "/nonexistent/libcuda.so.1");
    assert!(
        !umbp_cuda_driver::result::is_loaded(),
        "nothing loads the driver up front"
    );
    let e = umbp_cuda_driver::driver().unwrap_err();
    assert!(matches!(e, CudaError::NoDriver { .. }), "{e:?}");
    let m = e.to_string();
    assert!(
        m.contains("CUDA") && m.contains("/nonexistent/libcuda.so.1"),
        "{m}"
    );
    // The failure is remembered, not retried into a different state.
    assert_eq!(umbp_cuda_driver::driver().unwrap_err(), e);
    assert_eq!(Device::open(0).unwrap_err(), e);
    // A mover needs the pool's pinner, and the pinner an open device: neither can be made.
}
