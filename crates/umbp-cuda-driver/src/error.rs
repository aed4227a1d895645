use thiserror::Error;
use umbp_core::ErrorKind;

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
    /// A thread of the CUDA backend could not be started.
    #[error("could not start the CUDA backend's {thread} thread: {reason}; the process is at its thread or memory limit (check `ulimit -u` and the container's pids limit)")]
    Spawn {
        /// The thread.
        thread: &'static str,
        /// The system error's text.
        reason: String,
    },
    /// A range of this process's CUDA memory cannot be handed to another process.
    #[error("cannot export {addr:#x}+{len} of CUDA memory to another process: {reason}")]
    Export {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// What is wrong, and what to change.
        reason: String,
    },
    /// Another process's CUDA memory cannot be mapped into this one.
    #[error("cannot map another process's CUDA memory: {reason}")]
    Import {
        /// What is wrong, and what to change.
        reason: String,
    },
    /// No device this process sees has the UUID another process named.
    #[error(
        "no CUDA device of this process has UUID {uuid} (it sees {seen}); the server must see \
         the client's GPU: check both processes' CUDA_VISIBLE_DEVICES (and MIG layout)"
    )]
    UnknownDevice {
        /// The UUID asked for (`GPU-…`).
        uuid: String,
        /// The devices this process sees, with their UUIDs.
        seen: String,
    },
    /// Something else the caller asked for cannot be done.
    #[error("CUDA: {0}")]
    Invalid(String),
}

/// `CUresult`s after which the context is unusable: every later call fails too, until the
/// process exits (CUDA's "sticky" errors).
const STICKY: [i32; 10] = [
    214, // CUDA_ERROR_ECC_UNCORRECTABLE
    700, // CUDA_ERROR_ILLEGAL_ADDRESS
    702, // CUDA_ERROR_LAUNCH_TIMEOUT
    710, // CUDA_ERROR_ASSERT (a device-side assert)
    714, // CUDA_ERROR_HARDWARE_STACK_ERROR
    715, // CUDA_ERROR_ILLEGAL_INSTRUCTION
    716, // CUDA_ERROR_MISALIGNED_ADDRESS
    717, // CUDA_ERROR_INVALID_ADDRESS_SPACE
    718, // CUDA_ERROR_INVALID_PC
    719, // CUDA_ERROR_LAUNCH_FAILED
];

impl CudaError {
    /// Whether this is a driver call that failed with a sticky error: the context (and with
    /// it every transfer to or from its device) is unusable from now on.
    pub fn is_sticky(&self) -> bool {
        matches!(self, CudaError::Call { code, .. } if STICKY.contains(code))
    }

    /// The error's kind: a sticky driver failure is [`ErrorKind::DeviceLost`]; memory that is
    /// not the device's is [`ErrorKind::Registration`]; a bad option
    /// [`ErrorKind::InvalidArgument`]; the rest [`ErrorKind::Device`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            _ if self.is_sticky() => ErrorKind::DeviceLost,
            CudaError::Option { .. } => ErrorKind::InvalidArgument,
            CudaError::BadMemory { .. } | CudaError::Device { .. } => ErrorKind::Registration,
            CudaError::Spawn { .. } => ErrorKind::Internal,
            CudaError::NoDriver { .. }
            | CudaError::MissingSymbol { .. }
            | CudaError::Call { .. }
            | CudaError::Forked { .. }
            | CudaError::Export { .. }
            | CudaError::Import { .. }
            | CudaError::UnknownDevice { .. }
            | CudaError::Invalid(_) => ErrorKind::Device,
        }
    }

    /// Whether this is a driver call that failed for want of device memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Call { code, .. } if *code == crate::sys::types::CUDA_ERROR_OUT_OF_MEMORY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(code: i32) -> CudaError {
        CudaError::Call {
            call: "cuMemcpyAsync",
            code,
            name: format!("E{code}"),
            text: String::new(),
        }
    }

    #[test]
    fn sticky_errors_are_told_apart_from_others() {
        assert!(call(700).is_sticky() && call(719).is_sticky() && call(214).is_sticky());
        assert!(
            !call(1).is_sticky(),
            "CUDA_ERROR_INVALID_VALUE leaves the context usable"
        );
        assert!(
            !call(2).is_sticky(),
            "out of memory leaves the context usable"
        );
        assert!(!CudaError::Invalid("x".into()).is_sticky());
    }
}
