//! A bf16 matmul loop through cuBLAS, loaded at run time: the compute load of
//! `umbp bench gpu --under-load` (what an engine's forward pass does to the GPU's SMs).
//!
//! cuBLAS is found as `$UMBP_LIBCUBLAS`, else `libcublas.so.13` / `.12` / `libcublas.so` on the
//! loader's path (PyTorch's wheels ship it under `site-packages/nvidia/*/lib`). It runs in the
//! device's primary context, the one the store's copies use.

use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use umbp_cuda::{Device, DeviceBuffer, Stream};

type Handle = *mut c_void;
type Create = unsafe extern "C" fn(*mut Handle) -> c_int;
type Destroy = unsafe extern "C" fn(Handle) -> c_int;
type SetStream = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
#[allow(clippy::type_complexity)]
type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> c_int;

const CUBLAS_OP_N: c_int = 0;
const CUDA_R_16BF: c_int = 14;
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUBLAS_GEMM_DEFAULT: c_int = -1;

/// `C = A · B` of `n × n` bf16 matrices on one stream, queued as often as asked.
pub struct Matmul {
    handle: Handle,
    destroy: Destroy,
    gemm: GemmEx,
    n: c_int,
    a: DeviceBuffer,
    b: DeviceBuffer,
    c: DeviceBuffer,
    _lib: *mut c_void,
}

fn open() -> Result<(*mut c_void, String)> {
    let mut names: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var("UMBP_LIBCUBLAS") {
        names.push(p);
    }
    names.extend(["libcublas.so.13", "libcublas.so.12", "libcublas.so"].map(String::from));
    for name in &names {
        let c = CString::new(name.as_str())?;
        // SAFETY: a NUL-terminated path; the library stays loaded for the process (never
        // closed), so the function pointers taken from it stay valid.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !h.is_null() {
            return Ok((h, name.clone()));
        }
    }
    bail!(
        "--under-load needs cuBLAS: none of {names:?} could be loaded; set UMBP_LIBCUBLAS to \
         libcublas.so's path (PyTorch ships it in site-packages/nvidia/*/lib)"
    )
}

fn sym<T>(lib: *mut c_void, name: &str) -> Result<T> {
    let c = CString::new(name)?;
    // SAFETY: `lib` is a live dlopen handle and `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        bail!("cuBLAS has no symbol {name}");
    }
    // SAFETY: `T` is the C function pointer type of `name` in cuBLAS's v2 API (checked by the
    // declarations above against cublas_api.h); pointers and functions have the same size.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Matmul {
    /// Loads cuBLAS and allocates three `n × n` bf16 matrices (A and B filled with small
    /// values) on `dev`; matmuls run on `stream`.
    pub fn new(dev: &Arc<Device>, stream: &Stream, n: usize) -> Result<(Matmul, String)> {
        let (lib, name) = open()?;
        let create: Create = sym(lib, "cublasCreate_v2")?;
        let destroy: Destroy = sym(lib, "cublasDestroy_v2")?;
        let set_stream: SetStream = sym(lib, "cublasSetStream_v2")?;
        let gemm: GemmEx = sym(lib, "cublasGemmEx")?;
        let bytes = (n * n * 2) as u64;
        let (a, b, c) = (dev.alloc(bytes)?, dev.alloc(bytes)?, dev.alloc(bytes)?);
        // Every element 0x3C3C (bf16 ~0.0115): finite products however long the loop runs,
        // and not zero.
        for m in [&a, &b] {
            // SAFETY: the whole buffer, owned here.
            unsafe { dev.memset(m.ptr(), 0x3C, bytes, stream) }?;
        }
        stream.synchronize()?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let rc = unsafe { create(&mut handle) };
        if rc != 0 {
            bail!("cublasCreate failed ({rc})");
        }
        // SAFETY: a live handle and a live stream of the current device's primary context.
        let rc = unsafe { set_stream(handle, stream.raw()) };
        if rc != 0 {
            // SAFETY: the handle was created above.
            unsafe { destroy(handle) };
            bail!("cublasSetStream failed ({rc})");
        }
        Ok((
            Matmul {
                handle,
                destroy,
                gemm,
                n: n as c_int,
                a,
                b,
                c,
                _lib: lib,
            },
            name,
        ))
    }

    /// Floating-point operations of one matmul.
    pub fn flops(&self) -> f64 {
        2.0 * f64::from(self.n).powi(3)
    }

    /// Queues `count` matmuls on the stream.
    pub fn queue(&self, count: usize) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        for _ in 0..count {
            // SAFETY: a live handle; A, B, C are n × n bf16 device matrices owned by `self`;
            // alpha and beta are host floats, as the default pointer mode expects.
            let rc = unsafe {
                (self.gemm)(
                    self.handle,
                    CUBLAS_OP_N,
                    CUBLAS_OP_N,
                    self.n,
                    self.n,
                    self.n,
                    &alpha as *const f32 as *const c_void,
                    self.a.ptr() as *const c_void,
                    CUDA_R_16BF,
                    self.n,
                    self.b.ptr() as *const c_void,
                    CUDA_R_16BF,
                    self.n,
                    &beta as *const f32 as *const c_void,
                    self.c.ptr() as *mut c_void,
                    CUDA_R_16BF,
                    self.n,
                    CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT,
                )
            };
            if rc != 0 {
                return Err(anyhow::anyhow!("cublasGemmEx failed ({rc})"))
                    .context("the compute load of --under-load");
            }
        }
        Ok(())
    }
}

impl Drop for Matmul {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe { (self.destroy)(self.handle) };
    }
}
