use thiserror::Error;

/// Errors of the CUDA backend. Every message names CUDA and says what to change.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum CudaError {
    /// The driver library could not be loaded (no NVIDIA driver on this machine).
    #[error(
        "CUDA is not available: the NVIDIA driver library {lib} could not be loaded ({reason}); \
         install the NVIDIA driver (or set UMBP_LIBCUDA to libcuda.so.1's path), or keep the KV \
         cache in host memory and register it with register_memory"
    )]
    NoDriver {
        /// The library asked for.
        lib: String,
        /// `dlerror()`'s text.
        reason: String,
    },
    /// The driver library lacks an entry point UMBP needs.
    #[error(
        "CUDA driver library {lib} lacks {symbol}; the NVIDIA driver is too old for UMBP \
         (it needs CUDA 11.4 or newer)"
    )]
    MissingSymbol {
        /// The library.
        lib: String,
        /// The missing export.
        symbol: String,
    },
    /// A driver call failed.
    #[error("CUDA call {call} failed: {name} ({code}): {text}")]
    Call {
        /// The driver entry point.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
        /// `cuGetErrorName`.
        name: String,
        /// `cuGetErrorString`, with advice where UMBP has some.
        text: String,
    },
    /// CUDA was initialised in a parent process and this is a forked child.
    #[error(
        "CUDA was initialised in process {init_pid} and this is a forked child (pid {pid}); \
         create the UMBP store after the fork, or start workers with the spawn method"
    )]
    Forked {
        /// The process that initialised CUDA.
        init_pid: u32,
        /// This process.
        pid: u32,
    },
    /// A device ordinal that does not exist, or a second device for one store.
    #[error("CUDA device {device}: {reason}")]
    Device {
        /// The ordinal.
        device: i32,
        /// What is wrong.
        reason: String,
    },
    /// Memory handed to UMBP as CUDA memory is not (all) CUDA device memory of that device.
    #[error("cannot register {addr:#x}+{len} as CUDA memory of device {device}: {reason}")]
    BadMemory {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// The device it was said to be on.
        device: i32,
        /// What is wrong.
        reason: String,
    },
    /// An option of the CUDA backend is invalid.
    #[error("option `{name}`: {reason}")]
    Option {
        /// The option.
        name: &'static str,
        /// What to change.
        reason: String,
    },
    /// Something else the caller asked for cannot be done.
    #[error("CUDA: {0}")]
    Invalid(String),
}
