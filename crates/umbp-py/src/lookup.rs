//! The lookup service: a worker's `LookupServer` and the scheduler's `LookupClient`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use umbp_core::options;
use umbp_lookup::{LookupClient as CoreLookupClient, LookupServer as CoreLookupServer};
use umbp_store_lookup::StoreLookup;

use crate::errors::{Error, Result};
use crate::keys::key_builder;
use crate::lifecycle::{track_server, without_gil, Origin, ReleaseGilOnDrop};
use crate::store::EmbeddedStore;

/// Serves one worker's lookups and clears on a Unix socket (embedded mode).
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct LookupServer {
    inner: ReleaseGilOnDrop<Arc<CoreLookupServer>>,
}

#[pymethods]
impl LookupServer {
    /// Answers lookups for keys of `namespace` with this worker's ranks from `store`.
    #[new]
    #[pyo3(signature = (store, path, namespace, *, tp=0, pcp=0, dcp=0, pp=0, describe=String::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store: &EmbeddedStore,
        path: PathBuf,
        namespace: &str,
        tp: u16,
        pcp: u16,
        dcp: u16,
        pp: u16,
        describe: String,
    ) -> Result<Self> {
        let keys = key_builder(namespace, tp, pcp, dcp, pp)?;
        let target = Arc::new(StoreLookup::new(Arc::clone(store.live()?), keys, describe));
        let inner = Arc::new(without_gil(py, || CoreLookupServer::bind(&path, target))?);
        track_server(&inner);
        Ok(LookupServer {
            inner: ReleaseGilOnDrop::new(inner),
        })
    }

    /// The socket path.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_owned()
    }

    /// Stops serving and removes the socket. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        // A forked child has no service thread, and the socket is the parent's: leave both.
        if self.inner.forked() {
            return;
        }
        without_gil(py, || self.inner.shutdown());
    }
}

/// Asks every worker of an engine at once; any failure or late answer is a miss.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct LookupClient {
    inner: CoreLookupClient,
    /// A forked child must not share its connections.
    origin: Origin,
}

impl LookupClient {
    fn live(&self) -> Result<&CoreLookupClient> {
        self.origin.check("lookup client")?;
        Ok(&self.inner)
    }
}

#[pymethods]
impl LookupClient {
    /// A client of the workers' lookup sockets at `paths`; `timeout_ms` left out (or None) is
    /// the connector's `lookup_timeout_ms` default.
    #[new]
    #[pyo3(signature = (paths, timeout_ms=None))]
    fn new(paths: Vec<PathBuf>, timeout_ms: Option<u64>) -> Result<Self> {
        let timeout_ms = timeout_ms.unwrap_or_else(|| options::LOOKUP_TIMEOUT_MS.default_u64());
        if paths.is_empty() {
            return Err(Error::Config(
                "LookupClient needs the socket path of at least one worker; got none".into(),
            ));
        }
        Ok(LookupClient {
            inner: CoreLookupClient::new(paths, Duration::from_millis(timeout_ms)),
            origin: Origin::here(),
        })
    }

    /// Blocks, from the first, that every worker holds (0 on any failure).
    fn prefix_hits(
        &self,
        py: Python<'_>,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> u32 {
        // A forked child's lookups are misses (the connections are the parent's).
        let Ok(c) = self.live() else { return 0 };
        without_gil(py, || c.prefix_hits(group, packed_hashes, hash_len))
    }

    /// Which blocks every worker holds (all False on any failure).
    fn exists_all(
        &self,
        py: Python<'_>,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Vec<bool> {
        let Ok(c) = self.live() else {
            return vec![false; packed_hashes.len() / hash_len.max(1)];
        };
        without_gil(py, || c.exists_all(group, packed_hashes, hash_len))
    }

    /// Which blocks every worker's pool holds now, leasing nothing and reading no lower tier
    /// (for watching evictions; never before a load). None when a worker did not answer.
    fn holds_all(
        &self,
        py: Python<'_>,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Option<Vec<bool>> {
        let c = self.live().ok()?;
        without_gil(py, || c.holds_all(group, packed_hashes, hash_len))
    }

    /// Clears every worker's pool; returns the objects removed.
    #[pyo3(signature = (timeout_ms=10000))]
    fn clear(&self, py: Python<'_>, timeout_ms: u64) -> Result<u64> {
        let c = self.live()?;
        Ok(without_gil(py, || {
            c.clear(Duration::from_millis(timeout_ms))
        })?)
    }

    /// Waits until every worker answers; returns their descriptions.
    fn wait_ready(&self, py: Python<'_>, timeout_ms: u64) -> Result<Vec<String>> {
        let c = self.live()?;
        Ok(without_gil(py, || {
            c.wait_ready(Duration::from_millis(timeout_ms))
        })?)
    }

    /// The socket paths, in worker order.
    #[getter]
    fn paths(&self) -> Vec<PathBuf> {
        self.inner.paths()
    }
}

/// The socket path of a worker's lookup service.
#[pyfunction]
pub(crate) fn socket_path(dir: PathBuf, tag: &str, dp_rank: u32, worker: u32) -> PathBuf {
    umbp_lookup::socket_path(&dir, tag, dp_rank, worker)
}
