//! Python bindings: the `umbp._native` extension module.
//!
//! Nothing is created at import: no threads, no pools, no runtime. Every call that can block
//! (pool creation and its prefault, waits, clears, close) releases the GIL. Errors are raised as
//! the classes of `umbp.errors`.

use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PySlice};
use std::sync::Arc;
use umbp_copy::{CopyError, Direction, JobHandle, KeyResult};
use umbp_core::{
    BlockKey, CoreError, GroupLayout, HugepageSize, KeyBuilder as CoreKeyBuilder, KvLayout,
    LayerSpec, MemoryBacking, PoolConfig, RankTopology, TensorView,
};
use umbp_pool::PoolError;

use umbp_lookup::{LookupClient as CoreLookupClient, LookupServer as CoreLookupServer};
use umbp_store::{
    CopyMethod, CudaError, CudaOptions, EmbeddedStore as CoreStore, StoreConfig, StoreError,
    StoreLookup,
};

/// Raises `umbp.errors.<class>(message)`.
fn raise(py: Python<'_>, class: &str, msg: String) -> PyErr {
    match py
        .import("umbp.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((msg.clone(),)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

fn core_err(py: Python<'_>, e: CoreError) -> PyErr {
    raise(py, "ConfigError", e.to_string())
}

fn store_err(py: Python<'_>, e: StoreError) -> PyErr {
    let msg = e.to_string();
    let class = match &e {
        StoreError::Core(_) | StoreError::UnknownLayout(_) => "ConfigError",
        StoreError::Pool(PoolError::Full { .. }) => "PoolFullError",
        StoreError::Pool(PoolError::Config(_)) => "ConfigError",
        StoreError::Pool(PoolError::TooLarge { .. }) => "ConfigError",
        StoreError::Pool(PoolError::Closed) | StoreError::Closed => "StoreClosedError",
        StoreError::Pool(PoolError::Map { .. }) => "PoolError",
        StoreError::Copy(c) => match c {
            CopyError::Core(_) | CopyError::InvalidRequest(_) => "ConfigError",
            CopyError::BadRegistration { .. }
            | CopyError::UnknownRegion(_)
            | CopyError::RegionBusy { .. } => "RegistrationError",
            CopyError::Timeout { .. } => "TransferTimeout",
            CopyError::Closed => "StoreClosedError",
            CopyError::Pool(_) => "TransferError",
        },
        StoreError::Unmapped { .. } | StoreError::ForeignRegion(_) => "RegistrationError",
        StoreError::Cuda(c) => match c {
            CudaError::Option { .. } => "ConfigError",
            CudaError::BadMemory { .. } | CudaError::Device { .. } => "RegistrationError",
            _ => "CudaError",
        },
    };
    raise(py, class, msg)
}

fn status(r: &KeyResult) -> &'static str {
    match r {
        KeyResult::Pending => "pending",
        KeyResult::Done => "done",
        KeyResult::AlreadyPresent => "already_present",
        KeyResult::Missing => "missing",
        KeyResult::PoolFull => "pool_full",
        KeyResult::Cancelled => "cancelled",
        KeyResult::Failed(_) => "failed",
    }
}

/// An immutable batch of block keys, built in bulk by `KeyBuilder`.
#[pyclass(module = "umbp._native", frozen)]
struct Keys {
    keys: Vec<BlockKey>,
}

#[pymethods]
impl Keys {
    fn __len__(&self) -> usize {
        self.keys.len()
    }

    /// `keys[i:j]` (a slice) gives a new `Keys`.
    fn __getitem__(&self, py: Python<'_>, index: &Bound<'_, PySlice>) -> PyResult<Keys> {
        let _ = py;
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
        let mut buf = Vec::with_capacity(self.keys.len() * 64);
        for k in &self.keys {
            buf.extend_from_slice(k.as_bytes());
        }
        PyBytes::new(py, &buf)
    }

    /// Rebuilds keys from `to_bytes()` output.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Keys> {
        if !data.len().is_multiple_of(64) {
            return Err(raise(
                py,
                "ConfigError",
                format!("{} bytes is not a whole number of 64-byte keys", data.len()),
            ));
        }
        Ok(Keys {
            keys: data
                .chunks_exact(64)
                .map(|c| BlockKey::from_bytes(c.try_into().expect("64 bytes")))
                .collect(),
        })
    }

    fn __repr__(&self) -> String {
        format!("<umbp.Keys of {} keys>", self.keys.len())
    }
}

/// Builds keys for one namespace and one worker's ranks.
/// A key builder for `namespace` and one rank's topology position.
fn key_builder(
    py: Python<'_>,
    namespace: &str,
    tp: u16,
    pcp: u16,
    dcp: u16,
    pp: u16,
) -> PyResult<CoreKeyBuilder> {
    CoreKeyBuilder::new(namespace, RankTopology { tp, pcp, dcp, pp }).map_err(|e| core_err(py, e))
}

#[pyclass(module = "umbp._native", frozen)]
struct KeyBuilder {
    inner: CoreKeyBuilder,
}

#[pymethods]
impl KeyBuilder {
    #[new]
    #[pyo3(signature = (namespace, *, tp=0, pcp=0, dcp=0, pp=0))]
    fn new(
        py: Python<'_>,
        namespace: &str,
        tp: u16,
        pcp: u16,
        dcp: u16,
        pp: u16,
    ) -> PyResult<Self> {
        Ok(KeyBuilder {
            inner: key_builder(py, namespace, tp, pcp, dcp, pp)?,
        })
    }

    #[getter]
    fn namespace(&self) -> &str {
        self.inner.namespace()
    }

    /// Keys of `hashes` (each 1..=32 bytes) in cache group `group`.
    fn keys(&self, py: Python<'_>, group: u32, hashes: Vec<Vec<u8>>) -> PyResult<Keys> {
        let keys = self
            .inner
            .keys(group, hashes.iter().map(Vec::as_slice))
            .map_err(|e| core_err(py, e))?;
        Ok(Keys { keys })
    }

    /// Keys of hashes packed back to back in `packed`, `hash_len` bytes each.
    fn keys_packed(
        &self,
        py: Python<'_>,
        group: u32,
        packed: &[u8],
        hash_len: usize,
    ) -> PyResult<Keys> {
        let keys = self
            .inner
            .keys_packed(group, packed, hash_len)
            .map_err(|e| core_err(py, e))?;
        Ok(Keys { keys })
    }

    /// The readable form of each key.
    fn key_strings(&self, keys: &Keys) -> Vec<String> {
        keys.keys.iter().map(|k| self.inner.key_string(k)).collect()
    }
}

/// A transfer in flight. Dropping it does not cancel it.
#[pyclass(module = "umbp._native", frozen)]
struct Job {
    handle: JobHandle,
    timeout: Duration,
    /// The process that made it (a forked child cannot wait for the parent's copy threads).
    pid: u32,
}

#[pymethods]
impl Job {
    /// Per-key statuses once finished, else None. Never blocks.
    fn poll(&self) -> Option<Vec<&'static str>> {
        self.handle.poll().map(|r| r.iter().map(status).collect())
    }

    /// Whether the transfer has finished.
    #[getter]
    fn done(&self) -> bool {
        self.handle.is_done()
    }

    /// Waits (GIL released) up to `timeout_ms` (default: the store's `timeout_ms`) and returns
    /// per-key statuses; raises `TransferTimeout` when the job is still running.
    #[pyo3(signature = (timeout_ms=None))]
    fn wait(&self, py: Python<'_>, timeout_ms: Option<u64>) -> PyResult<Vec<&'static str>> {
        if std::process::id() != self.pid {
            return Err(forked_err(py, "job", self.pid));
        }
        let t = timeout_ms.map_or(self.timeout, Duration::from_millis);
        let h = self.handle.clone();
        let r = py
            .detach(move || h.wait(t))
            .map_err(|e| store_err(py, StoreError::Copy(e)))?;
        Ok(r.iter().map(status).collect())
    }

    /// Stops keys that have not started (they end as "cancelled").
    fn cancel(&self) {
        self.handle.cancel();
    }

    /// Messages of keys that ended "failed", by key index (empty until finished).
    fn errors(&self) -> Vec<(usize, String)> {
        self.handle
            .poll()
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                KeyResult::Failed(m) => Some((i, m)),
                _ => None,
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.handle.len()
    }
}

/// A value whose drop can wait for background threads, which may need the GIL to log (Rust
/// `log` records go to Python's `logging`): it is dropped with the GIL released, so that a
/// `del store` or a garbage collection never deadlocks against them. In a forked child it is
/// leaked instead: the threads it would join exist only in the parent.
struct ReleaseGilOnDrop<T: Send> {
    value: Option<T>,
    pid: u32,
}

impl<T: Send> ReleaseGilOnDrop<T> {
    fn new(v: T) -> Self {
        ReleaseGilOnDrop {
            value: Some(v),
            pid: std::process::id(),
        }
    }
}

impl<T: Send> ReleaseGilOnDrop<T> {
    /// Whether this is a forked child of the process that made the value.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// The value, or `StoreClosedError` in a forked child: its background threads, and any
    /// lock they held at the fork, exist only in the parent, so using it could hang or panic.
    fn live(&self, py: Python<'_>, what: &str) -> PyResult<&T> {
        if self.forked() {
            return Err(forked_err(py, what, self.pid));
        }
        Ok(self)
    }
}

fn forked_err(py: Python<'_>, what: &str, parent: u32) -> PyErr {
    raise(
        py,
        "StoreClosedError",
        format!(
            "this {what} was created in process {parent} and cannot be used in its forked \
             child (pid {}): its threads exist only in the parent; create a new one in the child",
            std::process::id()
        ),
    )
}

impl<T: Send> std::ops::Deref for ReleaseGilOnDrop<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("present until dropped")
    }
}

impl<T: Send> Drop for ReleaseGilOnDrop<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            if std::process::id() != self.pid {
                std::mem::forget(v);
                return;
            }
            Python::attach(|py| py.detach(move || drop(v)));
        }
    }
}

/// A weakly held object and the process that made it.
type Live<T> = std::sync::Mutex<Vec<(u32, std::sync::Weak<T>)>>;

/// Stores and lookup servers not yet dropped, closed by an `atexit` handler: at interpreter
/// exit their background threads must finish while they can still take the GIL (during
/// finalization they cannot, and joining them would hang).
static LIVE_STORES: Live<CoreStore> = std::sync::Mutex::new(Vec::new());
static LIVE_SERVERS: Live<CoreLookupServer> = std::sync::Mutex::new(Vec::new());

fn track<T>(live: &Live<T>, v: &Arc<T>) {
    if let Ok(mut l) = live.lock() {
        l.retain(|(_, w)| w.strong_count() > 0);
        l.push((std::process::id(), Arc::downgrade(v)));
    }
}

/// This process's live objects of `live` (a forked child skips its parent's).
fn take_live<T>(live: &Live<T>) -> Vec<Arc<T>> {
    let me = std::process::id();
    live.lock()
        .map(|mut l| {
            l.drain(..)
                .filter(|(pid, _)| *pid == me)
                .filter_map(|(_, w)| w.upgrade())
                .collect()
        })
        .unwrap_or_default()
}

/// Closes every live store and stops every lookup server of this process (registered with
/// `atexit` when `umbp._native` is imported, so it runs after every exit handler registered
/// later, e.g. a serving framework's shutdown).
#[pyfunction]
fn _close_all(py: Python<'_>) {
    let servers = take_live(&LIVE_SERVERS);
    let stores = take_live(&LIVE_STORES);
    py.detach(move || {
        for s in servers {
            s.shutdown();
        }
        for s in stores {
            s.close();
        }
    });
}

/// A private host-DRAM pool with its copy engine (embedded mode).
#[pyclass(module = "umbp._native", frozen)]
struct EmbeddedStore {
    inner: ReleaseGilOnDrop<Arc<CoreStore>>,
}

fn to_u64s(v: Vec<i64>, what: &str, py: Python<'_>) -> PyResult<Vec<u64>> {
    v.into_iter()
        .map(|x| {
            u64::try_from(x)
                .map_err(|_| raise(py, "ConfigError", format!("{what} must be >= 0, got {x}")))
        })
        .collect()
}

#[pymethods]
impl EmbeddedStore {
    #[new]
    #[pyo3(signature = (capacity_bytes, *, high_watermark=0.9, low_watermark=0.7, use_hugepages=false,
        hugepage_size="2MiB", numa_node=None, prefault=true, prefault_threads=0, memfd=false,
        segment_bytes=0, num_workers=4, timeout_ms=30000, cuda_copy_method="auto",
        cuda_staging_bytes=None, cuda_max_ctas=None, cuda_pin_chunk_bytes=None,
        cuda_batch_blocks=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        capacity_bytes: u64,
        high_watermark: f64,
        low_watermark: f64,
        use_hugepages: bool,
        hugepage_size: &str,
        numa_node: Option<u32>,
        prefault: bool,
        prefault_threads: usize,
        memfd: bool,
        segment_bytes: u64,
        num_workers: usize,
        timeout_ms: u64,
        cuda_copy_method: &str,
        cuda_staging_bytes: Option<u64>,
        cuda_max_ctas: Option<u32>,
        cuda_pin_chunk_bytes: Option<u64>,
        cuda_batch_blocks: Option<usize>,
    ) -> PyResult<Self> {
        let hugepage_size: HugepageSize = hugepage_size.parse().map_err(|e| core_err(py, e))?;
        let method: CopyMethod = cuda_copy_method
            .parse()
            .map_err(|e: CudaError| store_err(py, e.into()))?;
        // Unset options take the store's defaults (CudaOptions::default, documented in
        // docs/configuration.md).
        let d = CudaOptions::default();
        let cuda = CudaOptions {
            method,
            staging_bytes: cuda_staging_bytes.unwrap_or(d.staging_bytes),
            max_ctas: cuda_max_ctas.unwrap_or(d.max_ctas),
            pin_chunk_bytes: cuda_pin_chunk_bytes.unwrap_or(d.pin_chunk_bytes),
            batch_blocks: cuda_batch_blocks.unwrap_or(d.batch_blocks),
            ..d
        };
        let cfg = StoreConfig {
            pool: PoolConfig {
                capacity_bytes,
                high_watermark,
                low_watermark,
                use_hugepages,
                hugepage_size,
                numa_node,
                prefault,
                prefault_threads,
                backing: if memfd {
                    MemoryBacking::Memfd
                } else {
                    MemoryBacking::Anonymous
                },
                segment_bytes,
            },
            num_workers,
            timeout: Duration::from_millis(timeout_ms),
            cuda,
        };
        let inner = py
            .detach(move || CoreStore::new(cfg))
            .map_err(|e| store_err(py, e))?;
        let inner = Arc::new(inner);
        track(&LIVE_STORES, &inner);
        Ok(EmbeddedStore {
            inner: ReleaseGilOnDrop::new(inner),
        })
    }

    /// Registers host memory (e.g. a KV cache tensor's `data_ptr()` and byte size). The memory
    /// must stay alive until `deregister_memory` returns or the store is closed.
    fn register_memory(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<u64> {
        // SAFETY: the Python-facing contract (documented above and in the stubs) is that the
        // caller keeps the memory alive while it is registered; the connector holds the KV
        // cache tensors for the store's whole life.
        unsafe { self.live(py)?.register_memory(addr, length) }.map_err(|e| store_err(py, e))
    }

    /// Removes one registration (waiting for transfers that still use it).
    fn deregister_memory(&self, py: Python<'_>, region_id: u64) -> PyResult<()> {
        let s = self.live(py)?;
        py.detach(|| s.deregister_memory(region_id))
            .map_err(|e| store_err(py, e))
    }

    /// Registers a KV layout: one list per cache group, one
    /// `(base_addr, num_blocks, block_stride, block_bytes)` tuple per layer. Every layer must
    /// lie inside registered memory. Returns the layout id.
    fn register_layout(
        &self,
        py: Python<'_>,
        groups: Vec<Vec<(u64, u64, u64, u64)>>,
    ) -> PyResult<u32> {
        let mut gl = Vec::with_capacity(groups.len());
        for layers in groups {
            let specs = layers
                .into_iter()
                .map(
                    |(base_addr, num_blocks, block_stride, block_bytes)| LayerSpec {
                        base_addr,
                        num_blocks,
                        block_stride,
                        block_bytes,
                    },
                )
                .collect();
            gl.push(GroupLayout::new(specs).map_err(|e| core_err(py, e))?);
        }
        let layout = KvLayout::new(gl).map_err(|e| core_err(py, e))?;
        self.live(py)?
            .register_layout(layout)
            .map_err(|e| store_err(py, e))
    }

    /// Registers a KV layout from tensor views: one list per cache group, one
    /// `(name, data_ptr, element_size, shape, strides, block_dim, expected_block_bytes)` tuple
    /// per layer (strides in elements, as `torch.Tensor.stride()` gives them;
    /// `expected_block_bytes` may be None). `num_blocks[g]` is group `g`'s number of blocks; a
    /// block dimension of `r * num_blocks` rows holds `r` rows per block. The runs of each
    /// layer's block are found from the strides; a view that cannot be planned exactly raises
    /// `ConfigError` naming the tensor. Returns the layout id.
    #[allow(clippy::type_complexity)]
    fn register_tensor_layout(
        &self,
        py: Python<'_>,
        groups: Vec<Vec<(String, u64, u64, Vec<u64>, Vec<i64>, usize, Option<u64>)>>,
        num_blocks: Vec<u64>,
    ) -> PyResult<u32> {
        if groups.len() != num_blocks.len() {
            return Err(raise(
                py,
                "ConfigError",
                format!(
                    "register_tensor_layout: {} groups but {} block counts",
                    groups.len(),
                    num_blocks.len()
                ),
            ));
        }
        let mut gl = Vec::with_capacity(groups.len());
        for (layers, nb) in groups.into_iter().zip(num_blocks) {
            let mut specs = Vec::new();
            for (name, addr, elem_bytes, shape, strides, block_dim, expected) in layers {
                let view = TensorView {
                    name,
                    addr,
                    elem_bytes,
                    shape,
                    strides,
                    block_dim,
                };
                specs.extend(view.layer_runs(nb, expected).map_err(|e| core_err(py, e))?);
            }
            // Objects hold the runs in address order, so runs that follow each other in
            // memory (a block's layers in BHLNC, say) merge into one copy.
            specs.sort_by_key(|l| l.base_addr);
            gl.push(GroupLayout::new(specs).map_err(|e| core_err(py, e))?);
        }
        let layout = KvLayout::new(gl).map_err(|e| core_err(py, e))?;
        self.live(py)?
            .register_layout(layout)
            .map_err(|e| store_err(py, e))
    }

    /// Per cache group of layout `layout_id`: what copying one block involves, as a dict with
    /// `runs`, `ranges_per_block` (after merging adjacent runs), `min_piece`, `max_piece` and
    /// `object_bytes`.
    fn layout_summary<'py>(
        &self,
        py: Python<'py>,
        layout_id: u32,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let l = self
            .live(py)?
            .layout(layout_id)
            .map_err(|e| store_err(py, e))?;
        l.groups()
            .iter()
            .map(|g| {
                let s = g.summary();
                let d = PyDict::new(py);
                d.set_item("runs", s.runs)?;
                d.set_item("ranges_per_block", s.ranges_per_block)?;
                d.set_item("min_piece", s.min_piece)?;
                d.set_item("max_piece", s.max_piece)?;
                d.set_item("object_bytes", s.object_bytes)?;
                Ok(d)
            })
            .collect()
    }

    /// Bytes of one block's object in `group` of layout `layout_id`.
    fn object_bytes(&self, py: Python<'_>, layout_id: u32, group: u32) -> PyResult<u64> {
        let l = self
            .live(py)?
            .layout(layout_id)
            .map_err(|e| store_err(py, e))?;
        Ok(l.group(group).map_err(|e| core_err(py, e))?.object_bytes())
    }

    /// Which keys are in the pool. Pins nothing and never refreshes recency.
    fn exists(&self, py: Python<'_>, keys: &Keys) -> PyResult<Vec<bool>> {
        self.live(py)?
            .exists(&keys.keys)
            .map_err(|e| store_err(py, e))
    }

    /// How many keys, from the first, are in the pool.
    fn prefix_hits(&self, py: Python<'_>, keys: &Keys) -> PyResult<usize> {
        self.live(py)?
            .prefix_hits(&keys.keys)
            .map_err(|e| store_err(py, e))
    }

    /// Starts copying `block_ids` of cache group `group` into the pool under `keys`. For a CUDA
    /// layout, `stream` (`torch.cuda.current_stream().cuda_stream`) orders the copies after the
    /// work already queued on that stream.
    #[pyo3(signature = (layout_id, group, block_ids, keys, *, stream=None))]
    fn store(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        stream: Option<u64>,
    ) -> PyResult<Job> {
        self.start(
            py,
            Direction::Store,
            layout_id,
            group,
            block_ids,
            keys,
            stream,
        )
    }

    /// Starts copying `keys` from the pool into `block_ids` of cache group `group`. For a CUDA
    /// layout, `stream` makes the copies wait for the work already queued on that stream; the
    /// job finishes once the bytes are in place.
    #[pyo3(signature = (layout_id, group, block_ids, keys, *, stream=None))]
    fn load(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        stream: Option<u64>,
    ) -> PyResult<Job> {
        self.start(
            py,
            Direction::Load,
            layout_id,
            group,
            block_ids,
            keys,
            stream,
        )
    }

    /// Removes every object; returns how many.
    fn clear(&self, py: Python<'_>) -> PyResult<u64> {
        let s = self.live(py)?;
        py.detach(|| s.clear()).map_err(|e| store_err(py, e))
    }

    /// Counters and placement as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.live(py)?.stats().map_err(|e| store_err(py, e))?;
        let d = PyDict::new(py);
        d.set_item("capacity_bytes", s.capacity_bytes)?;
        d.set_item("used_bytes", s.used_bytes)?;
        d.set_item("objects", s.objects)?;
        d.set_item("puts", s.puts)?;
        d.set_item("duplicate_puts", s.duplicate_puts)?;
        d.set_item("gets", s.gets)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("bytes_in", s.bytes_in)?;
        d.set_item("bytes_out", s.bytes_out)?;
        d.set_item("reservations", s.reservations)?;
        d.set_item("pinned", s.pinned)?;
        d.set_item("events_dropped", s.events_dropped)?;
        d.set_item("segment_bytes", s.segment_bytes)?;
        d.set_item("free_segments", s.free_segments)?;
        d.set_item("metadata_bytes", s.metadata_bytes)?;
        let p = &s.placement;
        d.set_item(
            "hugepages_requested",
            p.hugepages_requested.map(|h| h.to_string()),
        )?;
        d.set_item("hugepages_used", p.hugepages_used.map(|h| h.to_string()))?;
        d.set_item("hugepage_fallback", p.hugepage_fallback.clone())?;
        d.set_item("numa_node", p.numa_node)?;
        d.set_item("prefaulted", p.prefaulted)?;
        d.set_item("prefault_seconds", p.prefault_seconds)?;
        d.set_item(
            "backing",
            match p.backing {
                MemoryBacking::Anonymous => "anonymous",
                MemoryBacking::Memfd => "memfd",
            },
        )?;
        Ok(d)
    }

    /// Stops the copy workers (after queued transfers) and the evictor. Idempotent.
    fn close(&self, py: Python<'_>) {
        // In a forked child the store's threads (and any lock they held) exist only in the
        // parent: closing there would join threads that are not there. Nothing to do.
        if self.inner.forked() {
            return;
        }
        py.detach(|| self.inner.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    /// Registers CUDA device memory of device `device` (a CUDA tensor's `data_ptr()` and byte
    /// size). The first call loads the CUDA driver and starts registering the pool for DMA in
    /// the background; without CUDA it raises `CudaError`. The memory must stay allocated until
    /// `deregister_memory` returns or the store is closed.
    fn register_cuda_memory(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        device: i32,
    ) -> PyResult<u64> {
        let inner = Arc::clone(self.live(py)?);
        // SAFETY: the Python-facing contract (documented above and in the stubs) is that the
        // caller keeps the memory allocated while it is registered.
        py.detach(move || unsafe { inner.register_cuda_memory(addr, length, device) })
            .map_err(|e| store_err(py, e))
    }

    /// The CUDA backend's counters and the pool's DMA registration as a dict, or None before
    /// any CUDA memory is registered.
    fn cuda_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some((s, p)) = self.live(py)?.cuda_status() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("dma_bytes", s.dma_bytes)?;
        d.set_item("staged_bytes", s.staged_bytes)?;
        d.set_item("kernel_ns", s.kernel_ns)?;
        d.set_item("kernel_launches", s.kernel_launches)?;
        d.set_item("copies_2d", s.copies_2d)?;
        d.set_item("copies_3d", s.copies_3d)?;
        d.set_item("copies_1d", s.copies_1d)?;
        d.set_item("batch_calls", s.batch_calls)?;
        d.set_item("staging_device_bytes", s.staging_device_bytes)?;
        d.set_item("max_ctas", s.max_ctas)?;
        d.set_item("sm_count", s.sm_count)?;
        d.set_item("auto_switches", s.auto_switches)?;
        d.set_item("small_pieces_by_dma", s.small_pieces_by_dma.to_vec())?;
        d.set_item("pool_registered_bytes", p.registered_bytes)?;
        d.set_item("pool_bytes", p.total_bytes)?;
        d.set_item("pool_registration_done", p.done)?;
        d.set_item("pool_registration_seconds", p.seconds)?;
        d.set_item("pool_registration_error", p.error)?;
        Ok(Some(d))
    }

    /// Waits (GIL released) up to `timeout_ms` for the pool's DMA registration; False when it
    /// has not finished or no CUDA memory is registered.
    fn wait_pool_registered(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<bool> {
        let inner = Arc::clone(self.live(py)?);
        Ok(py.detach(move || inner.wait_pool_registered(Duration::from_millis(timeout_ms))))
    }
}

impl EmbeddedStore {
    fn live(&self, py: Python<'_>) -> PyResult<&Arc<CoreStore>> {
        self.inner.live(py, "store")
    }

    /// Starts a store or a load (the shared body of `store` and `load`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        py: Python<'_>,
        direction: Direction,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        stream: Option<u64>,
    ) -> PyResult<Job> {
        let ids = to_u64s(block_ids, "block ids", py)?;
        let keys = keys.keys.clone();
        let started = match direction {
            Direction::Store => self
                .live(py)?
                .store_on(layout_id, group, &ids, keys, stream),
            Direction::Load => self.live(py)?.load_on(layout_id, group, &ids, keys, stream),
        };
        Ok(Job {
            handle: started.map_err(|e| store_err(py, e))?,
            timeout: self.live(py)?.timeout(),
            pid: std::process::id(),
        })
    }
}

/// Serves one worker's lookups and clears on a Unix socket (embedded mode).
#[pyclass(module = "umbp._native", frozen)]
struct LookupServer {
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
        path: std::path::PathBuf,
        namespace: &str,
        tp: u16,
        pcp: u16,
        dcp: u16,
        pp: u16,
        describe: String,
    ) -> PyResult<Self> {
        let keys = key_builder(py, namespace, tp, pcp, dcp, pp)?;
        let target = Arc::new(StoreLookup::new(
            Arc::clone(store.live(py)?),
            keys,
            describe,
        ));
        let inner = Arc::new(
            CoreLookupServer::bind(&path, target)
                .map_err(|e| raise(py, "LookupServiceError", e.to_string()))?,
        );
        track(&LIVE_SERVERS, &inner);
        Ok(LookupServer {
            inner: ReleaseGilOnDrop::new(inner),
        })
    }

    /// The socket path.
    #[getter]
    fn path(&self) -> std::path::PathBuf {
        self.inner.path().to_owned()
    }

    /// Stops serving and removes the socket. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        // A forked child has no service thread, and the socket is the parent's: leave both.
        if self.inner.forked() {
            return;
        }
        py.detach(|| self.inner.shutdown());
    }
}

/// Asks every worker of an engine at once; any failure or late answer is a miss.
#[pyclass(module = "umbp._native", frozen)]
struct LookupClient {
    inner: CoreLookupClient,
    /// The process that made it: a forked child must not share its connections.
    pid: u32,
}

impl LookupClient {
    fn live(&self, py: Python<'_>) -> PyResult<&CoreLookupClient> {
        if std::process::id() != self.pid {
            return Err(forked_err(py, "lookup client", self.pid));
        }
        Ok(&self.inner)
    }
}

#[pymethods]
impl LookupClient {
    #[new]
    #[pyo3(signature = (paths, timeout_ms=1000))]
    fn new(py: Python<'_>, paths: Vec<std::path::PathBuf>, timeout_ms: u64) -> PyResult<Self> {
        if paths.is_empty() {
            return Err(raise(
                py,
                "ConfigError",
                "LookupClient needs the socket path of at least one worker; got none".into(),
            ));
        }
        Ok(LookupClient {
            inner: CoreLookupClient::new(paths, Duration::from_millis(timeout_ms)),
            pid: std::process::id(),
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
        let Ok(c) = self.live(py) else { return 0 };
        py.detach(|| c.prefix_hits(group, packed_hashes, hash_len))
    }

    /// Which blocks every worker holds (all False on any failure).
    fn exists_all(
        &self,
        py: Python<'_>,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Vec<bool> {
        let Ok(c) = self.live(py) else {
            return vec![false; packed_hashes.len() / hash_len.max(1)];
        };
        py.detach(|| c.exists_all(group, packed_hashes, hash_len))
    }

    /// Clears every worker's pool; returns the objects removed.
    #[pyo3(signature = (timeout_ms=10000))]
    fn clear(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<u64> {
        let c = self.live(py)?;
        py.detach(|| c.clear(Duration::from_millis(timeout_ms)))
            .map_err(|e| raise(py, "LookupServiceError", e.to_string()))
    }

    /// Waits until every worker answers; returns their descriptions.
    fn wait_ready(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<Vec<String>> {
        let c = self.live(py)?;
        py.detach(|| c.wait_ready(Duration::from_millis(timeout_ms)))
            .map_err(|e| raise(py, "LookupServiceError", e.to_string()))
    }

    /// The socket paths, in worker order.
    #[getter]
    fn paths(&self) -> Vec<std::path::PathBuf> {
        self.inner.paths()
    }
}

/// The socket path of a worker's lookup service.
#[pyfunction]
fn socket_path(
    dir: std::path::PathBuf,
    tag: &str,
    dp_rank: u32,
    worker: u32,
) -> std::path::PathBuf {
    umbp_lookup::socket_path(&dir, tag, dp_rank, worker)
}

/// Memory this process may still use, `(bytes, what limits it)`: the host's `MemAvailable`, or
/// less where its memory cgroup (v2 or v1) has less room; None when neither can be read.
#[pyfunction]
fn memory_available() -> Option<(u64, String)> {
    umbp_pool::memory_available().map(|m| (m.bytes, m.source))
}

/// Runs the `umbp` command with `argv` (program name first); returns its exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || umbp_cli::main_with_args(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Route Rust `log` records to Python's `logging` (logger names start with "umbp").
    let _ = pyo3_log::try_init();
    // Close stores and stop lookup servers before finalization (see `LIVE_STORES`).
    m.add_function(wrap_pyfunction!(_close_all, m)?)?;
    m.py()
        .import("atexit")?
        .call_method1("register", (m.getattr("_close_all")?,))?;
    m.add_class::<EmbeddedStore>()?;
    m.add_class::<Job>()?;
    m.add_class::<KeyBuilder>()?;
    m.add_class::<Keys>()?;
    m.add_class::<LookupServer>()?;
    m.add_class::<LookupClient>()?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(memory_available, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
