//! The bindings' one error type, [`Error`], and the one place it becomes a Python exception.
//!
//! The exception classes are created here, when `umbp._native` is imported, and exported from
//! it; `umbp.errors` re-exports them. Their `__module__` is `umbp.errors`, so they print and
//! pickle as they did when that module defined them. Raising one never looks anything up.
//!
//! Every error has a kind ([`umbp_core::ErrorKind`]), in both modes the same for the same
//! fault (the standalone server sends it with each refusal); [`class_of`] picks the class from
//! the kind alone, and the exception carries the kind's name as `kind` (e.g.
//! `"session_lost"`). The server or the connection failing is `ServerUnavailable` (the client
//! attaches again by itself on a later call).

use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use umbp_client::ClientError;
use umbp_copy::CopyError;
use umbp_core::{CoreError, ErrorKind};
use umbp_lookup::LookupError;
use umbp_store::{CudaError, StoreError};

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

    /// The kind an instance made in Python (not raised by the extension) reports: the most
    /// general kind of the class.
    fn default_kind(self) -> ErrorKind {
        match self {
            Class::Umbp => ErrorKind::Internal,
            Class::ServerUnavailable | Class::LookupService => ErrorKind::Unavailable,
            class => ErrorKind::ALL
                .into_iter()
                .find(|k| class_of(*k) as usize == class as usize)
                .unwrap_or(ErrorKind::Internal),
        }
    }

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
        // What an instance raised from Python (without a kind of its own) reports.
        namespace.set_item("kind", class.default_kind().name())?;
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

/// The class of a failure of kind `kind`: the one place a kind becomes a Python class (the
/// lookup service's errors keep `LookupServiceError`, whatever their kind).
fn class_of(kind: ErrorKind) -> Class {
    match kind {
        ErrorKind::InvalidArgument | ErrorKind::NotFound => Class::Config,
        ErrorKind::PoolFull => Class::PoolFull,
        ErrorKind::Registration => Class::Registration,
        ErrorKind::SessionLost | ErrorKind::Unavailable => Class::ServerUnavailable,
        ErrorKind::Closed => Class::StoreClosed,
        ErrorKind::DeviceLost | ErrorKind::Device => Class::Cuda,
        ErrorKind::Timeout => Class::TransferTimeout,
        ErrorKind::TransferFailed => Class::Transfer,
        ErrorKind::Resource => Class::Pool,
        ErrorKind::Denied | ErrorKind::Internal => Class::Umbp,
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let (kind, class, message) = match e {
            Error::Python(e) => return e,
            Error::Config(m) => (ErrorKind::InvalidArgument, None, m),
            Error::Core(e) => (e.kind(), None, e.to_string()),
            Error::Store(e) => (e.kind(), None, e.to_string()),
            Error::Lookup(e) => (e.kind(), Some(Class::LookupService), e.to_string()),
            Error::Client(e) => (e.kind(), None, e.to_string()),
            Error::Forked { what, parent } => (
                ErrorKind::Closed,
                None,
                format!(
                    "this {what} was created in process {parent} and cannot be used in its \
                     forked child (pid {}): its threads exist only in the parent; create a new \
                     one in the child",
                    std::process::id()
                ),
            ),
        };
        let class = class.unwrap_or_else(|| class_of(kind));
        Python::attach(|py| {
            let Some(types) = TYPES.get(py) else {
                // Not reached: the classes exist before any object that can fail does.
                return pyo3::exceptions::PyRuntimeError::new_err(message);
            };
            // The exception carries its kind (`e.kind`, e.g. "session_lost"): what callers
            // decide on, the same in both modes.
            let made = types[class as usize]
                .bind(py)
                .call1((message,))
                .and_then(|exc| {
                    exc.setattr("kind", kind.name())?;
                    Ok(PyErr::from_value(exc))
                });
            made.unwrap_or_else(|e| e)
        })
    }
}
