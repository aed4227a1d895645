//! `umbp bench gpu` where CUDA cannot be loaded: a non-zero exit and a message naming CUDA.

use std::process::Command;

#[test]
fn bench_gpu_without_cuda_fails_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(["bench", "gpu", "--json"])
        // A driver path that cannot exist, so the test means the same on machines with a GPU.
        .env("UMBP_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .expect("run umbp");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("CUDA"), "{stderr}");
    assert!(stderr.contains("libcuda.so.1"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "no figures without a GPU");
}
