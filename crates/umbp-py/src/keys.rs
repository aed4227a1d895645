//! Block keys: `Keys`, an immutable batch, and `KeyBuilder`, which builds them in bulk.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySlice};
use umbp_core::{BlockKey, KeyBuilder as CoreKeyBuilder, RankTopology};

use crate::errors::{Error, Result};
use crate::lifecycle::bulk;

/// An immutable batch of block keys, built in bulk by `KeyBuilder`.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct Keys {
    pub(crate) keys: Vec<BlockKey>,
}

#[pymethods]
impl Keys {
    fn __len__(&self) -> usize {
        self.keys.len()
    }

    /// `keys[i:j]` (a slice) gives a new `Keys`.
    fn __getitem__(&self, index: &Bound<'_, PySlice>) -> Result<Keys> {
        let idx = index.indices(self.keys.len() as isize)?;
        let mut out = Vec::with_capacity(idx.slicelength);
        let mut i = idx.start;
        for _ in 0..idx.slicelength {
            out.push(self.keys[i as usize]);
            i += idx.step;
        }
        Ok(Keys { keys: out })
    }

    /// The keys' binary form: 64 bytes each, back to back.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let buf = bulk(py, self.keys.len(), || {
            let mut buf = Vec::with_capacity(self.keys.len() * 64);
            for k in &self.keys {
                buf.extend_from_slice(k.as_bytes());
            }
            buf
        });
        PyBytes::new(py, &buf)
    }

    /// Rebuilds keys from `to_bytes()` output.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> Result<Keys> {
        if !data.len().is_multiple_of(64) {
            return Err(Error::Config(format!(
                "{} bytes is not a whole number of 64-byte keys",
                data.len()
            )));
        }
        let keys = bulk(py, data.len() / 64, || {
            data.chunks_exact(64)
                .map(|c| BlockKey::from_bytes(c.try_into().expect("64 bytes")))
                .collect()
        });
        Ok(Keys { keys })
    }

    fn __repr__(&self) -> String {
        format!("<umbp.Keys of {} keys>", self.keys.len())
    }
}

/// A key builder for `namespace` and one rank's topology position.
pub(crate) fn key_builder(
    namespace: &str,
    tp: u16,
    pcp: u16,
    dcp: u16,
    pp: u16,
) -> Result<CoreKeyBuilder> {
    Ok(CoreKeyBuilder::new(
        namespace,
        RankTopology { tp, pcp, dcp, pp },
    )?)
}

/// Builds keys for one namespace and one worker's ranks.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct KeyBuilder {
    inner: CoreKeyBuilder,
}

#[pymethods]
impl KeyBuilder {
    #[new]
    #[pyo3(signature = (namespace, *, tp=0, pcp=0, dcp=0, pp=0))]
    fn new(namespace: &str, tp: u16, pcp: u16, dcp: u16, pp: u16) -> Result<Self> {
        Ok(KeyBuilder {
            inner: key_builder(namespace, tp, pcp, dcp, pp)?,
        })
    }

    #[getter]
    fn namespace(&self) -> &str {
        self.inner.namespace()
    }

    /// Keys of `hashes` (each 1..=32 bytes) in cache group `group`.
    fn keys(&self, py: Python<'_>, group: u32, hashes: Vec<Vec<u8>>) -> Result<Keys> {
        let keys = bulk(py, hashes.len(), || {
            self.inner.keys(group, hashes.iter().map(Vec::as_slice))
        })?;
        Ok(Keys { keys })
    }

    /// Keys of hashes packed back to back in `packed`, `hash_len` bytes each.
    fn keys_packed(
        &self,
        py: Python<'_>,
        group: u32,
        packed: &[u8],
        hash_len: usize,
    ) -> Result<Keys> {
        let keys = bulk(py, packed.len() / hash_len.max(1), || {
            self.inner.keys_packed(group, packed, hash_len)
        })?;
        Ok(Keys { keys })
    }

    /// The readable form of each key.
    fn key_strings(&self, py: Python<'_>, keys: &Keys) -> Vec<String> {
        bulk(py, keys.keys.len(), || {
            keys.keys.iter().map(|k| self.inner.key_string(k)).collect()
        })
    }
}
