//! Python bindings: the `umbp._native` extension module.
//!
//! Nothing is created at import but the exception classes: no threads, no pools, no runtime.
//! Native work that can block or scales with its input runs with the GIL released
//! ([`lifecycle::without_gil`]). Every failure is one [`errors::Error`], raised as one of the
//! classes of `umbp.errors`, which this module creates and exports.
//!
//! - [`errors`]: the error type, the exception classes and the conversion between them.
//! - [`keys`]: `Keys` and `KeyBuilder`.
//! - [`store`]: `EmbeddedStore`, the embedded store.
//! - [`lookup`]: `LookupServer`, `LookupClient` and `socket_path`.
//! - [`standalone`]: `StandaloneClient`, the standalone server's client (its runtime is made
//!   by the constructor).
//! - [`transfer`]: `Transfer` (also named `Job`), a store or load of either mode.
//! - [`options`]: the connector options' schema and validation.
//! - [`lifecycle`]: the GIL, forked children, drops and closing at exit.

use pyo3::prelude::*;

mod errors;
mod keys;
mod lifecycle;
mod lookup;
mod options;
mod standalone;
mod store;
mod transfer;

/// Memory this process may still use, `(bytes, what limits it)`: the host's `MemAvailable`, or
/// less where its memory cgroup (v2 or v1) has less room; None when neither can be read.
#[pyfunction]
fn memory_available(py: Python<'_>) -> Option<(u64, String)> {
    lifecycle::without_gil(py, || {
        umbp_pool::memory_available().map(|m| (m.bytes, m.source))
    })
}

/// One field of a group of counters: name, kind, Prometheus series, help.
type FieldRow = (&'static str, &'static str, String, String);

/// Every group of counters a stats dict may hold (`"disk"`, `"remote"`, `"pins"`), each a list of its
/// fields `(name, kind, series, help)` in order, from the groups' one model
/// (`umbp_core::counters`): what `disk_stats()`, `remote_stats()`, `pin_stats()` and a
/// standalone `stats()` report under those keys, and the server's Prometheus series of each.
#[pyfunction]
fn counter_fields() -> Vec<(&'static str, Vec<FieldRow>)> {
    fn group<S: umbp_core::CounterSet>() -> (&'static str, Vec<FieldRow>) {
        let fields = S::FIELDS
            .iter()
            .map(|f| {
                let kind = match f.kind {
                    umbp_core::CounterKind::Counter => "counter",
                    umbp_core::CounterKind::Gauge => "gauge",
                    umbp_core::CounterKind::Flag => "flag",
                };
                (f.name, kind, f.series(S::GROUP), f.help())
            })
            .collect();
        (S::GROUP, fields)
    }
    vec![
        group::<umbp_pool::PoolCounters>(),
        group::<umbp_store::DiskStats>(),
        group::<umbp_store::RemoteStats>(),
        group::<umbp_pool::KeepStats>(),
    ]
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Route Rust `log` records to Python's `logging` (logger names start with "umbp").
    let _ = pyo3_log::try_init();
    errors::add_classes(m)?;
    // Close stores and clients and stop lookup servers before finalization (see
    // `lifecycle::LIVE_STORES`).
    m.add_function(wrap_pyfunction!(lifecycle::_close_all, m)?)?;
    m.py()
        .import("atexit")?
        .call_method1("register", (m.getattr("_close_all")?,))?;
    m.add_class::<store::EmbeddedStore>()?;
    m.add_class::<transfer::Transfer>()?;
    // The name embedded mode's transfers had: the same class.
    m.add("Job", m.py().get_type::<transfer::Transfer>())?;
    m.add_class::<keys::KeyBuilder>()?;
    m.add_class::<keys::Keys>()?;
    m.add_class::<lookup::LookupServer>()?;
    m.add_class::<lookup::LookupClient>()?;
    m.add_class::<standalone::StandaloneClient>()?;
    m.add_function(wrap_pyfunction!(lookup::socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(memory_available, m)?)?;
    m.add_function(wrap_pyfunction!(counter_fields, m)?)?;
    options::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
