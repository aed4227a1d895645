//! The connector options' schema and validation, for `umbp.vllm.config`.
//!
//! `connector_options(extra_json, kv_role)` checks the user's `kv_connector_extra_config`
//! (given as JSON) against `umbp_core::options::SCHEMA` and returns every option, validated and
//! defaulted, as a dict; a bad option raises `umbp.errors.ConfigError` naming it.
//! `connector_option_schema()` returns the schema itself (the docs' tables are generated from
//! it).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;
use serde_json::Value;
use umbp_core::options::{Kind, TextRule, Unit, SCHEMA};
use umbp_core::ConnectorOptions;

/// `umbp.errors.ConfigError(msg)`, raised through the bindings' one error type.
fn config_error(_py: Python<'_>, msg: String) -> PyErr {
    crate::errors::Error::Config(msg).into()
}

/// A JSON value as the Python object `json.loads` would give.
fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    match v {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(b) => b.into_bound_py_any(py),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_bound_py_any(py),
            (None, Some(i)) => i.into_bound_py_any(py),
            _ => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py),
        },
        Value::String(s) => s.into_bound_py_any(py),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            Ok(list.into_any())
        }
        Value::Object(map) => {
            let d = PyDict::new(py);
            for (k, item) in map {
                d.set_item(k, to_py(py, item)?)?;
            }
            Ok(d.into_any())
        }
    }
}

/// Validates `kv_connector_extra_config` (`extra_json`, a JSON object) and `kv_role` (None:
/// `kv_both`); returns every option, defaulted, with `kv_role`. Raises `ConfigError` naming the
/// first bad option.
#[pyfunction]
#[pyo3(signature = (extra_json, kv_role=None))]
fn connector_options<'py>(
    py: Python<'py>,
    extra_json: &str,
    kv_role: Option<&str>,
) -> PyResult<Bound<'py, PyAny>> {
    let opts = ConnectorOptions::from_json(extra_json, kv_role)
        .map_err(|e| config_error(py, e.to_string()))?;
    to_py(py, &opts.to_json())
}

/// Every connector option, in the docs' order: a dict each with `name`, `scope` (`"shared"`,
/// `"embedded"`, `"standalone"`), `type`, `default` (None when unset), `nullable`, `min` and
/// `max` (integers; `max` None when unbounded), `unit`, `choices`, `doc`, `default_doc` and
/// `rejected` (the docs' Markdown for the Default and Rejected-when columns).
#[pyfunction]
fn connector_option_schema(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    SCHEMA
        .iter()
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("name", s.name)?;
            d.set_item("scope", s.scope.name())?;
            let (ty, min, max, unit, choices): (&str, _, _, _, Vec<&str>) = match s.kind {
                Kind::Bool => ("bool", None, None, None, vec![]),
                Kind::Int { min, max, unit } => (
                    "int",
                    Some(min),
                    (max != u64::MAX).then_some(max),
                    Some(match unit {
                        Unit::Count => "count",
                        Unit::Bytes => "bytes",
                        Unit::Millis => "ms",
                        Unit::Seconds => "s",
                    }),
                    vec![],
                ),
                Kind::Fraction => ("fraction", None, None, None, vec![]),
                Kind::Choice(c) => ("choice", None, None, None, c.to_vec()),
                Kind::Text(rule) => (
                    match rule {
                        TextRule::Namespace => "namespace",
                        TextRule::Instance => "instance",
                        TextRule::Directory => "directory",
                        TextRule::Endpoint => "endpoint",
                        TextRule::RemoteUrl => "remote_url",
                    },
                    None,
                    None,
                    None,
                    vec![],
                ),
                Kind::HugepageSize => ("hugepage_size", None, None, None, vec!["2MiB", "1GiB"]),
                Kind::Priority => ("priority", None, None, None, vec![]),
            };
            d.set_item("type", ty)?;
            d.set_item("default", to_py(py, &s.default_json())?)?;
            d.set_item("nullable", s.nullable)?;
            d.set_item("min", min)?;
            d.set_item("max", max)?;
            d.set_item("unit", unit)?;
            d.set_item("choices", choices)?;
            d.set_item("doc", s.doc)?;
            d.set_item("default_doc", s.default_text())?;
            d.set_item("rejected", s.rejected_text())?;
            Ok(d)
        })
        .collect()
}

/// Adds this module's functions to `umbp._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(connector_options, m)?)?;
    m.add_function(wrap_pyfunction!(connector_option_schema, m)?)?;
    Ok(())
}
