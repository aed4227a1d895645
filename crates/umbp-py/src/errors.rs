//! The bindings' one error type, [`Error`], and the one place it becomes a Python exception.
//!
//! The exception classes are created here, when `umbp._native` is imported, and exported from
//! it; `umbp.errors` re-exports them. Their `__module__` is `umbp.errors`, so they print and
//! pickle as they did when that module defined them. Raising one never looks anything up.
//!
//! Errors of the standalone client ([`umbp_client::ClientError`]) map onto the same classes
//! (see [`client_class`]): the server or the connection failing is `ServerUnavailable` (the
//! client attaches again by itself on a later call), a request it refuses is `ConfigError`,
//! `RegistrationError`, `PoolFullError` or `TransferError` by its gRPC code, and a closed or
//! forked client is `StoreClosedError`, as for the embedded store.

use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use umbp_client::ClientError;
use umbp_copy::CopyError;
use umbp_core::CoreError;
use umbp_lookup::LookupError;
use umbp_pool::PoolError;
use umbp_store::{CudaError, RemoteError, StoreError};

/// Every error the bindings raise.
#[derive(Debug)]
pub(crate) enum Error {
    /// An invalid argument, said by the message (`ConfigError`).
    Config(String),
    /// Invalid input to the core types (`ConfigError`).
    Core(CoreError),
    /// The store failed; the class depends on how.
    Store(StoreError),
    /// The lookup service could not start or its workers could not be reached.
    Lookup(LookupError),
    /// The standalone client failed; the class depends on how ([`client_class`]).
    Client(ClientError),
    /// An error already classified, kept to be raised again (a transfer's outcome).
    Raised(Raised),
    /// A native object used in a forked child of the process that made it.
    Forked {
        /// What it is ("store", "job", ...).
        what: &'static str,
        /// The process that made it.
        parent: u32,
    },
    /// Already a Python exception (from converting arguments or building results).
    Python(PyErr),
}

/// The bindings' result type.
pub(crate) type Result<T> = std::result::Result<T, Error>;

impl From<CoreError> for Error {
    fn from(e: CoreError) -> Self {
        Error::Core(e)
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(e)
    }
}

impl From<CopyError> for Error {
    fn from(e: CopyError) -> Self {
        Error::Store(StoreError::Copy(e))
    }
}

impl From<CudaError> for Error {
    fn from(e: CudaError) -> Self {
        Error::Store(StoreError::Cuda(e))
    }
}

impl From<LookupError> for Error {
    fn from(e: LookupError) -> Self {
        Error::Lookup(e)
    }
}

impl From<ClientError> for Error {
    fn from(e: ClientError) -> Self {
        Error::Client(e)
    }
}

impl From<Raised> for Error {
    fn from(r: Raised) -> Self {
        Error::Raised(r)
    }
}

/// An error's class and message, cloneable: what an outcome read more than once raises each
/// time.
#[derive(Debug, Clone)]
pub(crate) struct Raised {
    class: Class,
    message: String,
}

impl Raised {
    /// The class and message of a client error.
    pub(crate) fn of(e: &ClientError) -> Raised {
        Raised {
            class: client_class(e),
            message: e.to_string(),
        }
    }
}

impl From<PyErr> for Error {
    fn from(e: PyErr) -> Self {
        Error::Python(e)
    }
}

/// The exception classes of `umbp.errors`.
#[derive(Debug, Clone, Copy)]
enum Class {
    Umbp,
    Config,
    Pool,
    PoolFull,
    Registration,
    Transfer,
    TransferTimeout,
    StoreClosed,
    LookupService,
    Cuda,
    ServerUnavailable,
}

/// A built-in exception class that a class derives from besides `UmbpError`.
#[derive(Debug, Clone, Copy)]
enum Also {
    Nothing,
    ValueError,
    TimeoutError,
}

impl Class {
    /// Every class, in the order of the discriminants (checked below).
    const ALL: [Class; 11] = [
        Class::Umbp,
        Class::Config,
        Class::Pool,
        Class::PoolFull,
        Class::Registration,
        Class::Transfer,
        Class::TransferTimeout,
        Class::StoreClosed,
        Class::LookupService,
        Class::Cuda,
        Class::ServerUnavailable,
    ];

    /// The class's name, docstring and other base.
    fn spec(self) -> (&'static str, &'static str, Also) {
        match self {
            Class::Umbp => (
                "UmbpError",
                "Base class of every UMBP error.",
                Also::Nothing,
            ),
            Class::Config => (
                "ConfigError",
                "An option, layout, key or argument is invalid.",
                Also::ValueError,
            ),
            Class::Pool => (
                "PoolError",
                "The pool's memory could not be set up.",
                Also::Nothing,
            ),
            Class::PoolFull => (
                "PoolFullError",
                "The pool has no room even after eviction (what is left is pinned or being \
                 written); retry later.",
                Also::Nothing,
            ),
            Class::Registration => (
                "RegistrationError",
                "A memory registration is malformed, unknown, overlapping or still in use.",
                Also::Nothing,
            ),
            Class::Transfer => ("TransferError", "A transfer failed.", Also::Nothing),
            Class::TransferTimeout => (
                "TransferTimeout",
                "A wait ran past its deadline; the transfer is still running.",
                Also::TimeoutError,
            ),
            Class::StoreClosed => ("StoreClosedError", "The store was closed.", Also::Nothing),
            Class::LookupService => (
                "LookupServiceError",
                "A lookup service could not start, or its workers could not be reached.",
                Also::Nothing,
            ),
            Class::Cuda => (
                "CudaError",
                "CUDA is not available here (no NVIDIA driver), or a CUDA call failed.",
                Also::Nothing,
            ),
            Class::ServerUnavailable => (
                "ServerUnavailable",
                "The standalone server cannot be reached, went away or restarted, or did not \
                 answer in time; a later call attaches again by itself.",
                Also::Nothing,
            ),
        }
    }
}

// `Class::ALL[i]` is class `i`, so a class indexes `TYPES`.
const _: () = {
    let mut i = 0;
    while i < Class::ALL.len() {
        assert!(Class::ALL[i] as usize == i);
        i += 1;
    }
};

/// The classes, created once per process by [`add_classes`], indexed by [`Class`].
static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// Creates the classes, as `class Name(UmbpError[, ValueError | TimeoutError])` in
/// `umbp.errors` would (`UmbpError` itself derives from `Exception`).
fn create(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let mut types: Vec<Py<PyType>> = Vec::with_capacity(Class::ALL.len());
    for class in Class::ALL {
        let (name, doc, also) = class.spec();
        let mut bases = vec![match class {
            Class::Umbp => py.get_type::<PyException>(),
            _ => types[Class::Umbp as usize].bind(py).clone(),
        }];
        match also {
            Also::Nothing => {}
            Also::ValueError => bases.push(py.get_type::<PyValueError>()),
            Also::TimeoutError => bases.push(py.get_type::<PyTimeoutError>()),
        }
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "umbp.errors")?;
        namespace.set_item("__doc__", doc)?;
        let created = py
            .get_type::<PyType>()
            .call1((name, PyTuple::new(py, bases)?, namespace))?
            .cast_into::<PyType>()?;
        types.push(created.unbind());
    }
    Ok(types)
}

/// Creates the classes (once) and adds them to the module.
pub(crate) fn add_classes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let types = TYPES.get_or_try_init(m.py(), || create(m.py()))?;
    for class in Class::ALL {
        m.add(class.spec().0, types[class as usize].clone_ref(m.py()))?;
    }
    Ok(())
}

/// The class of a store error.
fn store_class(e: &StoreError) -> Class {
    match e {
        StoreError::Core(_) | StoreError::UnknownLayout(_) => Class::Config,
        StoreError::Pool(PoolError::Full { .. }) => Class::PoolFull,
        StoreError::Pool(PoolError::Config(_)) => Class::Config,
        StoreError::Pool(PoolError::TooLarge { .. }) => Class::Config,
        StoreError::Pool(PoolError::Closed)
        | StoreError::Closed
        | StoreError::SessionReleased(_) => Class::StoreClosed,
        StoreError::Pool(PoolError::Map { .. }) => Class::Pool,
        StoreError::Pool(PoolError::SharedFd { .. }) => Class::Registration,
        StoreError::Pool(PoolError::Spawn { .. }) => Class::Umbp,
        StoreError::Copy(c) => match c {
            CopyError::Core(_) | CopyError::InvalidRequest(_) => Class::Config,
            CopyError::BadRegistration { .. }
            | CopyError::UnknownRegion(_)
            | CopyError::RegionBusy { .. } => Class::Registration,
            CopyError::Timeout { .. } => Class::TransferTimeout,
            CopyError::Closed => Class::StoreClosed,
            CopyError::Pool(_) => Class::Transfer,
            CopyError::Spawn { .. } => Class::Umbp,
        },
        StoreError::Unmapped { .. } | StoreError::ForeignRegion(_) => Class::Registration,
        StoreError::Cuda(c) => cuda_class(c),
        StoreError::Remote(RemoteError::Thread { .. }) => Class::Umbp,
        StoreError::Remote(_) => Class::Config,
    }
}

/// The class of a CUDA error.
fn cuda_class(c: &CudaError) -> Class {
    match c {
        CudaError::Option { .. } => Class::Config,
        CudaError::BadMemory { .. } | CudaError::Device { .. } => Class::Registration,
        _ => Class::Cuda,
    }
}

/// The class of a standalone client error:
///
/// * `ServerUnavailable`: no server answers at the endpoint, the connection broke or the
///   server restarted (its session is gone), a call other than a transfer's wait ran past its
///   deadline, or an earlier call is still unanswered past its deadline (`Stalled`);
/// * `TransferTimeout`: a transfer's wait ran past its deadline (the transfer still runs);
/// * `ConfigError`: a bad endpoint, bad input found before sending (a count mismatch, an
///   unknown layout or region id, a layout outside registered memory), or a request the server
///   refused as invalid (`InvalidArgument`, `NotFound`, `OutOfRange`, `AlreadyExists`);
/// * `RegistrationError`: host memory that cannot be shared, CUDA memory that cannot be
///   exported, or a registration the server refused (`FailedPrecondition`, e.g. a region still
///   in use; `PermissionDenied`, memory of another session);
/// * `PoolFullError`: `ResourceExhausted`;
/// * `TransferError`: a transfer the server failed as a whole (`DeadlineExceeded`: it did
///   not stop after it was cancelled; `Internal`);
/// * `StoreClosedError`: the client was closed, or is used in a forked child;
/// * `UmbpError`: the rest (the server refused to attach this client: protocol version,
///   access; the client's runtime could not start).
fn client_class(e: &ClientError) -> Class {
    match e {
        ClientError::Endpoint(_)
        | ClientError::Invalid(_)
        | ClientError::UntrustedServer { .. } => Class::Config,
        ClientError::Unreachable { .. }
        | ClientError::Disconnected { .. }
        | ClientError::Stalled { .. } => Class::ServerUnavailable,
        ClientError::Timeout { what, .. } => {
            if *what == "transfer" {
                Class::TransferTimeout
            } else {
                Class::ServerUnavailable
            }
        }
        ClientError::Refused {
            call,
            code,
            message,
        } => refused_class(call, code, message),
        ClientError::Forked { .. } | ClientError::Closed => Class::StoreClosed,
        ClientError::Cuda(c) => cuda_class(c),
        ClientError::ShareBadRange { .. }
        | ClientError::ShareNotMapped { .. }
        | ClientError::ShareUnsupported { .. }
        | ClientError::ShareSystem { .. }
        | ClientError::ShareProc(_) => Class::Registration,
        ClientError::Io { what, .. } => {
            if what.contains("runtime") {
                Class::Umbp
            } else {
                // The descriptor side channel: the server went away.
                Class::ServerUnavailable
            }
        }
    }
}

/// The class of a request the server refused, by the gRPC code's name (see [`client_class`]).
fn refused_class(call: &str, code: &str, message: &str) -> Class {
    let attaching = matches!(call, "attach" | "ping");
    match code {
        "InvalidArgument" | "NotFound" | "OutOfRange" | "AlreadyExists" => Class::Config,
        "ResourceExhausted" => Class::PoolFull,
        // The server lost this client's session (it restarted, or released it).
        "FailedPrecondition" if message.contains("not attached") => Class::ServerUnavailable,
        "FailedPrecondition" | "PermissionDenied" if attaching => Class::Umbp,
        "FailedPrecondition" | "PermissionDenied" => Class::Registration,
        "DeadlineExceeded" | "Internal" if call == "transfer" => Class::Transfer,
        "DeadlineExceeded" => Class::ServerUnavailable,
        _ => Class::Umbp,
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let (class, message) = match e {
            Error::Python(e) => return e,
            Error::Config(m) => (Class::Config, m),
            Error::Core(e) => (Class::Config, e.to_string()),
            Error::Store(e) => (store_class(&e), e.to_string()),
            Error::Lookup(e) => (Class::LookupService, e.to_string()),
            Error::Client(e) => (client_class(&e), e.to_string()),
            Error::Raised(r) => (r.class, r.message),
            Error::Forked { what, parent } => (
                Class::StoreClosed,
                format!(
                    "this {what} was created in process {parent} and cannot be used in its \
                     forked child (pid {}): its threads exist only in the parent; create a new \
                     one in the child",
                    std::process::id()
                ),
            ),
        };
        Python::attach(|py| match TYPES.get(py) {
            Some(types) => PyErr::from_type(types[class as usize].bind(py).clone(), message),
            // Not reached: the classes exist before any object that can fail does.
            None => pyo3::exceptions::PyRuntimeError::new_err(message),
        })
    }
}
